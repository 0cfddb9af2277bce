"""Client side of the Syncer API: push a fragment delta, bootstrap, status.

Used by the learner's streamer thread, by tests and by the benchmarks. Every call has a
deadline; UNAVAILABLE is retried by the channel's retry policy, nothing else is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from diloco import auth, rpc
from diloco.codec import EncodedTensor, decode, frame, unframe
from diloco.convert import clock_from_proto, initialize_requests, spec_from_proto, push_meta_to_proto
from diloco.errors import InvalidArgument
from diloco.v1 import common_pb2, syncer_pb2, syncer_pb2_grpc
from diloco.wire import PushMeta

_KIND = {syncer_pb2.UPDATE_KIND_DELTA: "delta", syncer_pb2.UPDATE_KIND_FULL: "full"}
_OUTCOME = {
    syncer_pb2.PUSH_OUTCOME_ACCEPTED: "accepted",
    syncer_pb2.PUSH_OUTCOME_ACCEPTED_NEXT_ROUND: "accepted_next_round",
    syncer_pb2.PUSH_OUTCOME_DUPLICATE: "duplicate",
}


@dataclass(frozen=True)
class DecodedSegment:
    version: int
    kind: str
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class DecodedUpdate:
    fragment: int
    base_version: int
    version: int
    segments: list[DecodedSegment]
    close_reason: str
    participants: int
    clock: object
    wire_bytes: int

    def apply_to(self, anchor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The anchor advanced through the chain: the exact fp32 values the shard holds."""
        out = list(anchor)
        for segment in self.segments:
            if segment.kind == "full":
                out = [t.clone() for t in segment.tensors]
            else:
                out = [a + u for a, u in zip(out, segment.tensors)]
        return out


@dataclass(frozen=True)
class PushResult:
    outcome: str
    target_version: int
    update: DecodedUpdate
    bytes_up: int
    frame_s: float = 0.0
    """Framing (zstd) the payload, when ``push`` did it."""
    send_s: float = 0.0
    """Writing the request stream."""
    wait_s: float = 0.0
    """From the last write to the update's last chunk: the ack, the round, the download."""
    decode_s: float = 0.0


def open_channel(address: str, max_message_bytes: int = 8 * 1024 * 1024, channel_options=()) -> grpc.aio.Channel:
    """``channel_options``: more gRPC channel arguments (a benchmark's own connection per learner)."""
    return rpc.channel(address, [*rpc.channel_options(max_message_bytes, "diloco.v1.Syncer"), *channel_options])


async def write_all(call, requests) -> None:
    """Write a request stream through the call's write API. If the server ends the RPC
    early (bad credential, bad header) the write fails; the server's status then comes
    from reading the call, instead of the generic INTERNAL error a request iterator gets."""
    try:
        for request in requests:
            await call.write(request)
        await call.done_writing()
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        pass


def _decode_tensors(groups: list[list], chunks: list[bytes]) -> list[list]:
    """The tensors of ``groups`` (lists of tensor specs, in wire order) from the framed
    ``chunks`` that carry them back to back."""
    view = memoryview(unframe(chunks, sum(spec.byte_length for group in groups for spec in group)))
    offset, decoded = 0, []
    for group in groups:
        tensors = []
        for spec in group:
            tensors.append(decode(spec, view[offset : offset + spec.byte_length]))
            offset += spec.byte_length
        decoded.append(tensors)
    return decoded


def decode_update(first: syncer_pb2.FragmentUpdate, chunks: list[bytes]) -> DecodedUpdate:
    groups = _decode_tensors([[spec_from_proto(t) for t in s.tensors] for s in first.segments], chunks)
    segments = [DecodedSegment(s.version, _KIND[s.kind], tensors) for s, tensors in zip(first.segments, groups)]
    return DecodedUpdate(
        first.fragment, first.base_version, first.version, segments, first.close_reason, first.participants,
        clock_from_proto(first.clock), sum(len(c) for c in chunks),
    )


@dataclass(frozen=True)
class DecodedSample:
    """A learner's latest push of a fragment, as a shard kept it for the validator."""

    learner_id: str
    fragment: int
    seq: int
    base_version: int
    version: int
    tensors: list
    """The push's delta (anchor - params), one fp32 tensor per piece of the fragment."""


def decode_sample(header: syncer_pb2.Sample, chunks: list[bytes]) -> DecodedSample:
    (tensors,) = _decode_tensors([[spec_from_proto(t) for t in header.tensors]], chunks)
    return DecodedSample(header.learner_id, header.fragment, header.seq, header.base_version, header.version, tensors)


async def _updates(replies, kind_of_header: str = "update"):
    """Group a reply stream into (FragmentUpdate header, its chunks): an update's chunks
    run until the next header or the end of the stream."""
    header, chunks = None, []
    async for reply in replies:
        kind = reply.WhichOneof("kind")
        if kind == "chunk":
            if header is None:
                raise InvalidArgument("update stream: a chunk arrived before its header")
            chunks.append(reply.chunk.data)
        elif kind == kind_of_header:
            if header is not None:
                yield header, chunks
            header, chunks = getattr(reply, kind), []
        else:
            yield reply, None
    if header is not None:
        yield header, chunks


