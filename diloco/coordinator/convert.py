"""Protos <-> coordinator core types. The only coordinator module that imports both."""

from __future__ import annotations

import math
import re

from diloco.coordinator.core.membership import (
    ACTIVE, DRAINING, FAILED, JOINING, LEFT, Change, FailedLaunch, HeartbeatStats, Launch, Learner,
)
from diloco.coordinator.core.snapshots import COMPLETE, FAILED as SNAPSHOT_FAILED, RUNNING, Snapshot, SnapshotFile
from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.convert import clock_from_proto, clock_to_proto, plan_to_proto
from diloco.errors import InvalidArgument
from diloco.fragments import FragmentPlan
from diloco.v1 import common_pb2, coordinator_pb2

__all__ = ["clock_from_proto", "clock_to_proto"]

_STATE = {
    JOINING: common_pb2.LEARNER_STATE_JOINING,
    ACTIVE: common_pb2.LEARNER_STATE_ACTIVE,
    DRAINING: common_pb2.LEARNER_STATE_DRAINING,
    FAILED: common_pb2.LEARNER_STATE_FAILED,
    LEFT: common_pb2.LEARNER_STATE_LEFT,
}
# A learner becoming active is announced as another JOINED event with state ACTIVE.
_EVENT = {
    "joined": coordinator_pb2.MEMBERSHIP_EVENT_KIND_JOINED,
    "active": coordinator_pb2.MEMBERSHIP_EVENT_KIND_JOINED,
    "draining": coordinator_pb2.MEMBERSHIP_EVENT_KIND_DRAINING,
    "failed": coordinator_pb2.MEMBERSHIP_EVENT_KIND_FAILED,
    "left": coordinator_pb2.MEMBERSHIP_EVENT_KIND_LEFT,
}
_SNAPSHOT_STATE = {
    RUNNING: coordinator_pb2.SNAPSHOT_STATE_RUNNING,
    COMPLETE: coordinator_pb2.SNAPSHOT_STATE_COMPLETE,
    SNAPSHOT_FAILED: coordinator_pb2.SNAPSHOT_STATE_FAILED,
}


def _ms(seconds: float | None) -> int:
    return 0 if seconds is None else int(round(seconds * 1000))


def learner_to_proto(learner: Learner) -> common_pb2.LearnerInfo:
    return common_pb2.LearnerInfo(
        learner_id=learner.id,
        state=_STATE[learner.state],
        pool=learner.pool,
        address=learner.address,
        last_heartbeat_unix_ms=_ms(learner.heartbeat_s),
        counted_unix_ms=_ms(learner.counted_s),
        tokens=learner.tokens,
        inner_steps=learner.inner_steps,
        version_lag=learner.version_lag,
        joined_unix_ms=_ms(learner.joined_s),
        launch_id=learner.launch_id,
        reason=learner.reason,
        train_loss=learner.train_loss,
        eval_loss=learner.eval_loss,
        tokens_per_s=learner.tokens_per_s,
        loss_unit=learner.loss_unit,
    )


def launch_to_proto(launch: Launch | FailedLaunch) -> coordinator_pb2.LaunchInfo:
    if isinstance(launch, FailedLaunch):
        return coordinator_pb2.LaunchInfo(launch_id=launch.launch_id, pool=launch.pool, state="failed",
                                          detail=launch.detail, since_unix_ms=_ms(launch.failed_s))
    return coordinator_pb2.LaunchInfo(launch_id=launch.launch_id, pool=launch.pool, state="launching",
                                      since_unix_ms=_ms(launch.launched_s))


def membership_snapshot(learners: list[Learner], clock: VectorClock) -> coordinator_pb2.MembershipEvent:
    return coordinator_pb2.MembershipEvent(
        kind=coordinator_pb2.MEMBERSHIP_EVENT_KIND_SNAPSHOT,
        learners=[learner_to_proto(l) for l in learners],
        clock=clock_to_proto(clock),
    )


