"""Chandy-Lamport at a shard: what it records on a marker and how it comes back.

On marker n the shard records its whole state in one step on the event loop, with no
round being applied (``capture``): parameters, momentum, residuals, versions, update
chains, the pushes waiting in open rounds, the idempotency maps and its clock. From
then on the ``ChannelRecorder`` decides, push by push, what was *in flight* at the cut:
a push from a participant stamped with an older snapshot epoch was sent before that
learner recorded, so it belongs to the snapshot as channel state. A learner's channel
closes at its first push stamped with epoch >= n (the marker has reached it) or when
it leaves. ``restore`` puts a recorded state back into a fresh ``ShardCore``; the
runtime then accepts the channel pushes, once each.

Everything here is plain numpy arrays, numbers, strings, lists and dicts (see
``diloco.syncer.snapshot`` for the file format: nothing is pickled).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from diloco.clock import VectorClock
from diloco.codec import EncodedTensor, TensorSpec
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.manifest import Manifest
from diloco.wire import PushMeta
from diloco.syncer.core.bounds import Influence
from diloco.syncer.core.rounds import Timings
from diloco.syncer.core.shard import DUPLICATE, Pending, PushPayload, Segment, ShardCore, inspect_payload

FORMAT = 1


@dataclass(frozen=True)
class Decision:
    recorded: bool
    reason: str


@dataclass
class ChannelRecorder:
    snapshot_id: int
    cut_versions: dict[int, int]
    """Each fragment's version at the cut."""
    open_channels: set[str]
    """Participants whose pre-marker pushes may still arrive."""
    recorded: list[tuple[PushMeta, PushPayload]] = field(default_factory=list)
    excluded: int = 0

    @property
    def done(self) -> bool:
        return not self.open_channels

    def observe(self, meta: PushMeta, payload: PushPayload, outcome: str) -> Decision:
        """Classify a push the shard has just accepted (it counts in the live run either way)."""
        learner = meta.learner_id
        if learner not in self.open_channels:
            return Decision(False, f"no open channel from {learner}: after the cut")
        if meta.snapshot_epoch >= self.snapshot_id:
            self.open_channels.discard(learner)
            return Decision(False, f"marker {self.snapshot_id} reached {learner}: its channel is closed")
        if outcome == DUPLICATE:
            return Decision(False, "duplicate: already counted in the recorded state")
        if meta.base_version > self.cut_versions[meta.fragment]:
            # The learner used an update sent after the cut, so it is past the cut too
            # (the reply carries the marker's epoch). Only a learner that ignores the
            # reply's epoch gets here; its push is not part of this snapshot.
            self.excluded += 1
            return Decision(False, f"base version {meta.base_version} is after the cut: not recorded")
        self.recorded.append((meta, payload))
        return Decision(True, f"in flight at the cut: recorded as channel state of {learner}")

    def learner_gone(self, learner_id: str) -> None:
        self.open_channels.discard(learner_id)


# --- plain-data encoding -------------------------------------------------------------


def _array_of(payload) -> np.ndarray:
    return np.frombuffer(payload, dtype=np.uint8).copy()


def _encoded_out(t: EncodedTensor) -> dict:
    spec = dataclasses.asdict(t.spec)
    spec["shape"] = list(spec["shape"])
    return {"spec": spec, "payload": _array_of(t.payload)}


def _encoded_in(raw: dict) -> EncodedTensor:
    spec = dict(raw["spec"])
    spec["shape"] = tuple(spec["shape"])
    return EncodedTensor(TensorSpec(**spec), raw["payload"].tobytes())


def meta_out(meta: PushMeta) -> dict:
    """A push header as plain data (JSON-safe)."""
    fields = dataclasses.asdict(meta)
    fields["clock"] = dict(meta.clock.entries)
    fields["specs"] = [{**dataclasses.asdict(s), "shape": list(s.shape)} for s in meta.specs]
    return fields


def meta_in(raw: dict) -> PushMeta:
    fields = dict(raw)
    specs = tuple(TensorSpec(**{**s, "shape": tuple(s["shape"])}) for s in fields.pop("specs"))
    return PushMeta(**{**fields, "clock": VectorClock(fields["clock"]), "specs": specs})


def push_out(meta: PushMeta, payload: PushPayload, wire_bytes: int = 0) -> dict:
    return {"meta": meta_out(meta), "payloads": [_array_of(t.payload) for t in payload.tensors], "wire_bytes": wire_bytes}


def push_in(raw: dict) -> tuple[PushMeta, PushPayload, int]:
    """Rebuild a recorded push; its payload is validated again (checksums, scales)."""
    meta = meta_in(raw["meta"])
    payload = b"".join(t.tobytes() for t in raw["payloads"])
    return meta, inspect_payload(meta.specs, payload), int(raw["wire_bytes"])


