"""Protos <-> shard core types (acks, updates, initial values); the push header is the
kernel's (diloco.convert). The only syncer module that imports both."""

from __future__ import annotations

from diloco.clock import VectorClock
from diloco.convert import clock_to_proto, spec_from_proto, spec_to_proto
from diloco.codec import TensorSpec
from diloco.errors import InvalidArgument
from diloco.fragments import FragmentPlan
from diloco.wire import MAX_VERSION
from diloco.v1 import syncer_pb2
from diloco.syncer.core.shard import ACCEPTED, ACCEPTED_NEXT_ROUND, DUPLICATE, Ack, FragmentUpdate

_OUTCOME = {
    ACCEPTED: syncer_pb2.PUSH_OUTCOME_ACCEPTED,
    ACCEPTED_NEXT_ROUND: syncer_pb2.PUSH_OUTCOME_ACCEPTED_NEXT_ROUND,
    DUPLICATE: syncer_pb2.PUSH_OUTCOME_DUPLICATE,
}
_KIND = {"delta": syncer_pb2.UPDATE_KIND_DELTA, "full": syncer_pb2.UPDATE_KIND_FULL}


def ack_to_proto(ack: Ack, clock: VectorClock) -> syncer_pb2.PushReply:
    return syncer_pb2.PushReply(
        ack=syncer_pb2.PushAck(outcome=_OUTCOME[ack.outcome], target_version=ack.target_version, clock=clock_to_proto(clock))
    )


def update_to_proto(update: FragmentUpdate, clock: VectorClock) -> syncer_pb2.FragmentUpdate:
    return syncer_pb2.FragmentUpdate(
        fragment=update.fragment,
        base_version=update.base_version,
        version=update.version,
        segments=[
            syncer_pb2.UpdateSegment(
                version=s.version, kind=_KIND[s.kind], tensors=[spec_to_proto(t.spec) for t in s.tensors]
            )
            for s in update.segments
        ],
        clock=clock_to_proto(clock),
        close_reason=update.close_reason,
        participants=update.participants,
    )


def anchor_version_from_proto(msg: syncer_pb2.InitializeHeader) -> int | None:
    """The anchor's version of an Initialize (None: fresh initial values), bounded by
    ``MAX_VERSION``: a shard without its state cannot know the versions it issued, but no
    run reaches 2**53, and a larger one would break the shard's next round."""
    if not msg.anchor:
        return None
    if msg.anchor_version >= MAX_VERSION:
        raise InvalidArgument(f"anchor version {msg.anchor_version} is out of range (< 2**53)")
    return msg.anchor_version


def initial_specs(msg: syncer_pb2.InitializeHeader, plan: FragmentPlan) -> list[TensorSpec]:
    """The fp32 tensor headers of an Initialize, checked against the plan's fragment."""
    if not 0 <= msg.fragment < plan.num_fragments:
        raise InvalidArgument(f"fragment {msg.fragment} is not in the plan ({plan.num_fragments} fragments)")
    pieces = plan.fragments[msg.fragment].pieces
    specs = [spec_from_proto(t) for t in msg.tensors]
    if len(specs) != len(pieces):
        raise InvalidArgument(f"fragment {msg.fragment} has {len(pieces)} tensors, the request {len(specs)}")
    for spec, piece in zip(specs, pieces):
        if (spec.name, tuple(spec.shape)) != (piece.name, piece.shape):
            raise InvalidArgument(f"expected tensor {piece.name!r} {list(piece.shape)}, got {spec.name!r} {list(spec.shape)}")
        if (spec.encoding, spec.dtype, spec.byte_length) != ("fp32", "float32", 4 * piece.numel):
            raise InvalidArgument(f"tensor {piece.name!r}: initial values are raw float32 ({4 * piece.numel} bytes)")
    return specs
