"""The member counts the coordinator's ``diloco.coordinator.members`` gauge reports
(``CoordinatorRuntime.member_counts``), through a real coordinator's RPCs: every state and
pool a series (zeros too), each learner counted once, in its state, from its join to its
leave, and again after a restart from the state file."""

from diloco.coordinator.core.membership import STATES
from tests.grpc.conftest import run
from tests.grpc.coordinator_fixtures import joined, running_coordinator

POOLS = ("default", "spot")


def counted(server) -> dict:
    """The counts that are not zero, after checking that every (state, pool) is there."""
    counts = server.runtime.member_counts
    assert counts.keys() >= {(s, p) for s in STATES for p in POOLS}, counts
    return {key: n for key, n in counts.items() if n}


def test_members_are_counted_by_state_and_pool_from_join_to_leave(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, pools=POOLS) as server:
            assert counted(server) == {}
            first, second = await joined(server.address), await joined(server.address, pool="spot")
            assert counted(server) == {("joining", "default"): 1, ("joining", "spot"): 1}
            await first.heartbeat(tokens=64, inner_steps=1)
            assert counted(server) == {("active", "default"): 1, ("joining", "spot"): 1}
            await first.leave("done")
            await second.leave("failed to start", failed=True)
            assert counted(server) == {("left", "default"): 1, ("failed", "spot"): 1}
            await first.close()
            await second.close()
        async with running_coordinator(tmp_path, pools=POOLS) as server:  # from its state file
            assert counted(server) == {("left", "default"): 1, ("failed", "spot"): 1}

    run(scenario())
