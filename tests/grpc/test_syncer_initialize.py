"""A shard starts holding no model: the first learner's values of a fragment become its
version 0 (Initialize), later offers change nothing, and every malformed or hostile offer
gets a specific status and leaves the shard as it was."""

import asyncio
import contextlib
import json

import grpc
import numpy as np
import pytest
import torch

from diloco import auth
from diloco.codec import EncodedTensor, TensorSpec, checksum, encode, values_digest
from diloco.errors import DilocoError
from diloco.tape import read_tape
from diloco.v1 import common_pb2, syncer_pb2
from diloco.v1.syncer_pb2_grpc import SyncerStub
from diloco.snapshots import sign_manifest
from diloco.syncer import snapshot
from diloco.syncer.ceiling import CEILING_STRIDE, ceiling_name
from diloco.syncer.core import snapshot as core_snapshot
from diloco.syncer.core.bounds import Push
from diloco.syncer.config import MergeConfig, SyncerConfig
from diloco.syncer.runtime import MANIFEST_FILE, initial_name
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, TINY, client_for, run
from tests.grpc.test_syncer_service import FakeLearner
from tests.seeded import gpt_run, model_plan
from tests.checks import assert_mirrored, assert_same_tensors

MANIFEST, PLAN, STATE = model_plan(TINY)


@contextlib.asynccontextmanager
async def empty_shard(tmp_path, shard_id=0, num_shards=1, anchor_window_s=0.2, learners=("L0", "L1"), merge=None,
                      snapshot_dir=None):
    cfg = SyncerConfig(shard_id=shard_id, num_shards=num_shards, anchor_window_s=anchor_window_s,
                       merge=merge or MergeConfig())
    server = ShardServer(TINY, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path, static_learners=learners,
                                                      snapshot_dir=snapshot_dir))
    port = await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop()


def fp32(fragment, values=None):
    values = values or PLAN.gather(fragment, STATE)
    return [encode(p.name, t, encoding="fp32") for p, t in zip(PLAN.fragments[fragment].pieces, values)]


def test_first_offer_wins_and_the_shard_then_serves_it(tmp_path):
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1:
                with pytest.raises(grpc.aio.AioRpcError) as before:
                    await c0.bootstrap()
                assert before.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "holds no model yet" in before.value.details()
                status = await c0.status()
                assert status.plan_hash == "" and status.model_state == "empty: waiting for the first learner's values"
                # Two learners offer different values at once: one wins per fragment.
                other = [t + 1 for t in PLAN.gather(0, STATE)]
                results = await asyncio.gather(
                    c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0)),
                    c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, other)),
                )
                assert sorted(results) == [False, True]
                (update,) = await c1.bootstrap([0])
                winner = PLAN.gather(0, STATE) if results[0] else other
                assert update.version == 0 and all((a == b).all() for a, b in zip(update.segments[-1].tensors, winner))
                # Fragment 1 has no value yet: pushes to it and its bootstrap are refused.
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await c0.bootstrap([1])
                assert "fragment 1 has no value yet" in missing.value.details()
                assert (await c0.status()).model_state == "empty: waiting for the first learner's values (fragments [1])"
                assert await c0.initialize(1, MANIFEST.to_json(), PLAN.plan_hash, fp32(1))
                status = await c0.status()
                assert status.plan_hash == PLAN.plan_hash and status.model_state == "serving"
                learner = FakeLearner.of(server, "L0", fragment=1)
                assert (await learner.push(c0)).update.version == 1  # trains from the offered values
            # The run's manifest and each fragment's initial values are kept for replay.
            assert (tmp_path / MANIFEST_FILE).read_text() == MANIFEST.to_json()
            kept = snapshot.loads(tmp_path / initial_name(1))["pieces"]
            assert_same_tensors(kept, PLAN.gather(1, STATE))

    run(scenario())


