"""A shard never leaves a fragment busy for good: a round that fails after its merge
still releases the fragment, and a read that waits too long for a round is answered
with DEADLINE_EXCEEDED, never a hang (a learner's bootstrap and the final export read
whole fragments). A learner asked to stop while it bootstraps stops waiting."""

import asyncio
import threading

import pytest

from diloco import auth
from diloco.errors import Cancelled, DeadlineExceeded
from diloco.learner.streamer import Streamer
from tests.grpc.conftest import client_for, run, running_shard
from tests.grpc.test_syncer_service import FakeLearner


def test_a_round_that_fails_while_being_applied_releases_its_fragment(tmp_path, monkeypatch):
    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            core = server.runtime.core
            real = core.finish_round
            calls = {"n": 0}

            def broken(job, update, now):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("boom after the merge")
                return real(job, update, now)

            monkeypatch.setattr(core, "finish_round", broken)
            learner = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                failed = await learner.push(client)
                assert "internal error while applying" in failed.update.close_reason
                assert not core.fragments[0].applying
                assert (await client.bootstrap([0]))[0].version == 1  # readable at once, not after a timeout
                assert (await learner.push(client)).update.version == 2
    run(scenario())


def test_a_read_that_waits_too_long_for_a_round_gets_deadline_exceeded(tmp_path, monkeypatch):
    from diloco.syncer import runtime as syncer_runtime

    release = threading.Event()
    real = syncer_runtime.compute_round

    def stuck(job, cfg):
        release.wait(30)
        return real(job, cfg)

    monkeypatch.setattr(syncer_runtime, "compute_round", stuck)

    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            learner = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                push = asyncio.ensure_future(learner.push(client))
                while not server.runtime.core.fragments[0].applying:
                    await asyncio.sleep(0.01)
                with pytest.raises(DeadlineExceeded, match="busy with a round"):
                    await server.runtime.full(0, timeout_s=0.3)
                release.set()
                assert (await push).update.version == 1
                assert (await server.runtime.full(0, timeout_s=5)).version == 1
    try:
        run(scenario())
    finally:
        release.set()


def test_a_stop_ends_a_learner_s_blocking_wait_at_once():
    streamer = Streamer({}, auth.Credential("L0", "credential"), timeout_s=5, max_inflight=1)
    try:
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        with pytest.raises(Cancelled, match="stopped while waiting for the test's forever"):
            streamer._blocking(asyncio.sleep(3600), "the test's forever", timeout_s=60, stop=stop)
        with pytest.raises(DeadlineExceeded, match="took more than"):
            streamer._blocking(asyncio.sleep(3600), "the test's forever", timeout_s=0.3, stop=threading.Event())
    finally:
        streamer.close()
