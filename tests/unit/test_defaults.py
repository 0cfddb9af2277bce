"""One value for every default a run's behaviour depends on: the library's config
dataclasses, every command-line flag that sets the same field, and the Helm chart's
values.yaml agree (they disagreed: H 16 in the library and the chart, 4 on the command
line; outer lr/momentum 0.7/0.9 in the library, the chart and `diloco syncer`, 1.0/0 in
`diloco local` and the torchft baseline)."""

import argparse
import json
import typing
from pathlib import Path

import pytest
import yaml

from diloco.coordinator.config import CoordinatorConfig
from diloco.lab.baseline.torchft_peer import TorchftConfig
from diloco.command import build_parser
from diloco.config import RunConfig
from diloco.errors import DilocoError
from diloco.cli.local.config import LocalConfig
from diloco.lab.reference import CHART_VALUES, COMMANDS, DOC, command_parser, described, render, schema_text
from diloco.lab.reference import SCHEMA as SCHEMA_FILE
from diloco.cli.settings import add_flag, default_of, field_doc, from_flags
from diloco.learner.config import LearnerConfig
from diloco.syncer.config import GRACE_MODES, MergeConfig, RoundConfig, SyncerConfig

VALUES = yaml.safe_load((Path(__file__).parents[2] / "k8s" / "diloco" / "values.yaml").read_text())

# (config class, field, [(command line, argparse dest)]): the same setting in every command that
# sets it, whichever config class it lands in; the chart's value is CHART_VALUES's.
SETTINGS = [
    (RunConfig, "seed", [("learner", "seed"), ("syncer", "seed"), ("local", "seed")]),
    (RunConfig, "fragments", [("learner", "fragments"), ("syncer", "fragments"), ("local", "fragments")]),
    (RunConfig, "sync_every_steps", [("learner", "sync_every"), ("syncer", "sync_every"), ("local", "sync_every")]),
    (RunConfig, "overlap_steps", [("learner", "overlap"), ("syncer", "overlap"), ("local", "overlap")]),
    (RunConfig, "merge_alpha", [("learner", "alpha"), ("syncer", "alpha"), ("local", "alpha")]),
    (RunConfig, "reply_rule", [("learner", "reply_rule"), ("syncer", "reply_rule"), ("local", "reply_rule")]),
    (RoundConfig, "quorum", [("syncer", "quorum"), ("local", "quorum")]),
    (RoundConfig, "grace_gamma", [("syncer", "grace_gamma")]),
    (RoundConfig, "grace_max_s", [("syncer", "grace_max_s")]),
    (MergeConfig, "merge", [("syncer", "merge"), ("local", "merge")]),
    (MergeConfig, "staleness_lambda", [("syncer", "staleness_lambda")]),
    (MergeConfig, "outer_lr", [("syncer", "outer_lr"), ("local", "outer_lr"), ("baseline torchft", "outer_lr")]),
    (MergeConfig, "outer_momentum",
     [("syncer", "outer_momentum"), ("local", "outer_momentum"), ("baseline torchft", "outer_momentum")]),
    (MergeConfig, "scale_by", [("syncer", "scale_by"), ("local", "scale_by")]),
    (MergeConfig, "block_size", [("syncer", "block_size"), ("learner", "block_size")]),
    (MergeConfig, "reply_codec", [("syncer", "reply_codec"), ("local", "reply_codec")]),
    (MergeConfig, "reply_density", [("syncer", "reply_density"), ("local", "reply_density")]),
    (MergeConfig, "update_chain_length", [("syncer", "chain")]),
    (CoordinatorConfig, "lease_s", [("coordinator", "lease_s")]),
    (CoordinatorConfig, "idle_timeout_s", [("coordinator", "idle_timeout_s")]),
    (CoordinatorConfig, "max_learners", [("coordinator", "max_learners")]),
    (CoordinatorConfig, "drain_timeout_s", [("coordinator", "drain_timeout_s")]),
    (CoordinatorConfig, "join_timeout_s", [("coordinator", "join_timeout_s")]),
    (CoordinatorConfig, "snapshot_timeout_s", [("coordinator", "snapshot_timeout_s")]),
    (CoordinatorConfig, "snapshot_every_s", [("coordinator", "snapshot_every_s")]),
    (CoordinatorConfig, "credential_lifetime_s", [("coordinator", "credential_lifetime_s")]),
    (SyncerConfig, "anchor_window_s", [("syncer", "anchor_window_s")]),
    (SyncerConfig, "max_delta_ratio", [("syncer", "max_delta_ratio")]),
    (SyncerConfig, "robust_multiple", [("syncer", "robust_multiple"), ("local", "robust_multiple")]),
    (SyncerConfig, "stream_idle_timeout_s", [("syncer", "stream_idle_timeout_s")]),
    (LocalConfig, "snapshot_every_s", [("local", "snapshot_every_s")]),
    (LocalConfig, "snapshot_keep", [("local", "snapshot_keep")]),
    (LearnerConfig, "lr", [("learner", "lr"), ("local", "lr")]),
    (LearnerConfig, "inner_optimizer", [("learner", "inner_optimizer"), ("local", "inner_optimizer")]),
    (LearnerConfig, "warmup_steps", [("learner", "warmup_steps")]),
    (LearnerConfig, "delta_codec", [("learner", "delta_codec"), ("local", "delta_codec")]),
    (LearnerConfig, "delta_density", [("learner", "delta_density"), ("local", "delta_density")]),
    (LearnerConfig, "device", [("learner", "device")]),
    (LearnerConfig, "precision", [("learner", "precision")]),
]