@pytest.mark.parametrize("downlink", ["condensed", "chain"])
def test_a_learner_joining_late_downloads_one_int4_update_from_the_seed(tmp_path, downlink):
    """A learner joining a run in progress holds the seed, as every learner builds it: with
    condensed replies the shard answers its Bootstrap with one int4 update from the
    fragment's initial values (kept on disk) and mirrors the result, which the learner
    reaches (up to the drift the shard accounts), so its next reply is condensed too; with chains, full values."""
    async def scenario():
        async with empty_shard(tmp_path, learners=("L0", "L1", "L2"), merge=MergeConfig(downlink=downlink, reply_codec="int4")) as (server, address):
            seed = [t.float().clone() for t in PLAN.gather(0, STATE)]
            core = server.runtime.core
            async with client_for(address, "L0") as c0, client_for(address, "L2") as c2:
                assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                # Others on record with huge deltas: L0's pushes, alone, are not held to the
                # fallback bound (syncer.core.bounds), and the fragment moves.
                core.fragments[0].influence.record([Push("L8", 1e9, 1.0, -10.0), Push("L9", 1e9, 1.0, -10.0)])
                for learner in ("L8", "L9"):  # agreeing with a reference they turned: directions judged
                    core.fragments[0].influence.agreed(learner, 0.5)
                core.fragments[0].influence.turned(["L8", "L9"])
                trained = FakeLearner.of(server, "L0", fragment=0)
                for _ in range(3):
                    await trained.push(c0, deltas=[torch.randn(t.shape) * 0.05 for t in seed])
                held = {0: values_digest(fp32(0, seed))}
                nudged = [t.clone() for t in seed]
                nudged[0].view(-1)[0] += 1.0
                (other,) = await c2.bootstrap([0], have={0: values_digest(fp32(0, nudged))})
                (update,) = await c2.bootstrap([0], have=held)
                full_bytes = sum(4 * t.numel() for t in seed)
                assert [s.kind for s in other.segments] == ["full"] and other.wire_bytes > full_bytes * 0.9
                assert update.version == 3
                if downlink == "chain":
                    assert [s.kind for s in update.segments] == ["full"]
                    return
                assert [s.kind for s in update.segments] == ["delta"] and update.base_version == 0
                assert update.wire_bytes < full_bytes / 6
                anchor = update.apply_to(seed)
                params = [torch.from_numpy(p.copy()) for p in core.fragments[0].params]
                assert_mirrored(anchor, core.fragments[0].mirrors["L2"])
                moved = max(float((p - s).abs().max()) for p, s in zip(params, seed))
                assert moved > 0.01
                # Within one int4 step (absmax / 7 of a block) of the global values.
                assert max(float((a - p).abs().max()) for a, p in zip(anchor, params)) <= moved / 7
                joined = FakeLearner("L2", PLAN, [a.numpy() for a in anchor], fragment=0, seed=2)
                joined.version = update.version
                reply = (await joined.push(c2)).update
                assert [s.kind for s in reply.segments] == ["delta"] and reply.version == 4
                assert_mirrored(joined.anchor, core.fragments[0].mirrors["L2"])
        sent = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] == "sent" and r["what"] == "bootstrap"]
        assert [r["learner"] for r in sent] == ["L2", "L2"]

    run(scenario())


async def raw_initialize(address, messages, learner_id="L0"):
    metadata = [(auth.LEARNER_METADATA, learner_id), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, learner_id))]
    async with grpc.aio.insecure_channel(address) as channel:
        return await SyncerStub(channel).Initialize(iter(messages), metadata=metadata, timeout=10)


def header(fragment=0, manifest=None, plan_hash=None, encoded=None, learner_id="L0"):
    encoded = encoded if encoded is not None else fp32(fragment)
    from diloco.convert import spec_to_proto

    return syncer_pb2.InitializeRequest(header=syncer_pb2.InitializeHeader(
        learner_id=learner_id, fragment=fragment, manifest_json=MANIFEST.to_json() if manifest is None else manifest,
        plan_hash=PLAN.plan_hash if plan_hash is None else plan_hash, tensors=[spec_to_proto(e.spec) for e in encoded]))


