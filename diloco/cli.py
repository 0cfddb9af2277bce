"""The ``diloco`` command line: one entry point, one subcommand per job.

Parsers are built without importing torch or grpc so ``diloco --help`` stays instant;
each subcommand imports its implementation when it runs. This is the only module that
configures logging handlers (and, later, reads environment variables).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco.cli_coordinator import add_admin_parser, add_coordinator_parser
from diloco import __version__
from diloco.errors import DilocoError, InvalidArgument
from diloco.config import REPLY_RULES, RunConfig
from diloco.local_config import LocalConfig
from diloco.settings import add_config_flag, add_flag, apply_config, read_config
from diloco.task import DEFAULT_TASK
from learner.config import DELTA_CODECS, DEVICES, PRECISIONS, LearnerConfig
from syncer.config import MERGE_MODES, SCALE_MODES, MergeConfig, RoundConfig, SyncerConfig

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace], int]


def _bench_codec(args: argparse.Namespace) -> int:
    from diloco.bench import codec

    result = codec.run(size_mib=args.size_mib, repeats=args.repeats)
    _print_result(result, args.json)
    return 0


def _bench_syncer(args: argparse.Namespace) -> int:
    from diloco.bench import syncer

    _print_result(syncer.run(params=args.params, learners=args.learners, rounds=args.rounds), args.json)
    return 0


def _bench_learner(args: argparse.Namespace) -> int:
    from diloco.bench import learner

    result = learner.run(steps=args.steps, overlap_steps=args.overlap, threads=args.threads, tracing=args.tracing,
                         runs=args.runs)
    _print_result(result, args.json)
    return 0


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    codec = kinds.add_parser("codec", help="int4 quantize/dequantize and zstd framing vs memcpy")
    codec.add_argument("--size-mib", type=int, default=64, help="fp32 data per measurement (default 64 MiB)")
    codec.add_argument("--repeats", type=int, default=5, help="timed repetitions; the best is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object")
    codec.set_defaults(func=_bench_codec)
    sync = kinds.add_parser("syncer", help="one shard's ingress vs raw loopback TCP, merge time vs memcpy, memory")
    sync.add_argument("--params", type=int, default=4 * 1024 * 1024, help="parameters of the shard's fragment (default 4Mi)")
    sync.add_argument("--learners", type=int, default=8, help="client processes pushing (default 8)")
    sync.add_argument("--rounds", type=int, default=30, help="rounds to measure, after one warm-up round (default 30)")
    sync.add_argument("--json", action="store_true", help="print one JSON object")
    sync.set_defaults(func=_bench_syncer)
    lrn = kinds.add_parser("learner", help="a learner's tokens/s with syncing on vs off, side by side")
    lrn.add_argument("--steps", type=int, default=120, help="inner steps per run (default 120)")
    lrn.add_argument("--overlap", type=int, default=2, help="tau, inner steps of overlap (default 2)")
    lrn.add_argument("--threads", type=int, help="torch threads of the learner (default: all cores but one)")
    lrn.add_argument("--tracing", action="store_true",
                     help="compare OpenTelemetry on (SDK + OTLP exporters) vs off instead, syncing on in both")
    lrn.add_argument("--runs", type=int, default=2, help="with --tracing: runs per configuration, interleaved (default 2)")
    lrn.add_argument("--json", action="store_true", help="print one JSON object")
    lrn.set_defaults(func=_bench_learner)


def _simulate(args: argparse.Namespace) -> int:
    from diloco import simulate

    return simulate.run(args)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from diloco.simulate import add_arguments

    parser = commands.add_parser(
        "simulate",
        help="goodput and uptime of DP, elastic DP and Decoupled DiLoCo at scale (discrete-event simulation)",
        description="Simulate chip failures at the paper's scale and report goodput and uptime.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_simulate)


_GPT_OPTIONS = ("width", "depth", "heads", "context", "batch_size", "data")


def _add_run_config(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run (must match across every process of a run)")
    group.add_argument("--run-config", metavar="FILE", help="JSON run config (as written by diloco local); overrides the flags below")
    group.add_argument("--task", default=DEFAULT_TASK, metavar="FILE.py:FUNCTION",
                       help="what to train: a function (FILE.py:FUNCTION or package.module:FUNCTION) taking a "
                            f"diloco.TaskContext and returning a diloco.Task (default {DEFAULT_TASK}, the byte GPT)")
    group.add_argument("--task-option", action="append", metavar="KEY=VALUE",
                       help="an option for the task (TaskContext.options; repeatable)")
    add_flag(group, "--seed", RunConfig, "seed", "the run's seed: model initialisation, data order", type=int)
    group.add_argument("--init", default="", metavar="FILE.safetensors",
                       help="start the model from these weights (an export: diloco admin export, or a run's model.safetensors)")
    add_flag(group, "--fragments", RunConfig, "fragments", "P: fragments the model is cut into", type=int)
    add_flag(group, "--sync-every", RunConfig, "sync_every_steps", "H: inner steps between two sends of a fragment", type=int)
    add_flag(group, "--overlap", RunConfig, "overlap_steps", "tau: inner steps before a reply is needed", type=int)
    add_flag(group, "--alpha", RunConfig, "merge_alpha", "merge alpha when applying a reply (0: overwrite)", type=float)
    add_flag(group, "--reply-rule", RunConfig, "reply_rule",
             "apply a reply by rebasing the progress made since the push onto it, or by mixing with --alpha "
             "(DESIGN's rule)", choices=REPLY_RULES)
    gpt = parser.add_argument_group("the built-in byte GPT task (shorthands for its --task-option values)")
    gpt.add_argument("--width", type=int, help="model width (default 128)")
    gpt.add_argument("--depth", type=int, help="transformer blocks (default 2)")
    gpt.add_argument("--heads", type=int, help="attention heads (default 4)")
    gpt.add_argument("--context", type=int, help="tokens per sequence (default 128)")
    gpt.add_argument("--batch-size", type=int, help="sequences per inner step (default 16)")
    gpt.add_argument("--data", help="a text file or a directory of them (default: the Python standard library's sources)")


def _absolute_task(spec: str) -> str:
    """A task file given relative to this directory, made absolute: the run config travels
    to processes with other working directories (a path that is not a file here, say one
    inside a learner image, is kept as it is)."""
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py") and Path(path).is_file():
        return f"{Path(path).resolve()}:{name}"
    return spec


def _run_config(args: argparse.Namespace):
    from diloco.config import RunConfig
    from diloco.errors import InvalidArgument, NotFound
    from diloco.task import parse_options

    if args.run_config:
        try:
            text = Path(args.run_config).read_text()
        except OSError as error:
            raise NotFound(f"cannot read run config {args.run_config}: {error.strerror}") from None
        return RunConfig.from_json(text)
    shorthands = {k: str(getattr(args, k)) for k in _GPT_OPTIONS if getattr(args, k) is not None}
    if shorthands and args.task != DEFAULT_TASK:
        flags = ", ".join("--" + k.replace("_", "-") for k in shorthands)
        raise InvalidArgument(f"{flags} set options of the built-in byte GPT task; give your task's options "
                              "with --task-option KEY=VALUE")
    return RunConfig(
        task=_absolute_task(args.task),
        task_options={**shorthands, **parse_options(args.task_option or [])},
        seed=args.seed,
        init=str(Path(args.init).resolve()) if args.init else "",
        fragments=args.fragments,
        sync_every_steps=args.sync_every,
        overlap_steps=args.overlap,
        merge_alpha=args.alpha,
        reply_rule=args.reply_rule,
    )


def _secret(args: argparse.Namespace) -> str:
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


def _grace(value: str) -> tuple[str, float]:
    if value in ("auto", "off"):
        return value, 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"grace must be auto, off or seconds, got {value!r}") from None
    if not (seconds >= 0 and seconds != float("inf")):
        raise argparse.ArgumentTypeError(f"grace seconds must be finite and >= 0, got {value!r}")
    return "fixed", seconds


def _prometheus(value: str) -> tuple[str, int]:
    from diloco.errors import InvalidArgument
    from diloco.telemetry import prometheus_address

    try:
        return prometheus_address(value)
    except InvalidArgument as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_telemetry(parser: argparse.ArgumentParser) -> None:
    """Traces and OTLP metrics follow the standard OTEL_* environment variables (README,
    "Tracing and metrics"); only the Prometheus endpoint has a flag."""
    parser.add_argument(
        "--prometheus", type=_prometheus, metavar="[HOST:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST default 0.0.0.0; needs the diloco[metrics] "
             "extra). Traces and OTLP export follow the OTEL_* environment variables",
    )


def _start_telemetry(args: argparse.Namespace, role: str, **ids):
    """OpenTelemetry from this process's environment (nothing unless OTEL_* says so)."""
    from diloco import telemetry

    return telemetry.start(role, os.environ, prometheus=args.prometheus, **ids)


