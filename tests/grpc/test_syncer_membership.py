"""The shard follows a coordinator's WatchMembership stream (a real server on 127.0.0.1:0):
a learner reported failed no longer holds up a round."""

import asyncio

import grpc

from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from diloco.syncer.config import RoundConfig, SyncerConfig
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, TINY, client_for, run
from tests.seeded import seeded_core
from tests.grpc.test_syncer_service import FakeLearner


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self.watchers = []

    async def WatchMembership(self, request, context):
        self.watchers.append(dict(context.invocation_metadata()))
        while True:
            yield await self.events.get()


def info(learner, state):
    return common_pb2.LearnerInfo(learner_id=learner, state=state)


def test_failed_learner_reported_by_the_coordinator_completes_the_round(tmp_path):
    async def scenario():
        coordinator = FakeCoordinator()
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        cfg = SyncerConfig(rounds=RoundConfig(quorum=2, grace_mode="off"))
        shard = ShardServer(
            TINY, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path, coordinator=f"127.0.0.1:{port}"),
            seeded_core(TINY, cfg),
        )
        address = f"127.0.0.1:{await shard.start()}"
        try:
            await coordinator.events.put(
                coordinator_pb2.MembershipEvent(
                    kind=coordinator_pb2.MEMBERSHIP_EVENT_KIND_SNAPSHOT,
                    learners=[info("L0", common_pb2.LEARNER_STATE_ACTIVE), info("L1", common_pb2.LEARNER_STATE_ACTIVE)],
                )
            )
            core = shard.runtime.core
            for _ in range(500):
                if core.live == {"L0", "L1"}:
                    break
                await asyncio.sleep(0.01)
            assert core.live == {"L0", "L1"}
            learner = FakeLearner.of(shard, "L0")
            async with client_for(address, "L0") as client:
                acked = asyncio.Event()
                push = asyncio.ensure_future(learner.push_with_ack(client, acked))
                await asyncio.wait_for(acked.wait(), 10)
                assert not push.done()  # quorum 2: waiting for L1
                await coordinator.events.put(
                    coordinator_pb2.MembershipEvent(
                        kind=coordinator_pb2.MEMBERSHIP_EVENT_KIND_FAILED,
                        learners=[info("L1", common_pb2.LEARNER_STATE_FAILED)],
                    )
                )
                result = await asyncio.wait_for(push, 10)
            assert result.update.close_reason == "all 1 live learners pushed"
            assert core.failed == {"L1"}
            # The shard presents its own credential on the stream.
            assert coordinator.watchers[0]["x-diloco-learner"] == "S0"
        finally:
            await shard.stop()
            await server.stop(None)

    run(scenario())
