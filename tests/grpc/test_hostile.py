"""Regression tests for what an attacker with a small gRPC client did to a coordinator and
shards on loopback (issue "Trust nothing on the wire"): each case failed on the code before
the fix, and each now gets a specific status and leaves the service serving."""

import grpc
import numpy as np
import pytest

from diloco.coordinator.launcher import override_args
from diloco import auth, rpc
from diloco.command import build_parser
from diloco.codec import EncodedTensor, TensorSpec, checksum
from diloco.errors import FailedPrecondition, InvalidArgument, Unavailable
from diloco.snapshots import files_of
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, syncer_pb2
from diloco.convert import push_meta_to_proto
from diloco.wire import PushMeta
from tests.grpc.conftest import SECRET, client_for, run, running_shard
from tests.grpc.coordinator_fixtures import joined, running_coordinator
from tests.grpc.test_syncer_service import FakeLearner, chunk_msgs, header_msg, raw_push
from tests.checks import assert_same_tensors


def fp32_push(learner, fill, tokens=128):
    """An fp32 push of constant ``fill`` values with valid checksums (encode() refuses
    nothing finite, so this is what a crafted client sends)."""
    encoded = []
    for p in learner.pieces:
        payload = np.full(p.shape, fill, dtype=np.float32).tobytes()
        encoded.append(EncodedTensor(TensorSpec(p.name, p.shape, "float32", "fp32", 0, "", len(payload), checksum(payload)), payload))
    learner.clock = learner.clock.tick(learner.name)
    meta = PushMeta(learner.name, learner.fragment, learner.version, tokens, 4, 0.05, learner.clock,
                    tuple(e.spec for e in encoded))
    return [header_msg(meta), *chunk_msgs(encoded)]


def test_the_join_token_is_no_learners_credential(tmp_path):
    """Finding 1: HMAC(secret, "join") was also the credential of learner id "join"."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0", "join")) as (server, address):
            learner = FakeLearner.of(server, "join")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "join", fp32_push(learner, 1.0), credential=auth.join_credential(SECRET, "test", 64))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert server.runtime.counters.pushes == 0
    run(scenario())
    assert auth.join_credential(SECRET, "test", 64) not in {auth.sign(SECRET, name) for name in ("join", "", "L0", "C", "S0")}


def test_a_credential_outside_the_membership_cannot_push(tmp_path):
    """Findings 1 and 5: a push used to add its sender to the live set for good, and a
    learner marked failed kept pushing (ACKed, never merged, waiting to its deadline)."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            stranger = FakeLearner.of(server, "L7")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L7", fp32_push(stranger, 0.001))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not a live member" in info.value.details()
            assert server.runtime.core.live == {"L0"}
            server.runtime.membership("failed", "L0")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", fp32_push(FakeLearner.of(server, "L0"), 0.001))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "marked failed" in info.value.details()
            assert server.runtime.counters.pushes == 0
    run(scenario())


def test_a_push_whose_upload_outlasts_its_learners_lease_is_refused_when_it_arrives(tmp_path):
    """Found by the partition checker: a push that started before its learner was failed
    (its upload stalled on a cut link) was accepted once it arrived, after the failure."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            core = server.runtime.core
            check_header = core.check_header

            def header_then_failure(meta):
                check_header(meta)  # the header passes: L0 is live
                server.runtime.membership("failed", "L0")  # its lease runs out while the payload comes

            core.check_header = header_then_failure
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", fp32_push(FakeLearner.of(server, "L0"), 0.001))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "marked failed" in info.value.details()
            assert server.runtime.counters.pushes == 0 and core.fragments[0].version == 0
    run(scenario())


@pytest.mark.parametrize("fill", [3e38, 1e6])
def test_a_huge_delta_is_refused_and_the_fragment_keeps_serving(tmp_path, fill):
    """Finding 2: finite but huge values (3e38) were accepted, the round failed to quantise
    and the fragment stayed "being applied" for good; 1e6 moved the model by as much."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0", "L1")) as (server, address):
            before = [p.copy() for p in server.runtime.core.fragments[0].params]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", fp32_push(FakeLearner.of(server, "L0"), fill, tokens=10**12))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in info.value.details()
            assert_same_tensors(before, server.runtime.core.fragments[0].params)
            async with client_for(address, "L1") as client:
                assert (await FakeLearner.of(server, "L1").push(client)).update.version == 1
    run(scenario())