def _syncer(args: argparse.Namespace) -> int:
    import asyncio

    from syncer.config import MergeConfig, RoundConfig, SyncerConfig
    from syncer.server import ShardServerConfig, run_shard

    run = _run_config(args)
    grace_mode, grace_s = args.grace
    cfg = SyncerConfig(
        shard_id=args.shard_id,
        num_shards=args.shards,
        rounds=RoundConfig(
            quorum=args.quorum,
            grace_mode=grace_mode,
            grace_fixed_s=grace_s,
            grace_gamma=args.grace_gamma,
            grace_max_s=args.grace_max_s,
            overlap_steps=run.overlap_steps,
        ),
        merge=MergeConfig(
            merge=args.merge,
            staleness_lambda=args.staleness_lambda,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            scale_by=args.scale_by,
            block_size=args.block_size,
            scale_dtype=args.scale_dtype,
            update_chain_length=args.chain,
        ),
        max_push_bytes=args.max_push_mib * 1024 * 1024,
        max_delta_ratio=args.max_delta_ratio,
        anchor_window_s=args.anchor_window_s,
        stream_idle_timeout_s=args.stream_idle_timeout_s,
    )
    server_cfg = ShardServerConfig(
        secret=_secret(args),
        host=args.host,
        health_port=args.health_port,
        reflection=args.reflection,
        port=args.port,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        static_learners=tuple(x for x in args.learners.split(",") if x) if args.learners else (),
        coordinator=args.coordinator,
        snapshot_dir=args.snapshot_dir or None,
        restore=args.restore,
        push_log=args.push_log,
    )
    telemetry = _start_telemetry(args, "syncer", shard_id=args.shard_id)
    try:
        return asyncio.run(run_shard(run, cfg, server_cfg, Path(args.port_file) if args.port_file else None))
    finally:
        telemetry.shutdown()


