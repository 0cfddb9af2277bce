"""The settings reference: for every flag of the commands that run or measure a run, its
default, the config field it sets and the Helm value that sets it in the chart. It is
built from the parser (each ``add_flag`` action remembers its field) and written to
docs/SETTINGS.md by ``python -m diloco.lab.reference``; tests/unit/test_defaults.py fails
when that file is stale, when a chart default differs from its field's, and when the
chart's schema and a field's own checks disagree about what a value may be."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.cli.settings import field_doc
from diloco.coordinator.config import CoordinatorConfig
from diloco.config import RunConfig
from diloco.learner.config import LearnerConfig
from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig
from diloco.validator.config import ValidatorConfig

COMMANDS = ("syncer", "learner", "coordinator", "validator", "local", "compare", "baseline dp", "baseline torchft")
DOC = Path(__file__).resolve().parents[2] / "docs" / "SETTINGS.md"
SCHEMA = Path(__file__).resolve().parents[2] / "k8s" / "diloco" / "values.schema.json"
"""The chart's values schema: each value that sets a config field is described by the
field's own description (``described``), as its flag is."""


@dataclass(frozen=True)
class ChartValue:
    path: str
    """Where values.yaml holds it, dotted (``syncer.quorum``)."""
    shown: Callable[[object], object] | None = None
    """The field's value as the chart says it (MiB for bytes), as its flag does."""
    own_default: str = ""
    """Why the chart's default differs from the field's (empty: it is the field's)."""
    narrower: str = ""
    """Why the chart's schema takes fewer values than the field (empty: the same)."""