def chunks(encoded):
    from diloco.codec import frame

    return [syncer_pb2.InitializeRequest(chunk=common_pb2.Chunk(data=c)) for c in frame([e.payload for e in encoded])]


def _nan_values():
    out = []
    for p in PLAN.fragments[0].pieces:
        payload = np.full(p.shape, np.nan, dtype=np.float32).tobytes()
        out.append(EncodedTensor(TensorSpec(p.name, p.shape, "float32", "fp32", 0, "", len(payload), checksum(payload)), payload))
    return out


def _cases():
    good = fp32(0)
    other_manifest, other_plan, _ = model_plan(gpt_run(width=32, depth=1, heads=2, context=16, fragments=2))
    int4 = [encode(p.name, t) for p, t in zip(PLAN.fragments[0].pieces, PLAN.gather(0, STATE))]
    return {
        "bad manifest": ([header(manifest='{"entries": 7}'), *chunks(good)], "INVALID_ARGUMENT", "invalid model manifest"),
        "plan hash mismatch": ([header(plan_hash="0" * 64), *chunks(good)], "INVALID_ARGUMENT", "run config differs"),
        "unknown fragment": ([header(fragment=7, encoded=good), *chunks(good)], "INVALID_ARGUMENT", "not in the plan"),
        "wrong tensors": ([header(encoded=good[:1]), *chunks(good[:1])], "INVALID_ARGUMENT", "tensors"),
        "int4 values": ([header(encoded=int4), *chunks(int4)], "INVALID_ARGUMENT", "raw float32"),
        "nan values": ([header(encoded=_nan_values()), *chunks(_nan_values())], "INVALID_ARGUMENT", "is nan"),
        "truncated": ([header()], "INVALID_ARGUMENT", ""),
        "chunk first": (chunks(good), "INVALID_ARGUMENT", "header"),
        "learner mismatch": ([header(learner_id="L1"), *chunks(good)], "PERMISSION_DENIED", "claims"),
        "another model": (
            [syncer_pb2.InitializeRequest(header=syncer_pb2.InitializeHeader(
                learner_id="L0", fragment=0, manifest_json=other_manifest.to_json(), plan_hash=other_plan.plan_hash,
                tensors=[])), ], "FAILED_PRECONDITION", "another model",
        ),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_bad_offers_get_a_specific_status_and_change_nothing(tmp_path, case):
    messages, code, match = _cases()[case]

    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                if case == "another model":  # the shard holds the run's model already
                    assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await raw_initialize(address, messages)
                assert error.value.code().name == code, error.value.details()
                assert match in error.value.details()
                core = server.runtime.core
                assert sorted(core.fragments) == ([0] if case == "another model" else [])
                assert await c0.initialize(1, MANIFEST.to_json(), PLAN.plan_hash, fp32(1))  # still serves

    run(scenario())


def test_a_fragment_of_another_shard_is_failed_precondition(tmp_path):
    async def scenario():
        async with empty_shard(tmp_path, shard_id=1, num_shards=2) as (server, address):
            async with client_for(address, "L0") as c0:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "owned by shard 0" in error.value.details()
                assert server.runtime.core.fragments == {}

    run(scenario())


assert DilocoError  # the statuses above are the table in diloco.rpc


def test_a_shard_that_restarts_without_its_state_takes_only_an_anchor(tmp_path):
    """Its data directory says it held the run's model: a new learner's fresh values would
    silently reset its fragments, so only a learner's anchor (with its version) is taken."""
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
        async with empty_shard(tmp_path) as (server, address):
            core = server.runtime.core
            assert core.plan.plan_hash == PLAN.plan_hash and core.fragments == {}  # planned, holding nothing
            async with client_for(address, "L1") as c1:
                status = await c1.status()
                assert status.plan_hash == PLAN.plan_hash and status.model_state.startswith(
                    "recovering: restarted without its state; fragments [0, 1] wait for a learner's anchor")
                with pytest.raises(grpc.aio.AioRpcError) as fresh:
                    await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                assert fresh.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "restarted without its state" in fresh.value.details() and core.fragments == {}
                trained = [t + 0.25 for t in PLAN.gather(0, STATE)]
                assert await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, trained), anchor_version=7)
                (update,) = await c1.bootstrap([0])
                assert update.version == 7
                assert "fragments [1] wait" in (await c1.status()).model_state
                assert_same_tensors(update.segments[-1].tensors, trained)
                learner = FakeLearner.of(server, "L1", fragment=0)
                learner.version = 7
                assert (await learner.push(c1)).update.version == 8  # rounds go on from the anchor's version
        records = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] in ("recovering", "initialize")]
        assert [(r["kind"], r.get("source")) for r in records] == [
            ("initialize", "initial values"), ("recovering", None), ("initialize", "anchor at version 7")]

    run(scenario())