def _add_syncer(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "syncer",
        help="run one syncer shard (CPU parameter server owning fragments p with p mod S == shard id)",
        description="Run one syncer shard. SIGTERM closes open rounds, answers waiting pushes, flushes the tape, exits 0.",
    )
    add_config_flag(p)
    p.add_argument("--shard-id", type=int, default=0, help="this shard's id m (default 0)")
    p.add_argument("--shards", type=int, default=1, help="S: number of shards (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="also answer grpc.health.v1 in plaintext on PORT (for kubelet probes when --tls-dir "
                        "makes the main port mutual TLS)")
    p.add_argument("--reflection", action="store_true",
                   help="serve gRPC reflection (grpcurl without the .proto files); off by default")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port; see --port-file)")
    p.add_argument("--port-file", help="write HOST:PORT here once serving")
    p.add_argument("--data-dir", help="directory for the event tape (default: keep no tape)")
    p.add_argument("--push-log", action="store_true",
                   help="also log every accepted push's payload in DATA_DIR (for diloco replay; costs disk ~ bytes pushed)")
    p.add_argument("--secret-file", help="file holding the run secret (default: $DILOCO_SECRET)")
    p.add_argument("--learners", help="static live learners, e.g. L0,L1 (when there is no coordinator)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="follow this coordinator's membership stream")
    add_flag(p, "--quorum", RoundConfig, "quorum", "K: pushes needed before the grace window", type=int)
    p.add_argument("--grace", type=_grace, default=("auto", 0.0), help="auto (default), off, or fixed SECONDS")
    add_flag(p, "--grace-gamma", RoundConfig, "grace_gamma", "share of the estimated slack granted", type=float)
    add_flag(p, "--grace-max-s", RoundConfig, "grace_max_s", "upper bound of the adaptive grace, seconds", type=float)
    add_flag(p, "--merge", MergeConfig, "merge", "merge of non-embedding pieces", choices=MERGE_MODES)
    add_flag(p, "--staleness-lambda", MergeConfig, "staleness_lambda", "staleness discount lambda (0: off)", type=float)
    add_flag(p, "--outer-lr", MergeConfig, "outer_lr", "outer Nesterov learning rate", type=float)
    add_flag(p, "--outer-momentum", MergeConfig, "outer_momentum", "outer Nesterov momentum", type=float)
    add_flag(p, "--scale-by", MergeConfig, "scale_by",
             "scale the outer lr by the round's share of live learners (live) or not (round)", choices=SCALE_MODES)
    add_flag(p, "--block-size", MergeConfig, "block_size", "int4 block size", type=int)
    add_flag(p, "--scale-dtype", MergeConfig, "scale_dtype", "int4 scale dtype", choices=["float16", "float32"])
    add_flag(p, "--chain", MergeConfig, "update_chain_length", "int4 updates kept per fragment", type=int)
    p.add_argument("--max-push-mib", type=int, default=SyncerConfig.max_push_bytes // 2**20,
                   help=f"largest accepted push, MiB (default {SyncerConfig.max_push_bytes // 2**20})")
    add_flag(p, "--anchor-window-s", SyncerConfig, "anchor_window_s",
             "back without its state, collect learners' anchors of a fragment for S seconds and take the newest",
             type=float, metavar="S")
    add_flag(p, "--max-delta-ratio", SyncerConfig, "max_delta_ratio",
             "refuse a push whose delta norm exceeds this many times its fragment's norm", type=float)
    add_flag(p, "--stream-idle-timeout-s", SyncerConfig, "stream_idle_timeout_s",
             "close a push stream that sends nothing for this long, seconds", type=float)
    p.add_argument("--snapshot-dir", help="the coordinator's snapshot directory or URL, s3://... (for --restore latest or an id)")
    p.add_argument("--restore", metavar="latest|ID|PATH", help="start from a complete snapshot instead of waiting for a learner to give it one")
    _add_telemetry(p)
    _add_run_config(p)
    p.set_defaults(func=_syncer)


def _learner(args: argparse.Namespace) -> int:
    import time

    started = time.time()
    from diloco.errors import InvalidArgument, NotFound
    from learner.config import LearnerConfig
    from learner.server import joined_membership, run_learner, run_slice_follower, static_membership
    from learner.slice import SliceLink

    if args.prometheus:
        from diloco.telemetry import require_prometheus

        require_prometheus()  # before joining: fail with the fix, not after taking a slot
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    cfg = LearnerConfig(
        device=args.device, precision=args.precision, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
        eval_every_steps=args.eval_every, delta_codec=args.delta_codec,
        block_size=args.block_size, step_delay_s=args.step_delay_s, slow_factor=args.slow_factor,
        wire_delay_ms=args.wire_delay_ms, push_timeout_s=args.push_timeout_s,
        max_inflight_pushes=args.max_inflight, heartbeat_interval_s=args.heartbeat_s,
        coordinator_loss_timeout_s=args.coordinator_loss_timeout_s, slice_timeout_s=args.slice_timeout_s,
    )
    link = None
    if args.slice_hosts > 1 or args.slice_index:
        if not args.slice_leader:
            raise InvalidArgument("--slice-hosts N > 1 needs --slice-leader HOST:PORT (host 0's address on the slice port)")
        link = SliceLink(args.slice_hosts, args.slice_index, args.slice_leader, cfg.slice_timeout_s)
        if not link.leader:  # never joins: the leader is the learner
            run_slice_follower(cfg, link)
            return 0
    if args.coordinator:
        if not args.join_token_file:
            raise InvalidArgument("--coordinator needs --join-token-file")
        given = [f"--{k.replace('_', '-')}" for k in _GPT_OPTIONS if getattr(args, k) is not None]
        given += ["--task"] * (args.task != DEFAULT_TASK) + ["--task-option"] * bool(args.task_option)
        given += ["--init"] * bool(args.init)
        if given or args.run_config:
            raise InvalidArgument(f"{', '.join(given or ['--run-config'])}: a learner that joins a coordinator trains "
                                  "the coordinator's run config; set the task and its options there")
        try:
            token = Path(args.join_token_file).read_text().strip()
        except OSError as error:
            raise NotFound(f"cannot read join token {args.join_token_file}: {error.strerror}") from None
        member = joined_membership(args.coordinator, token, args.pool, args.launch_id)
    else:
        if not args.shards or not args.learner_id:
            raise InvalidArgument("without --coordinator, give --shards HOST:PORT,... and --learner-id (static topology)")
        member = static_membership(_run_config(args), args.learner_id, _secret(args), args.shards.split(","))
    summary_path = Path(args.summary) if args.summary else None
    if args.summary_dir:
        summary_path = Path(args.summary_dir) / f"{member.learner_id}.json"
    # Started once the learner's id is known (it is a resource attribute): the Join call
    # itself is not traced.
    telemetry = _start_telemetry(args, "learner", learner_id=member.learner_id,
                                 pool=args.pool if args.coordinator else None)
    try:
        run_learner(cfg, member, args.coordinator, summary_path,
                    events_dir=Path(args.events_dir) if args.events_dir else None, started_t=started,
                    num_learners=args.num_learners, slice_link=link)
    finally:
        telemetry.shutdown()
    return 0


def _add_learner(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "learner",
        allow_abbrev=False,  # launch overrides must not reach a reserved flag through a prefix (--coord)
        help="run one learner: the task's model trained with inner steps, fragments streamed to the shards",
        description="Run one learner. SIGTERM finishes in-flight pushes (bounded), leaves and exits 0. "
                    "With --coordinator the run's task comes from the coordinator's run config.",
    )
    add_config_flag(p)
    join = p.add_argument_group("joining (coordinator) or a static topology")
    join.add_argument("--coordinator", metavar="HOST:PORT", help="join this coordinator (topology, id, credential)")
    join.add_argument("--join-token-file", help="file with the run's join token (with --coordinator)")
    join.add_argument("--pool", default="default", help="pool name reported to the coordinator (default: default)")
    join.add_argument("--launch-id", default="", help="set by launchers to match the process they started")
    join.add_argument("--shards", help="static topology: shard addresses in shard-id order, comma-separated")
    join.add_argument("--learner-id", help="static topology: this learner's id, e.g. L0")
    join.add_argument("--secret-file", help="static topology: the run secret (default: $DILOCO_SECRET)")
    join.add_argument("--num-learners", type=int, default=1, help="learners the run is planned for (TaskContext.num_learners; default 1)")
    t = p.add_argument_group("training")
    add_flag(t, "--device", LearnerConfig, "device",
             "xla uses every device of the host (SPMD: parameters and optimizer state split, batches split; the "
             "task's batch size must be a multiple of the device count)", choices=DEVICES)
    add_flag(t, "--precision", LearnerConfig, "precision",
             "bf16: forward pass and loss under bfloat16 autocast; parameters, optimizer state and deltas stay fp32",
             choices=PRECISIONS)
    add_flag(t, "--steps", LearnerConfig, "steps", "inner steps", type=int)
    add_flag(t, "--lr", LearnerConfig, "lr",
             "peak inner AdamW learning rate (a task's own optimizer keeps its lr, scaled by the schedule)", type=float)
    add_flag(t, "--warmup-steps", LearnerConfig, "warmup_steps", "linear warmup steps", type=int)
    add_flag(t, "--eval-every", LearnerConfig, "eval_every_steps", "inner steps between evaluations", type=int)
    add_flag(t, "--delta-codec", LearnerConfig, "delta_codec", "delta encoding", choices=DELTA_CODECS)
    add_flag(t, "--block-size", LearnerConfig, "block_size", "int4 block size; must match the shards'", type=int)
    add_flag(t, "--step-delay-s", LearnerConfig, "step_delay_s", "extra seconds per step: a simulated slow learner", type=float)
    t.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    add_flag(t, "--slow-factor", LearnerConfig, "slow_factor", "steps take FACTOR x their compute time: a slower chip",
             type=float)
    add_flag(t, "--wire-delay-ms", LearnerConfig, "wire_delay_ms", "delay added to each push and each reply: a slow network",
             type=float)
    add_flag(t, "--push-timeout-s", LearnerConfig, "push_timeout_s", "deadline of one push, seconds", type=float)
    add_flag(t, "--max-inflight", LearnerConfig, "max_inflight_pushes", "pushes in flight before new ones are dropped", type=int)
    add_flag(t, "--heartbeat-s", LearnerConfig, "heartbeat_interval_s", "heartbeat interval, seconds", type=float)
    add_flag(t, "--coordinator-loss-timeout-s", LearnerConfig, "coordinator_loss_timeout_s",
             "leave after S seconds with every heartbeat failing (a coordinator restart shorter than that is "
             "trained through)", type=float, metavar="S")
    s = p.add_argument_group("a multi-host slice: one learner, one process per host (every host runs the same command)")
    s.add_argument("--slice-hosts", type=int, default=1, metavar="N", help="hosts of this learner's slice (default 1)")
    s.add_argument("--slice-index", type=int, default=0, metavar="I",
                   help="this host's index, 0..N-1; host 0 is the learner toward the coordinator and shards, the "
                        "others repeat its writes (default 0)")
    s.add_argument("--slice-leader", metavar="HOST:PORT", help="host 0's address on the slice port (with N > 1)")
    add_flag(s, "--slice-timeout-s", LearnerConfig, "slice_timeout_s",
             "a host waits this long for the others at any step before it fails", type=float, metavar="S")
    t.add_argument("--summary", help="write the JSON summary here at exit")
    t.add_argument("--summary-dir", help="write the JSON summary to DIR/<learner id>.json at exit")
    t.add_argument("--events-dir", help="write the event tape (states, evaluations) to DIR/<learner id>.events.jsonl")
    _add_telemetry(p)
    _add_run_config(p)
    p.set_defaults(func=_learner)


def _local(args: argparse.Namespace) -> int:
    from diloco.local import resume_config, run_local

    cfg = _local_config(args)
    if args.resume:  # the stored run, with what was given checked against it
        defaults = build_parser().parse_args(["local"])
        cfg = resume_config(Path(args.resume), cfg, _local_config(defaults))
    if not cfg.tls:
        logger.warning("--insecure: the run's processes talk plaintext gRPC (tokens and credentials in clear)")
    summary = run_local(cfg)
    print(json.dumps(summary, indent=1))
    return 0 if not summary["interrupted"] else 130


def _local_config(args: argparse.Namespace):
    from diloco.chaos import ChaosConfig, parse_learner_device, parse_scavenge, parse_slow

    grace_mode, grace_s = args.grace
    return LocalConfig(
        run=_run_config(args), learners=args.learners, shards=args.shards, quorum=args.quorum,
        grace=grace_mode if grace_mode != "fixed" else str(grace_s), steps=args.steps, tokens=args.tokens,
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        merge=args.merge, scale_by=args.scale_by, delta_codec=args.delta_codec, out=Path(args.out) if args.out else None,
        chaos=ChaosConfig(
            kill_every_s=args.kill_learner_every, max_kills=args.max_kills, restart_shard_at_s=args.restart_shard_at,
            restart_from=args.restart_from,
            scavenge=parse_scavenge(args.scavenge) if args.scavenge else None, seed=args.chaos_seed,
        ),
        slow_learners=tuple(parse_slow(x) for x in args.slow_learner or ()),
        learner_devices=tuple(parse_learner_device(x) for x in args.learner_device or ()),
        delay_ms=args.delay_ms,
        child_env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": args.otlp_endpoint,
                   "OTEL_EXPORTER_OTLP_INSECURE": "true"} if args.otlp_endpoint else None,
        learner_threads=args.learner_threads,
        snapshot_dir=args.snapshot_dir, snapshot_every_s=args.snapshot_every_s, snapshot_keep=args.snapshot_keep,
        tls=not (args.insecure or args.plaintext),
    )


