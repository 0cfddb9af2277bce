"""The learner's network side: one thread with its own event loop does every push and
bootstrap, so the training loop never waits on the network.

The training thread calls ``submit`` (never blocks: when too many pushes are in flight,
or the owning shard is down, the push is dropped and counted) and drains ``replies``.
A push that fails with UNAVAILABLE marks its shard down; a probe with backoff brings it
back and re-syncs that shard's fragments with a full bootstrap. A shard that comes back
holding no model (restarted without ``--restore``) is first offered this learner's
anchors, the newest global values it knows, so the run never falls back to an initial
model; the first learner to offer wins, the others bootstrap from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import context as otel_context

from diloco import auth
from diloco.clients.syncer import DecodedUpdate, SyncerClient, open_channel
from diloco.codec import EncodedTensor
from diloco.errors import Cancelled, DeadlineExceeded, FailedPrecondition
from diloco.wire import PushMeta
from diloco.learner.core.sync import Reply
from diloco.learner.telemetry import SyncTrace

logger = logging.getLogger(__name__)

SEED_WAIT_S = 30.0
"""How long a starting learner waits for the coordinator's seed of a shard it finds empty
(the coordinator seeds each shard as soon as it serves) before it offers its own values."""
SEED_POLL_S = 0.1


@dataclass(frozen=True)
class PushJob:
    shard: int
    meta: PushMeta
    encoded: Sequence[EncodedTensor]
    anchor: list[torch.Tensor]
    """The anchor the delta was taken against: the update chain applies to it."""
    sent_step: int
    sync: SyncTrace | None = None
    """The push's trace, ended here when the push is dropped or fails."""


@dataclass
class StreamStats:
    pushes_sent: int = 0
    pushes_acked: int = 0
    pushes_dropped: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_initialize: int = 0
    """fp32 values offered with Initialize (initial values, anchors), taken or not."""
    resyncs: int = 0
    latency_s: list[float] = field(default_factory=list)