def test_the_operator_sees_each_shards_model_state_through_the_coordinator(tmp_path):
    """``diloco admin shards``: every shard's Status relayed by the coordinator, or why it
    could not be reached."""
    from diloco.clients.coordinator import AdminClient
    from tests.grpc.coordinator_fixtures import ADMIN, running_coordinator

    async def scenario():
        async with empty_shard(tmp_path / "shard") as (server, address):
            async with running_coordinator(tmp_path, shards=(address, "127.0.0.1:1")) as coordinator:
                def listing():
                    admin = AdminClient(coordinator.address, ADMIN, timeout_s=30)
                    try:
                        return admin.shards()
                    finally:
                        admin.close()

                first, second = await asyncio.to_thread(listing)
                assert first["model_state"] == "empty: waiting for the first learner's values" and not first["error"]
                assert second["address"] == "127.0.0.1:1" and second["error"].startswith("UNAVAILABLE")
                async with client_for(address, "L0") as c0:
                    for fragment in (0, 1):
                        assert await c0.initialize(fragment, MANIFEST.to_json(), PLAN.plan_hash, fp32(fragment))
                first, _ = await asyncio.to_thread(listing)
                assert first["model_state"] == "serving" and first["versions"] == {"0": 0, "1": 0}

    run(scenario())


def test_an_operator_lets_a_shard_without_anchors_take_fresh_initial_values(tmp_path):
    """A shard back without its state and no learner left with an anchor: it refuses fresh
    values until ``diloco admin accept-initial-values`` says so (through the coordinator);
    then the next learner's values are taken and the decision is on the tape."""
    from diloco.clients.coordinator import AdminClient
    from diloco.errors import FailedPrecondition, InvalidArgument
    from tests.grpc.coordinator_fixtures import ADMIN, running_coordinator

    async def scenario():
        async with empty_shard(tmp_path / "shard") as (server, address):
            async with client_for(address, "L0") as c0:
                for fragment in (0, 1):
                    assert await c0.initialize(fragment, MANIFEST.to_json(), PLAN.plan_hash, fp32(fragment))
        async with empty_shard(tmp_path / "shard") as (server, address):  # restarted: anchors only
            async with running_coordinator(tmp_path, shards=(address,)) as coordinator:
                def accept(shard_id):
                    admin = AdminClient(coordinator.address, ADMIN, timeout_s=30)
                    try:
                        return admin.accept_initial_values(shard_id, "all learners and snapshots lost")
                    finally:
                        admin.close()

                async with client_for(address, "L1") as c1:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    with pytest.raises(InvalidArgument, match="shard 3 does not exist"):
                        await asyncio.to_thread(accept, 3)
                    result = await asyncio.to_thread(accept, 0)
                    assert result["fragments"] == [0, 1] and result["model_state"].startswith("empty")
                    assert await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                    assert await c1.initialize(1, MANIFEST.to_json(), PLAN.plan_hash, fp32(1))
                    assert (await c1.status()).model_state == "serving"
                    with pytest.raises(FailedPrecondition, match="not waiting for anchors"):
                        await asyncio.to_thread(accept, 0)
        records = [r for r in read_tape(tmp_path / "shard" / "tape-S0.jsonl") if r["kind"] == "accept_initial_values"]
        assert [(r["fragments"], r["reason"]) for r in records] == [([0, 1], "all learners and snapshots lost")]

    run(scenario())