def _add_local(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "local",
        help="the main job: a coordinator, S shards and M learners as processes on 127.0.0.1, training the default model",
        description="Run a real multi-process Decoupled DiLoCo training on this machine and write a run directory.",
    )
    add_config_flag(p)
    add_flag(p, "--learners", LocalConfig, "learners", "M: learners", type=int)
    add_flag(p, "--shards", LocalConfig, "shards", "S: syncer shards", type=int)
    add_flag(p, "--quorum", LocalConfig, "quorum", "K: minimum pushes per round", type=int)
    p.add_argument("--grace", type=_grace, default=("auto", 0.0), help="auto (default), off, or SECONDS")
    budget = p.add_mutually_exclusive_group()
    add_flag(budget, "--steps", LocalConfig, "steps", "inner steps per learner", type=int)
    budget.add_argument("--tokens", type=int, help="token budget of the whole run instead (learners drain once it is trained)")
    add_flag(p, "--outer-lr", LocalConfig, "outer_lr", "shards' outer learning rate (see README)", type=float)
    add_flag(p, "--outer-momentum", LocalConfig, "outer_momentum", "shards' outer Nesterov momentum", type=float)
    add_flag(p, "--merge", LocalConfig, "merge", "shards' merge", choices=MERGE_MODES)
    add_flag(p, "--scale-by", LocalConfig, "scale_by",
             "shards scale the outer lr by the round's share of live learners (live) or not (round)", choices=SCALE_MODES)
    add_flag(p, "--delta-codec", LocalConfig, "delta_codec", "learners' delta encoding", choices=DELTA_CODECS)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", help="run directory, new or empty (default ./runs/<timestamp>)")
    where.add_argument("--resume", metavar="RUN_DIR",
                       help="continue a stopped run from its newest complete snapshot (Ctrl-C and SIGTERM take one; "
                            "--snapshot-every-s for crashes), with its stored config: flags that would change it are "
                            "refused (--learners, --learner-threads, chaos, telemetry and snapshot schedule may differ)")
    p.add_argument("--otlp-endpoint", metavar="URL", help="send every process's traces and metrics here (OTLP/gRPC)")
    p.add_argument("--learner-device", action="append", metavar="ID:DEVICE",
                   help="the ID-th learner launched (0-based; L0 reads as 0) trains on DEVICE: cpu, cuda or xla "
                        "(repeatable; default: every learner on the CPU). xla uses every device PJRT_DEVICE gives "
                        "(on the CPU: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4) and needs torch-xla (constraints-xla.txt)")
    p.add_argument("--learner-threads", type=int, help="torch threads per learner (default: cores / learners, at least 1)")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC between the run's processes instead of mutual TLS with a CA and certificate "
                        "made for the run in RUN_DIR/tls (the default)")
    snapshots = p.add_argument_group("snapshots")
    snapshots.add_argument("--snapshot-dir", metavar="DIR|URL",
                           help="where snapshots go: a directory or an fsspec URL such as s3://bucket/run "
                                "(default RUN_DIR/coordinator/snapshots)")
    add_flag(snapshots, "--snapshot-every-s", LocalConfig, "snapshot_every_s",
             "the coordinator takes a snapshot every S seconds (0: only on demand)", type=float, metavar="S")
    add_flag(snapshots, "--snapshot-keep", LocalConfig, "snapshot_keep", "keep the newest N complete snapshots (0: all)",
             type=int, metavar="N")
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--kill-learner-every", type=float, metavar="SECONDS",
                       help="SIGKILL a random learner every SECONDS on average (Poisson; times count from the launch of the learners); a replacement is launched")
    chaos.add_argument("--max-kills", type=int, metavar="N", help="stop killing after N kills (default: no limit)")
    chaos.add_argument("--slow-learner", action="append", metavar="ID:FACTOR",
                       help="the ID-th learner launched (0-based; L1 reads as 1) takes FACTOR x as long per "
                       "step (repeatable); ids are given at join, so its events file says slow_factor")
    chaos.add_argument("--delay-ms", type=float, default=0.0, help="delay added to every push and reply (default 0)")
    chaos.add_argument("--restart-shard-at", type=float, metavar="SECONDS",
                       help="snapshot, SIGKILL shard 0 and restart it from the snapshot at SECONDS")
    chaos.add_argument("--restart-from", choices=["snapshot", "learners"], default="snapshot",
                       help="the restarted shard comes back from a snapshot (default) or, with no state, from the "
                            "learners' anchors")
    chaos.add_argument("--scavenge", metavar="N@SECONDS", help="add N learners through AddLearners at SECONDS")
    chaos.add_argument("--chaos-seed", type=int, default=0, help="seed of the kill schedule and victims (default 0)")
    _add_run_config(p)
    p.set_defaults(func=_local)


