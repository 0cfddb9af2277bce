"""Learners against real in-process shards on 127.0.0.1:0."""

import asyncio
import contextlib
import dataclasses


import numpy as np
import pytest

from diloco import auth
from diloco.codec import decode
from diloco.learner.api import Learner
from diloco.learner.config import LearnerConfig
from diloco.learner.membership import Membership
from diloco.learner.runner import run_task
from diloco.tape import read_tape
from diloco.syncer import snapshot
from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig
from diloco.syncer.runtime import initial_name
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, run
from tests.seeded import gpt_run, model_plan
from tests.checks import assert_mirrored, assert_same_tensors

RUN = gpt_run(width=32, depth=1, heads=2, context=32, fragments=4, sync_every_steps=16, overlap_steps=2,
              task_options={"batch_size": "8", "eval_batches": "2"})
CFG = LearnerConfig(steps=24, lr=3e-3, warmup_steps=4, eval_every_steps=8)


@contextlib.asynccontextmanager
async def shards(tmp_path, count, learners, merge=MergeConfig(), **rounds):
    servers = []
    for m in range(count):
        cfg = SyncerConfig(shard_id=m, num_shards=count, rounds=RoundConfig(**rounds), merge=merge)
        server = ShardServer(RUN, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path, static_learners=learners))
        servers.append((server, f"127.0.0.1:{await server.start()}"))
    try:
        yield servers
    finally:
        for server, _ in servers:
            await server.stop()


def member(name, addresses, run=RUN) -> Membership:
    return Membership(name, auth.Credential(name, secret=SECRET), run, dict(enumerate(addresses)), 0.0)


def train(name, addresses, run=RUN, on_learner=lambda learner: None, **overrides) -> Learner:
    """Build the run's task for learner ``name`` and train it on the shards (blocking)."""
    return run_task(member(name, addresses, run), dataclasses.replace(CFG, **overrides), on_learner=on_learner)


def assert_holds(learner, state, fragment_id):
    """The learner's anchor of the fragment: the shard's mirror of it (condensed replies;
    up to the drift the shard accounts), which stays within int4 rounding of the global
    values; or, with chain replies, the shard's values once the chain since the anchor's version is added
    (the learner's final push may have moved the shard on without a reply)."""
    anchor, version = learner.anchors()[fragment_id], learner.book.fragments[fragment_id].base_version
    mirror = state.mirrors.get(learner.learner_id)
    if mirror is not None:
        assert mirror.version == version
        assert_mirrored(anchor, mirror)
        if version == state.version:
            for m, p in zip(mirror.believed(), state.params):
                assert np.abs(m - p.reshape(-1)).max() <= 0.05 * max(np.abs(p).max(), 1e-3), "the mirror strayed from the values"
        return anchor
    chain = [decode(t.spec, t.payload) for s in state.chain if s.version > version for t in s.tensors]
    assert len(chain) == (state.version - version) * len(anchor)
    values = list(anchor)
    for i, update in enumerate(chain):
        values[i % len(anchor)] = values[i % len(anchor)] + update
    assert_same_tensors(values, state.params)
    return anchor


