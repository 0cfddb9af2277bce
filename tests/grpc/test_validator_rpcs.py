"""The validator's side door on a real shard (127.0.0.1): Samples hands it each learner's
latest push as it arrived, Score sets what a learner's pushes of a fragment count for from
the next round on, on the tape; only the run's validator (``V``) may call either."""

import grpc
import numpy as np
import pytest
import torch

from diloco import auth
from diloco.codec import decode
from diloco.tape import read_tape
from tests.grpc.conftest import client_for, run, running_shard
from tests.grpc.test_syncer_service import FakeLearner


def _moved(before, after) -> float:
    return float(np.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(after, before))))


def test_the_validator_samples_each_learners_latest_push_as_it_arrived(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, validator=True) as (server, address):
            learners = [FakeLearner.of(server, f"L{i}", seed=i) for i in range(2)]
            sent = {}
            for learner in learners:
                for _ in range(2):  # the second push replaces the first
                    meta, encoded = learner.next_push()
                    async with client_for(address, learner.name) as client:
                        await client.push(meta, encoded)
                    learner.version += 1
                    sent[learner.name] = (meta.seq, encoded)
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                samples = await validator.samples()
            assert [(s.learner_id, s.fragment) for s in samples] == [("L0", 0), ("L1", 0)]
            for sample in samples:
                seq, encoded = sent[sample.learner_id]
                assert sample.seq == seq and sample.version == server.runtime.core.fragments[0].version
                for got, e in zip(sample.tensors, encoded):
                    assert torch.equal(got, decode(e.spec, e.payload))

    run(scenario())


def test_a_distrusted_learner_moves_nothing_and_the_tape_says_so(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, validator=True) as (server, address):
            state = server.runtime.core.fragments[0]
            l0, l1 = FakeLearner.of(server, "L0", seed=0), FakeLearner.of(server, "L1", seed=1)
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                assert await validator.score([("L1", 0, 1, -0.4, 0.0), ("L1", 7, 1, -0.4, 0.0),  # no fragment 7
                                              ("L0", 0, 1, 0.3, 1.0)]) == 2
            before = [p.copy() for p in state.params]
            async with client_for(address, "L1") as client:
                await l1.push(client)
            assert _moved(before, state.params) == 0.0  # its round merged it at weight 0
            async with client_for(address, "L0") as client:
                await l0.push(client)
            assert _moved(before, state.params) > 0
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                assert await validator.score([("L1", 0, 2, None, 1.0)]) == 1  # trusted again: its next push counts
            before = [p.copy() for p in state.params]
            async with client_for(address, "L1") as client:
                await l1.push(client)
            assert _moved(before, state.params) > 0
        records = list(read_tape(tmp_path / "tape-S0.jsonl"))
        trusts = [r for r in records if r["kind"] == "trust"]
        assert [(r["learner"], r["trust"], r["score"]) for r in trusts] == [("L1", 0.0, -0.4), ("L0", 1.0, 0.3),
                                                                             ("L1", 1.0, None)]
        rounds = [r for r in records if r["kind"] == "round"]
        assert rounds[0]["participants"] == ["L1"] and rounds[0]["trust"] == [0.0] and rounds[0]["weights"] == [0.0]
        assert "trust" not in rounds[1] and "trust" not in rounds[2]

    run(scenario())


@pytest.mark.parametrize("caller", ["L0", auth.COORDINATOR_ID, "S0"])
def test_only_the_validator_samples_or_scores(tmp_path, caller):
    async def scenario():
        async with running_shard(tmp_path, validator=True) as (server, address):
            async with client_for(address, caller) as client:
                for call in (client.samples(), client.score([("L0", 0, 1, 0.5, 0.0)])):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "only the run's validator" in refused.value.details()
            assert server.runtime.core.fragments[0].trust == {}

    run(scenario())


def test_a_shard_without_a_validator_keeps_no_samples_and_takes_no_scores(tmp_path):
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            l0 = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                await l0.push(client)
            assert server.runtime.core.fragments[0].samples == {}
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                for call in (validator.samples(), validator.score([("L0", 0, 1, 0.5, 0.0)])):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "without a validator" in refused.value.details()

    run(scenario())


@pytest.mark.parametrize("trust", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_trust_outside_zero_to_one_is_refused_and_changes_nothing(tmp_path, trust):
    async def scenario():
        async with running_shard(tmp_path, validator=True) as (server, address):
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # the good one before it is not taken either
                    await validator.score([("L1", 0, 1, 0.5, 0.5), ("L0", 0, 1, 0.5, trust)])
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert server.runtime.core.fragments[0].trust == {}

    run(scenario())



def test_with_a_validator_a_learner_it_has_not_judged_is_on_probation(tmp_path):
    """From the run's first push, a learner's pushes of a fragment count once one of them
    has been judged (without a validator every push counts: ``test_a_shard_without_a_
    validator_keeps_no_samples_and_takes_no_scores``)."""
    async def scenario():
        async with running_shard(tmp_path, validator=True) as (server, address):
            state = server.runtime.core.fragments[0]
            l0, l2 = FakeLearner.of(server, "L0", seed=0), FakeLearner.of(server, "L2", seed=2)
            before = [p.copy() for p in state.params]
            async with client_for(address, "L2") as client:
                await l2.push(client)
            assert _moved(before, state.params) == 0.0  # the run's first push, not judged yet: nothing
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                await validator.score([("L2", 0, 1, 0.4, 1.0)])
            before = [p.copy() for p in state.params]
            async with client_for(address, "L2") as client:
                await l2.push(client)
            counted = _moved(before, state.params)
            assert counted > 0  # judged: it counts
            before = [p.copy() for p in state.params]
            async with client_for(address, "L0") as client:
                await l0.push(client)
            # Never judged: on probation (what moves is the int4 rounding the last step left over).
            assert _moved(before, state.params) < 0.01 * counted
            async with client_for(address, auth.VALIDATOR_ID) as validator:
                samples = await validator.samples()
                assert {s.learner_id for s in samples} == {"L0", "L2"}  # its push is there to be judged
                await validator.score([("L0", 0, 1, 0.3, 1.0)])
            before = [p.copy() for p in state.params]
            async with client_for(address, "L0") as client:
                await l0.push(client)
            assert _moved(before, state.params) > 0.5 * counted

    run(scenario())