def _timeline(args: argparse.Namespace) -> int:
    from diloco.timeline import draw_timeline

    print(draw_timeline(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from diloco.replay import replay

    results = replay(Path(args.run_dir), args.snapshot_dir or None)
    worst = max(r.max_abs_diff for r in results)
    if args.json:
        print(json.dumps({"max_abs_diff": worst, "shards": [r.__dict__ for r in results]}))
    else:
        for r in results:
            origin = f"snapshot {r.restored_from}" if r.restored_from is not None else "its initial values"
            print(f"shard {r.shard_id}: replayed {r.rounds} rounds from {origin}; "
                  f"fragments at versions {r.fragments}; max |diff| {r.max_abs_diff:.3g}")
        print(f"max absolute difference from the run's final global parameters: {worst:.3g}")
    return 0 if worst == 0 or not args.check else 1


def _compare(args: argparse.Namespace) -> int:
    from diloco import compare

    scenarios = tuple(args.scenario or compare.SCENARIOS)
    cfg = compare.CompareConfig(
        run=_run_config(args), workers=args.workers, steps=args.steps, seed=args.seed_faults,
        systems=tuple(x for x in args.systems.split(",") if x), out=Path(args.out),
    )
    emit = (lambda r: print(json.dumps(r), flush=True)) if args.json else None
    compare.run(cfg, scenarios, args.ablations, on_result=emit)
    if not args.json:
        print((cfg.out / "results.md").read_text())
    return 0


def _add_compare(commands: argparse._SubParsersAction) -> None:
    from diloco.compare import SCENARIOS, SYSTEMS

    p = commands.add_parser(
        "compare",
        help="Decoupled DiLoCo vs synchronous DP vs torchft, scenario by scenario (real runs); markdown, JSON, plots",
        description="Run the same task (--task) and workload under each system for each scenario and write "
                    "OUT/results.md, OUT/results.json and OUT/compare.png.",
    )
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only this scenario (repeatable; default all)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)} (default all)")
    p.add_argument("--ablations", action="store_true", help="also run the Decoupled ablations on nofault and hetero")
    p.add_argument("--workers", type=int, default=4, help="M: learners / DP workers / torchft replicas (default 4)")
    p.add_argument("--steps", type=int, default=120, help="inner steps per worker (default 120)")
    p.add_argument("--seed-faults", type=int, default=3,
                   help="seed of the fault schedules (default 3: its first kill falls 8 s in, inside a one-minute run)")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario as it finishes")
    _add_run_config(p)
    p.set_defaults(func=_compare)