@pytest.mark.parametrize("downlink", ["chain", "condensed"])
def test_anchors_are_what_the_shards_hold_for_them(tmp_path, downlink):
    async def scenario():
        # int4 replies: assert_holds bounds the mirror's distance from the values by int4's step.
        async with shards(tmp_path, 2, ("L0",), merge=MergeConfig(downlink=downlink, reply_codec="int4")) as servers:
            # Three sends of every fragment; the last inner step sends fragment 3.
            h = RUN.sync_every_steps
            learner = await asyncio.to_thread(train, "L0", [a for _, a in servers], steps=2 * h + (3 * h) // 4 + 1)
            summary = learner.summary
            # The shards started empty and took this learner's values as version 0.
            assert sorted(summary.initialized_fragments) == [0, 1, 2, 3]
            # 12 pushes and replies while training; leaving, one final push (no reply) of
            # each fragment trained since its last reply: 0, 1 and 2, not 3.
            assert summary.pushes_sent == summary.pushes_acked == 15 and summary.pushes_dropped == 0
            assert summary.replies_applied == 12
            for server, _ in servers:
                for fragment_id, state in server.runtime.core.fragments.items():
                    assert state.version == (4 if fragment_id < 3 else 3)
                    assert learner.book.fragments[fragment_id].base_version == 3
                    assert (fragment_id, "L0" in state.mirrors) == (fragment_id, downlink == "condensed")
                    assert_holds(learner, state, fragment_id)
            # Fragment 3's reply came after the last inner step: nothing to rebase (and with
            # alpha = 0 nothing to mix), so the model holds the reply's values, bit for bit.
            owner = servers[learner.plan.fragments[3].owner(2)][0].runtime.core.fragments[3]
            live = learner.plan.gather(3, learner.tensors)
            assert_same_tensors(live, assert_holds(learner, owner, 3))
            assert summary.blocked_s < 0.5 * summary.wall_s

    run(scenario())


def test_two_learners_two_shards_eval_loss_falls(tmp_path):
    async def scenario():
        async with shards(tmp_path, 2, ("L0", "L1"), quorum=1, grace_mode="fixed", grace_fixed_s=0.05) as servers:
            addresses = [a for _, a in servers]
            # Different seeds: the learners' own initial models differ, and only one of them
            # initialises each fragment; both then train from the shards' values.
            runs = [dataclasses.replace(RUN, seed=i) for i in range(2)]
            learners = await asyncio.gather(*(asyncio.to_thread(train, f"L{i}", addresses, runs[i], steps=96) for i in range(2)))
            summaries = [l.summary for l in learners]
            assert sorted(summaries[0].initialized_fragments + summaries[1].initialized_fragments) == [0, 1, 2, 3]
            for s in summaries:
                assert s.pushes_acked > 0 and s.replies_applied > 0
                assert s.eval_unit == "bits/byte"
                assert s.eval_loss_final < s.eval_loss_start - 0.5, (s.eval_loss_start, s.eval_loss_final)
            rounds = sum(server.runtime.counters.rounds for server, _ in servers)
            assert rounds >= 10

    run(scenario())


def test_shard_outage_drops_pushes_keeps_training_and_resyncs(tmp_path):
    async def scenario():
        cfg = SyncerConfig(rounds=RoundConfig())
        server_cfg = ShardServerConfig(secret=SECRET, data_dir=tmp_path, static_learners=("L0",))
        first = ShardServer(RUN, cfg, server_cfg)
        port = await first.start()
        # A slowed learner, so that the outage falls in the middle of its training.
        created = []
        training = asyncio.ensure_future(asyncio.to_thread(
            train, "L0", [f"127.0.0.1:{port}"], on_learner=created.append, steps=600, step_delay_s=0.02, push_timeout_s=5))
        await wait_until(lambda: created and created[0].book.applied >= 4)
        learner = created[0]
        await first.stop()
        await wait_until(lambda: learner.streamer.stats.pushes_dropped >= 2)
        # Restarted without its state: it holds no model, and the learner gives it its
        # anchors (the global values it last received), not the initial model.
        second = ShardServer(RUN, cfg, dataclasses.replace(server_cfg, port=port))
        await second.start()
        try:
            await wait_until(lambda: learner.streamer.stats.resyncs >= 1)
            summary = (await training).summary
        finally:
            await second.stop()
        assert summary.inner_steps == 600  # training never stopped
        assert summary.pushes_dropped >= 2 and summary.pushes_acked > 4
        # After the re-sync the learner follows the new shard again, bit for bit.
        _, plan, seed = model_plan(RUN)
        for fragment_id, state in second.runtime.core.fragments.items():
            assert state.version >= 1
            assert_holds(learner, state, fragment_id)
            restarted_from = snapshot.loads(tmp_path / initial_name(fragment_id))["pieces"]
            assert not all(np.array_equal(a, b.numpy()) for a, b in zip(restarted_from, plan.gather(fragment_id, seed)))
        # The restarted shard knew from its data directory that it had held the model: it
        # took the learner's anchors, at their versions, and rounds went on from there (its
        # stop flushed and closed the tape).
        lives = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] in ("recovering", "initialize")]
        recovered = lives[lives.index(next(r for r in lives if r["kind"] == "recovering")) + 1:]
        assert len(recovered) == 4 and all(r["source"].startswith("anchor at version") and r["version"] >= 1 for r in recovered)

    run(scenario())


async def wait_until(predicate, timeout_s=60):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