def change_to_proto(change: Change, clock: VectorClock) -> coordinator_pb2.MembershipEvent:
    return coordinator_pb2.MembershipEvent(
        kind=_EVENT[change.kind], learners=[learner_to_proto(change.learner)], clock=clock_to_proto(clock)
    )


MAX_UNIT_CHARS = 32


def stats_from_proto(msg: coordinator_pb2.HeartbeatRequest) -> HeartbeatStats:
    """A heartbeat's counts; a rate or loss that is not a finite number (>= 0 for the rate)
    is refused: the status page and the metrics show them as they come."""
    if not (math.isfinite(msg.tokens_per_s) and msg.tokens_per_s >= 0):
        raise InvalidArgument(f"tokens_per_s must be a finite number >= 0, got {msg.tokens_per_s}")
    losses = {}
    for name in ("train_loss", "eval_loss"):
        if msg.HasField(name):
            value = getattr(msg, name)
            if not math.isfinite(value):
                raise InvalidArgument(f"{name} must be a finite number, got {value}")
            losses[name] = value
    if len(msg.loss_unit) > MAX_UNIT_CHARS or not msg.loss_unit.isprintable():
        raise InvalidArgument(f"loss_unit must be at most {MAX_UNIT_CHARS} printable characters, got {msg.loss_unit[:40]!r}")
    return HeartbeatStats(msg.tokens, msg.inner_steps, msg.version_lag, msg.tokens_per_s, **losses,
                          loss_unit=msg.loss_unit, counted_s=msg.counted_unix_ms / 1000 if msg.counted_unix_ms > 0 else None)


_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def files_from_proto(files) -> list[SnapshotFile]:
    """A participant's snapshot files: plain names in the snapshot's directory (never a
    path that leads elsewhere: restore reads them back), each with a hex SHA-256."""
    out = []
    for f in files:
        if not _FILE_NAME.match(f.path) or f.path in (".", ".."):
            raise InvalidArgument(f"snapshot file {f.path[:60]!r} is not a plain file name")
        if not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            raise InvalidArgument(f"snapshot file {f.path!r}: sha256 must be 64 hex digits")
        out.append(SnapshotFile(f.path, f.size_bytes, f.sha256))
    return out


def snapshot_to_proto(snapshot: Snapshot) -> coordinator_pb2.SnapshotInfo:
    return coordinator_pb2.SnapshotInfo(
        snapshot_id=snapshot.id,
        state=_SNAPSHOT_STATE[snapshot.state],
        started_unix_ms=_ms(snapshot.started_s),
        finished_unix_ms=_ms(snapshot.finished_s),
        participants=snapshot.participants,
        reported=sorted(snapshot.reports),
        manifest=snapshot.manifest,
        detail=snapshot.detail,
    )


def topology_to_proto(
    run: RunConfig, shards: tuple[str, ...], epoch: int, plan: FragmentPlan | None = None, manifest_json: str = "",
    initial_values: tuple[bytes, ...] = (), seeds_shards: bool = False,
) -> common_pb2.Topology:
    """Without shards (a coordinator used for membership only) the plan is laid out
    for one shard and the shard list is empty. Before the first learner registered its
    model there is no plan (unless the model is pinned): the shards are listed without
    their fragments. ``initial_values``: the pinned initial values' digests;
    ``seeds_shards``: the coordinator seeds the shards with them."""
    num_shards = max(1, len(shards))
    return common_pb2.Topology(
        plan=plan_to_proto(plan, num_shards) if plan is not None else None,
        manifest_json=manifest_json,
        initial_values=list(initial_values),
        seeds_shards=seeds_shards,
        shards=[
            common_pb2.ShardInfo(
                shard_id=m, address=address,
                fragments=[f.id for f in plan.owned_by(m, num_shards)] if plan is not None else [],
            )
            for m, address in enumerate(shards)
        ],
        run_config_json=run.to_json(),
        epoch=epoch,
    )


def overrides_from_proto(msg: coordinator_pb2.AddLearnersRequest) -> dict[str, str]:
    overrides = dict(msg.overrides)
    if any(not k for k in overrides):
        raise InvalidArgument("override keys must not be empty")
    return overrides
