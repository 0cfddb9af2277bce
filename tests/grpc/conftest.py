import asyncio
import contextlib

import pytest

from diloco import auth
from diloco.clients.syncer import SyncerClient, open_channel
from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.seeded import gpt_run, seeded_core

SECRET = "test-secret"
TINY = gpt_run(width=16, depth=1, heads=2, context=16, fragments=2)


@contextlib.asynccontextmanager
async def running_shard(tmp_path, learners=("L0", "L1", "L2"), run=TINY, shard_id=0, num_shards=1, **rounds):
    merge = rounds.pop("merge", MergeConfig())
    max_push_bytes = rounds.pop("max_push_bytes", 512 * 1024 * 1024)
    idle_s = rounds.pop("stream_idle_timeout_s", 60.0)
    validator = rounds.pop("validator", False)
    bounds = {"robust_multiple": rounds.pop("robust_multiple")} if "robust_multiple" in rounds else {}
    cfg = SyncerConfig(
        shard_id=shard_id, num_shards=num_shards, rounds=RoundConfig(**rounds), merge=merge, max_push_bytes=max_push_bytes,
        stream_idle_timeout_s=idle_s, validator=validator, **bounds,
    )
    server = ShardServer(run, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path, static_learners=tuple(learners)),
                         seeded_core(run, cfg))
    port = await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def client_for(address, learner_id, credential=None):
    channel = open_channel(address)
    try:
        yield SyncerClient(channel, auth.Credential(learner_id, credential or auth.sign(SECRET, learner_id)), timeout_s=20)
    finally:
        await channel.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def tiny_run():
    return TINY