def capture(core: ShardCore, snapshot_id: int, now: float) -> dict:
    """The shard's state as plain data, copied (rounds update tensors in place once the
    runtime lets them run again), the influence bounds' included (their times as ages at
    ``now``, the shard's clock). Call with no round being applied."""
    fragments = []
    for fragment_id, state in sorted(core.fragments.items()):
        if state.applying or state.next:
            raise FailedPrecondition(f"fragment {fragment_id} is applying a round: cannot record it")
        fragments.append(
            {
                "id": fragment_id,
                "version": state.version,
                "params": [t.copy() for t in state.params],
                "momentum": [t.copy() for t in state.momentum],
                "residual": [t.copy() for t in state.residual],
                "chain": [
                    {"version": s.version, "kind": s.kind, "tensors": [_encoded_out(t) for t in s.tensors]}
                    for s in state.chain
                ],
                "open": [push_out(p.meta, p.payload, p.wire_bytes) for _, p in sorted(state.open.items())],
                "last_seq": dict(state.last_seq),
                "last_target": dict(state.last_target),
                "timings": dataclasses.asdict(state.timings),
                "last_reason": state.last_reason,
                "last_participants": state.last_participants,
                "outer_share": state.outer_share,
                "influence": state.influence.to_state(now),
                "reference": [t.copy() for t in state.reference],
                "departed": dict(state.departed),
                "trust": dict(state.trust),
            }
        )
    return {
        "format": FORMAT,
        "snapshot_id": snapshot_id,
        "shard_id": core.cfg.shard_id,
        "num_shards": core.cfg.num_shards,
        # A shard that holds no model yet records just that; restored, it waits for a learner.
        "plan_hash": core.plan.plan_hash if core.plan is not None else "",
        "manifest": core.manifest_json,
        "num_fragments": core.plan.num_fragments if core.plan is not None else 0,
        "clock": dict(core.clock.entries),
        "live": sorted(core.live),
        "failed": sorted(core.failed),
        "draining": sorted(core.draining),
        "pushes_received": core.pushes_received,
        "rounds_closed": core.rounds_closed,
        "fragments": fragments,
    }


def restore(core: ShardCore, state: dict, now: float) -> None:
    """Put a recorded state into a freshly built core: the same versions, tensors,
    chains and open rounds, so no push is counted twice or lost."""
    if state.get("format") != FORMAT:
        raise InvalidArgument(f"unknown shard snapshot format {state.get('format')!r}")
    cfg = core.cfg
    if (state["shard_id"], state["num_shards"]) != (cfg.shard_id, cfg.num_shards):
        raise FailedPrecondition(
            f"snapshot is of shard {state['shard_id']} of {state['num_shards']}, this is shard {cfg.shard_id} of {cfg.num_shards}"
        )
    recorded = {f["id"]: f for f in state["fragments"]}
    if core.plan is None and state["manifest"]:
        # A shard that starts from a snapshot learns the run's model from it.
        core.adopt_plan(Manifest.from_json(state["manifest"]).plan(int(state["num_fragments"])), state["manifest"])
    for fragment in core.owned:  # the recorded values are put in below
        if fragment.id in recorded and fragment.id not in core.fragments:
            core.add_fragment(fragment.id, [np.zeros(p.shape, dtype=np.float32) for p in fragment.pieces])
    if state["plan_hash"] != (core.plan.plan_hash if core.plan is not None else ""):
        raise FailedPrecondition("snapshot was taken with another fragment plan: check the model flags")
    if set(recorded) != set(core.fragments):
        raise FailedPrecondition(f"snapshot holds fragments {sorted(recorded)}, this shard owns {sorted(core.fragments)}")
    for fragment_id, raw in recorded.items():
        target = core.fragments[fragment_id]
        for name in ("params", "momentum", "residual"):
            tensors = getattr(target, name)
            if [tuple(t.shape) for t in raw[name]] != [tuple(t.shape) for t in tensors]:
                raise FailedPrecondition(f"fragment {fragment_id}: recorded {name} shapes do not match the plan")
            for dst, src in zip(tensors, raw[name]):
                np.copyto(dst, src)
        target.version = int(raw["version"])
        target.chain = deque(
            (Segment(s["version"], s["kind"], tuple(_encoded_in(t) for t in s["tensors"])) for s in raw["chain"]),
            maxlen=cfg.merge.update_chain_length,
        )
        target.last_seq = dict(raw["last_seq"])
        target.last_target = dict(raw["last_target"])
        target.timings = Timings(**raw["timings"])
        target.last_reason, target.last_participants = raw["last_reason"], raw["last_participants"]
        target.outer_share = float(raw.get("outer_share", 0.0))
        if "influence" in raw:  # the bounds continue (a snapshot from before they were kept: the fallback)
            target.influence = Influence.from_state(raw["influence"], now)
            if [t.shape for t in raw["reference"]] != [t.shape for t in target.reference]:
                raise FailedPrecondition(f"fragment {fragment_id}: recorded reference shapes do not match the plan")
            target.reference = [np.array(t, dtype=np.float32) for t in raw["reference"]]
            target.departed = {str(k): int(v) for k, v in raw["departed"].items()}
        # The validator's judgements continue (a snapshot from before they were kept: trusted
        # until its next pass).
        target.trust = {str(k): float(v) for k, v in raw.get("trust", {}).items() if 0.0 <= float(v) <= 1.0}
        target.full_cache = None
        target.open, target.next, target.opened_at, target.quorum_at = {}, {}, None, None
        for push in raw["open"]:
            meta, payload, wire_bytes = push_in(push)
            target.open[meta.learner_id] = Pending(meta, payload, now, wire_bytes)
        if target.open:
            # The round reopens now; its quorum time is not observed again.
            target.opened_at = now
            target.quorum_at = now if len(target.open) >= cfg.rounds.quorum else None
    core.clock = VectorClock(state["clock"])
    core.set_membership(set(state["live"]), set(state["failed"]), set(state.get("draining", ())))
    core.pushes_received, core.rounds_closed = state["pushes_received"], state["rounds_closed"]
