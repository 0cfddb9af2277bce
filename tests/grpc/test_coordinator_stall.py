"""A real coordinator whose clock jumps (its host stalled) keeps its learners; one silent
while the coordinator runs still fails a lease later (``diloco.coordinator.core.stall``).
One that hears no learner at all while its loop runs (it is the one cut off) holds their
failures, and says so on its status page's events."""

import asyncio

from diloco.coordinator.core.membership import ACTIVE, FAILED, JOINING, HeartbeatStats
from diloco.coordinator.core.stall import STALL_TICK_S
from tests.grpc.coordinator_fixtures import running_coordinator
from tests.unit.test_coordinator_membership import OPEN


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_coordinator_that_did_not_run_keeps_its_learners_and_fails_a_silent_one_later(tmp_path):
    """The runtime's own look at the clock (a tick of its loop, a request) sees the gap:
    after a 20 s stall the learner heartbeats on, with a lease of 5 s; silent while the
    coordinator ticks, it fails one lease later."""
    clock = Clock(1000.0)

    async def main():
        async with running_coordinator(tmp_path, clock=clock, lease_s=5.0) as server:
            runtime = server.runtime
            learner = runtime.join("", "127.0.0.1:1", "", runtime.run.plan_hash, credential=OPEN)
            assert learner.state == JOINING
            runtime.heartbeat(learner.id, HeartbeatStats(tokens=64, inner_steps=1))
            clock.t += 20.0  # the whole host stopped for 20 s
            runtime.heartbeat(learner.id, HeartbeatStats(tokens=128, inner_steps=2))
            assert runtime.membership.learner(learner.id).state == ACTIVE
            assert runtime.stall.total_s == 20.0 - STALL_TICK_S
            assert any(e["kind"] == "stall" and "did not run for 19.5 s" in e["text"] for e in runtime.recent.events)
            for _ in range(21):  # then silence while the coordinator runs: ticks of its loop, 0.3 s apart
                clock.t += 0.3
                runtime._watch()
            (listed,) = [m for m in runtime.list_learners(include_gone=True) if m.id == learner.id]
            assert listed.state == FAILED and listed.reason.startswith("lease expired: no heartbeat for 6.3 s")

    asyncio.run(main())


def test_a_coordinator_that_hears_no_learner_holds_their_failures_until_one_is_heard(tmp_path):
    """Two learners, a 5 s lease: 8 s in which the loop ticks and nobody is heard (the
    coordinator's network is cut) fail neither; a heartbeat after it moves both leases on
    by the silence; the other learner, silent since, fails one lease after it was last
    heard of."""
    clock = Clock(1000.0)

    async def main():
        async with running_coordinator(tmp_path, clock=clock, lease_s=5.0) as server:
            runtime = server.runtime
            a = runtime.join("", "127.0.0.1:1", "", runtime.run.plan_hash, credential=OPEN)
            b = runtime.join("", "127.0.0.1:2", "", runtime.run.plan_hash, credential=OPEN)
            runtime.heartbeat(a.id, HeartbeatStats(tokens=64, inner_steps=1))
            runtime.heartbeat(b.id, HeartbeatStats(tokens=64, inner_steps=1))
            for _ in range(27):  # 8.1 s of the loop's ticks and timers, 0.3 s apart, and not a heartbeat
                clock.t += 0.3
                runtime._watch()
                runtime._tick()
            states = {m.id: m.state for m in runtime.list_learners(include_gone=True)}
            assert states == {a.id: ACTIVE, b.id: ACTIVE}
            assert [e["text"] for e in runtime.recent.events if e["kind"] == "unheard"] == [
                "no learner heard for 5.1 s: this coordinator may be the one cut off, so no lease fails before 30 s "
                "of silence"]
            runtime.heartbeat(a.id, HeartbeatStats(tokens=128, inner_steps=2))
            assert any(e["kind"] == "heard" and "after 8.1 s of silence" in e["text"] for e in runtime.recent.events)
            for _ in range(16):  # b stays silent: 4.8 s more, its lease (moved on by 8.1 s) still runs
                clock.t += 0.3
                runtime._watch()
                runtime.heartbeat(a.id, HeartbeatStats(tokens=128, inner_steps=2))
            assert runtime.membership.learner(b.id).state == ACTIVE
            for _ in range(2):
                clock.t += 0.3
                runtime._watch()
                runtime.heartbeat(a.id, HeartbeatStats(tokens=128, inner_steps=2))
            (listed,) = [m for m in runtime.list_learners(include_gone=True) if m.id == b.id]
            assert listed.state == FAILED and listed.reason.startswith("lease expired")
            assert runtime.membership.learner(a.id).state == ACTIVE

    asyncio.run(main())
