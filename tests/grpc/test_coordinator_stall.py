"""A real coordinator whose clock jumps (its host stalled) keeps its learners; one silent
while the coordinator runs still fails a lease later (``diloco.coordinator.core.stall``)."""

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
