"""Process wiring of one shard: build the core from the run config, serve gRPC, follow
the coordinator's membership stream, shut down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
from pathlib import Path

import grpc
import numpy as np

from diloco import auth, rpc
from diloco.config import RunConfig
from diloco.errors import DilocoError, Unavailable
from diloco.manifest import MAX_JSON_BYTES
from diloco.tape import TapeWriter
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from diloco.syncer import snapshot
from diloco.syncer.config import ShardServerConfig, SyncerConfig
from diloco.syncer.core.shard import ShardCore
from diloco.syncer.pushlog import PushLogWriter, log_name
from diloco.syncer.runtime import MANIFEST_FILE, MarkerResult, ShardRuntime
from diloco.syncer.service import SERVICE_NAME, SyncerServicer, add_to_server

logger = logging.getLogger(__name__)

_MEMBERSHIP_EVENTS = {
    common_pb2.LEARNER_STATE_ACTIVE: "joined",
    common_pb2.LEARNER_STATE_JOINING: "joined",
    common_pb2.LEARNER_STATE_FAILED: "failed",
    common_pb2.LEARNER_STATE_LEFT: "left",
    common_pb2.LEARNER_STATE_DRAINING: "draining",
}


RUN_MODEL_TIMEOUT_S = 10.0
"""Deadline of the shard's GetTopology, which fetches the run's model from the coordinator."""
RUN_MODEL_MESSAGE_BYTES = MAX_JSON_BYTES + (4 << 20)
"""A topology carries the manifest (at most ``MAX_JSON_BYTES``) and the plan."""


class ShardServer:
    def __init__(self, run: RunConfig, cfg: SyncerConfig, server_cfg: ShardServerConfig,
                 core: ShardCore | None = None) -> None:
        """``core``: a shard state to serve (tests, benchmarks); by default the shard starts
        holding no model, and the first learner (or ``--restore``) gives it one."""
        self.cfg, self.server_cfg = cfg, server_cfg
        tape = None
        if server_cfg.data_dir is not None:
            tape = TapeWriter(Path(server_cfg.data_dir) / f"tape-S{cfg.shard_id}.jsonl", server_cfg.tape_fsync_every)
        push_log = None
        if server_cfg.data_dir is not None and server_cfg.push_log:
            push_log = PushLogWriter(Path(server_cfg.data_dir) / log_name(cfg.shard_id))
        data_dir = Path(server_cfg.data_dir) if server_cfg.data_dir is not None else None
        self.runtime = ShardRuntime(core or ShardCore(cfg), tape, push_log, num_fragments=run.fragments, data_dir=data_dir,
                                    max_model_bytes=run.max_model_bytes)
        if server_cfg.coordinator:
            self.runtime.run_model = self._run_model
        if server_cfg.restore:
            self.runtime.restore(*snapshot.load_for_restore(server_cfg.restore, server_cfg.snapshot_dir, cfg.shard_id,
                                                            server_cfg.secret, pin=True))
        elif core is None and data_dir is not None and (data_dir / MANIFEST_FILE).is_file():
            self.runtime.expect_anchors((data_dir / MANIFEST_FILE).read_text())
            self.runtime.anchor_reference = _snapshot_values(server_cfg, cfg.shard_id, self.runtime.core.plan.plan_hash)
        if server_cfg.static_learners:
            self.runtime.core.set_membership(set(server_cfg.static_learners), set())
        self.runtime.on_snapshot_recorded = self._report_snapshot
        self.server = rpc.server(
            options=[
                ("grpc.max_receive_message_length", server_cfg.max_message_bytes),
                ("grpc.max_send_message_length", server_cfg.max_message_bytes),
            ]
        )
        self.servicer = SyncerServicer(self.runtime, server_cfg.secret)
        add_to_server(self.servicer, self.server)
        self.health = rpc.add_standard_services(self.server, [SERVICE_NAME], self.server_cfg.reflection)
        self.port = 0
        self._probes: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> int:
        """Listen and serve. A start that fails (a port taken) lets go of what it opened."""
        try:
            self.port = rpc.bind(self.server, f"{self.server_cfg.host}:{self.server_cfg.port}")
            await self.server.start()
            if self.server_cfg.health_port is not None:
                self._probes, _ = await rpc.health_server(self.health,
                                                          f"{self.server_cfg.host}:{self.server_cfg.health_port}")
        except BaseException:
            self._stopped = True
            await self.server.stop(None)
            # Dropped now: a grpc.aio server that lives on to the interpreter's exit (its
            # servicers refer back here, a cycle the collector cannot see through gRPC's
            # objects) keeps gRPC's poller thread running through the teardown, which then
            # prints a stray "Error in sys.excepthook" after the command's one line.
            self.server = None
            raise
        await rpc.mark_serving(self.health, [SERVICE_NAME])
        self.runtime.evaluate_all()  # rounds restored from a snapshot may be ready to close
        if self.server_cfg.coordinator:
            self._watch = asyncio.get_running_loop().create_task(self._follow_membership())
        logger.info("shard %d listening on %s:%d", self.cfg.shard_id, self.server_cfg.host, self.port)
        return self.port

    def follow(self, coordinator: str) -> None:
        """Follow (and report snapshots to) a coordinator that started after this shard:
        with ephemeral ports, one of the two must start first."""
        self.server_cfg = dataclasses.replace(self.server_cfg, coordinator=coordinator)
        self.runtime.run_model = self._run_model
        if self._watch is not None:
            self._watch.cancel()
        self._watch = asyncio.get_running_loop().create_task(self._follow_membership())

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await rpc.mark_serving(self.health, [SERVICE_NAME], serving=False)
        if self._watch is not None:
            self._watch.cancel()
        await self.runtime.drain()
        await self.server.stop(self.server_cfg.shutdown_grace_s)
        if self._probes is not None:
            await self._probes.stop(0)

    def _credentials(self) -> tuple[tuple[str, str], ...]:
        name = f"S{self.cfg.shard_id}"
        return ((auth.LEARNER_METADATA, name), (auth.CREDENTIAL_METADATA, auth.sign(self.server_cfg.secret, name)))

    async def _run_model(self) -> tuple[str, tuple[bytes, ...]]:
        """The run's manifest and pinned initial values as the coordinator holds them (its
        topology, asked as ``S<m>``). UNAVAILABLE is retried by the channel's policy."""
        options = rpc.channel_options(RUN_MODEL_MESSAGE_BYTES, "diloco.v1.Coordinator")
        async with rpc.channel(self.server_cfg.coordinator, options) as channel:
            try:
                topology = await coordinator_pb2_grpc.CoordinatorStub(channel).GetTopology(
                    coordinator_pb2.GetTopologyRequest(), metadata=self._credentials(), timeout=RUN_MODEL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                raise Unavailable(f"the coordinator's model (GetTopology): {error.code().name}: {error.details()}") from None
        return topology.manifest_json, tuple(topology.initial_values)

    async def _report_snapshot(self, result: MarkerResult) -> None:
        """Tell the coordinator this shard's part of a snapshot is on disk (state and
        channel state). UNAVAILABLE is retried by the channel's policy."""
        if not self.server_cfg.coordinator:
            logger.info("snapshot %d recorded; no coordinator to report to", result.snapshot_id)
            return
        request = coordinator_pb2.ReportSnapshotRequest(
            snapshot_id=result.snapshot_id,
            participant=f"S{self.cfg.shard_id}",
            clock=common_pb2.VectorClock(entries=dict(result.clock.entries)),
            files=[common_pb2.SnapshotFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in result.files],
        )
        options = rpc.channel_options(self.server_cfg.max_message_bytes, "diloco.v1.Coordinator")
        async with rpc.channel(self.server_cfg.coordinator, options) as channel:
            try:
                await coordinator_pb2_grpc.CoordinatorStub(channel).ReportSnapshot(
                    request, metadata=self._credentials(), timeout=self.server_cfg.report_timeout_s
                )
            except grpc.aio.AioRpcError as error:
                raise Unavailable(f"ReportSnapshot: {error.code().name}: {error.details()}") from None

    async def _follow_membership(self) -> None:
        """Follow WatchMembership; reconnect with backoff while the coordinator is away
        (rounds keep closing on the membership last known)."""
        name = f"S{self.cfg.shard_id}"
        backoff = 0.2
        while True:
            try:
                async with rpc.channel(self.server_cfg.coordinator) as channel:
                    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                    stream = stub.WatchMembership(coordinator_pb2.WatchMembershipRequest(watcher=name, incarnation=self.runtime.incarnation),
                                                  metadata=self._credentials())  # signed afresh: credentials expire
                    async for event in stream:
                        backoff = 0.2
                        self._apply_membership(event)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                logger.warning("membership stream from %s: %s; retrying in %.1f s", self.server_cfg.coordinator, error.code().name, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _apply_membership(self, event: coordinator_pb2.MembershipEvent) -> None:
        if event.kind == coordinator_pb2.MEMBERSHIP_EVENT_KIND_SNAPSHOT:
            live = {i.learner_id for i in event.learners if _MEMBERSHIP_EVENTS.get(i.state) == "joined"}
            failed = {i.learner_id for i in event.learners if i.state == common_pb2.LEARNER_STATE_FAILED}
            draining = {i.learner_id for i in event.learners if i.state == common_pb2.LEARNER_STATE_DRAINING}
            left = {i.learner_id for i in event.learners if i.state == common_pb2.LEARNER_STATE_LEFT}
            self.runtime.set_membership(live, failed, draining, left)
            return
        for info in event.learners:
            kind = _MEMBERSHIP_EVENTS.get(info.state)
            if kind is not None:
                self.runtime.membership(kind, info.learner_id)


def _snapshot_values(server_cfg: ShardServerConfig, shard_id: int, plan_hash: str) -> dict[int, list]:
    """Each fragment's values in the shard's latest complete snapshot (checked against the
    run secret's mac and the files' checksums): what a shard back without its state
    compares the anchors offered with. Empty when there is none."""
    if server_cfg.snapshot_dir is None:
        return {}
    try:
        snapshot_id, state, _ = snapshot.load_for_restore("latest", server_cfg.snapshot_dir, shard_id, server_cfg.secret)
    except DilocoError as error:
        logger.warning("shard %d: no snapshot to compare the anchors offered with (%s): they are compared with "
                       "their elementwise median", shard_id, error)
        return {}
    if state["plan_hash"] != plan_hash:
        logger.warning("shard %d: the latest snapshot (%d) is of another plan: anchors offered are compared with "
                       "their elementwise median", shard_id, snapshot_id)
        return {}
    logger.info("shard %d: anchors offered are compared with snapshot %d's values", shard_id, snapshot_id)
    return {int(f["id"]): [np.asarray(p, dtype=np.float32) for p in f["params"]] for f in state["fragments"]}


# glibc <malloc.h> mallopt parameters.
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 4 << 20


def tune_malloc() -> None:
    """glibc malloc for a shard, whose threads (event loop, gRPC, worker threads) allocate
    and free a push's buffers (1 MiB chunks, a 2 MiB payload per 4M parameters) and
    fragment-sized ones every round. One arena: a buffer freed by one thread is reused by
    the next push on any thread instead of piling up in per-thread arenas. A fixed 4 MiB
    mmap threshold: push-sized buffers come from the heap and are reused without page
    faults; fragment-sized ones are mmapped and returned to the OS when freed.

    Measured with ``diloco bench syncer`` (4M parameters, 8 learners, medians of 3):
    glibc's defaults peak at 418 MB; a 1 MiB threshold alone at 245 MB with 172 MB/s
    ingress and 3.0 rounds/s (a fifth of the shard's CPU then zeroed fresh pages); one
    arena and 4 MiB at 216 MB, 204 MB/s and 3.5 rounds/s, and 220 MB instead of 290 MB
    over 80 rounds. Call before any other thread starts. No-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_ARENA_MAX, 1)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        logger.debug("not glibc: leaving malloc alone")


async def run_shard(run: RunConfig, cfg: SyncerConfig, server_cfg: ShardServerConfig, port_file: Path | None = None) -> int:
    """Serve until SIGTERM/SIGINT; then drain rounds, flush the tape and exit 0."""
    tune_malloc()
    shard = ShardServer(run, cfg, server_cfg)
    port = await shard.start()
    await rpc.announce_and_wait_for_signal(f"syncer shard {cfg.shard_id}", f"{server_cfg.host}:{port}", port_file)
    logger.info("shard %d shutting down", cfg.shard_id)
    await shard.stop()
    return 0