def test_a_round_that_fails_releases_its_fragment(tmp_path, monkeypatch):
    """Whatever makes a round's computation fail, its pushers get an answer (the shard's
    values, in full) and the fragment keeps closing rounds."""
    from diloco.syncer import runtime as syncer_runtime

    real = syncer_runtime.compute_round
    calls = {"n": 0}

    def flaky(job, cfg):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FloatingPointError("boom")
        return real(job, cfg)

    monkeypatch.setattr(syncer_runtime, "compute_round", flaky)

    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            learner = FakeLearner.of(server, "L0")
            async with client_for(address, "L0") as client:
                failed = await learner.push(client)
                assert failed.update.version == 1 and failed.update.segments[-1].kind == "full"
                assert "round failed (FloatingPointError: boom)" in failed.update.close_reason
                state = server.runtime.core.fragments[0]
                assert_same_tensors(learner.anchor, state.params)
                assert (await learner.push(client)).update.version == 2  # serving again
    run(scenario())


@pytest.mark.parametrize("clock, match", [
    ({"S0": 2**64 - 1}, "out of range"),
    ({"L0": 1, "evil": 3}, "not a process of a run"),
    ({f"L{i}": 1 for i in range(5000)}, "entries"),
])
def test_hostile_vector_clocks_are_refused_at_the_door(tmp_path, clock, match):
    """Finding 3: a clock {"S0": 2**64-1} made every later Status/Push/Bootstrap fail; 200k
    entries made every Status reply 2.6 MB."""
    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            learner = FakeLearner.of(server, "L0")
            meta, encoded = learner.next_push()
            header = push_meta_to_proto(meta)
            header.clock.CopyFrom(common_pb2.VectorClock(entries={**clock, "L0": 1}))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_push(address, "L0", [syncer_pb2.PushRequest(header=header), *chunk_msgs(encoded)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in info.value.details()
            async with client_for(address, "L0") as client:
                status = await client.status()
                assert len(status.clock.entries) <= 2
                assert (await learner.push(client)).update.version == 1
    run(scenario())


def test_a_hostile_join_clock_cannot_break_the_coordinator(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Join(coordinator_pb2.JoinRequest(clock=common_pb2.VectorClock(entries={"C": 2**64 - 1})),
                                    metadata=((auth.JOIN_METADATA, auth.join_credential(SECRET, "test", 64)),), timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            session = await joined(server.address)  # Join, heartbeat and the state file still work
            await session.heartbeat()
            assert max(server.runtime.vector_clock.entries.values()) < 2**53
            await session.close()
    run(scenario())


def test_launch_overrides_are_an_allow_list_and_no_prefix_reaches_a_reserved_flag():
    """Finding 6: --coord (argparse's abbreviation of --coordinator) redirected a launched
    learner, with the join token, to a server of the caller's choice."""
    for key in ("coord", "join_token", "launch", "coordinator", "pool", "data"):
        with pytest.raises(InvalidArgument):
            override_args({key: "evil:1"})
    assert override_args({"slow_factor": "2", "steps": "10"}) == ["--slow-factor", "2", "--steps", "10"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["learner", "--coord", "evil:1"])
    # Every allowed setting is a real `diloco learner` flag.
    from diloco.coordinator.launcher import LEARNER_SETTINGS

    parser = build_parser()
    for flag in LEARNER_SETTINGS:
        value = {"device": "cpu", "delta-codec": "int4", "precision": "bf16"}.get(flag, "1")
        parser.parse_args(["learner", f"--{flag}", value])


def test_restore_never_reads_outside_the_snapshot_directory(tmp_path):
    """Finding 7: a manifest naming ../../evil/S0-state.npz restored every parameter from
    outside the snapshot directory."""
    snapshot = tmp_path / "snapshots" / "000001"
    snapshot.mkdir(parents=True)
    evil = tmp_path / "S0-state.npz"
    evil.write_bytes(b"x")
    manifest = {"snapshot_id": 1, "files": [
        {"participant": "S0", "path": "../S0-state.npz", "size_bytes": 1, "sha256": "0" * 64}]}
    with pytest.raises(FailedPrecondition, match="outside"):
        files_of(snapshot / "manifest.json", manifest, "S0")

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            session = await joined(server.address)
            with pytest.raises(InvalidArgument, match="plain file name"):
                await session.report_snapshot(1, [("../../evil/S0-state.npz", 1, "0" * 64)])
            await session.close()
    run(scenario())


def test_a_busy_port_is_an_error_not_a_shared_listener():
    """Finding 9: with SO_REUSEPORT a second server on a busy port silently took half the
    connections."""
    async def scenario():
        first = rpc.server()
        port = rpc.bind(first, "127.0.0.1:0")
        await first.start()
        try:
            with pytest.raises(Unavailable, match="in use"):
                rpc.bind(rpc.server(), f"127.0.0.1:{port}")
        finally:
            await first.stop(None)
    run(scenario())



def test_a_push_stream_that_goes_quiet_is_closed(tmp_path):
    """Finding 8: streams that sent only a header stayed open for over a minute."""
    from diloco.v1.syncer_pb2_grpc import SyncerStub

    async def scenario():
        async with running_shard(tmp_path, learners=("L0",), stream_idle_timeout_s=0.5) as (server, address):
            meta, _ = FakeLearner.of(server, "L0").next_push()
            metadata = ((auth.LEARNER_METADATA, "L0"), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, "L0")))
            async with grpc.aio.insecure_channel(address) as channel:
                call = SyncerStub(channel).PushFragment(metadata=metadata, timeout=20)
                await call.write(header_msg(meta))  # and then nothing, without closing
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sent nothing for 0.5 s" in info.value.details()
            assert server.runtime.counters.pushes == 0
            async with client_for(address, "L0") as client:  # and the shard serves on
                assert (await FakeLearner.of(server, "L0").push(client)).update.version == 1
    run(scenario())


def test_a_snapshot_manifest_not_signed_by_the_run_is_refused(tmp_path):
    """Finding 7, second half: the manifest's checksums were not keyed, so whoever could
    write the snapshot directory could rewrite a snapshot and its manifest."""
    import json

    from diloco.snapshots import read_manifest, sign_manifest

    path = tmp_path / "manifest.json"
    manifest = {"format": 1, "snapshot_id": 3, "files": [{"participant": "S0", "path": "S0-state.npz",
                                                         "size_bytes": 1, "sha256": "0" * 64}]}
    path.write_text(json.dumps(sign_manifest(SECRET, manifest)))
    assert read_manifest(path, SECRET)["snapshot_id"] == 3
    with pytest.raises(FailedPrecondition, match="mac does not match"):
        read_manifest(path, "another run's secret")
    forged = json.loads(path.read_text())
    forged["files"][0]["sha256"] = "1" * 64  # the attacker swapped the state file
    path.write_text(json.dumps(forged))
    with pytest.raises(FailedPrecondition, match="mac does not match"):
        read_manifest(path, SECRET)
    path.write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="has no mac"):
        read_manifest(path, SECRET)


def test_shard_status_needs_a_credential_of_the_run(tmp_path):
    """Finding 9: an unauthenticated Status listed live learner ids, the plan hash and
    counters to anyone who connected."""
    from diloco.v1 import syncer_pb2_grpc

    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = syncer_pb2_grpc.SyncerStub(channel)
                for metadata in ((), ((auth.LEARNER_METADATA, "L0"), (auth.CREDENTIAL_METADATA, "forged"))):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Status(syncer_pb2.StatusRequest(), metadata=metadata, timeout=5)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with client_for(address, "L0") as client:
                assert list((await client.status()).live_learners) == ["L0"]
    run(scenario())


def test_launch_override_values_are_checked_as_the_learner_would_before_anything_starts():
    """`--set steps=abc` used to launch a learner that died at once ("invalid int value")
    while AddLearners said ok. Each setting's check agrees with the learner's own flag: a
    value it takes parses there to the same value, a value it refuses for its type is
    refused there too."""
    from diloco.coordinator.launcher import LEARNER_SETTINGS

    parser = build_parser()
    for flag, check in LEARNER_SETTINGS.items():
        dest = flag.replace("-", "_")
        choices = {"device": ("cpu", "xla"), "delta-codec": ("int4", "sparse", "fp32"), "precision": ("fp32", "bf16"),
                   "delta-density": ("0.0625", "1")}
        for good in choices.get(flag, ("1", "3")):
            assert getattr(parser.parse_args(["learner", f"--{flag}", good]), dest) == check(good), flag
        for bad in ("abc", "1.5x", ""):
            with pytest.raises(ValueError):
                check(bad)
            with pytest.raises(SystemExit):
                parser.parse_args(["learner", f"--{flag}", bad])
    for key, value, why in (("steps", "abc", "not an integer"), ("steps", "0", "must be >= 1"), ("lr", "-1", "must be > 0"),
                            ("lr", "nan", "must be > 0"), ("device", "tpu", "must be one of cpu, cuda, xla"),
                            ("threads", "2.5", "not an integer"), ("delta-density", "2", "must be at most 1")):
        with pytest.raises(InvalidArgument, match=f"--set {key}={value}: {why}"):
            override_args({key: value})