def _certs(args: argparse.Namespace) -> int:
    from diloco.certs import make_certs

    hosts = [h.strip() for h in (args.hosts or "").split(",") if h.strip()]
    files = make_certs(Path(args.out), hosts, days=args.days, overwrite=args.overwrite)
    print(f"wrote {', '.join(str(f) for f in files)}: give every process of the run --tls-dir {args.out} "
          f"(keep {files[1].name} to yourself; it signs more certificates)")
    return 0


def _add_certs(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "certs", help="make a run's CA and certificate for mutual TLS (--tls-dir)",
        description="Write ca.crt, ca.key, tls.crt and tls.key: a CA for one run and one certificate, signed by "
                    "it, that every process of the run presents (as server and client) with --tls-dir DIR.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created; keys are 0600)")
    p.add_argument("--hosts", metavar="H1,H2", help="extra DNS names or IPs the certificate names (channels verify "
                   "the name 'diloco', which it always carries)")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--overwrite", action="store_true", help="replace certificates already in DIR")
    p.set_defaults(func=_certs)


def _add_run_tools(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("timeline", help="redraw a diloco local run's busy/idle timeline from its tapes")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", help="PNG to write (default RUN_DIR/timeline.png)")
    p.set_defaults(func=_timeline)
    p = commands.add_parser("replay", help="re-run a diloco local run's rounds from its tapes; compare with its final model")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--snapshot-dir", help="where the run's snapshots are, a directory or URL (default RUN_DIR/coordinator/snapshots)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the replay matches bit for bit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_replay)


def _add_baseline(commands: argparse._SubParsersAction) -> None:
    """``diloco baseline dp|torchft``: the systems Decoupled DiLoCo is compared against."""
    from diloco.baseline.torchft_peer import TorchftConfig

    def baseline(args: argparse.Namespace) -> int:
        from diloco.baseline.common import parse_slow_workers

        common = dict(
            run=_run_config(args), workers=args.workers, steps=args.steps,
            kill_every_s=args.kill_every, slow_workers=parse_slow_workers(args.slow_worker),
            kill_at_steps=tuple(args.kill_at_step or ()), fault_seed=args.fault_seed,
            threads_per_worker=args.threads_per_worker, out=Path(args.out) if args.out else None,
        )
        if args.baseline == "dp":
            from diloco.baseline.dp import DPConfig, run_dp

            result = run_dp(DPConfig(**common, checkpoint_every_steps=args.checkpoint_every))
        else:
            from diloco.baseline.torchft_peer import TorchftConfig, run_torchft

            # torchft's Streaming DiLoCo mixes a synced fragment in with alpha: its own rule.
            from dataclasses import replace

            common["run"] = replace(common["run"], reply_rule="mix")
            result = run_torchft(TorchftConfig(**common, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum))
        _print_result(result, args.json)
        return 0

    parser = commands.add_parser(
        "baseline",
        help="the baselines on the same workload as diloco local: synchronous data-parallel, torchft",
        description="Run a baseline on diloco local's task (--task: model, data, loss, eval), token budget and "
                    "worker count; write a run directory with summary.json (wall_s, tokens, eval_unit, eval_loss_*, "
                    "goodput, uptime, global_stall_s, bytes_per_1k_tokens, restarts, steps).",
    )
    kinds = parser.add_subparsers(dest="baseline", required=True, metavar="BASELINE")
    dp = kinds.add_parser(
        "dp", help="synchronous data-parallel: one gradient all-reduce per step (gloo), elastic restart from checkpoints",
        description="Synchronous data-parallel over gloo on 127.0.0.1. A dead worker stalls every worker until the "
                    "supervisor restarts all of them from the last checkpoint.",
    )
    ft = kinds.add_parser(
        "torchft", help="torchft's Streaming DiLoCo (needs the optional extra: pip install 'diloco[peers]')",
        description="The same workload under torchft's Streaming DiLoCo (Lighthouse on 127.0.0.1, gloo, CPU). "
                    "A killed replica is restarted alone and heals from a peer.",
    )
    for p, who in ((dp, "workers"), (ft, "replicas")):
        p.add_argument("--workers", type=int, default=3, help=f"M: {who}, one process each (default 3)")
        p.add_argument("--steps", type=int, default=150, help="steps per worker (default 150, as diloco local)")
        p.add_argument("--kill-every", type=float, default=0.0, metavar="SECONDS",
                       help=f"SIGKILL a random one of the {who} every SECONDS on average (exponential; default 0: never)")
        p.add_argument("--kill-at-step", type=int, action="append", metavar="STEP",
                       help="deterministic fault: SIGKILL a random one once step STEP is done (repeatable)")
        p.add_argument("--slow-worker", action="append", metavar="ID:FACTOR",
                       help="that worker's steps take FACTOR x as long (repeatable, or comma-separated)")
        p.add_argument("--fault-seed", type=int, default=0, help="seed of the kill plan (default 0)")
        p.add_argument("--threads-per-worker", type=int, default=1,
                       help="torch threads of each process (default 1, as torchrun sets)")
        p.add_argument("--out", help="run directory (default ./runs/<baseline>-<timestamp>)")
        p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
        _add_run_config(p)
        p.set_defaults(func=baseline)
    dp.add_argument("--checkpoint-every", type=int, default=25, metavar="STEPS",
                    help="steps between two checkpoints (default 25)")
    add_flag(ft, "--outer-lr", TorchftConfig, "outer_lr", "outer SGD learning rate, as the shards'", type=float)
    add_flag(ft, "--outer-momentum", TorchftConfig, "outer_momentum", "outer Nesterov momentum, as the shards'", type=float)

def _tape_show(args: argparse.Namespace) -> int:
    from diloco.tape import read_tape

    records = list(read_tape(args.path))
    if args.kind:
        present = sorted({r["kind"] for r in records})
        unknown = sorted(set(args.kind) - set(present))
        if unknown:
            raise InvalidArgument(f"{args.path} has no records of kind {', '.join(unknown)}; its kinds: {', '.join(present)}")
        records = [r for r in records if r["kind"] in args.kind]
    if args.json:
        print(json.dumps(records))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", title=str(args.path))
    for column in ("t", "kind", "learner", "fragment", "version", "detail"):
        table.add_column(column)
    start = records[0]["t"] if records else 0.0
    for r in records:
        version = r.get("version", r.get("target_version", ""))
        if r["kind"] == "round":
            detail = f"{len(r['participants'])} learners, {r['reason']}, merge {r['merge_s'] * 1e3:.1f} ms"
        elif r["kind"] == "push":
            detail = f"base {r['base_version']}, {r['tokens']} tokens / {r['steps']} steps, {r['bytes']} B, {r['outcome']}"
        else:
            detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("t", "kind", "learner", "fragment"))
        table.add_row(
            f"{r['t'] - start:9.3f}", r["kind"], str(r.get("learner", "")), str(r.get("fragment", "")), str(version), detail
        )
    Console().print(table)
    return 0