def test_accept_initial_values_needs_a_confirmation(capsys):
    from diloco import command as cli

    assert cli.main(["--insecure", "admin", "--coordinator", "127.0.0.1:1", "--token-file", "/dev/null", "accept-initial-values", "0"]) == 2
    err = capsys.readouterr().err
    assert "Pass --yes" in err and "Traceback" not in err


def test_a_shard_back_without_its_state_takes_the_newest_anchor_offered_in_its_window(tmp_path):
    """Anchors of a fragment are collected for anchor_window_s after the first offer: an
    older anchor that arrives first loses to a newer one that arrives within the window,
    every offerer gets its answer when the window closes (L2, live, never offers), and
    the tape lists the offers."""
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                for fragment in (0, 1):
                    assert await c0.initialize(fragment, MANIFEST.to_json(), PLAN.plan_hash, fp32(fragment))
        async with empty_shard(tmp_path, anchor_window_s=1.5, learners=("L0", "L1", "L2")) as (server, address):
            older = [t + 0.1 for t in PLAN.gather(0, STATE)]
            newer = [t + 0.2 for t in PLAN.gather(0, STATE)]
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1:
                async def late_newer():
                    await asyncio.sleep(0.5)
                    return await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, newer), anchor_version=12)

                started = asyncio.get_running_loop().time()
                first, second = await asyncio.gather(
                    c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, older), anchor_version=9), late_newer())
                assert asyncio.get_running_loop().time() - started >= 1.4  # both answered when the window closed
                assert (first, second) == (False, True)
                (update,) = await c0.bootstrap([0])
                assert update.version == 12 and all((a == b).all() for a, b in zip(update.segments[-1].tensors, newer))
                assert server.runtime.recovered[0] == ("L1", 12)
        [record] = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] == "initialize" and r["version"] == 12]
        assert record["learner"] == "L1" and record["offered"] == [["L0", 9], ["L1", 12]]

    run(scenario())


def test_the_anchor_window_closes_once_every_live_learner_has_offered(tmp_path):
    """No newer anchor can come once every live learner has offered one: the shard takes
    the newest then, not at the end of its window (a run whose learners finish within the
    window used to end with the shard still recovering, and its final model unexported)."""
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
        async with empty_shard(tmp_path, anchor_window_s=30.0) as (server, address):
            newer = [t * 1.1 for t in PLAN.gather(0, STATE)]  # near the other anchor, as honest ones are
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1:
                started = asyncio.get_running_loop().time()
                first, second = await asyncio.gather(
                    c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, newer), anchor_version=7),
                    c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0), anchor_version=5))
                assert asyncio.get_running_loop().time() - started < 10  # long before the 30 s window ends
                assert (first, second) == (True, False)
                assert server.runtime.recovered[0] == ("L0", 7)

    run(scenario())


