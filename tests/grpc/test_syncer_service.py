"""A real shard on 127.0.0.1:0 and concurrent fake learners pushing real int4 payloads."""

import asyncio
import dataclasses
import math
import re

import grpc
import pytest
import torch

from diloco.clock import VectorClock
from diloco.codec import EncodedTensor, TensorSpec, checksum, encode, values_digest
from diloco.tape import read_tape
from diloco.v1 import common_pb2, syncer_pb2
from diloco.v1.syncer_pb2_grpc import SyncerStub
from diloco.clients.syncer import write_all
from diloco.syncer.config import MergeConfig
from diloco.convert import push_meta_to_proto
from diloco.wire import PushMeta
from tests.grpc.conftest import client_for, run, running_shard
from tests.checks import assert_mirrored, assert_same_tensors


class FakeLearner:
    def __init__(self, name, plan, params, fragment=0, seed=0):
        self.name, self.fragment = name, fragment
        self.pieces = plan.fragments[fragment].pieces
        # The shard's parameters are numpy arrays; a learner's anchor is torch tensors.
        self.anchor = [torch.from_numpy(t.copy()) for t in params]
        self.version = 0
        self.clock = VectorClock()
        self.g = torch.Generator().manual_seed(seed)

    @classmethod
    def of(cls, server, name, fragment=0, seed=0):
        core = server.runtime.core
        return cls(name, core.plan, core.fragments[fragment].params, fragment, seed)

    def next_push(self, tokens=128, steps=4, encoding="int4", deltas=None, step_time_s=0.05, kept=0):
        deltas = deltas or [torch.randn(p.shape, generator=self.g) * 0.01 for p in self.pieces]
        encoded = [encode(p.name, d, encoding=encoding, kept=kept) for p, d in zip(self.pieces, deltas)]
        self.clock = self.clock.tick(self.name)
        meta = PushMeta(self.name, self.fragment, self.version, tokens, steps, step_time_s, self.clock,
                        tuple(e.spec for e in encoded))
        return meta, encoded

    async def push(self, client, **kw):
        meta, encoded = self.next_push(**kw)
        result = await client.push(meta, encoded)
        self.anchor = result.update.apply_to(self.anchor)
        self.version = result.update.version
        return result

    async def push_with_ack(self, client, acked: asyncio.Event):
        meta, encoded = self.next_push()
        result = await client.push(meta, encoded, on_ack=lambda *_: acked.set())
        self.anchor = result.update.apply_to(self.anchor)
        self.version = result.update.version
        return result


def test_concurrent_pushes_close_a_round_and_downlink_is_bit_identical(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, quorum=2, grace_mode="fixed", grace_fixed_s=5.0, merge=MergeConfig(downlink="chain")) as (server, address):
            learners = [FakeLearner.of(server, f"L{i}", seed=i) for i in range(3)]
            async with client_for(address, "L0") as client:  # no round yet: no age
                assert not (await client.status()).fragments[0].HasField("last_round_age_s")
            for round_index in range(3):
                async def one(learner):
                    async with client_for(address, learner.name) as client:
                        return await learner.push(client)
                results = await asyncio.gather(*(one(l) for l in learners))
                assert {r.outcome for r in results} == {"accepted"}
                assert {r.update.version for r in results} == {round_index + 1}
                # Every live learner pushed: the round closed early, without the 5 s grace.
                assert results[0].update.close_reason == "all 3 live learners pushed"
                assert results[0].update.participants == 3
            shard_params = server.runtime.core.fragments[0].params
            for learner in learners:
                assert_same_tensors(learner.anchor, shard_params)
            async with client_for(address, "L0") as client:
                status = (await client.status()).fragments[0]  # what the status page shows of a round
                assert (status.version, status.last_round_participants) == (3, 3)
                assert 0 <= status.last_round_age_s < 5
                await client.bootstrap()
            sent = server.runtime.counters.bytes_sent
        tape = list(read_tape(tmp_path / "tape-S0.jsonl"))
        # Every reply and the bootstrap on the tape, with the bytes the shard counted sending.
        replies = [r for r in tape if r["kind"] == "sent"]
        assert [r["what"] for r in replies].count("reply") == 9 and replies[-1]["what"] == "bootstrap"
        assert sum(r["bytes"] for r in replies) == sent > 0
        assert {r["learner"] for r in replies} == {"L0", "L1", "L2"}
        rounds = [r for r in tape if r["kind"] == "round"]
        assert [r["version"] for r in rounds] == [1, 2, 3]
        assert all(sorted(r["participants"]) == ["L0", "L1", "L2"] for r in rounds)
        assert all(abs(sum(r["weights"]) - 1) < 1e-5 for r in rounds)

    run(scenario())