def _add_tape(commands: argparse._SubParsersAction) -> None:
    tape = commands.add_parser("tape", help="read a shard's event tape")
    verbs = tape.add_subparsers(dest="tape", required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print a tape as a table (or JSON)")
    show.add_argument("path", type=Path, help="tape file (tape-S<m>.jsonl in a shard's data directory)")
    show.add_argument("--kind", action="append", help="only these record kinds (repeatable): push, round, membership, ...")
    show.add_argument("--json", action="store_true", help="print the records as one JSON list")
    show.set_defaults(func=_tape_show)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo over gRPC: learners, syncer shards and a coordinator.",
    )
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level for messages on stderr (default WARNING)",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true",
        help="stop (as on SIGTERM) when the parent process is gone (diloco local starts every process of its run so)",
    )
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument(
        "--tls-dir", metavar="DIR",
        help="mutual TLS for every server and channel of this process: DIR holds ca.crt, tls.crt and tls.key "
             "(`diloco certs`, or a cert-manager Secret; default $DILOCO_TLS_DIR)",
    )
    transport.add_argument(
        "--insecure", dest="plaintext", action="store_true",
        help="plaintext gRPC for this process: tokens and credentials cross the network in clear "
             "(default $DILOCO_INSECURE). coordinator, syncer, learner and admin refuse to start "
             "with neither this nor --tls-dir",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_local(commands)
    _add_certs(commands)
    _add_run_tools(commands)
    _add_compare(commands)
    _add_baseline(commands)
    _add_bench(commands)
    _add_syncer(commands)
    _add_learner(commands)
    _add_tape(commands)
    _add_simulate(commands)
    add_coordinator_parser(commands)
    add_admin_parser(commands)
    return parser


def _exit_with_parent() -> None:
    """SIGTERM this process (its graceful shutdown) once its parent process is gone: a
    run's processes never outlive the process that started them, however it ended
    (SIGKILL included, which no handler of the parent sees)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)  # nothing to wait on: the kernel reparents us without telling
        logger.warning("parent process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="diloco-parent-watch", daemon=True).start()


def _deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command given, so its usage, not the top level's, is shown."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _deepest_parser(chosen, args)
    return parser


_NETWORKED = ("coordinator", "syncer", "learner", "admin")
"""The commands that open gRPC servers or channels: they need --tls-dir or --insecure."""


def _choose_transport(args: argparse.Namespace) -> None:
    """Mutual TLS from --tls-dir, or plaintext only when asked for (--insecure). The
    choice is kept as ``args.transport`` (flags), so what the process launches (the
    coordinator's local learners) talks the same way."""
    from diloco import rpc

    tls_dir, plaintext = args.tls_dir, args.plaintext  # a flag wins over the environment
    if not tls_dir and not plaintext:
        tls_dir = os.environ.get("DILOCO_TLS_DIR") or None
        plaintext = os.environ.get("DILOCO_INSECURE", "").lower() in ("1", "true", "yes")
    if tls_dir:
        rpc.use_tls(rpc.Tls.from_dir(tls_dir))
        args.transport = ["--tls-dir", str(Path(tls_dir).resolve())]
    elif plaintext:
        if args.command in _NETWORKED:
            logger.warning("--insecure: plaintext gRPC, tokens and credentials cross the network in clear")
        args.transport = ["--insecure"]
    elif args.command in _NETWORKED and not (args.command == "admin" and args.run_dir):
        # (admin --run-dir follows the run: its RUN_DIR/tls, or plaintext for a run made --insecure)
        raise InvalidArgument(
            f"{args.command} refuses plaintext gRPC: give --tls-dir DIR (mutual TLS; `diloco certs --out DIR` "
            "makes one for a run) or --insecure (tokens and credentials then cross the network in clear); "
            "both go before the command, e.g. `diloco --tls-dir DIR " + args.command + " ...`")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "config", None):  # the file's settings become the command's defaults
        try:
            apply_config(_deepest_parser(parser, args), read_config(args.config), args.config)
        except DilocoError as error:
            print(f"diloco: error: {error}", file=sys.stderr)
            return 2
        args, unknown = parser.parse_known_args(argv)
    if unknown:
        _deepest_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.exit_with_parent:
        _exit_with_parent()
    # A supervisor that gives up on a process sends SIGUSR1 before SIGKILL: the stacks of
    # every thread go to the log, so a hang says where it was.
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # stderr not a file: in-process callers
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        _choose_transport(args)
        return args.func(args)
    except DilocoError as error:
        print(f"diloco: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
