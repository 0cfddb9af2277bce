"""Protos <-> kernel types for the messages every service shares. The only kernel module
that imports both the generated protos and the core types."""

from __future__ import annotations

import re

from diloco.clock import VectorClock
from diloco.codec import EncodedTensor, TensorSpec, frame
from diloco.errors import InvalidArgument
from diloco.fragments import FragmentPlan
from diloco.v1 import common_pb2, syncer_pb2
from diloco.wire import PushMeta

_ENCODING_TO_PROTO = {"fp32": common_pb2.ENCODING_FP32, "int4": common_pb2.ENCODING_INT4,
                      "sparse": common_pb2.ENCODING_SPARSE}
_ENCODING_FROM_PROTO = {v: k for k, v in _ENCODING_TO_PROTO.items()}


def clock_to_proto(clock: VectorClock) -> common_pb2.VectorClock:
    return common_pb2.VectorClock(entries=dict(clock.entries))


MAX_CLOCK_ENTRIES = 4096
"""More processes than any run has: a larger clock is hostile (every reply would carry it)."""
MAX_CLOCK_VALUE = 1 << 53
"""Far beyond any count of events; past it a counter could not be incremented or stored safely."""
_PROCESS_NAME = re.compile(r"^(L\d{1,9}|S\d{1,6}|C)$")


def clock_from_proto(msg: common_pb2.VectorClock) -> VectorClock:
    """A clock from the wire, bounded: at most ``MAX_CLOCK_ENTRIES`` entries, each named
    after a process of a run (``L<n>``, ``S<m>``, ``C``) with a value below
    ``MAX_CLOCK_VALUE``; anything else is InvalidArgument and changes nothing."""
    entries = dict(msg.entries)
    if len(entries) > MAX_CLOCK_ENTRIES:
        raise InvalidArgument(f"vector clock with {len(entries)} entries (at most {MAX_CLOCK_ENTRIES})")
    for name, value in entries.items():
        if not _PROCESS_NAME.match(name):
            raise InvalidArgument(f"vector clock entry {name[:20]!r} is not a process of a run (L<n>, S<m>, C)")
        if value >= MAX_CLOCK_VALUE:
            raise InvalidArgument(f"vector clock entry {name} = {value} is out of range (< 2**53)")
    return VectorClock(entries)


# The fields each message carries unchanged, one list for both directions: a field added
# to one direction only would not survive a round trip.
_SPEC_FIELDS = ("name", "dtype", "block_size", "scale_dtype", "byte_length", "checksum", "kept")
_PUSH_FIELDS = ("learner_id", "fragment", "base_version", "tokens", "inner_steps", "step_time_s", "snapshot_epoch",
                "final")


def _fields(source, names: tuple[str, ...]) -> dict:
    return {name: getattr(source, name) for name in names}


def spec_to_proto(spec: TensorSpec) -> common_pb2.TensorHeader:
    return common_pb2.TensorHeader(
        shape=list(spec.shape), encoding=_ENCODING_TO_PROTO[spec.encoding], **_fields(spec, _SPEC_FIELDS)
    )


def spec_from_proto(msg: common_pb2.TensorHeader) -> TensorSpec:
    if msg.encoding not in _ENCODING_FROM_PROTO:
        raise InvalidArgument(f"tensor {msg.name!r}: unknown encoding {msg.encoding}")
    if any(d < 0 for d in msg.shape):
        raise InvalidArgument(f"tensor {msg.name!r}: negative dimension in shape {list(msg.shape)}")
    return TensorSpec(
        shape=tuple(msg.shape), encoding=_ENCODING_FROM_PROTO[msg.encoding], **_fields(msg, _SPEC_FIELDS)
    )


def plan_to_proto(plan: FragmentPlan, num_shards: int) -> common_pb2.FragmentPlan:
    return common_pb2.FragmentPlan(
        plan_hash=plan.plan_hash,
        fragments=[
            common_pb2.Fragment(
                id=f.id,
                shard_id=f.owner(num_shards),
                pieces=[
                    common_pb2.Piece(
                        tensor=p.tensor,
                        row_start=p.row_start,
                        row_stop=p.row_stop,
                        shape=list(p.shape),
                        embedding=p.embedding,
                        buffer=p.buffer,
                    )
                    for p in f.pieces
                ],
            )
            for f in plan.fragments
        ],
    )


def push_meta_from_proto(msg: syncer_pb2.PushHeader) -> PushMeta:
    if not msg.learner_id:
        raise InvalidArgument("push header lacks learner_id")
    return PushMeta(
        clock=clock_from_proto(msg.clock),
        specs=tuple(spec_from_proto(t) for t in msg.tensors),
        **_fields(msg, _PUSH_FIELDS),
    )


def push_meta_to_proto(meta: PushMeta) -> syncer_pb2.PushHeader:
    return syncer_pb2.PushHeader(
        clock=clock_to_proto(meta.clock),
        tensors=[spec_to_proto(s) for s in meta.specs],
        **_fields(meta, _PUSH_FIELDS),
    )


def initialize_requests(sender: str, fragment: int, manifest_json: str, plan_hash: str, encoded: list[EncodedTensor],
                        anchor_version: int | None = None) -> list[syncer_pb2.InitializeRequest]:
    """An Initialize stream: its header, then the fp32 pieces framed in chunks. Slow for a
    large fragment (framing copies it): off the event loop."""
    header = syncer_pb2.InitializeHeader(
        learner_id=sender, fragment=fragment, manifest_json=manifest_json, plan_hash=plan_hash,
        tensors=[spec_to_proto(e.spec) for e in encoded],
        anchor=anchor_version is not None, anchor_version=anchor_version or 0,
    )
    chunks = frame([e.payload for e in encoded])
    return [syncer_pb2.InitializeRequest(header=header), *(syncer_pb2.InitializeRequest(chunk=common_pb2.Chunk(data=c))
                                                           for c in chunks)]
