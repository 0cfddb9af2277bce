"""Regression tests for what an attacker holding a legitimate learner credential did to a
coordinator and a shard (issue 39, "bounded merged state"): each case failed on the code
before the fix, and each now leaves the services serving honest learners."""

import asyncio
import contextlib
import json

import grpc
import numpy as np
import pytest
import torch

from diloco import auth
from diloco.codec import encode
from diloco.convert import push_meta_to_proto
from diloco.errors import FailedPrecondition
from diloco.v1 import common_pb2, coordinator_pb2, syncer_pb2
from diloco.v1.syncer_pb2_grpc import SyncerStub
from diloco.wire import MAX_VERSION
from tests.grpc.conftest import SECRET, TINY, client_for, run, running_shard
from tests.grpc.coordinator_fixtures import admin_stub, joined, running_coordinator
from tests.grpc.test_syncer_initialize import fp32
from tests.grpc.test_syncer_service import FakeLearner, chunk_msgs, raw_push
from tests.checks import assert_same_tensors
from tests.seeded import gpt_run, model_plan

FRESH = 4095
"""Fresh names per message: with the sender's own entry, a clock at the door's bound."""


def fresh_names(batch: int) -> dict[str, int]:
    """``FRESH`` well-formed learner ids no run issued, different for each batch."""
    return {f"L{10**8 + batch * FRESH + i}": 1 for i in range(FRESH)}


def test_fresh_clock_names_cannot_grow_the_merged_clocks(tmp_path):
    """Two Joins or one heartbeat with 4095 fresh names each grew the coordinator's clock
    past the 4096 entries a message may carry (and a shard's, through pushes): honest
    heartbeats then got INVALID_ARGUMENT, shard replies were refused by learners and the
    export failed. Unknown names are now dropped at every merge."""
    async def scenario():
        async with running_shard(tmp_path / "shard", learners=("L0", "L1")) as (shard, shard_address):
            async with running_coordinator(tmp_path, shards=(shard_address,)) as coordinator:
                honest = await joined(coordinator.address)
                attacker = await joined(coordinator.address)
                assert (honest.learner_id, attacker.learner_id) == ("L0", "L1")
                await honest.register_model(model_plan(TINY)[0].to_json())
                join_md = ((auth.JOIN_METADATA, auth.join_credential(SECRET, "test", 64)),)
                for batch in range(3):
                    clock = common_pb2.VectorClock(entries={**fresh_names(2 * batch), attacker.learner_id: 10 + batch})
                    await attacker.stub.Heartbeat(
                        coordinator_pb2.HeartbeatRequest(learner_id=attacker.learner_id, clock=clock),
                        metadata=attacker.metadata, timeout=10)
                    await attacker.stub.Join(
                        coordinator_pb2.JoinRequest(clock=common_pb2.VectorClock(entries=fresh_names(2 * batch + 1))),
                        metadata=join_md, timeout=10)
                for _ in range(2):  # the first reply's clock goes into the second heartbeat
                    await honest.heartbeat()
                runtime = coordinator.runtime
                assert len(runtime.vector_clock.entries) <= 6  # C, L0, L1 and the attacker's 3 extra Joins
                assert len(honest.clock.entries) <= 6
                assert set(runtime.vector_clock.entries) <= runtime.known_processes()

                sneaky = FakeLearner.of(shard, "L1")
                for batch in range(3):
                    meta, encoded = sneaky.next_push()
                    header = push_meta_to_proto(meta)
                    header.clock.CopyFrom(common_pb2.VectorClock(entries={**fresh_names(batch), "L1": meta.seq}))
                    await raw_push(shard_address, "L1", [syncer_pb2.PushRequest(header=header), *chunk_msgs(encoded)])
                core = shard.runtime.core
                async with client_for(shard_address, "L0") as client:
                    learner = FakeLearner.of(shard, "L0")
                    learner.version = core.fragments[0].version
                    assert (await learner.push(client)).update.version == learner.version
                    assert len((await client.status()).clock.entries) <= 3
                assert set(core.clock.entries) <= core.known_processes() == {"C", "S0", "L0", "L1"}

                async with admin_stub(coordinator.address) as (stub, md):
                    replies = [r async for r in stub.ExportModel(coordinator_pb2.ExportModelRequest(), metadata=md, timeout=20)]
                assert replies
                await honest.close()
    run(scenario())