def test_every_round_a_learner_saw_is_on_disk_while_the_shard_still_runs(tmp_path):
    """A push's reply comes only once the round's records reached the operating system: a
    shard killed with SIGKILL right after answering loses none of them. Read here from
    the file while the shard runs (its writer not flushed by the test), as a restarted
    shard or replay would find it."""
    async def scenario():
        async with running_shard(tmp_path, quorum=1) as (server, address):
            learner = FakeLearner.of(server, "L0", seed=0)
            for version in (1, 2, 3):
                async with client_for(address, "L0") as client:
                    result = await learner.push(client)
                assert result.update.version == version
                on_disk = list(read_tape(tmp_path / "tape-S0.jsonl"))
                assert [r["version"] for r in on_disk if r["kind"] == "round"] == list(range(1, version + 1))
            assert server.runtime.tape.records < 64  # one fsync batch: only the write-through put them there

    run(scenario())


def test_a_rounds_update_is_framed_once_for_every_waiter_and_dropped_with_the_chain(tmp_path, monkeypatch):
    from diloco.syncer import service as syncer_service

    framed = []

    real_frame = syncer_service.frame

    def counting_frame(payloads, **kw):
        framed.append(1)
        return real_frame(payloads, **kw)

    monkeypatch.setattr(syncer_service, "frame", counting_frame)

    async def scenario():
        names = tuple(f"L{i}" for i in range(4))
        async with running_shard(tmp_path, learners=names, quorum=4, merge=MergeConfig(update_chain_length=2, downlink="chain")) as (
            server, address
        ):
            learners = [FakeLearner.of(server, name, seed=i) for i, name in enumerate(names)]
            for _ in range(3):
                async def one(learner):
                    async with client_for(address, learner.name) as client:
                        return await learner.push(client)
                await asyncio.gather(*(one(l) for l in learners))
            servicer_cache = server.servicer._framing
            # Four learners got each round's update; it was framed once per round, and only
            # the segments still in the chain of 2 keep their frames.
            assert len(framed) == 3
            assert len(servicer_cache) == 2

    run(scenario())


def test_quorum_then_grace_then_straggler_joins_next_round(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, quorum=2, grace_mode="fixed", grace_fixed_s=0.3, merge=MergeConfig(downlink="chain")) as (
            server, address
        ):
            a, b, c = (FakeLearner.of(server, f"L{i}", seed=i) for i in range(3))
            async with client_for(address, "L0") as ca, client_for(address, "L1") as cb:
                loop = asyncio.get_running_loop()
                started = loop.time()
                ra, rb = await asyncio.gather(a.push(ca), b.push(cb))
                waited = loop.time() - started
            assert ra.update.version == rb.update.version == 1
            assert ra.update.participants == 2
            assert "quorum 2/3 + grace 0.30 s expired" in ra.update.close_reason
            assert waited >= 0.3
            async with client_for(address, "L2") as cc, client_for(address, "L0") as ca:
                # Round 2 needs a quorum of 2 again: the straggler and L0's next push.
                rc, ra2 = await asyncio.gather(c.push(cc), a.push(ca))
            assert ra2.update.version == 2 and [s.version for s in ra2.update.segments] == [2]
            # The straggler's delta was taken against version 0; it joins round 2 and gets the chain 1..2.
            assert rc.update.base_version == 0 and rc.update.version == 2
            assert [s.version for s in rc.update.segments] == [1, 2]

    run(scenario())


