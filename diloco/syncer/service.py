"""The Syncer gRPC servicer: decode, call the runtime, encode. No round logic here."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator

import grpc
import numpy as np
from opentelemetry.trace import Status, StatusCode

from diloco import auth, rpc
from diloco.codec import Unframer, frame
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from diloco.v1 import common_pb2, syncer_pb2, syncer_pb2_grpc
from diloco.convert import clock_from_proto, clock_to_proto, push_meta_from_proto, spec_to_proto
from diloco.syncer import convert
from diloco.syncer.core.shard import FragmentUpdate, PushPayload, Segment, inspect_payload
from diloco.syncer.runtime import ShardRuntime
from diloco.syncer.telemetry import push_attributes

logger = logging.getLogger(__name__)

SERVICE_NAME = "diloco.v1.Syncer"
MAX_CHUNK_BYTES = 1 << 20
MAX_SCORES = 65536
"""Scores in one Score request (a learner per fragment each)."""
# zstd frames of incompressible data are a little larger than their payload.
_CHUNK_SLACK_BYTES = 64 * 1024


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


async def _drain(requests, limit_bytes: int, timeout_s: float = 5.0) -> None:
    """Read what the client is still sending before rejecting its push, bounded in bytes
    and time. Ending the RPC while a grpc.aio client is still writing makes that client
    report INTERNAL instead of our status (grpc/grpc#36066)."""

    async def consume() -> None:
        seen = 0
        async for request in requests:
            seen += request.ByteSize()
            if seen > limit_bytes:
                return

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError, StopAsyncIteration):
        pass


async def _next(requests, idle_timeout_s: float):
    """The stream's next message, None at its end. A client that sends nothing for
    ``idle_timeout_s`` loses the stream: it cannot hold a server's stream (and its buffer)
    open by going quiet."""
    try:
        return await asyncio.wait_for(anext(requests), idle_timeout_s)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise InvalidArgument(f"the stream sent nothing for {idle_timeout_s:g} s: closed") from None


async def _header(requests, what: str, idle_timeout_s: float):
    """The header that must open a client stream of header-then-chunks messages."""
    first = await _next(requests, idle_timeout_s)
    if first is None:
        raise InvalidArgument(f"empty {what} stream: it starts with its header")
    if first.WhichOneof("kind") != "header":
        raise InvalidArgument(f"a {what} stream starts with its header, not a chunk")
    return first.header