class SyncerClient:
    """One learner's connection to one shard."""

    def __init__(self, channel: grpc.aio.Channel, credential: auth.Credential, timeout_s: float = 60.0):
        """``credential``: read per call, so a renewed one is used from the next call on."""
        self.stub = syncer_pb2_grpc.SyncerStub(channel)
        self.credential = credential
        self.timeout_s = timeout_s

    async def push(
        self, meta: PushMeta, encoded: Sequence[EncodedTensor], on_ack=None, chunks: Sequence[bytes] | None = None
    ) -> PushResult:
        """Stream one push; returns once the round it joined has closed and the update
        arrived. ``on_ack(outcome, target_version)`` is called when the shard acknowledges.
        ``chunks``: the payloads already framed (``frame``), to skip framing here."""
        started = time.perf_counter()
        if chunks is None:
            chunks = await asyncio.to_thread(lambda: list(frame([e.payload for e in encoded])))
        bytes_up = sum(len(c) for c in chunks)
        framed = time.perf_counter()

        requests = [syncer_pb2.PushRequest(header=push_meta_to_proto(meta))]
        requests += [syncer_pb2.PushRequest(chunk=common_pb2.Chunk(data=data)) for data in chunks]
        call = self.stub.PushFragment(metadata=self.credential.metadata(), timeout=self.timeout_s)
        await write_all(call, requests)
        sent = received = time.perf_counter()
        outcome, target, update = None, 0, None
        async for message, update_chunks in _updates(call):
            if update_chunks is None:
                outcome, target = _OUTCOME[message.ack.outcome], message.ack.target_version
                if on_ack is not None:
                    on_ack(outcome, target)
            else:
                received = time.perf_counter()
                update = await asyncio.to_thread(decode_update, message, update_chunks)
        if outcome is None or update is None:
            raise InvalidArgument("push stream ended without an ack and an update")
        return PushResult(
            outcome, target, update, bytes_up, frame_s=framed - started, send_s=sent - framed,
            wait_s=received - sent, decode_s=time.perf_counter() - received,
        )

    async def bootstrap(self, fragments: Sequence[int] = (), have: Mapping[int, bytes] | None = None) -> list[DecodedUpdate]:
        """The shard's fragments (all it owns by default), each in full; or, for a fragment
        in ``have`` (fragment -> ``values_digest`` of values held here): an update with no
        segments when the shard holds those values bit for bit (keep yours), one int4
        update when they are the fragment's initial values and the shard's replies are
        condensed. ``DecodedUpdate.apply_to`` the values held gives the anchor."""
        have = [syncer_pb2.FragmentDigest(fragment=f, sha256=d) for f, d in sorted((have or {}).items())]
        call = self.stub.Bootstrap(
            syncer_pb2.BootstrapRequest(fragments=list(fragments), have=have), metadata=self.credential.metadata(),
            timeout=self.timeout_s,
        )
        return [await asyncio.to_thread(decode_update, header, chunks) async for header, chunks in _updates(call)]

    async def samples(self, fragments: Sequence[int] = ()) -> list[DecodedSample]:
        """The validator's call: each recent learner's latest push of each fragment (all the
        shard owns by default)."""
        call = self.stub.Samples(syncer_pb2.SamplesRequest(fragments=list(fragments)),
                                 metadata=self.credential.metadata(), timeout=self.timeout_s)
        return [await asyncio.to_thread(decode_sample, header, chunks) async for header, chunks in _updates(call, "sample")]

    async def score(self, scores: Sequence[tuple[str, int, int, float | None, float]]) -> int:
        """The validator's call: (learner, fragment, seq, score or None, trust) judgements."""
        reply = await self.stub.Score(
            syncer_pb2.ScoreRequest(scores=[syncer_pb2.LearnerScore(learner_id=l, fragment=f, seq=q, score=s, trust=t)
                                            for l, f, q, s, t in scores]),
            metadata=self.credential.metadata(), timeout=self.timeout_s)
        return reply.applied

    async def initialize(self, fragment: int, manifest_json: str, plan_hash: str, encoded: Sequence[EncodedTensor],
                         anchor_version: int | None = None) -> bool:
        """Offer fp32 values of a fragment the shard holds none of: this learner's initial
        values, or (``anchor_version``) its anchor, the global values at that version. True
        if the shard took them, False if the fragment already had values."""
        requests = await asyncio.to_thread(initialize_requests, self.credential.id, fragment, manifest_json, plan_hash,
                                           list(encoded), anchor_version)
        reply = await self.stub.Initialize(iter(requests), metadata=self.credential.metadata(), timeout=self.timeout_s)
        return reply.initialized

    async def status(self) -> syncer_pb2.StatusReply:
        return await self.stub.Status(syncer_pb2.StatusRequest(), metadata=self.credential.metadata(), timeout=self.timeout_s)