def test_auto_grace_widens_for_slow_steps_and_narrows_again(tmp_path):
    """grace auto at run time: the window is gamma * (tau * step_time - (quorum + sync time)),
    from the step times the pushes report (EMA factor 1: the newest one)."""
    def grace_of(reason):
        match = re.search(r"grace ([0-9.]+) s expired", reason)
        return float(match.group(1)) if match else 0.0

    async def scenario():
        async with running_shard(tmp_path, learners=("L0", "L1"), quorum=1, grace_mode="auto", grace_gamma=0.5,
                                 overlap_steps=2, ema_factor=1.0) as (server, address):
            fast, slow = FakeLearner.of(server, "L0", seed=0), FakeLearner.of(server, "L1", seed=1)
            loop = asyncio.get_running_loop()
            reasons, waits = [], []
            async with client_for(address, "L0") as cf, client_for(address, "L1") as cs:
                for learner, client, step_time_s in ((fast, cf, 0.001), (slow, cs, 0.6), (slow, cs, 0.6),
                                                     (fast, cf, 0.001)):
                    started = loop.time()
                    result = await learner.push(client, step_time_s=step_time_s)
                    waits.append(loop.time() - started)
                    reasons.append(result.update.close_reason)
            return reasons, waits

    reasons, waits = run(scenario())
    graces = [grace_of(r) for r in reasons]
    # Fast steps: next to no slack, the round closes at quorum. A learner that steps in 0.6 s
    # leaves 1.2 s of slack: about 0.6 s of it is granted, and the push really waits it.
    assert graces[0] < 0.01 and waits[0] < 0.45, (reasons, waits)
    for grace, wait in zip(graces[1:3], waits[1:3]):
        assert 0.45 <= grace <= 0.6 and wait >= grace, (reasons, waits)
    # Back to fast steps: the window narrows to nothing again.
    assert graces[3] < 0.01 and waits[3] < 0.45, (reasons, waits)


