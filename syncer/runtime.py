"""The shard's runtime: one event loop owns the ``ShardCore`` (no locks).

It re-decides a fragment's round whenever something changes (a push, a membership
event, a grace deadline), runs the merge and outer step in a worker thread, swaps the
result in, answers every push waiting on that round and writes the event tape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.tape import TapeWriter
from syncer.core.rounds import Close
from syncer.core.shard import DUPLICATE, Ack, PushMeta, PushPayload, RoundJob, ShardCore, Segment, compute_round

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    pushes: int = 0
    duplicates: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    rounds: int = 0


@dataclass
class _Waiter:
    target_version: int
    base_version: int
    future: asyncio.Future = field(repr=False)


class ShardRuntime:
    def __init__(
        self,
        core: ShardCore,
        tape: TapeWriter | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.tape = tape
        self.counters = Counters()
        self._monotonic = monotonic
        self._wall = wall
        self._waiters: dict[int, list[_Waiter]] = {f: [] for f in core.fragments}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._rounds: set[asyncio.Task] = set()
        # Set while no round of the fragment is being applied: its tensors may be read.
        self._idle: dict[int, asyncio.Event] = {f: asyncio.Event() for f in core.fragments}
        for event in self._idle.values():
            event.set()
        self.accepting = True
        self._record("start", shard=core.cfg.shard_id, fragments=sorted(core.fragments), plan=core.plan.plan_hash)

    def now(self) -> float:
        return self._monotonic()

    def _record(self, kind: str, **fields) -> None:
        if self.tape is not None:
            self.tape.append(kind, self._wall(), **fields)

    # --- pushes ----------------------------------------------------------------------

    def push(self, meta: PushMeta, payload: PushPayload, wire_bytes: int) -> tuple[Ack, asyncio.Future]:
        """Accept a decoded push; returns its ack and a future resolved with the update
        once the round it joined has closed."""
        from diloco.errors import Unavailable

        if not self.accepting:
            raise Unavailable(f"shard {self.core.cfg.shard_id} is shutting down")
        now = self._monotonic()
        ack = self.core.accept(meta, payload, wire_bytes, now)
        self.counters.bytes_received += wire_bytes
        if ack.outcome == DUPLICATE:
            self.counters.duplicates += 1
        else:
            self.counters.pushes += 1
        self._record(
            "push",
            learner=meta.learner_id,
            fragment=meta.fragment,
            base_version=meta.base_version,
            tokens=meta.tokens,
            steps=meta.inner_steps,
            step_time_s=meta.step_time_s,
            bytes=wire_bytes,
            clock=dict(meta.clock.entries),
            outcome=ack.outcome,
            target_version=ack.target_version,
        )
        future = asyncio.get_running_loop().create_future()
        self._waiters[meta.fragment].append(_Waiter(ack.target_version, meta.base_version, future))
        self._resolve(meta.fragment)
        self._evaluate(meta.fragment)
        return ack, future

    # --- rounds ----------------------------------------------------------------------

    def _evaluate(self, fragment_id: int) -> None:
        timer = self._timers.pop(fragment_id, None)
        if timer is not None:
            timer.cancel()
        decision = self.core.decide(fragment_id, self._monotonic())
        if isinstance(decision, Close):
            self._close(fragment_id, decision)
            return
        logger.debug("fragment %d: %s", fragment_id, decision.reason)
        if decision.deadline is not None:
            delay = max(0.0, decision.deadline - self._monotonic())
            self._timers[fragment_id] = asyncio.get_running_loop().call_later(delay, self._evaluate, fragment_id)

    def _close(self, fragment_id: int, decision: Close) -> None:
        job = self.core.begin_round(fragment_id, decision, self._monotonic())
        self._idle[fragment_id].clear()
        task = asyncio.get_running_loop().create_task(self._run_round(job))
        self._rounds.add(task)
        task.add_done_callback(self._rounds.discard)

    async def _run_round(self, job: RoundJob) -> None:
        started = time.perf_counter()
        update: Segment = await asyncio.to_thread(compute_round, job, self.core.cfg)
        merge_s = time.perf_counter() - started
        self.core.finish_round(job, update, self._monotonic())
        self._idle[job.fragment.id].set()
        self.counters.rounds += 1
        participants = [p.meta.learner_id for p in job.pushes]
        logger.info(
            "fragment %d -> version %d: %d learners, %s (merge %.1f ms)",
            job.fragment.id, job.version, len(participants), job.reason, merge_s * 1e3,
        )
        self._record(
            "round",
            fragment=job.fragment.id,
            version=job.version,
            participants=participants,
            weights=[round(w, 6) for w in job.weights],
            quorum_s=round(job.quorum_s, 6),
            grace_s=round(job.grace_s, 6),
            merge_s=round(merge_s, 6),
            reason=job.reason,
            opened_t=self._wall() - (self._monotonic() - job.opened_at),
            clock=dict(self.core.clock.entries),
        )
        self._resolve(job.fragment.id)
        self._evaluate(job.fragment.id)

    def _resolve(self, fragment_id: int) -> None:
        state = self.core.fragments[fragment_id]
        if state.applying:
            return  # resolved when the round in flight finishes
        version = state.version
        still = []
        for waiter in self._waiters[fragment_id]:
            if waiter.future.done():
                continue
            if waiter.target_version <= version:
                waiter.future.set_result(self.core.update_for(fragment_id, waiter.base_version))
            else:
                still.append(waiter)
        self._waiters[fragment_id] = still

    async def full(self, fragment_id: int) -> Segment:
        """The full fp32 fragment, read only between rounds (rounds update it in place)."""
        self.core.state_of(fragment_id)
        await self._idle[fragment_id].wait()
        return self.core.full(fragment_id)

    # --- membership ------------------------------------------------------------------

    def membership(self, event: str, learner_id: str) -> None:
        """event: joined | failed | left | draining. Re-decides every round: a failure can
        complete a round (every remaining live learner has pushed)."""
        if event == "joined":
            self.core.learner_joined(learner_id)
        elif event == "failed":
            self.core.learner_failed(learner_id)
        elif event in ("left", "draining"):
            self.core.learner_left(learner_id)
        self._record("membership", learner=learner_id, event=event)
        for fragment_id in self.core.fragments:
            self._evaluate(fragment_id)

    def set_membership(self, live: set[str], failed: set[str]) -> None:
        self.core.set_membership(live, failed)
        self._record("membership", event="snapshot", live=sorted(live), failed=sorted(failed))
        for fragment_id in self.core.fragments:
            self._evaluate(fragment_id)

    # --- shutdown --------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop accepting, close every open round so its pushers get their replies, wait
        for rounds in flight, flush the tape."""
        self.accepting = False
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        while True:
            for fragment_id, state in self.core.fragments.items():
                if state.open and not state.applying:
                    self._close(fragment_id, Close("shard shutting down", 0.0))
            if not self._rounds:
                break
            await asyncio.gather(*list(self._rounds), return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.cancel()
        self._record("stop", rounds=self.counters.rounds, pushes=self.counters.pushes)
        if self.tape is not None:
            self.tape.close()
