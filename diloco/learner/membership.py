"""The learner's side of the coordinator, through the kernel's ``LearnerSession`` (the
client tests use too): Join, then heartbeats on their own small channel and thread
(never queued behind bulk pushes), Leave at the end. While the coordinator is
down the learner keeps training; heartbeats retry and resume when it returns."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from diloco import auth, rpc
from diloco.clients.coordinator import LearnerSession
from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.errors import (DilocoError, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unauthenticated,
                           Unavailable)
from diloco.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    learner_id: str
    credential: auth.Credential
    """Renewed in place by heartbeat replies; every channel reads it per call."""
    run: RunConfig
    shards: dict[int, str]
    lease_s: float


HEARTBEATS_PER_LEASE = 5
"""A learner heartbeats every lease / 5 unless told an interval: four heartbeats in a row
may be lost, or wait on a loaded host, before its lease runs out."""
HANDSHAKE_FAILURES_TO_GIVE_UP = 3
"""Join attempts in a row that fail as the two ends disagreeing on TLS before joining
stops retrying: a coordinator that is starting refuses connections, and one that restarts
closes a socket once, but a transport mismatch fails the same way every time."""


async def _join(address: str, join_token: str, pool: str, launch_id: str, host: str, timeout_s: float) -> Membership:
    loop = asyncio.get_running_loop()
    deadline, backoff, handshake_failures = loop.time() + timeout_s, 0.2, 0
    session = LearnerSession(address, timeout_s=10)
    try:
        while True:
            try:
                reply = await session.join(join_token, pool=pool, address=host, launch_id=launch_id)
                break
            except Unavailable as error:
                handshake_failures = handshake_failures + 1 if rpc.handshake_failed(str(error)) else 0
                if handshake_failures >= HANDSHAKE_FAILURES_TO_GIVE_UP or loop.time() + backoff > deadline:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
    finally:
        await session.close()
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
    except DilocoError as error:
        hint = f"; {rpc.handshake_hint()}" if isinstance(error, Unavailable) and rpc.handshake_failed(str(error)) else ""
        raise type(error)(f"cannot join the coordinator at {address}: {error}{hint}") from None
    logger.info("joined the coordinator at %s as %s (pool %s, launch %s)", address, member.learner_id, pool or "default",
                launch_id or "none")
    return member


def _session(address: str, member: Membership, timeout_s: float) -> LearnerSession:
    """A session of the joined learner ``member``."""
    session = LearnerSession(address, timeout_s)
    session.learner_id, session.credential = member.learner_id, member.credential.value
    return session


def register_model(address: str, member: Membership, manifest_json: str, timeout_s: float = 60.0) -> common_pb2.Topology:
    """Register this learner's model manifest; returns the topology with the run's
    manifest. A model that differs from the run's raises FailedPrecondition. While the
    coordinator is unreachable (UNAVAILABLE: restarting, or a partition just after the
    join) it retries with backoff for ``timeout_s``, as the join does."""

    async def call() -> common_pb2.Topology:
        loop = asyncio.get_running_loop()
        deadline, backoff = loop.time() + timeout_s, 0.2
        session = _session(address, member, timeout_s)
        try:
            while True:
                try:
                    return await session.register_model(manifest_json)
                except Unavailable:
                    if loop.time() + backoff > deadline:
                        raise
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            await session.close()

    return asyncio.run(call())


class Heartbeats:
    """Heartbeat every ``interval_s`` from a thread; ``on_drain(reason, after_tokens)`` is
    called when the coordinator asks this learner to leave (on every heartbeat while it
    does), ``after_tokens`` being the token count to train to first (0: now)."""

    def __init__(self, address: str, member: Membership, interval_s: float | None, stats: Callable[[], dict],
                 on_drain: Callable[[str, int], None], on_snapshot: Callable[[int, str], None] = lambda *_: None,
                 loss_timeout_s: float = 300.0) -> None:
        """``interval_s``: None for the lease's (``HEARTBEATS_PER_LEASE``, following the
        lease each reply announces); one longer than half the lease is refused.
        ``loss_timeout_s``: after this long with every heartbeat failing (the coordinator
        unreachable), ``on_drain`` is called: the learner leaves."""
        if interval_s is not None and interval_s > member.lease_s / 2:
            raise InvalidArgument(f"--heartbeat-s {interval_s:g} is longer than half the coordinator's lease "
                                  f"({member.lease_s:g} s): its lease would run out between heartbeats; leave it "
                                  f"unset for a fifth of the lease")
        self.address, self.member, self._given_interval_s = address, member, interval_s
        self.interval_s = interval_s or member.lease_s / HEARTBEATS_PER_LEASE
        self.loss_timeout_s = loss_timeout_s
        self.stats, self.on_drain, self.on_snapshot = stats, on_drain, on_snapshot
        self.reports: queue.SimpleQueue[tuple[int, VectorClock, list[tuple[str, int, str]]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._left = False
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="diloco-heartbeat", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def _metadata(self):
        return self.member.credential.metadata()

    async def _run(self) -> None:
        # Its own small channel and thread: never queued behind bulk pushes.
        session = _session(self.address, self.member, max(self.interval_s, 1.0))
        try:
            last_ok = time.monotonic()
            while not self._stop.is_set():
                await self._send_reports(session)
                session.credential = self.member.credential.value
                try:
                    reply = await session.heartbeat(**self.stats())
                    self.member.credential.renew(reply.credential)  # every channel uses it from now on
                    if self._given_interval_s is None and reply.lease_s > 0:  # a restarted coordinator's may differ
                        self.interval_s = reply.lease_s / HEARTBEATS_PER_LEASE
                        session.timeout_s = max(self.interval_s, 1.0)
                    for directive in reply.directives:
                        kind = directive.WhichOneof("kind")
                        if kind == "drain":
                            self.on_drain(directive.drain.reason or "asked by the coordinator",
                                          directive.drain.after_tokens)
                        elif kind == "snapshot":
                            self.on_snapshot(directive.snapshot.snapshot_id, directive.snapshot.directory)
                    last_ok = time.monotonic()
                except (FailedPrecondition, NotFound, Unauthenticated, PermissionDenied) as error:
                    # No longer a member (lease expired, removed): stop; a launcher starts a
                    # fresh learner if the run wants one.
                    self.failures += 1
                    self.on_drain(f"the coordinator refused our heartbeat: {error}", 0)
                    return
                except DilocoError as error:
                    self.failures += 1
                    lost_s = time.monotonic() - last_ok
                    if lost_s > self.loss_timeout_s:
                        self.on_drain(f"lost the coordinator at {self.address} for {lost_s:.0f} s "
                                      f"(--coordinator-loss-timeout-s {self.loss_timeout_s:g})", 0)
                        return
                    logger.warning("heartbeat failed (coordinator unreachable for %.0f s of %g): %s", lost_s,
                                   self.loss_timeout_s, error)
                await asyncio.to_thread(self._stop.wait, self.interval_s)
        finally:
            await session.close()

    def report(self, snapshot_id: int, clock: VectorClock, files: list[tuple[str, int, str]]) -> None:
        """Queue a ReportSnapshot (sent from the heartbeat thread before its next beat)."""
        self.reports.put((snapshot_id, clock, files))

    async def _send_reports(self, session: LearnerSession) -> None:
        while True:
            try:
                snapshot_id, clock, files = self.reports.get_nowait()
            except queue.Empty:
                return
            try:
                await session.report_snapshot(snapshot_id, files, clock=clock)
            except DilocoError as error:
                # The coordinator re-sends the marker until we report; a lost report is
                # answered by recording again.
                logger.warning("snapshot report failed: %s", error)

    def stop_and_leave(self, reason: str, failed: bool = False) -> None:
        """Stop beating and Leave (``failed``: marked failed, with ``reason``); once (a
        second call does nothing)."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        self._thread.join(timeout=10)

        final = {k: v for k, v in self.stats().items() if k in ("tokens", "inner_steps")}

        async def leave():
            session = _session(self.address, self.member, 5.0)
            try:
                await session.leave(reason, failed=failed, **final)
            finally:
                await session.close()

        try:
            asyncio.run(leave())
        except DilocoError as error:
            logger.warning("leave failed: %s", error)