class Streamer:
    def __init__(
        self,
        shards: dict[int, str],
        credential: auth.Credential,
        timeout_s: float = 120.0,
        max_inflight: int = 16,
        fragments_of: dict[int, list[int]] | None = None,
        wire_delay_s: float = 0.0,
    ) -> None:
        self.shards = dict(shards)
        self.wire_delay_s = wire_delay_s
        self.fragments_of = fragments_of or {}
        self.credential, self.timeout_s = credential, timeout_s
        self.max_inflight = max_inflight
        self.replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self.stats = StreamStats()
        self._lock = threading.Lock()
        self._inflight = 0
        self._down: set[int] = set()
        self._loop = asyncio.new_event_loop()
        self._clients: dict[int, SyncerClient] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: set[asyncio.Future] = set()
        self.reoffer: tuple[str, str, Callable[[int], tuple[list[EncodedTensor], int]]] | None = None
        """(manifest JSON, plan hash, fragment -> (its anchor encoded fp32, the anchor's
        version)): what a shard that came back empty is offered."""
        self._thread = threading.Thread(target=self._loop.run_forever, name="diloco-streamer", daemon=True)
        self._thread.start()

    # --- called from the training thread ---------------------------------------------

    def submit(self, job: PushJob) -> bool:
        with self._lock:
            if self._inflight >= self.max_inflight or job.shard in self._down:
                self.stats.pushes_dropped += 1
                if job.sync is not None:
                    job.sync.dropped("shard_down" if job.shard in self._down else "inflight_limit")
                return False
            self._inflight += 1
            self.stats.pushes_sent += 1
        future = asyncio.run_coroutine_threadsafe(self._push(job), self._loop)
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)
        return True

    def _blocking(self, coroutine, what: str, timeout_s: float, stop: threading.Event | None):
        """Run ``coroutine`` on the network loop and wait for it from the calling thread,
        for at most ``timeout_s`` and only while ``stop`` is not set (a drain or a signal
        that arrives before training starts ends the wait at once)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=0.25)
            except concurrent.futures.TimeoutError:
                if stop is not None and stop.is_set():
                    future.cancel()
                    raise Cancelled(f"stopped while waiting for {what}") from None
                if time.monotonic() >= deadline:
                    future.cancel()
                    raise DeadlineExceeded(f"{what} took more than {timeout_s:.0f} s") from None

    def bootstrap(self, fragments_by_shard: dict[int, list[int]], have: dict[int, bytes] | None = None,
                  timeout_s: float = 120.0, stop: threading.Event | None = None) -> list[DecodedUpdate]:
        """Full fragments from their shards, but none we ``have`` (``SyncerClient.bootstrap``);
        blocks (only used before training starts)."""
        return self._blocking(self._bootstrap(fragments_by_shard, have), "the shards' bootstrap", timeout_s, stop)

    def initialize(self, shard: int, manifest_json: str, plan_hash: str, fragments: list[int],
                   encode: Callable[[int], list[EncodedTensor]], timeout_s: float = 300.0,
                   stop: threading.Event | None = None, seed_wait_s: float = 0.0) -> list[int]:
        """Offer our values (``encode(fragment)``, fp32) of the shard's fragments that have
        none yet; returns those that took ours. ``seed_wait_s``: the coordinator seeds the
        shards (``Topology.seeds_shards``): wait this long for its seed first, and offer
        ours only for what it did not bring. Blocks (only used before training starts)."""

        async def offer() -> list[int]:
            client = self._client(shard)
            status = await self._until_up(shard, client.status)
            if status.plan_hash and status.plan_hash != plan_hash:
                raise FailedPrecondition(
                    f"shard {shard} holds another model (plan {status.plan_hash[:12]}; this learner's model gives "
                    f"{plan_hash[:12]}): every learner of a run trains the same model"
                )
            if status.anchors_only:  # recovering: it takes other learners' anchors, never our fresh values
                logger.warning("shard %d is recovering its fragments from learners' anchors: waiting for them", shard)
                while status.anchors_only and not set(fragments) <= {f.fragment for f in status.fragments}:
                    await asyncio.sleep(0.5)
                    status = await self._until_up(shard, client.status)
            have = {f.fragment for f in status.fragments}
            deadline = time.monotonic() + seed_wait_s
            while not set(fragments) <= have and time.monotonic() < deadline:
                await asyncio.sleep(SEED_POLL_S)
                have = {f.fragment for f in (await self._until_up(shard, client.status)).fragments}
            if seed_wait_s and not set(fragments) <= have:
                logger.warning("shard %d: the coordinator's seed of fragments %s did not come in %.0f s: offering ours",
                               shard, sorted(set(fragments) - have), seed_wait_s)
            taken = []
            for fragment in fragments:
                if fragment in have:
                    continue
                encoded = await asyncio.to_thread(encode, fragment)
                self.stats.bytes_initialize += sum(len(e.payload) for e in encoded)
                if await client.initialize(fragment, manifest_json, plan_hash, encoded):
                    taken.append(fragment)
            return taken

        return self._blocking(offer(), f"shard {shard}'s initial values", timeout_s, stop)

    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def any_down(self) -> bool:
        """A shard is unreachable or being re-synced."""
        with self._lock:
            return bool(self._down)

    def wait(self, timeout_s: float) -> bool:
        """Wait (bounded) until no push is in flight; False if some still are."""
        deadline = time.monotonic() + timeout_s
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.inflight()

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) for in-flight pushes, offer our anchors to any shard recovering
        from them, then stop the loop and close channels."""
        deadline = time.monotonic() + timeout_s
        self.wait(timeout_s)
        offering = asyncio.run_coroutine_threadsafe(self._offer_to_recovering(), self._loop)
        try:
            offering.result(max(min(deadline - time.monotonic(), 10.0), 1.0))
        except concurrent.futures.TimeoutError:
            offering.cancel()
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # --- on the streamer loop ----------------------------------------------------------

    def _client(self, shard: int) -> SyncerClient:
        client = self._clients.get(shard)
        if client is None:
            channel = open_channel(self.shards[shard])
            self._channels.append(channel)
            client = self._clients[shard] = SyncerClient(channel, self.credential, self.timeout_s)
        return client

    async def _push(self, job: PushJob) -> None:
        started = time.monotonic()
        # The job carries its trace from the training thread; made current in this task
        # only, the RPC's span (and the shard's, through the metadata) become its children.
        token = otel_context.attach(job.sync.context) if job.sync is not None else None
        replied = False
        try:
            if self.wire_delay_s:
                await asyncio.sleep(self.wire_delay_s)  # chaos: a slower network, each way
            result = await self._client(job.shard).push(
                job.meta, job.encoded, on_ack=job.sync.acked if job.sync is not None else None
            )
            if self.wire_delay_s:
                await asyncio.sleep(self.wire_delay_s)
            applying = time.perf_counter()
            # A final push's reply carries no values: its learner is leaving.
            values = [] if job.meta.final else await asyncio.to_thread(result.update.apply_to, job.anchor)
            staleness = max(result.update.version - job.meta.base_version - 1, 0)
            if job.sync is not None:
                for name, seconds in (("frame", result.frame_s), ("send", result.send_s), ("wait", result.wait_s),
                                      ("decode", result.decode_s), ("apply", time.perf_counter() - applying)):
                    job.sync.phase(name, seconds)
                job.sync.replied(result.update.version, staleness, result.bytes_up, result.update.wire_bytes)
            self.replies.put(Reply(job.meta.fragment, result.update.version, values, job.sent_step, staleness,
                                   failed=job.meta.final))
            replied = True
            with self._lock:
                self.stats.pushes_acked += 1
                self.stats.bytes_up += result.bytes_up
                self.stats.bytes_down += result.update.wire_bytes
                self.stats.latency_s.append(time.monotonic() - started)
        except grpc.aio.AioRpcError as error:
            with self._lock:
                self.stats.pushes_dropped += 1
            logger.warning("push of fragment %d to shard %d failed: %s %s", job.meta.fragment, job.shard,
                           error.code().name, error.details())
            if job.sync is not None:
                job.sync.failed(error.code().name, error.details() or "")
            # Unreachable, or it lost our versions (restarted without its state): re-sync.
            if error.code() in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION
            ):
                self._mark_down(job.shard)
        finally:
            if job.sync is not None and not replied:  # ended before the worker hears of it
                job.sync.failed("ERROR", "the push ended without an update")  # no-op if already ended
            if not replied:  # the worker may send this fragment again
                self.replies.put(Reply(job.meta.fragment, -1, [], job.sent_step, 0, failed=True))
            if token is not None:
                otel_context.detach(token)
            with self._lock:
                self._inflight -= 1

    def _mark_down(self, shard: int) -> None:
        with self._lock:
            if shard in self._down:
                return
            self._down.add(shard)
        self._loop.create_task(self._probe(shard))

    async def _probe(self, shard: int) -> None:
        """Probe a down shard with backoff; when it answers, re-sync its fragments."""
        backoff = 0.2
        while True:
            await asyncio.sleep(backoff)
            try:
                status = await asyncio.wait_for(self._client(shard).status(), 2)
                await self._reoffer(shard, {f.fragment for f in status.fragments})
                updates = await self._bootstrap({shard: self.fragments_of.get(shard, [])})
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                backoff = min(backoff * 2, 5.0)
                continue
            for update in updates:
                values = update.segments[-1].tensors
                self.replies.put(Reply(update.fragment, update.version, values, -1, 0))
            with self._lock:
                self._down.discard(shard)
                self.stats.resyncs += 1
            logger.info("shard %d is back: re-synced %d fragments", shard, len(updates))
            return

    async def _offer_to_recovering(self) -> None:
        """A shard restarted without its state holds nothing until learners offer their
        anchors, which they do when a push to it fails. A learner leaving offers its anchors
        to every shard that is still recovering, so that a run ending during a recovery
        still ends with a global model. A shard that is down may be restarting: it is asked
        again until the caller's bound; one that refuses is left alone."""
        if self.reoffer is None:  # not bootstrapped: no anchors to offer
            return

        async def one(shard: int) -> None:
            try:
                while True:
                    try:
                        status = await asyncio.wait_for(self._client(shard).status(), 2)
                        break
                    except grpc.aio.AioRpcError as error:
                        if error.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        # Down, perhaps restarting without its state: ask again until the
                        # caller's bound (close: at most 10 s) cancels this.
                        await asyncio.sleep(0.25)
                if status.anchors_only:
                    await self._reoffer(shard, {f.fragment for f in status.fragments})
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as error:
                logger.info("shard %d: no anchor offered on leaving (%s)", shard, error)

        await asyncio.gather(*(one(shard) for shard in self.fragments_of))

    async def _reoffer(self, shard: int, held: set[int]) -> None:
        if self.reoffer is None:
            return
        manifest_json, plan_hash, encode_anchor = self.reoffer

        async def offer(fragment: int) -> None:
            encoded, version = await asyncio.to_thread(encode_anchor, fragment)
            self.stats.bytes_initialize += sum(len(e.payload) for e in encoded)
            if await self._client(shard).initialize(fragment, manifest_json, plan_hash, encoded, version):
                logger.warning("shard %d came back without fragment %d: it restarts from our anchor at version %d",
                               shard, fragment, version)

        # At once for every fragment: the shard collects each fragment's anchors for a while.
        await asyncio.gather(*(offer(f) for f in self.fragments_of.get(shard, []) if f not in held))

    async def _until_up(self, shard: int, call):
        """``call()``, retried with backoff while the shard is down (UNAVAILABLE): a learner
        that starts during a shard's restart waits for it (bounded by the caller's wait)."""
        delay = 0.2
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                logger.warning("shard %d is unreachable (%s): retrying in %.1f s", shard, error.details(), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _bootstrap(self, fragments_by_shard: dict[int, list[int]],
                         have: dict[int, bytes] | None = None) -> list[DecodedUpdate]:
        results = await asyncio.gather(
            *(self._until_up(shard, lambda s=shard, f=fragments: self._client(s).bootstrap(f, have))
              for shard, fragments in fragments_by_shard.items())
        )
        updates = [u for shard_updates in results for u in shard_updates]
        with self._lock:
            self.stats.bytes_down += sum(u.wire_bytes for u in updates)
        return updates

    async def _close(self) -> None:
        for channel in self._channels:
            await channel.close()