def _parsed(command: str):
    return build_parser().parse_args(command.split())


def _value(path: str):
    node = VALUES
    for key in path.split("."):
        node = node[key]
    return node


@pytest.mark.parametrize(("cls", "name", "flags"), SETTINGS, ids=[f"{c.__name__}.{n}" for c, n, _ in SETTINGS])
def test_library_command_line_and_chart_agree(cls, name, flags):
    default = default_of(cls, name)
    for command, dest in flags:
        assert getattr(_parsed(command), dest) == default, f"diloco {command} --{dest.replace('_', '-')}"
    chart = CHART_VALUES.get((cls, name))
    if chart is not None and not chart.own_default:
        assert _value(chart.path) == default, f"values.yaml {chart.path}"


@pytest.mark.parametrize("key", CHART_VALUES, ids=[f"{c.__name__}.{n}" for c, n in CHART_VALUES])
def test_the_charts_defaults_are_the_fields(key):
    """Every chart value that sets a config field defaults to that field's default (in
    the flag's units), unless the chart says why not."""
    chart = CHART_VALUES[key]
    default = default_of(*key)
    if chart.shown is not None:
        default = chart.shown(default)
    if chart.own_default:
        assert _value(chart.path) != default, f"{chart.path} is the field's default: drop its own_default"
    else:
        assert _value(chart.path) == default, f"values.yaml {chart.path}"


def test_the_configs_that_copy_a_default_take_it_from_its_source():
    """diloco local and the torchft baseline set the shards' and learners' settings: the
    same values, so a comparison runs every system on the same outer step."""
    assert (LocalConfig().outer_lr, LocalConfig().outer_momentum) == (MergeConfig().outer_lr, MergeConfig().outer_momentum)
    assert (TorchftConfig().outer_lr, TorchftConfig().outer_momentum) == (LocalConfig().outer_lr, LocalConfig().outer_momentum)
    assert LocalConfig().quorum == RoundConfig().quorum and LocalConfig().delta_codec == LearnerConfig().delta_codec
    assert LocalConfig().run == RunConfig()
    assert _parsed("syncer").grace[0] == _parsed("local").grace[0] == RoundConfig().grace_mode == VALUES["syncer"]["grace"]
    assert _parsed("syncer").max_push_mib * 2**20 == SyncerConfig().max_push_bytes
    assert VALUES["syncer"]["maxPushMiB"] * 2**20 == SyncerConfig().max_push_bytes