def _serialize(message) -> bytes:
    """Replies may be serialized ahead of time: update chunks are serialized once for
    every learner that gets them instead of once per reply."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: syncer_pb2_grpc.SyncerServicer, server: grpc.aio.Server) -> None:
    """Register the Syncer service as the generated code does, with ``_serialize`` for
    every reply."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}

    class Collect:
        def add_generic_rpc_handlers(self, generic_handlers) -> None:
            pass

        def add_registered_method_handlers(self, service: str, method_handlers) -> None:
            handlers.update(method_handlers)

    syncer_pb2_grpc.add_SyncerServicer_to_server(servicer, Collect())
    handlers = {name: h._replace(response_serializer=_serialize) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class SyncerServicer(syncer_pb2_grpc.SyncerServicer):
    def __init__(self, runtime: ShardRuntime, secret: str) -> None:
        self.runtime = runtime
        self._secret = secret
        self._framing: dict[tuple[int, type], asyncio.Future] = {}

    def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        meta = _metadata(context)
        learner_id = meta.get(auth.LEARNER_METADATA, "")
        auth.verify(self._secret, learner_id, meta.get(auth.CREDENTIAL_METADATA))
        return learner_id

    def _coordinator_only(self, context: grpc.aio.ServicerContext, doing: str) -> None:
        if self._authenticate(context) != auth.COORDINATOR_ID:
            raise PermissionDenied(f"only the coordinator {doing}")

    async def _chunk_messages(self, segment: Segment, wrap) -> list[tuple[bytes, int]]:
        """A segment's chunk messages (``wrap(chunk=...)``), framed and serialized once in a
        worker thread however many replies carry them (every waiter of a round wakes at
        once), as (message bytes, chunk bytes). Kept exactly as long as the segment: in
        the fragment's update chain, or in a reply still being sent."""
        key = (id(segment), wrap)
        framing = self._framing.get(key)
        if framing is None:

            def build() -> list[tuple[bytes, int]]:
                chunks = frame([t.payload for t in segment.tensors])
                return [(wrap(chunk=common_pb2.Chunk(data=c)).SerializeToString(), len(c)) for c in chunks]

            framing = asyncio.ensure_future(asyncio.to_thread(build))
            self._framing[key] = framing
            weakref.finalize(segment, self._framing.pop, key, None)
        return await framing

    async def _update_messages(self, update: FragmentUpdate, wrap, learner_id: str, what: str) -> AsyncIterator:
        header = convert.update_to_proto(update, self.runtime.core.clock)
        header.snapshot_epoch = self.runtime.snapshot_epoch
        yield wrap(update=header)
        sent = 0
        for segment in update.segments:
            for message, size in await self._chunk_messages(segment, wrap):
                self.runtime.counters.bytes_sent += size
                self.runtime.telemetry.bytes_sent(size)
                sent += size
                yield message
        self.runtime.sent(learner_id, what, update.fragment, sent)

    async def _receive(self, requests, specs, payload_bytes: int) -> tuple[PushPayload, int]:
        """Read a push's chunks and unframe each one in a worker thread while the next one
        arrives; a chunk is dropped once inflated, so a push never holds more than its
        payload and a chunk or two. Then validate the payload (``inspect_payload``)."""
        unframer = Unframer(payload_bytes)
        limit = payload_bytes + _CHUNK_SLACK_BYTES * (1 + payload_bytes // MAX_CHUNK_BYTES)
        wire_bytes, inflating = 0, None
        try:
            while (request := await _next(requests, self.runtime.core.cfg.stream_idle_timeout_s)) is not None:
                if request.WhichOneof("kind") != "chunk":
                    raise InvalidArgument("only chunks may follow the push header")
                data = request.chunk.data
                if len(data) > MAX_CHUNK_BYTES + _CHUNK_SLACK_BYTES:
                    raise InvalidArgument(f"chunk of {len(data)} bytes exceeds the 1 MiB chunk limit")
                wire_bytes += len(data)
                if wire_bytes > limit:
                    raise InvalidArgument(f"push carries more data than its header announces ({payload_bytes} bytes)")
                if inflating is not None:
                    await inflating
                inflating = asyncio.ensure_future(asyncio.to_thread(unframer.add, data))
            if inflating is not None:
                await inflating
        finally:
            if inflating is not None and not inflating.done():
                # Rejected mid-stream: let the worker finish with the buffer before it goes.
                await asyncio.gather(inflating, return_exceptions=True)
        payload = await asyncio.to_thread(lambda: inspect_payload(specs, unframer.result()))
        return payload, wire_bytes

    async def PushFragment(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        reading = True
        span = self.runtime.telemetry.start_push()  # a child of the RPC's span: the learner's trace
        try:
            learner_id = self._authenticate(context)
            meta = push_meta_from_proto(await _header(requests, "push", self.runtime.core.cfg.stream_idle_timeout_s))
            if meta.learner_id != learner_id:
                raise PermissionDenied(f"credential is for {learner_id!r}, the push claims {meta.learner_id!r}")
            span.set_attributes(push_attributes(meta))
            self.runtime.core.check_header(meta)
            payload, wire_bytes = await self._receive(requests, meta.specs, meta.payload_bytes)
            reading = False
            ack, waiter = self.runtime.push(meta, payload, wire_bytes, span.get_span_context())
            span.set_attributes({"diloco.push.outcome": ack.outcome, "diloco.target_version": ack.target_version,
                                 "diloco.bytes_up": wire_bytes})
            reply = convert.ack_to_proto(ack, self.runtime.core.clock)
            reply.ack.snapshot_epoch = self.runtime.snapshot_epoch
            yield reply
            update = await waiter
            span.add_event("round closed", {"diloco.version": update.version, "diloco.close_reason": update.close_reason})
            async for message in self._update_messages(update, syncer_pb2.PushReply, learner_id, "reply"):
                yield message
        except DilocoError as error:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            if reading:
                await _drain(requests, self.runtime.core.cfg.max_push_bytes)
            await rpc.abort_with(context, error)
        finally:
            span.end()

    async def Initialize(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        reading = True
        try:
            learner_id = self._authenticate(context)
            core = self.runtime.core
            core.check_reader(learner_id)  # a learner that left or failed: refused before anything is parsed
            header = await _header(requests, "initialize", core.cfg.stream_idle_timeout_s)
            if header.learner_id != learner_id:
                raise PermissionDenied(f"credential is for {learner_id!r}, the request claims {header.learner_id!r}")
            anchor_version = convert.anchor_version_from_proto(header)
            model = await self.runtime.model_for_initialize(header.manifest_json)
            plan = model.plan
            if plan.plan_hash != header.plan_hash:
                raise InvalidArgument(
                    f"plan hash {header.plan_hash[:12]!r} is not the plan this shard cuts the run's manifest into "
                    f"({self.runtime.num_fragments} fragments: {plan.plan_hash[:12]}): the learner's model or run config "
                    "differs from the run's"
                )
            if core.plan is not None and core.plan.plan_hash != plan.plan_hash:
                core.adopt_plan(plan, model.manifest_json)  # raises FailedPrecondition, naming both plans
            specs = convert.initial_specs(header, plan)
            owner = plan.fragments[header.fragment].owner(core.cfg.num_shards)
            if owner != core.cfg.shard_id:
                raise FailedPrecondition(f"fragment {header.fragment} is owned by shard {owner}, not shard {core.cfg.shard_id}")
            payload_bytes = sum(spec.byte_length for spec in specs)
            if payload_bytes > core.cfg.max_push_bytes * 8:
                raise ResourceExhausted(f"initial values of {payload_bytes} bytes exceed the limit of {core.cfg.max_push_bytes * 8}")
            if header.fragment in core.fragments:
                await _drain(requests, payload_bytes)
                reading = False
                return syncer_pb2.InitializeReply(initialized=False, version=core.fragments[header.fragment].version,
                                                  clock=clock_to_proto(core.clock))
            uploads = self.runtime.initializing
            uploads[header.fragment] += 1  # (Status lists it: learners starting now wait instead of sending theirs)
            try:
                payload, _ = await self._receive(requests, specs, payload_bytes)
            finally:
                uploads[header.fragment] -= 1
                if not uploads[header.fragment]:
                    del uploads[header.fragment]
            reading = False
            if anchor_version is None:
                await self.runtime.check_initial_values(learner_id, model, header.fragment, payload.tensors)
            values = [np.frombuffer(t.payload, dtype="<f4").reshape(t.spec.shape) for t in payload.tensors]
            if anchor_version is not None and self.runtime.anchors_only:  # the newest anchor offered in a window wins
                added = await self.runtime.offer_anchor(learner_id, model.manifest_json, plan, header.fragment, values,
                                                        anchor_version)
            else:
                added = self.runtime.initialize(learner_id, model.manifest_json, plan, header.fragment, values,
                                                anchor_version)
            return syncer_pb2.InitializeReply(initialized=added, version=core.fragments[header.fragment].version,
                                              clock=clock_to_proto(core.clock))
        except DilocoError as error:
            if reading:
                await _drain(requests, self.runtime.core.cfg.max_push_bytes)
            await rpc.abort_with(context, error)

    async def Bootstrap(self, request, context):
        try:
            learner_id = self._authenticate(context)
            core = self.runtime.core
            core.check_reader(learner_id)
            wanted = list(request.fragments) or [f.id for f in core.owned]
            if not wanted:
                core.state_of(0)  # no plan yet: says so
            for fragment_id in wanted:
                core.state_of(fragment_id)
            have = {d.fragment: d.sha256 for d in request.have}
            # An export or the validator's read is not a learner's anchor.
            learner = None if learner_id in (auth.COORDINATOR_ID, auth.VALIDATOR_ID) else learner_id
            for fragment_id in wanted:
                update = await self.runtime.bootstrap(fragment_id, learner, have.get(fragment_id))
                async for message in self._update_messages(update, syncer_pb2.BootstrapReply, learner_id, "bootstrap"):
                    yield message
        except DilocoError as error:
            await rpc.abort_with(context, error)

    async def Marker(self, request, context):
        try:
            self._coordinator_only(context, "sends snapshot markers")
            if request.snapshot_id < 1 or not request.directory:
                raise InvalidArgument("a marker needs a snapshot id >= 1 and a directory")
            result = await self.runtime.marker(
                request.snapshot_id, request.directory, list(request.learners), clock_from_proto(request.clock)
            )
            return syncer_pb2.MarkerReply(
                participant=self.runtime.core.process,
                incarnation=self.runtime.incarnation,
                clock=clock_to_proto(result.clock),
                files=[common_pb2.SnapshotFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in result.files],
            )
        except DilocoError as error:
            await rpc.abort_with(context, error)

    def _validator_only(self, context: grpc.aio.ServicerContext) -> None:
        if self._authenticate(context) != auth.VALIDATOR_ID:
            raise PermissionDenied("only the run's validator samples pushes and scores learners")

    async def Samples(self, request, context):
        try:
            self._validator_only(context)
            core = self.runtime.core
            for fragment_id in request.fragments:
                core.state_of(fragment_id)
            for fragment_id, version, pending in self.runtime.samples(list(request.fragments)):
                meta, payload = pending.meta, pending.payload
                yield syncer_pb2.SamplesReply(sample=syncer_pb2.Sample(
                    learner_id=meta.learner_id, fragment=fragment_id, seq=meta.seq, base_version=meta.base_version,
                    version=version, tensors=[spec_to_proto(t.spec) for t in payload.tensors]))
                for chunk in await asyncio.to_thread(frame, [t.payload for t in payload.tensors]):
                    yield syncer_pb2.SamplesReply(chunk=common_pb2.Chunk(data=chunk))
        except DilocoError as error:
            await rpc.abort_with(context, error)

    async def Score(self, request, context):
        try:
            self._validator_only(context)
            if len(request.scores) > MAX_SCORES:
                raise InvalidArgument(f"{len(request.scores)} scores in one request; at most {MAX_SCORES}")
            applied = self.runtime.score([(s.learner_id[:128], s.fragment, s.seq, s.score if s.HasField("score") else None,
                                           s.trust) for s in request.scores])
            return syncer_pb2.ScoreReply(applied=applied)
        except DilocoError as error:
            await rpc.abort_with(context, error)

    async def AcceptInitialValues(self, request, context):
        try:
            self._coordinator_only(context, "relays an operator's decision")
            fragments = self.runtime.accept_initial_values(request.reason[:500])
            return syncer_pb2.AcceptInitialValuesReply(fragments=fragments, model_state=self.runtime.model_state())
        except DilocoError as error:
            await rpc.abort_with(context, error)

    async def Status(self, request, context):
        try:
            # any process of the run that is still in it: it lists live learner ids and counters
            self.runtime.core.check_reader(self._authenticate(context))
        except DilocoError as error:
            await rpc.abort_with(context, error)
        core, counters = self.runtime.core, self.runtime.counters
        fragments = []
        for fragment_id, state in sorted(core.fragments.items()):
            decision = core.decide(fragment_id, self.runtime.now())
            fragments.append(
                syncer_pb2.FragmentStatus(
                    fragment=fragment_id,
                    version=state.version,
                    open_round_pushes=len(state.open),
                    round_state=decision.reason,
                    last_round_age_s=None if state.last_round_at is None else self.runtime.now() - state.last_round_at,
                    last_round_participants=state.last_participants,
                )
            )
        return syncer_pb2.StatusReply(
            shard_id=core.cfg.shard_id,
            fragments=fragments,
            live_learners=sorted(core.live - core.failed),
            rounds_closed=core.rounds_closed,
            pushes_received=counters.pushes,
            bytes_received=counters.bytes_received,
            bytes_sent=counters.bytes_sent,
            clock=clock_to_proto(core.clock),
            plan_hash=core.plan.plan_hash if core.plan is not None else "",
            model_state=self.runtime.model_state(),
            anchors_only=self.runtime.anchors_only,
            initializing=sorted(self.runtime.initializing),
        )