def test_duplicate_push_is_not_applied_twice(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            learner = FakeLearner.of(server, "L0")
            meta, encoded = learner.next_push()
            async with client_for(address, "L0") as client:
                first = await client.push(meta, encoded)
                again = await client.push(meta, encoded)
            assert first.outcome == "accepted" and again.outcome == "duplicate"
            assert server.runtime.core.fragments[0].version == 1
            assert server.runtime.counters.pushes == 1 and server.runtime.counters.duplicates == 1
            assert again.update.version == 1

    run(scenario())


def test_condensed_replies_bring_a_learner_that_missed_rounds_to_the_global_values_in_one_int4_update(tmp_path):
    """Condensed downlink (the default): however many rounds a learner missed, its reply
    is one int4 update, the size of a push. It lands the learner on the shard's mirror of
    its anchor (up to the drift the shard accounts), which stays within one int4 rounding
    of the global values: what one reply rounds away, the next one sends (error feedback).
    (int4 replies here; the sparse codec's replies: tests/unit/test_codec_sparse.py.)"""
    async def scenario():
        # Bounds off: the fake learners push random directions, which nothing judges, and
        # pushes that close together would share the fragment's fallback (syncer.core.bounds).
        async with running_shard(tmp_path, quorum=1, grace_mode="off", merge=MergeConfig(reply_codec="int4"),
                                 robust_multiple=math.inf) as (server, address):
            core = server.runtime.core
            state = core.fragments[0]
            learners = [FakeLearner.of(server, f"L{i}", seed=i) for i in range(3)]
            for learner in learners:  # each starts from a bootstrap, which the shard mirrors
                async with client_for(address, learner.name) as client:
                    [update] = [u for u in await client.bootstrap([0])]
                learner.anchor = update.apply_to(learner.anchor)
            assert sorted(state.mirrors) == ["L0", "L1", "L2"]
            straggler, others = learners[2], learners[:2]
            for round_index in range(4):
                for learner in others:  # two rounds per pass: the straggler misses both
                    async with client_for(address, learner.name) as client:
                        await learner.push(client)
                async with client_for(address, straggler.name) as client:
                    result = await straggler.push(client)
                assert result.update.version - result.update.base_version == 3
                assert [s.kind for s in result.update.segments] == ["delta"]
                assert straggler.version == state.version
                mirror = state.mirrors["L2"]
                assert mirror.version == state.version
                assert_mirrored(straggler.anchor, mirror)
                for mine, theirs in zip(straggler.anchor, state.params):
                    error = (mine - torch.from_numpy(theirs)).abs().max().item()
                    assert 0 < error < 1e-2  # int4 rounding of the last reply, not a drift
            # One int4 update per reply, about a push's size (both framed int4 payloads of the
            # fragment), not one per round it missed: a chain would be about 3 pushes.
            tape = read_tape_now(server)
            sent = [r["bytes"] for r in tape if r["kind"] == "sent" and r["learner"] == "L2" and r["what"] == "reply"]
            pushes = [r["bytes"] for r in tape if r["kind"] == "push" and r["learner"] == "L2"]
            assert len(sent) == len(pushes) == 4
            assert all(0.8 * p < s < 1.25 * p for s, p in zip(sent, pushes)), (sent, pushes)

    run(scenario())


def read_tape_now(server):
    server.runtime.tape.flush()
    return list(read_tape(server.runtime.tape.path))


def test_a_learner_the_shard_does_not_mirror_gets_full_values_then_condensed_replies(tmp_path):
    """A push whose base the shard holds no mirror of (a learner that never bootstrapped
    from this shard life, or did not apply its last reply) is answered with full values,
    which the shard mirrors; the next reply is condensed again."""
    async def scenario():
        async with running_shard(tmp_path, quorum=1, grace_mode="off") as (server, address):
            learner = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                first = await learner.push(client)
                second = await learner.push(client)
                learner.version = 0  # as if it never applied the second reply
                third = await learner.push(client)
            assert [s.kind for s in first.update.segments] == ["full"]
            assert [s.kind for s in second.update.segments] == ["delta"]
            assert [s.kind for s in third.update.segments] == ["full"] and third.update.base_version == 0
            assert_mirrored(learner.anchor, server.runtime.core.fragments[0].mirrors["L0"])
            assert_same_tensors(learner.anchor, server.runtime.core.fragments[0].params)

    run(scenario())


def test_bootstrap_streams_full_fragments(tmp_path):
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as client:
                updates = await client.bootstrap()
            core = server.runtime.core
            assert sorted(u.fragment for u in updates) == sorted(core.fragments)
            for u in updates:
                assert [s.kind for s in u.segments] == ["full"]
                shard_params = core.fragments[u.fragment].params
                assert_same_tensors(u.segments[0].tensors, shard_params)

    run(scenario())


def test_bootstrap_sends_no_values_the_learner_already_holds(tmp_path):
    """A learner offering the digest of its own values (the run's seed) gets the version
    alone for a fragment the shard holds bit for bit, and full values otherwise: a value
    one ulp off, or the same values after a round moved the fragment on."""
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            core = server.runtime.core
            owned = sorted(core.fragments)

            def digest_of(fragment, nudge=False):
                values = [torch.from_numpy(t.copy()) for t in core.fragments[fragment].params]
                if nudge:
                    values[0].view(-1)[0] = torch.nextafter(values[0].view(-1)[0], torch.tensor(1e9))
                pieces = core.plan.fragments[fragment].pieces
                return values_digest([encode(p.name, v, encoding="fp32") for p, v in zip(pieces, values)])

            seed = {owned[0]: digest_of(owned[0]), owned[1]: digest_of(owned[1], nudge=True)}
            async with client_for(address, "L0") as client:
                updates = {u.fragment: u for u in await client.bootstrap(have=seed)}
            assert updates[owned[0]].segments == [] and updates[owned[0]].wire_bytes == 0
            assert updates[owned[0]].base_version == updates[owned[0]].version == 0
            assert [s.kind for s in updates[owned[1]].segments] == ["full"]
            assert_same_tensors(updates[owned[1]].segments[0].tensors, core.fragments[owned[1]].params)
            learner = FakeLearner.of(server, "L0", fragment=owned[0])
            async with client_for(address, "L0") as client:
                await learner.push(client)
                updates = {u.fragment: u for u in await client.bootstrap([owned[0]], have=seed)}
            assert [s.kind for s in updates[owned[0]].segments] == ["full"] and updates[owned[0]].version == 1
        sent = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] == "sent" and r["what"] == "bootstrap"]
        assert [(r["fragment"], r["bytes"] == 0) for r in sent] == [(owned[0], True), (owned[1], False), (owned[0], False)]

    run(scenario())