@pytest.mark.parametrize("attack", ["values", "negated", "copies"])
def test_an_anchor_one_learner_inflates_loses_to_the_honest_ones(tmp_path, attack, caplog):
    """A shard back without its state took the newest anchor offered: one learner's anchor
    with its values x1000 (measured: norm 4.8 -> 4816), or negated (the same norm), one
    version ahead, became the fragment; and offers were not one per learner, so 4 copies
    of a negated anchor were the median of 6. Now each learner counts once (its latest
    offer) and the newest anchor near the lower median of the versions and norms, and
    near the elementwise median of the values, wins; the attacker's answer is False like
    any loser's."""
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
        async with empty_shard(tmp_path, anchor_window_s=30.0, learners=("L0", "L1", "L2")) as (server, address):
            honest = PLAN.gather(0, STATE)
            near = [t * 1.01 for t in honest]
            hostile = [t * 1000 for t in honest] if attack == "values" else [-t for t in honest]
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1, client_for(address, "L2") as c2:
                copies = 4 if attack == "copies" else 1
                attacks = [asyncio.ensure_future(c2.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, hostile),
                                                               anchor_version=13)) for _ in range(copies)]
                replaced = lambda: sum("L2 offered fragment 0 again" in r.getMessage() for r in caplog.records)  # noqa: E731
                offers = server.runtime._anchor_offers
                while replaced() < copies - 1 or 0 not in offers or "L2" not in offers[0].offered:
                    await asyncio.sleep(0.02)
                answers = await asyncio.gather(
                    c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, honest), anchor_version=11),
                    c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, near), anchor_version=12), *attacks)
                assert answers == [False, True] + [False] * copies
                assert server.runtime.recovered[0] == ("L1", 12)
                (update,) = await c0.bootstrap([0])
                assert update.version == 12 and all((a == b).all() for a, b in zip(update.segments[-1].tensors, near))
        [record] = [r for r in read_tape(tmp_path / "tape-S0.jsonl") if r["kind"] == "initialize" and r["version"] == 12]
        assert record["offered"] == [["L0", 11], ["L1", 12], ["L2", 13]]  # L2 once, however often it offered

    with caplog.at_level("WARNING", logger="diloco.syncer.runtime"):
        run(scenario())


def test_an_anchor_above_the_version_ceiling_kept_in_the_data_directory_is_refused(tmp_path):
    """No learner can hold a version its shard never published: the shard keeps a ceiling
    of each fragment's versions in its data directory (CEILING_STRIDE ahead, rewritten as
    versions pass it), and a shard back without its state refuses an anchor above it
    (INVALID_ARGUMENT, nothing taken), as its next life does once rounds moved it on."""
    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0:
                assert await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
        assert json.loads((tmp_path / ceiling_name(0)).read_text()) == {"0": CEILING_STRIDE}
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1:
                with pytest.raises(grpc.aio.AioRpcError) as above:
                    await c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0), anchor_version=CEILING_STRIDE + 1)
                assert above.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert above.value.details() == (f"anchor version {CEILING_STRIDE + 1} of fragment 0 is above every version "
                                                 f"shard 0 has published (its ceiling, kept in its data directory: {CEILING_STRIDE})")
                assert server.runtime.core.fragments == {} and 0 not in server.runtime._anchor_offers
                assert await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0), anchor_version=CEILING_STRIDE - 2)
                learner = FakeLearner.of(server, "L1", fragment=0)
                learner.version = CEILING_STRIDE - 2
                for _ in range(3):  # version CEILING_STRIDE + 1 passes the ceiling: rewritten before its reply
                    await learner.push(c1)
                assert json.loads((tmp_path / ceiling_name(0)).read_text()) == {"0": 2 * CEILING_STRIDE + 1}
        async with empty_shard(tmp_path) as (server, address):
            async with client_for(address, "L1") as c1:
                with pytest.raises(grpc.aio.AioRpcError) as above:
                    await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0), anchor_version=2 * CEILING_STRIDE + 2)
                assert above.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert await c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0), anchor_version=CEILING_STRIDE + 1)

    run(scenario())


