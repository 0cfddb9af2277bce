"""What several commands share: the run config's flags, the run secret, the grace flag and
the telemetry flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from diloco.config import REPLY_RULES, RunConfig
from diloco.task import DEFAULT_TASK
from diloco.tasks.byte_gpt_options import ModelConfig, Options
from diloco.cli.settings import add_flag, default_of, field_doc, from_flags

GPT_OPTIONS = ("width", "depth", "heads", "context", "batch_size", "data")


def add_run_config(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run (must match across every process of a run)")
    group.add_argument("--run-config", metavar="FILE", help="JSON run config (as written by diloco local); overrides the flags below")
    add_flag(group, "--task", RunConfig, "task", metavar="FILE.py:FUNCTION")
    group.add_argument("--task-option", action="append", metavar="KEY=VALUE",
                       help="an option for the task (TaskContext.options; repeatable)")
    add_flag(group, "--seed", RunConfig, "seed", type=int)
    add_flag(group, "--init", RunConfig, "init",
             metavar="FILE.safetensors|DIR")
    add_flag(group, "--fragments", RunConfig, "fragments", type=int)
    add_flag(group, "--max-model-bytes", RunConfig, "max_model_bytes", type=int, metavar="BYTES")
    add_flag(group, "--sync-every", RunConfig, "sync_every_steps", type=int)
    add_flag(group, "--overlap", RunConfig, "overlap_steps", type=int)
    add_flag(group, "--alpha", RunConfig, "merge_alpha", type=float)
    add_flag(group, "--reply-rule", RunConfig, "reply_rule", choices=REPLY_RULES)
    gpt = parser.add_argument_group("the built-in byte GPT task (shorthands for its --task-option values)")
    gpt.add_argument("--width", type=int, help=f"model width (default {ModelConfig.width})")
    gpt.add_argument("--depth", type=int, help=f"transformer blocks (default {ModelConfig.depth})")
    gpt.add_argument("--heads", type=int, help=f"attention heads (default {ModelConfig.heads})")
    gpt.add_argument("--context", type=int, help=f"tokens per sequence (default {ModelConfig.context})")
    gpt.add_argument("--batch-size", type=int, help=f"sequences per inner step (default {Options.batch_size})")
    gpt.add_argument("--data", help="a text file or a directory of them (default: the Python standard library's sources)")


def _absolute_task(spec: str) -> str:
    """A task file given relative to this directory, made absolute: the run config travels
    to processes with other working directories (a path that is not a file here, say one
    inside a learner image, is kept as it is)."""
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py") and Path(path).is_file():
        return f"{Path(path).resolve()}:{name}"
    return spec


def build_run_config(args: argparse.Namespace):
    from diloco.errors import InvalidArgument, NotFound
    from diloco.task import parse_options

    if args.run_config:
        try:
            text = Path(args.run_config).read_text()
        except OSError as error:
            raise NotFound(f"cannot read run config {args.run_config}: {error.strerror}") from None
        return RunConfig.from_json(text)
    shorthands = {k: str(getattr(args, k)) for k in GPT_OPTIONS if getattr(args, k) is not None}
    if shorthands and args.task != DEFAULT_TASK:
        flags = ", ".join("--" + k.replace("_", "-") for k in shorthands)
        raise InvalidArgument(f"{flags} set options of the built-in byte GPT task; give your task's options "
                              "with --task-option KEY=VALUE")
    return from_flags(
        args, RunConfig,
        task=_absolute_task(args.task),
        task_options={**shorthands, **parse_options(args.task_option or [])},
        init=str(Path(args.init).resolve()) if args.init else "",
    )


def run_secret(args: argparse.Namespace) -> str:
    from diloco.errors import InvalidArgument, NotFound

    if args.secret_file:
        try:
            secret = Path(args.secret_file).read_text().strip()
        except OSError as error:
            raise NotFound(f"cannot read secret file {args.secret_file}: {error.strerror}") from None
    else:
        secret = os.environ.get("DILOCO_SECRET", "")
    if not secret:
        raise InvalidArgument("no run secret: pass --secret-file PATH or set DILOCO_SECRET")
    return secret


def parse_grace(value: str) -> tuple[str, float]:
    if value in ("auto", "off"):
        return value, 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"grace must be auto, off or seconds, got {value!r}") from None
    if not (seconds >= 0 and seconds != float("inf")):
        raise argparse.ArgumentTypeError(f"grace seconds must be finite and >= 0, got {value!r}")
    return "fixed", seconds


_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def parse_count(value: str) -> int:
    """A positive count, plain (``1048576``) or with a decimal or binary suffix (``4M``, ``1Mi``)."""
    text = value.strip()
    digits = text.rstrip("KMGi")
    suffix = text[len(digits):]
    if suffix not in _COUNT_SUFFIXES or not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive whole number, optionally with K, M, G (x1000) or Ki, Mi, Gi (x1024), got {value!r}")
    return int(digits) * _COUNT_SUFFIXES[suffix]


def add_grace_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, name: str,
                   taken=None) -> argparse.Action:
    """``--grace auto|off|SECONDS`` with ``cls.name``'s default (a grace mode, or a
    ``--grace`` value as a string) and description; its value is (mode, seconds)."""
    action = add_flag(parser, "--grace", cls, name, type=parse_grace, shown=parse_grace, taken=taken)
    action.help = f"{field_doc(cls, name)} (default {default_of(cls, name)})"  # as it is given, not parsed
    return action


def _prometheus(value: str) -> tuple[str, int]:
    from diloco.errors import InvalidArgument
    from diloco.telemetry import prometheus_address

    try:
        return prometheus_address(value)
    except InvalidArgument as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_telemetry(parser: argparse.ArgumentParser) -> None:
    """Traces and OTLP metrics follow the standard OTEL_* environment variables (README,
    "Tracing and metrics"); only the Prometheus endpoint has a flag."""
    parser.add_argument(
        "--prometheus", type=_prometheus, metavar="[HOST:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST default 0.0.0.0; PORT 0: one the OS "
             "chooses; needs the diloco[metrics] extra). Traces and OTLP export follow the OTEL_* environment variables",
    )
    parser.add_argument(
        "--prometheus-targets-dir", metavar="DIR",
        help="with --prometheus: once serving, write DIR/<name>.json (coordinator, shard<m>, the learner's id), this "
             "process's target for a Prometheus file_sd_configs: its address with the port it got, labels role and "
             "learner or shard; removed at a clean exit",
    )


def start_telemetry(args: argparse.Namespace, role: str, **ids):
    """OpenTelemetry from this process's environment (nothing unless OTEL_* says so)."""
    from diloco import telemetry

    targets = Path(args.prometheus_targets_dir) if args.prometheus_targets_dir else None
    return telemetry.start(role, os.environ, prometheus=args.prometheus, prometheus_targets_dir=targets, **ids)


