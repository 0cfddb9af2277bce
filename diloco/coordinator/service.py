"""The Coordinator gRPC servicer: check the caller, decode, call the runtime, encode.

Who may call what: Join needs the join token; learner calls, WatchMembership and
ReportSnapshot need a credential (a learner's, or a shard's ``S<m>``) and may only act
for that id, and a learner only while it is a member (not once it left or failed:
Heartbeat and Leave say so themselves); admin calls need the admin token.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from diloco.coordinator import convert
from diloco.coordinator.runtime import MAX_INCARNATION_CHARS, CoordinatorRuntime
from diloco.coordinator.telemetry import CoordinatorTelemetry
from diloco import auth, rpc
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument, PermissionDenied
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 600.0
"""Deadline of the Bootstrap of one shard while exporting."""
EXPORT_IDLE_S = 30.0
"""An export fails (UNAVAILABLE, naming the shard) when a shard sends nothing for this long."""
SHARD_STATUS_TIMEOUT_S = 5.0
"""Deadline of one shard's Status in ListShards."""


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _status_on_error(handler):
    """A unary handler whose domain errors end the call with their status code (the one
    translator, ``rpc.abort_with``). Streaming handlers are async generators, which this
    cannot wrap: they translate their errors themselves."""

    @functools.wraps(handler)
    async def call(self, request, context):
        try:
            return await handler(self, request, context)
        except DilocoError as error:
            await rpc.abort_with(context, error)

    return call


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, runtime: CoordinatorRuntime, secret: str, admin_token: str, shards=None) -> None:
        """``shards``: the coordinator's calls to its shards (``diloco.coordinator.server.ShardCalls``:
        ``status``, ``bootstrap``, ``accept_initial_values``); None: it cannot call them."""
        self.runtime = runtime
        self._secret = secret
        self._admin_token = admin_token
        self._shards = shards
        self._topology: tuple[tuple, common_pb2.Topology] | None = None
        self._telemetry = CoordinatorTelemetry(members=lambda: runtime.member_counts)

    def _caller(self, context, claimed: str | None = None, field: str = "learner_id") -> str:
        """The credential's id; when the request names an id (``claimed``), it must be it."""
        meta = _metadata(context)
        caller = meta.get(auth.LEARNER_METADATA, "")
        auth.verify(self._secret, caller, meta.get(auth.CREDENTIAL_METADATA))
        if claimed is not None:
            if not claimed:
                raise InvalidArgument(f"the request lacks {field}")
            if claimed != caller:
                raise PermissionDenied(f"credential is for {caller!r}, the request is for {claimed!r}")
        return caller

    def _member(self, context, claimed: str | None = None, field: str = "learner_id") -> str:
        """``_caller``, for calls that read or act on the run: a learner that left or
        failed is refused although its credential has not expired."""
        caller = self._caller(context, claimed, field)
        self.runtime.check_member(caller)
        return caller

    def _credential(self, learner_id: str) -> str:
        return auth.sign(self._secret, learner_id, self.runtime.cfg.credential_lifetime_s)

    def _admin(self, context) -> None:
        auth.check_admin(self._admin_token, _metadata(context).get(auth.ADMIN_METADATA))

    def _clock(self, msg) -> common_pb2.VectorClock:
        """Merge a learner's clock; returns the reply's, the coordinator's entry alone (``received``)."""
        return convert.clock_to_proto(self.runtime.received(convert.clock_from_proto(msg)))

    # --- learner calls ---------------------------------------------------------------

    @_status_on_error
    async def Join(self, request, context):
        credential = auth.check_join(self._secret, _metadata(context).get(auth.JOIN_METADATA))
        learner = self.runtime.join(request.pool, request.address, request.launch_id, request.plan_hash, credential)
        self._telemetry.membership("joined", request.pool)
        return coordinator_pb2.JoinReply(
            learner_id=learner.id,
            credential=self._credential(learner.id),
            topology=self._topology_now(),
            lease_s=self.runtime.cfg.lease_s,
            clock=self._clock(request.clock),
        )

    @_status_on_error
    async def Heartbeat(self, request, context):
        self._caller(context, request.learner_id)
        _, directives = self.runtime.heartbeat(request.learner_id, convert.stats_from_proto(request))
        self._telemetry.heartbeat(request.learner_id, request.version_lag, request.tokens_per_s)
        return coordinator_pb2.HeartbeatReply(
            directives=[_directive(d) for d in directives],
            lease_s=self.runtime.cfg.lease_s,
            topology_epoch=self.runtime.topology_epoch,
            clock=self._clock(request.clock),
            credential=self._credential(request.learner_id),
        )

    @_status_on_error
    async def Leave(self, request, context):
        self._caller(context, request.learner_id)
        final = (request.tokens, request.inner_steps) if request.HasField("tokens") and request.HasField("inner_steps") else None
        self.runtime.leave(request.learner_id, request.reason, final, failed=request.failed)
        self._telemetry.membership("left")
        self._clock(request.clock)
        return coordinator_pb2.LeaveReply()

    @_status_on_error
    async def GetTopology(self, request, context):
        self._member(context)
        return self._topology_now()

    @_status_on_error
    async def RegisterModel(self, request, context):
        self._member(context, request.learner_id)
        await self.runtime.register_model(request.learner_id, request.manifest_json)
        return coordinator_pb2.RegisterModelReply(topology=self._topology_now(), clock=self._clock(request.clock))

    async def WatchMembership(self, request, context):
        try:
            watcher = self._member(context, request.watcher or None)
            if len(request.incarnation) > MAX_INCARNATION_CHARS:
                raise InvalidArgument(f"incarnation has more than {MAX_INCARNATION_CHARS} characters")
            self.runtime.received(convert.clock_from_proto(request.clock))
        except DilocoError as error:
            await rpc.abort_with(context, error)
            return
        if request.incarnation:
            self.runtime.watcher_connected(watcher, request.incarnation)
        queue, learners = self.runtime.watch()
        try:
            yield convert.membership_snapshot(learners, self.runtime.vector_clock)  # a shard's: the whole clock
            while (change := await queue.get()) is not None:
                yield convert.change_to_proto(change, self.runtime.vector_clock)
        finally:
            self.runtime.unwatch(queue)

    @_status_on_error
    async def ReportSnapshot(self, request, context):
        self._member(context, request.participant, "participant")
        files = convert.files_from_proto(request.files)
        self.runtime.report_snapshot(request.snapshot_id, request.participant, convert.clock_from_proto(request.clock), files)
        self._clock(request.clock)
        return coordinator_pb2.ReportSnapshotReply()

    # --- admin calls -----------------------------------------------------------------

    @_status_on_error
    async def AddLearners(self, request, context):
        self._admin(context)
        results = await self.runtime.add_learners(request.count, request.pool, convert.overrides_from_proto(request))
        return coordinator_pb2.AddLearnersReply(
            launches=[coordinator_pb2.LaunchResult(launch_id=r.launch_id, ok=r.ok, detail=r.detail) for r in results]
        )

    @_status_on_error
    async def RemoveLearners(self, request, context):
        self._admin(context)
        removed = self.runtime.remove_learners(list(request.learner_ids), request.count, request.drain,
                                               dict(request.after_tokens))
        return coordinator_pb2.RemoveLearnersReply(learner_ids=removed)

    @_status_on_error
    async def ListLearners(self, request, context):
        self._admin(context)
        learners = self.runtime.list_learners(request.include_gone)
        return coordinator_pb2.ListLearnersReply(
            learners=[convert.learner_to_proto(l) for l in learners],
            launches=[convert.launch_to_proto(x) for x in self.runtime.list_launches()],
        )

    @_status_on_error
    async def StartSnapshot(self, request, context):
        self._admin(context)
        snapshot = self.runtime.start_snapshot()
        return coordinator_pb2.StartSnapshotReply(snapshot_id=snapshot.id)

    @_status_on_error
    async def ListSnapshots(self, request, context):
        self._admin(context)
        return coordinator_pb2.ListSnapshotsReply(
            snapshots=[convert.snapshot_to_proto(s) for s in self.runtime.list_snapshots()]
        )

    async def ExportModel(self, request, context):
        try:
            self._admin(context)
            run = self.runtime.run
            if not run.manifest_json:
                raise FailedPrecondition("no learner has registered a model yet: there is nothing to export")
            if self._shards is None or not self.runtime.cfg.shards:
                raise FailedPrecondition("this coordinator knows no shards to export from")
        except DilocoError as error:
            await rpc.abort_with(context, error)
            return
        yield coordinator_pb2.ExportModelReply(header=coordinator_pb2.ExportHeader(
            manifest_json=run.manifest_json, plan_hash=run.plan_hash, fragments=run.run.fragments))
        for m, address in enumerate(self.runtime.cfg.shards):
            call = self._shards.bootstrap(address, EXPORT_TIMEOUT_S)
            try:
                while (reply := await asyncio.wait_for(call.read(), EXPORT_IDLE_S)) is not grpc.aio.EOF:
                    kind = reply.WhichOneof("kind")
                    if kind == "update":
                        yield coordinator_pb2.ExportModelReply(update=reply.update)
                    elif kind == "chunk":
                        yield coordinator_pb2.ExportModelReply(chunk=reply.chunk)
            except asyncio.TimeoutError:
                call.cancel()
                try:  # is the shard alive at all? (the log says, for whoever looks into it)
                    status = await self._shards.status(address, SHARD_STATUS_TIMEOUT_S)
                    alive = "its Status answers: " + ", ".join(
                        f"fragment {f.fragment} v{f.version} ({f.round_state or 'idle'})" for f in status.fragments)
                except grpc.aio.AioRpcError as error:
                    alive = f"its Status fails too: {error.code().name} {error.details()}"
                logger.error("export: shard %d at %s sent nothing for %g s; %s", m, address, EXPORT_IDLE_S, alive)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"shard {m} at {address} sent nothing for {EXPORT_IDLE_S:g} s")
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), f"shard {m} at {address}: {error.details()}")

    @_status_on_error
    async def AcceptInitialValues(self, request, context):
        self._admin(context)
        shards = self.runtime.cfg.shards
        if not 0 <= request.shard_id < len(shards):
            raise InvalidArgument(f"shard {request.shard_id} does not exist (this run has shards 0..{len(shards) - 1})")
        if self._shards is None:
            raise FailedPrecondition("this coordinator cannot call its shards")
        reason = request.reason or "an operator's decision"
        logger.warning("shard %d: accepting fresh initial values (%s)", request.shard_id, reason)
        try:
            reply = await self._shards.accept_initial_values(shards[request.shard_id], reason, SHARD_STATUS_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), f"shard {request.shard_id} at {shards[request.shard_id]}: {error.details()}")
        return coordinator_pb2.AcceptShardInitialValuesReply(shard=reply)

    @_status_on_error
    async def ListShards(self, request, context):
        self._admin(context)
        shards = []
        for m, address in enumerate(self.runtime.cfg.shards):
            entry = coordinator_pb2.ShardStatus(shard_id=m, address=address)
            try:
                if self._shards is None:
                    raise FailedPrecondition("this coordinator cannot call its shards")
                entry.status.CopyFrom(await self._shards.status(address, SHARD_STATUS_TIMEOUT_S))
            except grpc.aio.AioRpcError as error:
                entry.error = f"{error.code().name}: {error.details()}"
            except DilocoError as error:
                entry.error = str(error)
            shards.append(entry)
        return coordinator_pb2.ListShardsReply(shards=shards)

    def _topology_now(self) -> common_pb2.Topology:
        run = self.runtime.run
        key = (self.runtime.topology_epoch, run.plan_hash)
        if self._topology is None or self._topology[0] != key:
            topology = convert.topology_to_proto(run.run, self.runtime.cfg.shards, self.runtime.topology_epoch,
                                                 run.plan, run.manifest_json, run.initial_values, run.seeds_shards)
            self._topology = (key, topology)
        return self._topology[1]


def _directive(directive) -> coordinator_pb2.Directive:
    if directive.kind == "drain":
        return coordinator_pb2.Directive(drain=coordinator_pb2.DrainDirective(reason=directive.reason,
                                                                              after_tokens=directive.after_tokens))
    if directive.kind == "snapshot":
        return coordinator_pb2.Directive(
            snapshot=coordinator_pb2.SnapshotMarker(snapshot_id=directive.snapshot_id, directory=directive.directory)
        )
    raise InvalidArgument(f"unknown directive {directive.kind!r}")