CHART_VALUES: dict[tuple[type, str], ChartValue] = {
    (RunConfig, "task"): ChartValue("run.task"),
    (RunConfig, "seed"): ChartValue("run.seed"),
    (RunConfig, "fragments"): ChartValue("run.fragments"),
    (RunConfig, "sync_every_steps"): ChartValue("run.syncEverySteps"),
    (RunConfig, "overlap_steps"): ChartValue("run.overlapSteps"),
    (RunConfig, "merge_alpha"): ChartValue("run.mergeAlpha"),
    (RunConfig, "reply_rule"): ChartValue("run.replyRule"),
    (RunConfig, "max_model_bytes"): ChartValue("run.maxModelBytes"),
    (RoundConfig, "quorum"): ChartValue("syncer.quorum"),
    (RoundConfig, "grace_mode"): ChartValue("syncer.grace"),
    (RoundConfig, "grace_gamma"): ChartValue("syncer.graceGamma"),
    (RoundConfig, "grace_max_s"): ChartValue("syncer.graceMaxSeconds"),
    (MergeConfig, "merge"): ChartValue("syncer.merge"),
    (MergeConfig, "staleness_lambda"): ChartValue("syncer.stalenessLambda"),
    (MergeConfig, "outer_lr"): ChartValue("syncer.outerLr"),
    (MergeConfig, "outer_momentum"): ChartValue("syncer.outerMomentum"),
    (MergeConfig, "outer_optimizer"): ChartValue("syncer.outerOptimizer"),
    (MergeConfig, "block_size"): ChartValue("syncer.blockSize"),
    (MergeConfig, "update_chain_length"): ChartValue("syncer.chain"),
    (MergeConfig, "reply_codec"): ChartValue("syncer.replyCodec"),
    (MergeConfig, "reply_density"): ChartValue("syncer.replyDensity"),
    (SyncerConfig, "max_push_bytes"): ChartValue("syncer.maxPushMiB", shown=lambda size: size // 2**20),
    (SyncerConfig, "num_shards"): ChartValue("syncer.shards", own_default="a deployment spreads the model over 2 shards"),
    (CoordinatorConfig, "lease_s"): ChartValue("coordinator.leaseSeconds"),
    (CoordinatorConfig, "idle_timeout_s"): ChartValue("coordinator.idleTimeoutSeconds"),
    (CoordinatorConfig, "isolation_hold_leases"): ChartValue("coordinator.isolationHoldLeases"),
    (CoordinatorConfig, "max_learners"): ChartValue("coordinator.maxLearners"),
    (CoordinatorConfig, "model_sha256"): ChartValue("coordinator.modelSha256"),
    (CoordinatorConfig, "drain_timeout_s"): ChartValue("coordinator.drainTimeoutSeconds"),
    (CoordinatorConfig, "join_timeout_s"): ChartValue("coordinator.joinTimeoutSeconds"),
    (CoordinatorConfig, "snapshot_timeout_s"): ChartValue("coordinator.snapshotTimeoutSeconds"),
    (CoordinatorConfig, "snapshot_every_s"): ChartValue("snapshots.everySeconds"),
    (CoordinatorConfig, "snapshot_keep"): ChartValue("snapshots.keep"),
    (CoordinatorConfig, "port"): ChartValue("coordinator.port", own_default="a Service needs a fixed port",
                                            narrower="0 (any free port) cannot be a Service's port"),
    (CoordinatorConfig, "status_port"): ChartValue(
        "coordinator.statusPage.port", own_default="the chart serves the status page (coordinator.statusPage.enabled) "
        "at a fixed port, for the port-forward its NOTES give", narrower="0 (any free port) cannot be port-forwarded "
        "by a recipe"),
    (LearnerConfig, "steps"): ChartValue("learners.steps", own_default="a deployment trains longer than a local try"),
    (LearnerConfig, "lr"): ChartValue("learners.lr"),
    (LearnerConfig, "inner_optimizer"): ChartValue("learners.innerOptimizer"),
    (LearnerConfig, "delta_codec"): ChartValue("learners.deltaCodec"),
    (LearnerConfig, "delta_density"): ChartValue("learners.deltaDensity"),
    (LearnerConfig, "warmup_steps"): ChartValue("learners.warmupSteps"),
    (ValidatorConfig, "interval_s"): ChartValue("validator.intervalSeconds"),
    (ValidatorConfig, "steps"): ChartValue("validator.steps"),
    (ValidatorConfig, "agreement"): ChartValue("validator.agreement"),
}


def command_parser(parser: argparse.ArgumentParser, words: str) -> argparse.ArgumentParser:
    """The subparser of ``diloco WORDS`` (``"baseline dp"``)."""
    for word in words.split():
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(parser: argparse.ArgumentParser) -> str:
    lines = [
        "# Settings reference",
        "",
        "Generated by `python -m diloco.lab.reference` from the command-line parser; do not edit",
        "(tests/unit/test_defaults.py fails when it is stale). A default comes from the config field",
        "the flag sets (the \"sets\" column); the Helm chart's value of the same setting is named beside it",
        "(its default is the field's unless marked †, with the reason below the table). Every flag can",
        "also come from `--config FILE` (TOML or JSON), one key per flag: its name without the dashes.",
    ]
    for words in COMMANDS:
        sub = command_parser(parser, words)
        lines += ["", f"## `diloco {words}`", "", "| flag | default | sets | Helm value | what |", "|---|---|---|---|---|"]
        notes = []
        for action in sub._actions:
            if not action.option_strings or action.dest in ("help", "config"):
                continue
            field = getattr(action, "field", None)
            sets = f"`{field[0].__name__}.{field[1]}`" if field else ""
            chart = CHART_VALUES.get(field) if field else None
            helm = ""
            if chart is not None:
                helm = f"`{chart.path}`" + (" †" if chart.own_default else "")
                if chart.own_default and f"`{chart.path}`: {chart.own_default}" not in notes:
                    notes.append(f"`{chart.path}`: {chart.own_default}")
            what, _, said = (action.help or "").partition(" (default ")
            default = _default(action) or _cell(said.rstrip(")"))
            lines.append(f"| `{', '.join(action.option_strings)}` | {default} | {sets} | {helm} | {_cell(what)} |")
        if notes:
            lines += ["", *(f"† {note}" for note in notes)]
    return "\n".join(lines).rstrip() + "\n"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return ""
    if isinstance(action.default, tuple) and action.dest == "grace":
        return f"`{action.default[0]}`"
    return f"`{action.default}`" if action.default != "" else "none"


def described(schema: dict) -> dict:
    """``schema`` (the chart's, parsed) with the description of each value in
    ``CHART_VALUES`` set to its field's (``field_doc``); the other values keep theirs."""
    for (cls, name), chart in CHART_VALUES.items():
        node = schema
        for part in chart.path.split("."):
            node = node["properties"][part]
        node["description"] = field_doc(cls, name)
    return schema


def schema_text(schema: dict) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    from diloco.cli.main import COMMANDS, build_parser
    from diloco.lab.commands import COMMANDS as LAB

    DOC.write_text(render(build_parser(COMMANDS + LAB)))
    SCHEMA.write_text(schema_text(described(json.loads(SCHEMA.read_text()))))
    print(f"wrote {DOC} and {SCHEMA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