# The flags of those commands that have a default of their own and set no config field.
NOT_A_FIELD = {
    "launch_id": "the id a launcher gives the process it starts, to match its Join; none by hand",
    "serve_forks": "how a launcher starts its fork server (store_true), not a setting",
    "num_learners": "a static-topology learner's TaskContext.num_learners (a joined one gets the coordinator's)",
    "slice_hosts": "the SliceLink's host count (1: no slice)",
    "slice_index": "the SliceLink's host index",
    "data_dir": "the coordinator's directory, ./coordinator: CoordinatorConfig.data_dir has no default",
    "ablations": "what compare runs, not how",
    "json": "how a command prints",
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_with_a_default_takes_it_from_a_config_field(command):
    """No hand-written default beside a config field: a flag whose default is not None
    was made by add_flag (and remembers its field), or is one of the few above."""
    flags = [a for a in command_parser(build_parser(), command)._actions if a.option_strings and a.default not in (None, argparse.SUPPRESS)]
    assert any(hasattr(a, "field") for a in flags)
    offenders = [f"diloco {command} {a.option_strings[0]} (default {a.default!r})"
                 for a in flags if not hasattr(a, "field") and a.dest not in NOT_A_FIELD]
    assert not offenders, offenders


def test_a_flag_shows_the_default_it_takes_and_its_fields_description():
    parser = argparse.ArgumentParser()
    action = add_flag(parser, "--sync-every", RunConfig, "sync_every_steps", type=int)
    described = "H: inner steps between two sends of the same fragment (with outer Nesterov 0.7 / 0.9 take H >= 16)."
    assert action.default == RunConfig().sync_every_steps
    assert action.help == f"{described} (default {RunConfig().sync_every_steps})"
    with pytest.raises(KeyError, match="no field 'nope'"):
        default_of(RunConfig, "nope")
    assert action.field == (RunConfig, "sync_every_steps")
    mib = add_flag(parser, "--max-push-mib", SyncerConfig, "max_push_bytes", type=int, shown=lambda b: b // 2**20)
    assert mib.default == SyncerConfig().max_push_bytes // 2**20 and mib.help.endswith(f"(default {mib.default})")
    with pytest.raises(ValueError, match="is on by default"):
        add_flag(parser, "--tls", LocalConfig, "tls", action="store_true")
    assert add_flag(parser, "--insecure", LocalConfig, "tls", action="store_true", shown=lambda tls: not tls).default is False


def test_a_fields_description_is_its_docstrings_first_paragraph_or_its_sources():
    """One setting, one description: the docstring under the field, its first paragraph
    (the rest says why); a field whose default is another config's field (LocalConfig's
    copies of the shards' settings) has that field's description; a field a base class
    declares, the base's."""
    assert field_doc(RunConfig, "sync_every_steps").startswith("H: inner steps between two sends")
    assert "seeded sweep" not in field_doc(RunConfig, "sync_every_steps")  # the second paragraph
    assert field_doc(LocalConfig, "outer_lr") == field_doc(MergeConfig, "outer_lr")
    assert field_doc(TorchftConfig, "lr") == field_doc(TorchftConfig.__mro__[1], "lr")
    with pytest.raises(KeyError, match="LocalConfig.run has no docstring"):
        field_doc(LocalConfig, "run")  # nested configs are described by their own fields
    assert "``" not in field_doc(LocalConfig, "tls")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_that_sets_a_field_is_described_by_the_field(command):
    flags = [a for a in command_parser(build_parser(), command)._actions if hasattr(a, "field")]
    assert flags
    for action in flags:
        cls, name = action.field
        assert action.help.startswith(field_doc(cls, name).replace("%", "%%") + " (default "), action.option_strings


def test_the_charts_schema_describes_each_value_by_its_field():
    """k8s/diloco/values.schema.json (python -m diloco.lab.reference rewrites it) describes
    every value that sets a config field with the field's own description."""
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema_text(described(json.loads(SCHEMA_FILE.read_text()))) == SCHEMA_FILE.read_text(), \
        "the chart's schema descriptions are stale: run python -m diloco.lab.reference"
    assert schema["properties"]["syncer"]["properties"]["quorum"]["description"] == field_doc(RoundConfig, "quorum")


def test_the_settings_reference_is_fresh():
    """docs/SETTINGS.md is what the parser says (python -m diloco.lab.reference rewrites it)."""
    text = render(build_parser())
    assert "| `--quorum` | `1` | `RoundConfig.quorum` | `syncer.quorum` |" in text
    assert DOC.read_text() == text, "docs/SETTINGS.md is stale: run python -m diloco.lab.reference"


SCHEMA = json.loads(SCHEMA_FILE.read_text())


def _schema(path: str) -> dict:
    node = SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    if "$ref" in node:  # #/definitions/NAME
        node = SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _make(cls: type, **changes):
    """``cls`` with ``changes`` (the coordinator's config needs its directory)."""
    return cls(**({"data_dir": Path("coordinator")} if cls is CoordinatorConfig else {}), **changes)


def _accepts(cls: type, name: str, value) -> bool:
    try:
        _make(cls, **{name: value})
    except DilocoError:
        return False
    return True


BOUNDS = [(key, chart) for key, chart in CHART_VALUES.items() if chart.shown is None]


@pytest.mark.parametrize(("key", "chart"), BOUNDS, ids=[f"{c.__name__}.{n}" for (c, n), _ in BOUNDS])
def test_the_charts_schema_and_the_fields_checks_agree(key, chart):
    """What values.schema.json lets through, the field's own check takes, and at each bound
    the schema sets the field refuses what the schema refuses: a chart value that passes
    the schema never fails the process at start (a crash loop), and no check is only in
    one of them. Choices: the schema's enum is the flag's choices."""
    cls, name = key
    schema = _schema(chart.path)
    default = default_of(cls, name)
    choices = {c for words in COMMANDS for a in command_parser(build_parser(), words)._actions
               if getattr(a, "field", None) == key and a.choices for c in a.choices}
    if key == (RoundConfig, "grace_mode"):  # auto, off or SECONDS (the mode "fixed")
        assert schema["oneOf"] == [{"enum": [m for m in GRACE_MODES if m != "fixed"]}, {"type": "number", "minimum": 0}]
        assert not _accepts(RoundConfig, "grace_fixed_s", -1e-9) and _accepts(RoundConfig, "grace_fixed_s", 0.0)
        return
    if "enum" in schema or choices:
        assert set(schema.get("enum", ())) == choices, chart.path
        return
    kind = schema.get("type")
    hint = typing.get_type_hints(cls)[name]  # an optional field (None: off) by its value's type
    value_type = type(default) if default is not None else next(t for t in typing.get_args(hint) if t is not type(None))
    assert kind == {int: "integer", float: "number", str: "string"}[value_type], chart.path
    step = 1 if kind == "integer" else 1e-9
    cast = int if kind == "integer" else float
    if "minimum" in schema:
        low = cast(schema["minimum"])
        assert _accepts(cls, name, low) and (chart.narrower or not _accepts(cls, name, low - step)), chart.path
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"]
        assert not _accepts(cls, name, cast(low)) and _accepts(cls, name, cast(low + step)), chart.path
    if "maximum" in schema:
        assert _accepts(cls, name, cast(schema["maximum"])) and not _accepts(cls, name, cast(schema["maximum"] + step)), chart.path
    if "exclusiveMaximum" in schema:
        high = schema["exclusiveMaximum"]
        assert not _accepts(cls, name, cast(high)) and _accepts(cls, name, cast(high - step)), chart.path
    if "multipleOf" in schema:
        base = schema.get("minimum", schema["multipleOf"])
        assert not _accepts(cls, name, cast(base + 1)), chart.path


def test_from_flags_puts_each_flag_back_into_its_field():
    """A config built from a command's flags takes every flag add_flag made for its class
    (through ``taken`` where the flag speaks other units), and what the command gives wins."""
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("g")  # a group records into its parser's defaults
    add_flag(parser, "--quorum", RoundConfig, "quorum", type=int)
    add_flag(group, "--grace-max-s", RoundConfig, "grace_max_s", type=float)
    add_flag(parser, "--max-push-mib", SyncerConfig, "max_push_bytes", type=int,
             shown=lambda b: b // 2**20, taken=lambda mib: mib * 2**20)
    args = parser.parse_args(["--quorum", "3", "--grace-max-s", "2.5", "--max-push-mib", "7"])
    assert from_flags(args, RoundConfig) == RoundConfig(quorum=3, grace_max_s=2.5)
    assert from_flags(args, RoundConfig, quorum=2).quorum == 2
    assert from_flags(args, SyncerConfig).max_push_bytes == 7 * 2**20
    assert from_flags(parser.parse_args([]), SyncerConfig) == SyncerConfig()


def test_local_takes_every_flag_it_is_given():
    from diloco.cli.runs import _local_config

    args = build_parser().parse_args(["local", "--grace", "0.5", "--insecure", "--delay-ms", "3", "--chaos-seed", "7",
                                      "--restart-from", "learners", "--outer-lr", "0.5", "--learners", "5"])
    cfg = _local_config(args)
    assert (cfg.grace, cfg.tls, cfg.delay_ms, cfg.chaos.seed, cfg.chaos.restart_from, cfg.outer_lr, cfg.learners) == (
        "0.5", False, 3.0, 7, "learners", 0.5, 5)