def test_shutdown_closes_open_rounds_and_answers_waiting_pushes(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, quorum=2, grace_mode="off") as (server, address):
            learner = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                task = asyncio.ensure_future(learner.push(client))
                for _ in range(200):
                    if server.runtime.core.fragments[0].open:
                        break
                    await asyncio.sleep(0.01)
                assert not task.done()
                await server.stop()
                result = await task
            assert result.update.close_reason == "shard shutting down"
            assert result.update.version == 1
        kinds = [r["kind"] for r in read_tape(tmp_path / "tape-S0.jsonl")]
        assert kinds[0] == "start" and kinds[-1] == "stop" and "round" in kinds

    run(scenario())


# --- bad input: a specific status, a useful message, no state change ---------------------


async def raw_push(address, learner_id, messages, credential=True):
    from diloco import auth
    from tests.grpc.conftest import SECRET

    metadata = [("x-diloco-learner", learner_id)]
    if credential is True:
        metadata.append(("x-diloco-credential", auth.sign(SECRET, learner_id)))
    elif credential:
        metadata.append(("x-diloco-credential", credential))
    async with grpc.aio.insecure_channel(address) as channel:
        call = SyncerStub(channel).PushFragment(metadata=metadata, timeout=10)
        await write_all(call, messages)
        return [r async for r in call]


def header_msg(meta):
    return syncer_pb2.PushRequest(header=push_meta_to_proto(meta))


def chunk_msgs(encoded):
    from diloco.codec import frame

    return [syncer_pb2.PushRequest(chunk=common_pb2.Chunk(data=c)) for c in frame([e.payload for e in encoded])]