@pytest.mark.parametrize("version", [2**64 - 1, MAX_VERSION])
def test_an_anchor_version_out_of_range_is_refused_before_touching_the_shard(tmp_path, version):
    """Initialize with anchor=true, anchor_version=2**64-1 on a fresh shard was accepted;
    the next push failed "Value out of range" and the shard's Status failed for good."""
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, chunks, empty_shard, header, raw_initialize

    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            encoded = fp32(0)
            hostile = header(0, encoded=encoded)
            hostile.header.anchor, hostile.header.anchor_version = True, version
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_initialize(address, [hostile, *chunks(encoded)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in info.value.details()
            assert server.runtime.core.fragments == {} and server.runtime.core.plan is None
            async with client_for(address, "L0") as client:
                assert (await client.status()).model_state.startswith("empty")
                assert await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, encoded)
                learner = FakeLearner.of(server, "L0")
                assert (await learner.push(client)).update.version == 1
                status = await client.status()
                assert [f.version for f in status.fragments] == [1]
    run(scenario())


DEEP = "[" * 100_000
"""A manifest nested 100,000 deep: json.loads raised RecursionError, which became UNKNOWN."""


def test_a_deeply_nested_manifest_is_an_invalid_argument_and_both_services_keep_serving(tmp_path):
    """RegisterModel on the coordinator and Initialize on a shard with a manifest nested
    100,000 deep ended UNKNOWN "RecursionError"; now INVALID_ARGUMENT, saying why."""
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, chunks, empty_shard, header, raw_initialize

    async def scenario():
        async with running_coordinator(tmp_path) as coordinator:
            learner = await joined(coordinator.address)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await learner.stub.RegisterModel(
                    coordinator_pb2.RegisterModelRequest(learner_id=learner.learner_id, manifest_json=DEEP),
                    metadata=learner.metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "nested too deeply" in info.value.details()
            topology = await learner.register_model(model_plan(TINY)[0].to_json())
            assert topology.plan.plan_hash
            await learner.close()
        async with empty_shard(tmp_path / "shard") as (server, address):
            encoded = fp32(0)
            hostile = header(0, encoded=encoded)
            hostile.header.manifest_json = DEEP
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_initialize(address, [hostile, *chunks(encoded)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "nested too deeply" in info.value.details()
            async with client_for(address, "L0") as client:
                assert await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, encoded)
    run(scenario())


async def _refused(call, code):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def test_a_learner_that_left_or_failed_no_longer_reads_the_coordinator(tmp_path):
    """After Leave (or being marked failed), the learner's credential still read the
    topology (with the model manifest) and followed the membership until it expired.
    Now FAILED_PRECONDITION, as its Heartbeat already was; it joins again under a new id."""
    async def scenario():
        async with running_coordinator(tmp_path) as coordinator:
            honest = await joined(coordinator.address)
            await honest.register_model(model_plan(TINY)[0].to_json())
            leaver, failer = await joined(coordinator.address), await joined(coordinator.address)
            assert (await leaver.topology()).plan.plan_hash
            await leaver.leave("done")
            await failer.leave("crashed", failed=True)
            precondition = grpc.StatusCode.FAILED_PRECONDITION
            for gone, state in ((leaver, "left"), (failer, "failed")):
                md = gone.metadata
                details = await _refused(lambda: gone.stub.GetTopology(coordinator_pb2.GetTopologyRequest(), metadata=md,
                                                                       timeout=10), precondition)
                assert f"{gone.learner_id} is no longer a member of the run: it {state}" in details
                await _refused(lambda: gone.stub.RegisterModel(coordinator_pb2.RegisterModelRequest(
                    learner_id=gone.learner_id, manifest_json=model_plan(TINY)[0].to_json()), metadata=md, timeout=10),
                    precondition)
                await _refused(lambda: gone.stub.WatchMembership(coordinator_pb2.WatchMembershipRequest(
                    watcher=gone.learner_id), metadata=md, timeout=10), precondition)
                await _refused(lambda: gone.stub.ReportSnapshot(coordinator_pb2.ReportSnapshotRequest(
                    snapshot_id=1, participant=gone.learner_id), metadata=md, timeout=10), precondition)
                await gone.leave("again")  # idempotent, as before
            assert (await honest.topology()).plan.plan_hash
            again = await joined(coordinator.address)
            assert again.learner_id not in (leaver.learner_id, failer.learner_id)
            assert (await again.topology()).plan.plan_hash
            for session in (honest, leaver, failer, again):
                await session.close()
    run(scenario())


def test_a_learner_a_shard_knows_is_gone_no_longer_reads_the_shard(tmp_path):
    """Bootstrap (the full model) and Status answered a learner the shard knew had left
    or failed. Now refused like its pushes: FAILED_PRECONDITION once it left,
    PERMISSION_DENIED once it failed; a draining learner, one the shard has not heard of
    yet and the coordinator still read."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0", "L1", "L2")) as (shard, address):
            shard.runtime.membership("left", "L0")
            shard.runtime.membership("failed", "L1")
            shard.runtime.membership("draining", "L2")
            for learner_id, code, says in (("L0", grpc.StatusCode.FAILED_PRECONDITION, "has left"),
                                           ("L1", grpc.StatusCode.PERMISSION_DENIED, "marked failed")):
                async with client_for(address, learner_id) as client:
                    assert says in await _refused(client.status, code)
                    assert says in await _refused(lambda: client.stub.Bootstrap(
                        syncer_pb2.BootstrapRequest(), metadata=client.credential.metadata(), timeout=10), code)
            for reader in ("L2", "L9", auth.COORDINATOR_ID):
                async with client_for(address, reader) as client:
                    assert list((await client.status()).live_learners) == []
                    assert [u.fragment for u in await client.bootstrap()] == [f.id for f in shard.runtime.core.owned]
            shard.runtime.set_membership({"L3"}, {"L1"}, left={"L2"})  # a snapshot of the coordinator's membership
            async with client_for(address, "L2") as client:
                await _refused(client.status, grpc.StatusCode.FAILED_PRECONDITION)
    run(scenario())


# --- the operator fixes the model (issue 39, part 3) -------------------------------------

def _manifest_with(entries) -> str:
    return json.dumps({"entries": entries, "aliases": []}, separators=(",", ":"))


HUGE_MODEL = _manifest_with([{"name": "w", "shape": [1 << 20, 1 << 20], "dtype": "float32", "kind": "parameter"}])
"""2^40 elements (4 TiB): registered first, it was the run's model and every honest learner was refused."""

MANY_TENSORS = _manifest_with([{"name": f"layers.{i}.w", "shape": [8, 8], "dtype": "float32", "kind": "parameter"}
                               for i in range(100_000)])
"""100,000 tensors, 7.7 MB: parsed and planned on the event loop, it froze a shard (21.7 s
for 4 calls) and a coordinator (1.6-2.1 s a call)."""


def _other_model():
    return model_plan(gpt_run(width=24, depth=1, heads=2, context=16, fragments=2))


def _other_fragment0():
    """Another model's manifest, plan and fragment 0's values as an Initialize carries them."""
    other, other_plan, other_state = _other_model()
    own = [encode(p.name, t, encoding="fp32") for p, t in zip(other_plan.fragments[0].pieces, other_plan.gather(0, other_state))]
    return other, other_plan, own


def _register(session, manifest_json):
    """RegisterModel on the raw stub (its status code, not the client's error)."""
    return session.stub.RegisterModel(coordinator_pb2.RegisterModelRequest(
        learner_id=session.learner_id, manifest_json=manifest_json), metadata=session.metadata, timeout=60)


def _state_manifest(coordinator) -> str:
    return json.loads(coordinator.runtime.state_path.read_text())["manifest"]


def test_a_pinned_coordinator_keeps_the_operators_model_whoever_registers_first(tmp_path):
    """The attacker registered first every time and its model became the run's. Pinned
    (the model built from the run config at start), the coordinator refuses any other
    manifest, names the first difference, fails that learner, and never adopts it."""
    manifest, plan, _ = model_plan(TINY)

    async def scenario():
        async with running_coordinator(tmp_path, pin_model=True) as coordinator:
            assert _state_manifest(coordinator) == manifest.to_json()  # pinned before anyone registers
            attacker, rich, honest = [await joined(coordinator.address) for _ in range(3)]
            details = await _refused(lambda: _register(attacker, _other_model()[0].to_json()),
                                     grpc.StatusCode.FAILED_PRECONDITION)
            assert "model differs from the run's" in details and "tok_embed" in details
            await _refused(lambda: _register(rich, HUGE_MODEL), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert _state_manifest(coordinator) == manifest.to_json()
            assert coordinator.runtime.membership.learners[attacker.learner_id].state == "failed"
            topology = await honest.register_model(manifest.to_json())
            assert topology.manifest_json == manifest.to_json() and topology.plan.plan_hash == plan.plan_hash
            assert len(topology.initial_values) == plan.num_fragments
            for session in (attacker, rich, honest):
                await session.close()
    run(scenario())


def test_a_manifest_over_the_maximum_model_size_is_refused_before_it_is_planned(tmp_path):
    """Unpinned, a 2^40-element manifest registered first refused every honest learner and
    stayed in coordinator-state.json. Now RESOURCE_EXHAUSTED (the run's max_model_bytes),
    and the honest learner's model is the run's."""
    async def scenario():
        async with running_coordinator(tmp_path) as coordinator:
            attacker, honest = await joined(coordinator.address), await joined(coordinator.address)
            details = await _refused(lambda: _register(attacker, HUGE_MODEL), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "maximum model size" in details
            assert _state_manifest(coordinator) == ""
            manifest = model_plan(TINY)[0]
            assert (await honest.register_model(manifest.to_json())).manifest_json == manifest.to_json()
            assert _state_manifest(coordinator) == manifest.to_json()
            for session in (attacker, honest):
                await session.close()
    run(scenario())


@contextlib.asynccontextmanager
async def _shard_following(tmp_path, **coordinator_cfg):
    """An empty shard that follows a real coordinator (its manifest and pinned values)."""
    from tests.grpc.test_syncer_initialize import empty_shard

    async with empty_shard(tmp_path / "shard", learners=()) as (shard, shard_address):
        async with running_coordinator(tmp_path, shards=(shard_address,), **coordinator_cfg) as coordinator:
            shard.follow(coordinator.address)
            yield shard, shard_address, coordinator


def _initialize_as(learner, fragment, manifest_json, plan_hash, encoded):
    from tests.grpc.test_syncer_initialize import chunks, header

    return [header(fragment, manifest=manifest_json, plan_hash=plan_hash, encoded=encoded, learner_id=learner),
            *chunks(encoded)]


def test_shards_take_only_the_pinned_model_and_its_initial_values(tmp_path):
    """Whichever learner reached a shard first gave a fragment its values (honest learners
    then trained from all-0.5 values), and the shard planned from the manifest it was sent.
    Now the shard plans from the coordinator's manifest and takes fresh values only with
    the pinned digest; refused offers leave it as it was. (The coordinator here kept the
    digests alone, as one of an earlier version did: it does not seed the shard, whose
    fragments stay for the learners to offer.)"""
    from diloco.coordinator.pin import PIN_FILE, build_pin
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, raw_initialize

    (tmp_path / "coordinator").mkdir(mode=0o700)
    (tmp_path / "coordinator" / PIN_FILE).write_text(build_pin(TINY).to_json(TINY))

    async def scenario():
        async with _shard_following(tmp_path, pin_model=True) as (shard, address, coordinator):
            assert not coordinator.runtime.run.seeds_shards
            attacker, honest = await joined(coordinator.address), await joined(coordinator.address)
            await honest.register_model(MANIFEST.to_json())
            halves = fp32(0, [torch.full_like(t, 0.5) for t in PLAN.gather(0, model_plan(TINY)[2])])
            details = await _refused(lambda: raw_initialize(address, _initialize_as(
                attacker.learner_id, 0, MANIFEST.to_json(), PLAN.plan_hash, halves), attacker.learner_id),
                grpc.StatusCode.FAILED_PRECONDITION)
            assert "not the run's pinned ones" in details
            other, other_plan, own = _other_fragment0()
            details = await _refused(lambda: raw_initialize(address, _initialize_as(
                attacker.learner_id, 0, other.to_json(), other_plan.plan_hash, own), attacker.learner_id),
                grpc.StatusCode.INVALID_ARGUMENT)
            assert "run's manifest" in details
            assert shard.runtime.core.fragments == {}
            async with client_for(address, honest.learner_id, honest.credential) as client:
                assert await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
                assert shard.runtime.core.plan.plan_hash == PLAN.plan_hash
                (update,) = await client.bootstrap([0])
                assert_same_tensors(update.segments[-1].tensors, PLAN.gather(0, model_plan(TINY)[2]))
            for session in (attacker, honest):
                await session.close()
    run(scenario())


def test_the_coordinator_seeds_an_empty_shard_with_the_pinned_values_and_a_learner_offers_none(tmp_path):
    """Every starting learner offered its fp32 initial values of each fragment it found
    empty (4.70 MB crossed the links for a 1.91 MB model in one measured run). Now the
    coordinator, which holds the pinned values, seeds each shard as soon as it serves; a
    hostile offer after that changes nothing."""
    from diloco.coordinator.pin import PIN_FILE, VALUES_FILE, ModelPin
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, raw_initialize

    async def scenario():
        async with _shard_following(tmp_path, pin_model=True) as (shard, address, coordinator):
            pin = coordinator.runtime.run.pin
            assert coordinator.runtime.run.seeds_shards and pin.values is not None
            owned = {f.id for f in PLAN.owned_by(0, 1)}
            deadline = asyncio.get_running_loop().time() + 20
            while set(shard.runtime.core.fragments) != owned:
                assert asyncio.get_running_loop().time() < deadline, f"not seeded: {sorted(shard.runtime.core.fragments)}"
                await asyncio.sleep(0.05)
            assert coordinator.seeded == {0: sorted(owned)}
            for f in owned:
                assert_same_tensors(shard.runtime.core.fragments[f].params, pin.values[f])
            attacker = await joined(coordinator.address)
            async with client_for(address, attacker.learner_id, attacker.credential) as client:
                topology = await attacker.register_model(MANIFEST.to_json())
                assert topology.seeds_shards and list(topology.initial_values) == list(pin.initial_values)
                halves = fp32(0, [torch.full_like(t, 0.5) for t in PLAN.gather(0, model_plan(TINY)[2])])
                assert not await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, halves)
            assert_same_tensors(shard.runtime.core.fragments[0].params, pin.values[0])
            await attacker.close()
            # Kept beside the pin: a restarted coordinator seeds from the file, checked against the digests.
            kept = ModelPin.read(tmp_path / "coordinator" / PIN_FILE, TINY)
            assert kept == pin
            for f in owned:
                assert_same_tensors(kept.values[f], pin.values[f])
        tape = [json.loads(line) for line in (tmp_path / "shard" / "tape-S0.jsonl").read_text().splitlines()]
        assert {(r["fragment"], r["learner"]) for r in tape if r["kind"] == "initialize"} == {(f, "C") for f in owned}
        path = tmp_path / "coordinator" / VALUES_FILE
        with np.load(path) as archive:
            values = {k: archive[k] for k in archive.files}
        values["f0p0"] = values["f0p0"] + 1
        np.savez(path, **values)
        with pytest.raises(FailedPrecondition, match="does not hold the values pinned"):
            ModelPin.read(tmp_path / "coordinator" / PIN_FILE, TINY)
    run(scenario())


def test_shards_plan_from_the_registered_manifest_not_the_learners(tmp_path):
    """Unpinned, a shard planned from whatever manifest came with Initialize. Now it plans
    from the manifest registered with the coordinator and ignores the learner's."""
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, raw_initialize

    async def scenario():
        async with _shard_following(tmp_path) as (shard, address, coordinator):
            honest, attacker = await joined(coordinator.address), await joined(coordinator.address)
            other, other_plan, own = _other_fragment0()
            details = await _refused(lambda: raw_initialize(address, _initialize_as(
                attacker.learner_id, 0, other.to_json(), other_plan.plan_hash, own), attacker.learner_id),
                grpc.StatusCode.FAILED_PRECONDITION)
            assert "holds no model for this run yet" in details  # nobody registered one
            await honest.register_model(MANIFEST.to_json())
            await _refused(lambda: raw_initialize(address, _initialize_as(
                attacker.learner_id, 0, other.to_json(), other_plan.plan_hash, own), attacker.learner_id),
                grpc.StatusCode.INVALID_ARGUMENT)
            assert shard.runtime.core.plan is None and shard.runtime.core.fragments == {}
            async with client_for(address, honest.learner_id, honest.credential) as client:
                assert await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
            for session in (attacker, honest):
                await session.close()
    run(scenario())


def test_a_learner_that_left_cannot_make_a_shard_parse_a_manifest(tmp_path):
    """Initialize with the credential of a learner that had left was parsed (a 100,000-tensor
    manifest, on the event loop) before any check; now refused first."""
    from tests.grpc.test_syncer_initialize import chunks, empty_shard, header, raw_initialize

    async def scenario():
        async with empty_shard(tmp_path) as (server, address):
            server.runtime.membership("left", "L0")
            encoded = fp32(0)
            hostile = header(0, encoded=encoded)
            hostile.header.manifest_json = DEEP
            details = await _refused(lambda: raw_initialize(address, [hostile, *chunks(encoded)]),
                                     grpc.StatusCode.FAILED_PRECONDITION)
            assert "has left" in details
            assert server.runtime.core.plan is None
    run(scenario())


def _parsed_on(monkeypatch) -> list[bool]:
    """Whether each parse of ``MANY_TENSORS`` ran on the event loop's thread."""
    from diloco import manifest

    on_loop, parse = [], manifest.Manifest.from_json.__func__

    def recording(cls, text):
        if text != MANY_TENSORS:
            return parse(cls, text)
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse(cls, text)

    monkeypatch.setattr(manifest.Manifest, "from_json", classmethod(recording))
    return on_loop


def test_a_manifest_of_100000_tensors_is_parsed_off_the_event_loop(tmp_path, monkeypatch):
    """Four header-only calls carrying a 100,000-tensor manifest froze a shard for 21.7 s
    and a coordinator for 1.6-2.1 s each: they were parsed and planned on the event loop.
    Now in a worker thread, one at a time (and a shard that follows a coordinator never
    parses the learner's manifest)."""
    from tests.grpc.test_syncer_initialize import empty_shard

    on_loop = _parsed_on(monkeypatch)
    options = [("grpc.max_send_message_length", 32 << 20)]

    async def scenario():
        async with empty_shard(tmp_path / "shard") as (server, address):
            md = [(auth.LEARNER_METADATA, "L1"), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, "L1"))]
            request = syncer_pb2.InitializeRequest(header=syncer_pb2.InitializeHeader(
                learner_id="L1", fragment=0, manifest_json=MANY_TENSORS, plan_hash="x"))
            async with grpc.aio.insecure_channel(address, options=options) as channel, \
                    client_for(address, "L0") as client:
                calls = [SyncerStub(channel).Initialize(iter([request]), metadata=md, timeout=120) for _ in range(4)]
                assert (await client.status()).model_state.startswith("empty")
                for outcome in await asyncio.gather(*calls, return_exceptions=True):
                    assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT  # its plan hash is not "x"
        assert len(on_loop) == 4 and not any(on_loop)
        on_loop.clear()
        async with running_coordinator(tmp_path, pin_model=True) as coordinator:
            honest = await joined(coordinator.address)
            attackers = [await joined(coordinator.address) for _ in range(4)]
            calls = [a.stub.RegisterModel(coordinator_pb2.RegisterModelRequest(
                learner_id=a.learner_id, manifest_json=MANY_TENSORS), metadata=a.metadata, timeout=120)
                for a in attackers]
            await honest.heartbeat()
            for outcome in await asyncio.gather(*calls, return_exceptions=True):
                assert outcome.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert on_loop == [False] * 4
            for session in (honest, *attackers):
                await session.close()
    run(scenario())