def _snapshot_of(server, directory):
    """Snapshot 1 of the shard's state as the coordinator leaves one: its files and the
    manifest signed with the run's secret."""
    state = core_snapshot.capture(server.runtime.core, 1, now=0.0)
    target = directory / "000001"
    files = [snapshot.write(str(target), snapshot.state_name(0), state), snapshot.write_channel(str(target), 0, 1, [])]
    manifest = sign_manifest(SECRET, {"format": 1, "snapshot_id": 1, "files": [
        {"participant": "S0", "path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in files]})
    (target / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("reference", ["snapshot", "median"])
def test_with_a_snapshot_an_anchor_far_from_its_values_is_not_chosen(tmp_path, reference):
    """Of two learners, one offers its anchor negated and one version ahead: compared with
    each other (their median is their mean) nothing tells them apart and the newer wins, a
    limit of a hostile half. With a snapshot of the shard (its latest, verified with the
    run's secret), its values are the reference: the negated anchor is far from them and
    points away, and loses; offered alone it is refused, and the fragment waits."""
    async def scenario():
        async with empty_shard(tmp_path / "shard") as (server, address):
            async with client_for(address, "L0") as c0:
                for fragment in (0, 1):
                    assert await c0.initialize(fragment, MANIFEST.to_json(), PLAN.plan_hash, fp32(fragment))
            if reference == "snapshot":
                _snapshot_of(server, tmp_path / "snapshots")
        async with empty_shard(tmp_path / "shard", anchor_window_s=1.0, snapshot_dir=tmp_path / "snapshots") as (server, address):
            assert (0 in server.runtime.anchor_reference) == (reference == "snapshot")
            trained = [t * 1.05 + 0.01 for t in PLAN.gather(0, STATE)]
            negated = [-t for t in trained]
            async with client_for(address, "L0") as c0, client_for(address, "L1") as c1:
                if reference == "snapshot":  # fragment 1, L1 alone (its window of 1 s closes)
                    with pytest.raises(grpc.aio.AioRpcError) as alone:
                        await c1.initialize(1, MANIFEST.to_json(), PLAN.plan_hash, fp32(1, [-t for t in PLAN.gather(1, STATE)]),
                                            anchor_version=3)
                    assert alone.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "compared with the latest snapshot" in alone.value.details()
                    assert 1 not in server.runtime.core.fragments
                answers = await asyncio.gather(
                    c0.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, trained), anchor_version=11),
                    c1.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0, negated), anchor_version=12))
                assert answers == ([True, False] if reference == "snapshot" else [False, True])

    run(scenario())


@pytest.mark.parametrize("first_upload", ["lands", "fails"])
def test_status_lists_the_initial_values_being_uploaded_until_the_upload_ends(tmp_path, first_upload):
    """``StatusReply.initializing``: the fragments whose values a learner is uploading now,
    listed from the header until the upload lands or fails (its deadline here)."""
    from diloco.clients.syncer import open_channel
    from diloco.convert import spec_to_proto
    from diloco.codec import frame

    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            encoded, go = fp32(0), asyncio.Event()
            header = syncer_pb2.InitializeHeader(learner_id="L0", fragment=0, manifest_json=MANIFEST.to_json(),
                                                 plan_hash=PLAN.plan_hash, tensors=[spec_to_proto(e.spec) for e in encoded])

            async def slow_upload():  # the header now, the values when the test says
                yield syncer_pb2.InitializeRequest(header=header)
                await go.wait()
                for data in frame([e.payload for e in encoded]):
                    yield syncer_pb2.InitializeRequest(chunk=common_pb2.Chunk(data=data))

            async with open_channel(address) as channel, client_for(address, "L1") as c1:
                assert list((await c1.status()).initializing) == []
                upload = asyncio.ensure_future(SyncerStub(channel).Initialize(
                    slow_upload(), metadata=auth.Credential("L0", auth.sign(SECRET, "L0")).metadata(),
                    timeout=30 if first_upload == "lands" else 3))
                for _ in range(200):
                    if list((await c1.status()).initializing) == [0]:
                        break
                    await asyncio.sleep(0.05)
                assert list((await c1.status()).initializing) == [0]
                if first_upload == "lands":
                    go.set()
                    assert (await upload).initialized
                    assert [f.fragment for f in (await c1.status()).fragments] == [0]
                else:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await upload
                    assert [f.fragment for f in (await c1.status()).fragments] == []
                assert list((await c1.status()).initializing) == []

    run(scenario())