def corrupt(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


def _bad_cases(learner):
    meta, encoded = learner.next_push()
    good = [header_msg(meta), *chunk_msgs(encoded)]
    # encode() refuses NaN, so build the fp32 payload by hand, with valid checksums.
    nan_encoded = []
    for p in learner.pieces:
        payload = torch.full(p.shape, float("nan")).numpy().tobytes()
        spec = TensorSpec(p.name, p.shape, "float32", "fp32", 0, "", len(payload), checksum(payload))
        nan_encoded.append(EncodedTensor(spec, payload))
    learner.clock = learner.clock.tick(learner.name)
    nan_meta = dataclasses.replace(meta, clock=learner.clock, specs=tuple(e.spec for e in nan_encoded))
    bad_checksum = [dataclasses.replace(e.spec, checksum=(e.spec.checksum + 1) % 2**32) for e in encoded]

    def sparse_push(damage):
        """A sparse push whose first block's indices are damaged, checksums made to match."""
        learner.clock = learner.clock.tick(learner.name)
        sparse_meta, sparse = learner.next_push(encoding="sparse", kept=4)
        payload = bytearray(sparse[0].payload)
        payload[1] = 200 if damage == "outside" else payload[0]
        tensors = [EncodedTensor(dataclasses.replace(sparse[0].spec, checksum=checksum(bytes(payload))), bytes(payload)),
                   *sparse[1:]]
        return [header_msg(dataclasses.replace(sparse_meta, specs=tuple(t.spec for t in tensors))), *chunk_msgs(tensors)]

    return {
        "unknown fragment": ([header_msg(dataclasses.replace(meta, fragment=9)), *good[1:]], "INVALID_ARGUMENT", "not in the plan"),
        "shape mismatch": (
            [header_msg(dataclasses.replace(meta, specs=(dataclasses.replace(meta.specs[0], shape=(1, 2)), *meta.specs[1:]))), *good[1:]],
            "INVALID_ARGUMENT", "shape",
        ),
        "block size": (
            [header_msg(dataclasses.replace(meta, specs=tuple(dataclasses.replace(s, block_size=32) for s in meta.specs))), *good[1:]],
            "INVALID_ARGUMENT", "block size",
        ),
        "corrupt chunk": ([good[0], syncer_pb2.PushRequest(chunk=common_pb2.Chunk(data=corrupt(good[1].chunk.data))), *good[2:]], "INVALID_ARGUMENT", ""),
        "truncated stream": (good[:1], "INVALID_ARGUMENT", ""),
        "checksum": ([header_msg(dataclasses.replace(meta, specs=tuple(bad_checksum))), *good[1:]], "INVALID_ARGUMENT", "checksum"),
        "nan delta": ([header_msg(nan_meta), *chunk_msgs(nan_encoded)], "INVALID_ARGUMENT", "is nan"),
        "future base version": ([header_msg(dataclasses.replace(meta, base_version=5)), *good[1:]], "FAILED_PRECONDITION", "future"),
        "absurd tokens": ([header_msg(dataclasses.replace(meta, tokens=10**15)), *good[1:]], "INVALID_ARGUMENT", "absurd"),
        "chunk first": (good[1:], "INVALID_ARGUMENT", "header"),
        "empty stream": ([], "INVALID_ARGUMENT", "empty push stream"),
        "learner mismatch": ([header_msg(dataclasses.replace(meta, learner_id="L1")), *good[1:]], "PERMISSION_DENIED", "claims"),
        "sparse index outside its block": (sparse_push("outside"), "INVALID_ARGUMENT", "stay below"),
        "sparse index repeated": (sparse_push("repeat"), "INVALID_ARGUMENT", "ascend strictly"),
    }


@pytest.mark.parametrize(
    "case",
    ["unknown fragment", "shape mismatch", "block size", "corrupt chunk", "truncated stream", "checksum",
     "nan delta", "future base version", "absurd tokens", "chunk first", "empty stream", "learner mismatch",
     "sparse index outside its block", "sparse index repeated"],
)
def test_bad_push_gets_specific_status_and_changes_nothing(tmp_path, case):
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            learner = FakeLearner.of(server, "L0")
            messages, code, match = _bad_cases(learner)[case]
            before = (server.runtime.core.clock, server.runtime.counters.pushes, server.runtime.core.fragments[0].version)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", messages)
            assert info.value.code().name == code, info.value.details()
            assert match in info.value.details()
            after = (server.runtime.core.clock, server.runtime.counters.pushes, server.runtime.core.fragments[0].version)
            assert before == after and not server.runtime.core.fragments[0].open
            # The shard still works.
            async with client_for(address, "L0") as client:
                fresh = FakeLearner.of(server, "L0", seed=5)
                fresh.clock = VectorClock({"L0": 100})
                assert (await fresh.push(client)).update.version == 1

    run(scenario())


@pytest.mark.parametrize("credential,match", [(False, "missing credential"), ("bogus", "invalid credential")])
def test_credentials_required(tmp_path, credential, match):
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            meta, encoded = FakeLearner.of(server, "L0").next_push()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", [header_msg(meta), *chunk_msgs(encoded)], credential=credential)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert match in info.value.details()
            assert server.runtime.counters.pushes == 0

    run(scenario())


def test_oversized_push_is_resource_exhausted(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, max_push_bytes=64) as (server, address):
            meta, encoded = FakeLearner.of(server, "L0").next_push()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", [header_msg(meta), *chunk_msgs(encoded)])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    run(scenario())


def test_not_owned_fragment_is_failed_precondition(tmp_path):
    async def scenario():
        async with running_shard(tmp_path, num_shards=2) as (server, address):
            plan = server.runtime.core.plan
            pieces = plan.fragments[1].pieces
            encoded = [encode(p.name, torch.zeros(p.shape)) for p in pieces]
            meta = PushMeta("L0", 1, 0, 10, 1, 0.1, VectorClock({"L0": 1}), tuple(e.spec for e in encoded))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", [header_msg(meta), *chunk_msgs(encoded)])
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "owned by shard 1" in info.value.details()

    run(scenario())


def test_client_disconnect_mid_stream_discards_partial_push(tmp_path):
    async def scenario():
        async with running_shard(tmp_path) as (server, address):
            learner = FakeLearner.of(server, "L0")
            meta, encoded = learner.next_push()
            from diloco import auth
            from diloco.v1 import syncer_pb2_grpc
            from tests.grpc.conftest import SECRET

            gate = asyncio.Event()

            async def requests():
                yield header_msg(meta)
                gate.set()
                await asyncio.sleep(30)  # never finishes: the client goes away mid-stream

            async with grpc.aio.insecure_channel(address) as channel:
                call = syncer_pb2_grpc.SyncerStub(channel).PushFragment(
                    requests(), metadata=[("x-diloco-learner", "L0"), ("x-diloco-credential", auth.sign(SECRET, "L0"))]
                )
                await gate.wait()
                call.cancel()
            async with client_for(address, "L0") as client:
                assert (await learner.push(client)).update.version == 1
            # Only the complete push counted; the abandoned one left nothing behind.
            assert server.runtime.counters.pushes == 1
            assert server.runtime.core.fragments[0].version == 1

    run(scenario())
