"""The learner's side of the coordinator: Join, then heartbeats on their own small channel
and thread (never queued behind bulk pushes), Leave at the end. While the coordinator is
down the learner keeps training; heartbeats retry and resume when it returns."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from diloco import auth, rpc
from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.convert import clock_to_proto
from diloco.errors import Unavailable
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    learner_id: str
    credential: auth.Credential
    """Renewed in place by heartbeat replies; every channel reads it per call."""
    run: RunConfig
    shards: dict[int, str]
    lease_s: float


def _channel(address: str) -> grpc.aio.Channel:
    return rpc.channel(address, rpc.channel_options(4 * 1024 * 1024, "diloco.v1.Coordinator"))


async def _join(address: str, join_token: str, pool: str, launch_id: str, host: str, timeout_s: float) -> Membership:
    loop = asyncio.get_running_loop()
    deadline, backoff = loop.time() + timeout_s, 0.2
    while True:
        try:
            async with _channel(address) as channel:
                reply = await coordinator_pb2_grpc.CoordinatorStub(channel).Join(
                    coordinator_pb2.JoinRequest(pool=pool, address=host, launch_id=launch_id),
                    metadata=((auth.JOIN_METADATA, join_token),),
                    timeout=10,
                )
            break
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + backoff > deadline:
                raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
    topology = reply.topology
    return Membership(
        reply.learner_id,
        auth.Credential(reply.learner_id, reply.credential),
        RunConfig.from_json(topology.run_config_json),
        {s.shard_id: s.address for s in topology.shards},
        reply.lease_s,
    )


def join(address: str, join_token: str, pool: str, launch_id: str, host: str, timeout_s: float = 60.0) -> Membership:
    try:
        member = asyncio.run(_join(address, join_token, pool, launch_id, host, timeout_s))
    except grpc.aio.AioRpcError as error:
        raise Unavailable(f"cannot join the coordinator at {address}: {error.code().name}: {error.details()}") from None
    logger.info("joined the coordinator at %s as %s (pool %s, launch %s)", address, member.learner_id, pool or "default",
                launch_id or "none")
    return member


def register_model(address: str, member: Membership, manifest_json: str, timeout_s: float = 60.0) -> common_pb2.Topology:
    """Register this learner's model manifest; returns the topology with the run's
    manifest. A model that differs from the run's raises FailedPrecondition."""
    from coordinator.client import LearnerSession

    async def call() -> common_pb2.Topology:
        session = LearnerSession(address, timeout_s)
        session.learner_id, session.credential = member.learner_id, member.credential.value
        try:
            return await session.register_model(manifest_json)
        finally:
            await session.close()

    return asyncio.run(call())


class Heartbeats:
    """Heartbeat every ``interval_s`` from a thread; ``on_drain`` is called once when the
    coordinator asks this learner to leave."""

    def __init__(self, address: str, member: Membership, interval_s: float, stats: Callable[[], dict],
                 on_drain: Callable[[str], None], on_snapshot: Callable[[int, str], None] = lambda *_: None,
                 loss_timeout_s: float = 300.0) -> None:
        """``loss_timeout_s``: after this long with every heartbeat failing (the coordinator
        unreachable), ``on_drain`` is called: the learner leaves."""
        self.address, self.member, self.interval_s = address, member, interval_s
        self.loss_timeout_s = loss_timeout_s
        self.stats, self.on_drain, self.on_snapshot = stats, on_drain, on_snapshot
        self.reports: queue.SimpleQueue[coordinator_pb2.ReportSnapshotRequest] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._left = False
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="diloco-heartbeat", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def _metadata(self):
        return self.member.credential.metadata()

    async def _run(self) -> None:
        async with _channel(self.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            last_ok = time.monotonic()
            while not self._stop.is_set():
                await self._send_reports(stub)
                try:
                    reply = await stub.Heartbeat(
                        coordinator_pb2.HeartbeatRequest(learner_id=self.member.learner_id, **self.stats()),
                        metadata=self._metadata(), timeout=max(self.interval_s, 1.0),
                    )
                    self.member.credential.renew(reply.credential)  # every channel uses it from now on
                    for directive in reply.directives:
                        kind = directive.WhichOneof("kind")
                        if kind == "drain":
                            self.on_drain(directive.drain.reason or "asked by the coordinator")
                        elif kind == "snapshot":
                            self.on_snapshot(directive.snapshot.snapshot_id, directive.snapshot.directory)
                    last_ok = time.monotonic()
                except grpc.aio.AioRpcError as error:
                    self.failures += 1
                    if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        # No longer a member (lease expired, removed): stop; a launcher
                        # starts a fresh learner if the run wants one.
                        self.on_drain(f"the coordinator refused our heartbeat: {error.details()}")
                        return
                    lost_s = time.monotonic() - last_ok
                    if lost_s > self.loss_timeout_s:
                        self.on_drain(f"lost the coordinator at {self.address} for {lost_s:.0f} s "
                                      f"(--coordinator-loss-timeout-s {self.loss_timeout_s:g})")
                        return
                    logger.warning("heartbeat failed (coordinator unreachable for %.0f s of %g): %s %s", lost_s,
                                   self.loss_timeout_s, error.code().name, error.details())
                await asyncio.to_thread(self._stop.wait, self.interval_s)

    def report(self, snapshot_id: int, clock: VectorClock, files: list[tuple[str, int, str]]) -> None:
        """Queue a ReportSnapshot (sent from the heartbeat thread before its next beat)."""
        self.reports.put(
            coordinator_pb2.ReportSnapshotRequest(
                snapshot_id=snapshot_id, participant=self.member.learner_id, clock=clock_to_proto(clock),
                files=[common_pb2.SnapshotFile(path=p, size_bytes=n, sha256=h) for p, n, h in files],
            )
        )

    async def _send_reports(self, stub) -> None:
        while True:
            try:
                request = self.reports.get_nowait()
            except queue.Empty:
                return
            try:
                await stub.ReportSnapshot(request, metadata=self._metadata(), timeout=10)
            except grpc.aio.AioRpcError as error:
                # The coordinator re-sends the marker until we report; a lost report is
                # answered by recording again.
                logger.warning("snapshot report failed: %s %s", error.code().name, error.details())

    def stop_and_leave(self, reason: str) -> None:
        """Stop beating and Leave; once (a second call does nothing)."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        self._thread.join(timeout=10)

        final = {k: v for k, v in self.stats().items() if k in ("tokens", "inner_steps")}

        async def leave():
            async with _channel(self.address) as channel:
                await coordinator_pb2_grpc.CoordinatorStub(channel).Leave(
                    coordinator_pb2.LeaveRequest(learner_id=self.member.learner_id, reason=reason, **final),
                    metadata=self._metadata(), timeout=5,
                )

        try:
            asyncio.run(leave())
        except grpc.aio.AioRpcError as error:
            logger.warning("leave failed: %s", error.code().name)
