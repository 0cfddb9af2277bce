"""One value for every default a run's behaviour depends on: the library's config
dataclasses, every command-line flag that sets the same field, and the Helm chart's
values.yaml agree (they disagreed: H 16 in the library and the chart, 4 on the command
line; outer lr/momentum 0.7/0.9 in the library, the chart and `diloco syncer`, 1.0/0 in
`diloco local` and the torchft baseline)."""

from pathlib import Path

import pytest
import yaml

from coordinator.config import CoordinatorConfig
from tools.baseline.torchft_peer import TorchftConfig
from tools.cli.main import build_parser
from diloco.config import RunConfig
from tools.local.config import LocalConfig
from tools.cli.settings import add_flag, default_of
from learner.config import LearnerConfig
from syncer.config import MergeConfig, RoundConfig, SyncerConfig

VALUES = yaml.safe_load((Path(__file__).parents[2] / "k8s" / "diloco" / "values.yaml").read_text())

# (config class, field, [(command line, argparse dest)], values.yaml path or None)
SETTINGS = [
    (RunConfig, "seed", [("learner", "seed"), ("syncer", "seed"), ("local", "seed")], "run.seed"),
    (RunConfig, "fragments", [("learner", "fragments"), ("syncer", "fragments"), ("local", "fragments")], "run.fragments"),
    (RunConfig, "sync_every_steps", [("learner", "sync_every"), ("syncer", "sync_every"), ("local", "sync_every")],
     "run.syncEverySteps"),
    (RunConfig, "overlap_steps", [("learner", "overlap"), ("syncer", "overlap"), ("local", "overlap")], "run.overlapSteps"),
    (RunConfig, "merge_alpha", [("learner", "alpha"), ("syncer", "alpha"), ("local", "alpha")], "run.mergeAlpha"),
    (RunConfig, "reply_rule", [("learner", "reply_rule"), ("syncer", "reply_rule"), ("local", "reply_rule")],
     "run.replyRule"),
    (RoundConfig, "quorum", [("syncer", "quorum"), ("local", "quorum")], "syncer.quorum"),
    (RoundConfig, "grace_gamma", [("syncer", "grace_gamma")], "syncer.graceGamma"),
    (RoundConfig, "grace_max_s", [("syncer", "grace_max_s")], "syncer.graceMaxSeconds"),
    (MergeConfig, "merge", [("syncer", "merge"), ("local", "merge")], "syncer.merge"),
    (MergeConfig, "staleness_lambda", [("syncer", "staleness_lambda")], "syncer.stalenessLambda"),
    (MergeConfig, "outer_lr", [("syncer", "outer_lr"), ("local", "outer_lr"), ("baseline torchft", "outer_lr")],
     "syncer.outerLr"),
    (MergeConfig, "outer_momentum",
     [("syncer", "outer_momentum"), ("local", "outer_momentum"), ("baseline torchft", "outer_momentum")],
     "syncer.outerMomentum"),
    (MergeConfig, "scale_by", [("syncer", "scale_by"), ("local", "scale_by")], None),
    (MergeConfig, "block_size", [("syncer", "block_size"), ("learner", "block_size")], "syncer.blockSize"),
    (MergeConfig, "update_chain_length", [("syncer", "chain")], "syncer.chain"),
    (CoordinatorConfig, "lease_s", [("coordinator", "lease_s")], "coordinator.leaseSeconds"),
    (CoordinatorConfig, "max_learners", [("coordinator", "max_learners")], "coordinator.maxLearners"),
    (CoordinatorConfig, "drain_timeout_s", [("coordinator", "drain_timeout_s")], "coordinator.drainTimeoutSeconds"),
    (CoordinatorConfig, "join_timeout_s", [("coordinator", "join_timeout_s")], "coordinator.joinTimeoutSeconds"),
    (CoordinatorConfig, "snapshot_timeout_s", [("coordinator", "snapshot_timeout_s")], "coordinator.snapshotTimeoutSeconds"),
    (CoordinatorConfig, "snapshot_every_s", [("coordinator", "snapshot_every_s")], None),
    (CoordinatorConfig, "credential_lifetime_s", [("coordinator", "credential_lifetime_s")], None),
    (SyncerConfig, "anchor_window_s", [("syncer", "anchor_window_s")], None),
    (SyncerConfig, "max_delta_ratio", [("syncer", "max_delta_ratio")], None),
    (SyncerConfig, "stream_idle_timeout_s", [("syncer", "stream_idle_timeout_s")], None),
    (LocalConfig, "snapshot_every_s", [("local", "snapshot_every_s")], None),
    (LocalConfig, "snapshot_keep", [("local", "snapshot_keep")], None),
    (LearnerConfig, "lr", [("learner", "lr")], "learners.lr"),
    (LearnerConfig, "warmup_steps", [("learner", "warmup_steps")], None),
    (LearnerConfig, "delta_codec", [("learner", "delta_codec"), ("local", "delta_codec")], None),
    (LearnerConfig, "device", [("learner", "device")], None),
    (LearnerConfig, "precision", [("learner", "precision")], None),
]


def _parsed(command: str):
    return build_parser().parse_args(command.split())


def _value(path: str):
    node = VALUES
    for key in path.split("."):
        node = node[key]
    return node


@pytest.mark.parametrize(("cls", "name", "flags", "chart"), SETTINGS, ids=[f"{c.__name__}.{n}" for c, n, _, _ in SETTINGS])
def test_library_command_line_and_chart_agree(cls, name, flags, chart):
    default = default_of(cls, name)
    for command, dest in flags:
        assert getattr(_parsed(command), dest) == default, f"diloco {command} --{dest.replace('_', '-')}"
    if chart is not None:
        assert _value(chart) == default, f"values.yaml {chart}"


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


def test_a_flag_shows_the_default_it_takes():
    import argparse

    parser = argparse.ArgumentParser()
    action = add_flag(parser, "--sync-every", RunConfig, "sync_every_steps", "H", type=int)
    assert action.default == RunConfig().sync_every_steps and action.help == f"H (default {RunConfig().sync_every_steps})"
    with pytest.raises(KeyError, match="no field 'nope'"):
        default_of(RunConfig, "nope")
