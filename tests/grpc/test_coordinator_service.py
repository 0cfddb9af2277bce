"""A real coordinator on 127.0.0.1:0: membership over the RPCs, the membership stream a
real shard follows, bad input answered with a specific status, state across restarts."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.clients.coordinator import LearnerSession
from diloco.clock import VectorClock
from diloco.learner.membership import Heartbeats, Membership
from diloco import auth
from diloco.config import RunConfig
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, TINY, run
from tests.grpc.coordinator_fixtures import admin_stub, joined, reconnect, running_coordinator, wait_for
from tests.seeded import gpt_run, model_plan


def test_join_heartbeat_list_leave_and_the_topology(tmp_path):
    async def scenario():
        shards = ("127.0.0.1:7101", "127.0.0.1:7102")  # only named in the topology here
        async with running_coordinator(tmp_path, shards=shards, pools=("default", "spot")) as server:
            session = LearnerSession(server.address)
            reply = await session.join(auth.join_credential(SECRET, "test", 64), pool="spot", address="host:42")
            assert reply.learner_id == "L0" and reply.lease_s == 5.0
            auth.verify(SECRET, "L0", reply.credential)  # the run's, for L0, valid for the default lifetime
            assert abs(auth.expiry(reply.credential) - time.time() - auth.CREDENTIAL_LIFETIME_S) < 5
            # No learner has registered a model yet: no manifest, no plan, shards without fragments.
            assert reply.topology.manifest_json == "" and not reply.topology.plan.fragments
            assert [list(s.fragments) for s in reply.topology.shards] == [[], []]
            manifest, plan, _ = model_plan(TINY)
            topology = await session.register_model(manifest.to_json())
            assert topology.plan.plan_hash == plan.plan_hash and topology.manifest_json == manifest.to_json()
            assert [(s.shard_id, s.address, list(s.fragments)) for s in topology.shards] == [
                (0, "127.0.0.1:7101", [0]), (1, "127.0.0.1:7102", [1]),
            ]
            assert RunConfig.from_json(topology.run_config_json) == TINY
            assert RunConfig.from_json(topology.run_config_json) == TINY
            assert reply.clock.entries["C"] >= 1

            counted_ms = int(time.time() * 1000) - 1  # taken just before it was sent
            beat = await session.heartbeat(tokens=1024, inner_steps=8, version_lag=2, tokens_per_s=99.0,
                                           counted_unix_ms=counted_ms)
            assert list(beat.directives) == [] and beat.lease_s == 5.0 and beat.topology_epoch == 1
            assert (await session.topology()).plan.plan_hash == topology.plan.plan_hash
            async with admin_stub(server.address) as (stub, md):
                (info,) = (await stub.ListLearners(coordinator_pb2.ListLearnersRequest(), metadata=md)).learners
                assert (info.learner_id, info.state, info.pool, info.address) == ("L0", common_pb2.LEARNER_STATE_ACTIVE, "spot", "host:42")
                assert (info.tokens, info.inner_steps, info.version_lag) == (1024, 8, 2)
                assert abs(info.last_heartbeat_unix_ms / 1000 - time.time()) < 60
                assert (info.tokens_per_s, info.counted_unix_ms) == (99.0, counted_ms)
                await session.leave("done")
                assert list((await stub.ListLearners(coordinator_pb2.ListLearnersRequest(), metadata=md)).learners) == []
                failing = LearnerSession(server.address)
                await failing.join(auth.join_credential(SECRET, "test", 64), address="host:43")
                await failing.leave("failed to start: task 't.py:build': no such file", failed=True)
                gone = await stub.ListLearners(coordinator_pb2.ListLearnersRequest(include_gone=True), metadata=md)
                assert [(l.learner_id, l.state, l.reason) for l in gone.learners] == [
                    ("L0", common_pb2.LEARNER_STATE_LEFT, "done"),
                    ("L1", common_pb2.LEARNER_STATE_FAILED, "failed to start: task 't.py:build': no such file")]
                await failing.close()
            await session.close()

    run(scenario())


def test_the_first_registered_model_is_the_runs_and_a_different_one_is_refused(tmp_path):
    async def scenario():
        manifest, plan, _ = model_plan(TINY)
        wider, _, _ = model_plan(gpt_run(width=32, depth=1, heads=2, context=16, fragments=2))
        async with running_coordinator(tmp_path) as server:
            first, second = await joined(server.address), await joined(server.address)
            await first.register_model(manifest.to_json())
            with pytest.raises(FailedPrecondition) as refused:
                await second.register_model(wider.to_json())
            # The first tensor that differs, with both shapes.
            assert "tok_embed.weight" in str(refused.value) and "[256, 32]" in str(refused.value)
            assert "[256, 16]" in str(refused.value)
            async with admin_stub(server.address) as (stub, md):
                gone = await stub.ListLearners(coordinator_pb2.ListLearnersRequest(include_gone=True), metadata=md)
                states = {l.learner_id: (l.state, l.reason) for l in gone.learners}
                # Refused, it fails (its process cannot train this run), and says why.
                assert states["L1"][0] == common_pb2.LEARNER_STATE_FAILED and "tok_embed.weight" in states["L1"][1]
                assert states["L0"][0] == common_pb2.LEARNER_STATE_JOINING  # no heartbeat yet
            with pytest.raises(InvalidArgument):
                await first.register_model('{"entries": [{"name": "x", "shape": [-1], "dtype": "float32", "kind": "parameter"}]}')
            # A learner with the same model is accepted; so is the run's model after a restart.
            same = await joined(server.address)
            assert (await same.register_model(manifest.to_json())).plan.plan_hash == plan.plan_hash
            for session in (first, second, same):
                await session.close()
        async with running_coordinator(tmp_path) as server:
            late = await joined(server.address)
            with pytest.raises(FailedPrecondition):
                await late.register_model(wider.to_json())
            with pytest.raises(FailedPrecondition, match="no longer a member"):  # refused, it has failed
                await late.topology()
            other = await joined(server.address)
            assert (await other.topology()).plan.plan_hash == plan.plan_hash
            for session in (late, other):
                await session.close()

    run(scenario())


def test_health_and_reflection(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service="diloco.v1.Coordinator"), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(scenario())


# --- bad input: a specific status and a message that says what is wrong ------------------


async def _bad_join_token(server):
    session = LearnerSession(server.address)
    await session.join("not-the-token")


async def _unknown_learner(server):
    session = LearnerSession(server.address)
    session.learner_id, session.credential = "L7", auth.sign(SECRET, "L7")
    await session.heartbeat()


async def _someone_elses_learner_id(server):
    a, b = await joined(server.address), await joined(server.address)
    async with grpc.aio.insecure_channel(server.address) as channel:  # b's credential, a's id
        await coordinator_pb2_grpc.CoordinatorStub(channel).Heartbeat(
            coordinator_pb2.HeartbeatRequest(learner_id=a.learner_id), metadata=b.metadata
        )


async def _expired_lease(server):
    session = await joined(server.address)
    await wait_for(lambda: server.runtime.membership.learner("L0").state == "failed", "the lease to run out")
    await session.heartbeat()


async def _bad_admin_token(server):
    async with admin_stub(server.address, token="guess") as (stub, md):
        await stub.ListLearners(coordinator_pb2.ListLearnersRequest(), metadata=md)


async def _admin(server, method, request):
    async with admin_stub(server.address) as (stub, md):
        return await getattr(stub, method)(request, metadata=md)


async def _count_zero(server):
    await _admin(server, "AddLearners", coordinator_pb2.AddLearnersRequest(count=0))


async def _above_the_cap(server):
    await _admin(server, "AddLearners", coordinator_pb2.AddLearnersRequest(count=5))


async def _unknown_pool(server):
    await _admin(server, "AddLearners", coordinator_pb2.AddLearnersRequest(count=1, pool="gpu"))


async def _remove_unknown(server):
    await _admin(server, "RemoveLearners", coordinator_pb2.RemoveLearnersRequest(learner_ids=["L9"]))


async def _after_tokens_without_drain(server):
    await joined(server.address)
    try:
        await _admin(server, "RemoveLearners", coordinator_pb2.RemoveLearnersRequest(learner_ids=["L0"], after_tokens={"L0": 5}))
    finally:
        assert server.runtime.membership.learner("L0").state == "joining"  # refused whole: nothing changed


async def _after_tokens_for_another(server):
    await joined(server.address)
    await joined(server.address)
    try:
        await _admin(server, "RemoveLearners", coordinator_pb2.RemoveLearnersRequest(
            learner_ids=["L0"], drain=True, after_tokens={"L0": 5, "L1": 7}))
    finally:
        assert [server.runtime.membership.learner(i).state for i in ("L0", "L1")] == ["joining", "joining"]


async def _snapshot_already_running(server):
    await joined(server.address)  # a participant that never reports keeps snapshot 1 running
    await _admin(server, "StartSnapshot", coordinator_pb2.StartSnapshotRequest())
    await _admin(server, "StartSnapshot", coordinator_pb2.StartSnapshotRequest())


async def _report_for_someone_else(server):
    session = await joined(server.address)
    request = coordinator_pb2.ReportSnapshotRequest(snapshot_id=1, participant="S0")
    async with grpc.aio.insecure_channel(server.address) as channel:
        await coordinator_pb2_grpc.CoordinatorStub(channel).ReportSnapshot(request, metadata=session.metadata)


@pytest.mark.parametrize(
    "call,code,message,cfg",
    [
        (_bad_join_token, grpc.StatusCode.UNAUTHENTICATED, "not a join credential", {}),
        (_unknown_learner, grpc.StatusCode.NOT_FOUND, "unknown learner 'L7'", {}),
        (_someone_elses_learner_id, grpc.StatusCode.PERMISSION_DENIED, "credential is for 'L1', the request is for 'L0'", {}),
        (_expired_lease, grpc.StatusCode.FAILED_PRECONDITION, "L0 was marked failed (lease expired", {"lease_s": 0.2}),
        (_bad_admin_token, grpc.StatusCode.UNAUTHENTICATED, "invalid admin token", {}),
        (_count_zero, grpc.StatusCode.INVALID_ARGUMENT, "count must be >= 1, got 0", {"launcher": "local"}),
        (_above_the_cap, grpc.StatusCode.RESOURCE_EXHAUSTED, "cannot add 5 learners: 0 of the cap of 4", {"launcher": "local", "max_learners": 4}),
        (_unknown_pool, grpc.StatusCode.NOT_FOUND, "unknown pool 'gpu'; pools: default", {"launcher": "local"}),
        (_remove_unknown, grpc.StatusCode.NOT_FOUND, "unknown learner 'L9'", {}),
        (_after_tokens_without_drain, grpc.StatusCode.INVALID_ARGUMENT, "after_tokens is for a drain: set drain too", {}),
        (_after_tokens_for_another, grpc.StatusCode.INVALID_ARGUMENT, "after_tokens names learners not drained by this call: L1", {}),
        (_snapshot_already_running, grpc.StatusCode.ALREADY_EXISTS, "snapshot 1 is already running (waiting for L0", {}),
        (_report_for_someone_else, grpc.StatusCode.PERMISSION_DENIED, "credential is for 'L0', the request is for 'S0'", {}),
    ],
    ids=lambda x: x.__name__.strip("_") if callable(x) else None,
)
def test_bad_input(tmp_path, call, code, message, cfg):
    async def scenario():
        async with running_coordinator(tmp_path, **cfg) as server:
            with pytest.raises((grpc.aio.AioRpcError, DilocoError)) as info:
                await call(server)
        error = info.value
        if isinstance(error, DilocoError):  # raised through LearnerSession
            assert f"({code.name})" in str(error) and message in str(error), str(error)
        else:
            assert error.code() == code and message in error.details(), error.details()

    run(scenario())


def test_a_drain_after_tokens_rides_every_heartbeat_until_the_learner_leaves(tmp_path):
    """How a token budget ends exactly: RemoveLearners(drain, after_tokens) makes each
    heartbeat's drain directive carry the token count the learner trains to first (0 for a
    learner drained without one: leave now); the learner stays a draining member meanwhile."""
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            a, b = await joined(server.address), await joined(server.address)
            drained = await _admin(server, "RemoveLearners", coordinator_pb2.RemoveLearnersRequest(
                learner_ids=["L0", "L1"], drain=True, after_tokens={"L0": 5000}))
            assert list(drained.learner_ids) == ["L0", "L1"]
            for tokens in (1000, 4000):
                (directive,) = (await a.heartbeat(tokens=tokens)).directives
                assert directive.drain.after_tokens == 5000 and "drained at 5,000 tokens" in directive.drain.reason
            (directive,) = (await b.heartbeat()).directives
            assert directive.drain.after_tokens == 0 and directive.drain.reason == "removed by an operator (drain)"
            assert server.runtime.membership.learner("L0").state == "draining"
            await _admin(server, "RemoveLearners", coordinator_pb2.RemoveLearnersRequest(
                learner_ids=["L0"], drain=True, after_tokens={"L0": 4500}))  # a budget moves it
            (directive,) = (await a.heartbeat(tokens=4200)).directives
            assert directive.drain.after_tokens == 4500 and "drained at 4,500 tokens" in directive.drain.reason
            await a.leave("drained", tokens=5000)
            assert server.runtime.membership.learner("L0").drain_after_tokens == 0  # a departure ends the drain

    run(scenario())


def test_a_heartbeat_carries_two_clock_entries_each_way_however_many_learners_the_run_has(tmp_path, monkeypatch):
    """A learner's session clock is its own entry and the coordinator's: every reply carries
    the coordinator's entry alone, so a heartbeat costs the same at 3 learners as at 2,048
    (docs/results/heartbeat/). The coordinator's clock still merges each learner's entry
    (markers and snapshot manifests carry it whole), never a process the run did not issue,
    and drops learners membership forgot."""
    from diloco.coordinator.core import membership

    monkeypatch.setattr(membership, "MAX_GONE_KEPT", 0)  # a learner that leaves is forgotten at once

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            sessions = [await joined(server.address) for _ in range(3)]
            for _ in range(3):
                for session in sessions:
                    reply = await session.heartbeat()
                    assert set(reply.clock.entries) == {"C"}
                    assert set(session.clock.entries) == {session.learner_id, "C"}
            hostile = sessions[0]
            hostile.clock = hostile.clock.merge(VectorClock({"L999": 7, "S5": 3}))
            await hostile.heartbeat()
            clock = server.runtime.vector_clock
            assert set(clock.entries) == {"C", "L0", "L1", "L2"}
            assert [clock[s.learner_id] for s in sessions] == [s.clock[s.learner_id] for s in sessions]
            assert clock["C"] == sessions[-1].clock["C"] + 1  # every call ticked it: the last reply's, then L0's beat
            for _ in range(20):  # learners come and go: the clock keeps the members' entries
                churn = await joined(server.address)
                await churn.heartbeat()
                await churn.leave("done")
            assert set(server.runtime.vector_clock.entries) == {"C", "L0", "L1", "L2"}
            assert len(server.runtime._clock_entries) <= 2 * (3 + 1 + 1)

    run(scenario())


def test_heartbeats_come_every_fifth_of_the_lease_the_coordinator_announces(tmp_path):
    """Unless told an interval, a learner heartbeats every fifth of the lease, as the
    coordinator's replies announce it (a coordinator restarted with another lease is
    followed); an interval longer than half the lease is refused before any beat."""
    async def scenario():
        async with running_coordinator(tmp_path, lease_s=1.0) as server:
            session = await joined(server.address)
            member = Membership(session.learner_id, auth.Credential(session.learner_id, session.credential), TINY, {}, 5.0)
            with pytest.raises(InvalidArgument, match=r"--heartbeat-s 3 is longer than half the coordinator's lease"):
                Heartbeats(server.address, member, 3.0, stats=dict, on_drain=lambda *_: None)
            beats = Heartbeats(server.address, member, None, stats=dict, on_drain=lambda *_: None)
            assert beats.interval_s == 1.0  # what Join said: 5 s
            beats.start()
            try:
                await wait_for(lambda: beats.interval_s == 0.2, "the interval to follow the announced 1 s lease")
                await asyncio.sleep(2.5)  # 2.5 leases
                assert server.runtime.membership.learner(session.learner_id).state == "active"
            finally:
                await asyncio.to_thread(beats.stop_and_leave, "done")

    run(scenario())


# --- the membership stream -----------------------------------------------------------


def test_membership_stream_and_a_real_shard_hear_of_a_failure_within_one_lease(tmp_path):
    async def scenario():
        lease_s = 0.5
        # Both learners fall silent below: with the hold of a coordinator that hears nobody
        # (test_coordinator_stall.py) they would not fail for 30 s; here it is off.
        async with running_coordinator(tmp_path, lease_s=lease_s, isolation_hold_leases=0.0) as server:
            a = await joined(server.address)
            shard = ShardServer(TINY, SyncerConfig(), ShardServerConfig(secret=SECRET, coordinator=server.address))
            await shard.start()
            try:
                metadata = ((auth.LEARNER_METADATA, "S9"), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, "S9")))
                async with grpc.aio.insecure_channel(server.address) as channel:
                    stream = coordinator_pb2_grpc.CoordinatorStub(channel).WatchMembership(
                        coordinator_pb2.WatchMembershipRequest(watcher="S9"), metadata=metadata
                    )
                    first = await stream.read()
                    assert first.kind == coordinator_pb2.MEMBERSHIP_EVENT_KIND_SNAPSHOT
                    assert [(l.learner_id, l.state) for l in first.learners] == [("L0", common_pb2.LEARNER_STATE_JOINING)]
                    await wait_for(lambda: shard.runtime.core.live == {"L0"}, "the shard to learn of L0")
                    b = await joined(server.address)
                    await b.heartbeat()
                    last_heartbeat = time.monotonic()
                    events = [await stream.read() for _ in range(2)]
                    assert [(e.kind, e.learners[0].learner_id, e.learners[0].state) for e in events] == [
                        (coordinator_pb2.MEMBERSHIP_EVENT_KIND_JOINED, "L1", common_pb2.LEARNER_STATE_JOINING),
                        (coordinator_pb2.MEMBERSHIP_EVENT_KIND_JOINED, "L1", common_pb2.LEARNER_STATE_ACTIVE),
                    ]
                    # Neither heartbeats again: both leases run out; the shard hears it.
                    await wait_for(lambda: shard.runtime.core.failed == {"L0", "L1"}, "the shard to hear of failures")
                    assert time.monotonic() - last_heartbeat < 2 * lease_s
                    failed = await stream.read()
                    assert failed.kind == coordinator_pb2.MEMBERSHIP_EVENT_KIND_FAILED
                    stream.cancel()
                await a.close()
                await b.close()
            finally:
                await shard.stop()

    run(scenario())


def test_watching_needs_a_credential(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stream = coordinator_pb2_grpc.CoordinatorStub(channel).WatchMembership(
                    coordinator_pb2.WatchMembershipRequest(watcher="S0"), metadata=((auth.LEARNER_METADATA, "S0"),)
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(scenario())


def test_an_overlong_incarnation_is_refused_and_changes_nothing(tmp_path):
    """A watcher's process id is at most 64 characters: a longer one (any credential
    holder can send one) gets INVALID_ARGUMENT and is not remembered."""
    async def scenario():
        async with running_coordinator(tmp_path, shards=("127.0.0.1:1",)) as server:
            metadata = ((auth.LEARNER_METADATA, "S0"), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, "S0")))
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                stream = stub.WatchMembership(coordinator_pb2.WatchMembershipRequest(watcher="S0", incarnation="x" * 65),
                                              metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "incarnation has more than 64 characters" in info.value.details()
                assert server.runtime.incarnations == {}
                stream = stub.WatchMembership(coordinator_pb2.WatchMembershipRequest(watcher="S0", incarnation="x" * 64),
                                              metadata=metadata)
                assert (await stream.read()).kind == coordinator_pb2.MEMBERSHIP_EVENT_KIND_SNAPSHOT
                assert server.runtime.incarnations == {"S0": "x" * 64}
                stream.cancel()

    run(scenario())


# --- the coordinator's own state -----------------------------------------------------


def test_state_survives_a_restart_and_restore_makes_learners_rejoin(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            a, b = await joined(server.address), await joined(server.address)
            await a.heartbeat()
            await b.leave("bye")
            async with admin_stub(server.address) as (stub, md):
                await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
            await wait_for(lambda: server.runtime.snapshots.running() is not None, "snapshot 1 to run")
            await a.report_snapshot(1)
            await wait_for(lambda: server.runtime.snapshots.get(1).state == "complete", "snapshot 1 to complete")
        # Restarted (the learner never noticed): same ids, a fresh lease, the counter goes on.
        async with running_coordinator(tmp_path) as server:
            await reconnect(a, server.address)
            await a.heartbeat()
            c = await joined(server.address)
            assert c.learner_id == "L2"
            states = {l.id: l.state for l in server.runtime.membership.listing(include_gone=True)}
            assert states == {"L0": "active", "L1": "left", "L2": "joining"}
            assert [(s.id, s.state) for s in server.runtime.snapshots.listing()] == [(1, "complete")]
        # Restarted from the snapshot: everyone re-joins and bootstraps from the shards.
        async with running_coordinator(tmp_path, restore="latest") as server:
            assert server.runtime.restored_from == 1
            assert server.runtime.membership.live() == []
            await reconnect(a, server.address)
            with pytest.raises(DilocoError, match="restored from snapshot 1; join again"):
                await a.heartbeat()
            assert (await joined(server.address)).learner_id == "L3"
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
            assert reply.snapshot_id == 2

    run(scenario())


def test_restore_of_a_missing_snapshot_is_refused(tmp_path):
    from diloco.errors import NotFound

    with pytest.raises(NotFound, match="no complete snapshot"):
        run(running_coordinator(tmp_path, restore="latest").__aenter__())


def test_an_export_names_the_shard_that_stops_sending(tmp_path, monkeypatch, caplog):
    """A shard that accepts the export's Bootstrap and then sends nothing fails the export
    within the idle bound, UNAVAILABLE and naming it, instead of holding it for the whole
    deadline; the coordinator logs whether the shard still answers Status."""
    from diloco.coordinator import service
    from diloco.v1 import syncer_pb2, syncer_pb2_grpc

    class Silent(syncer_pb2_grpc.SyncerServicer):
        async def Bootstrap(self, request, context):
            await asyncio.Event().wait()  # accepted, never answered
            yield syncer_pb2.BootstrapReply()

        async def Status(self, request, context):
            return syncer_pb2.StatusReply(shard_id=0, fragments=[syncer_pb2.FragmentStatus(fragment=0, version=7)])

    async def scenario():
        silent = grpc.aio.server()
        syncer_pb2_grpc.add_SyncerServicer_to_server(Silent(), silent)
        address = f"127.0.0.1:{silent.add_insecure_port('127.0.0.1:0')}"
        await silent.start()
        monkeypatch.setattr(service, "EXPORT_IDLE_S", 0.5)
        try:
            async with running_coordinator(tmp_path, shards=(address,)) as server:
                session = await joined(server.address)
                await session.register_model(model_plan(TINY)[0].to_json())
                async with admin_stub(server.address) as (stub, md):
                    started = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        async for _ in stub.ExportModel(coordinator_pb2.ExportModelRequest(), metadata=md, timeout=20):
                            pass
                    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert error.value.details() == f"shard 0 at {address} sent nothing for 0.5 s"
                    assert time.monotonic() - started < 10
                assert f"export: shard 0 at {address} sent nothing for 0.5 s; its Status answers: fragment 0 v7 (idle)" \
                    in caplog.text
        finally:
            await silent.stop(None)

    run(scenario())


def test_a_learner_registers_its_model_once_its_coordinator_is_reachable_again(tmp_path):
    """Cut off right after its join (found by the partitions soak: the learner exited with
    an error), a learner's RegisterModel retries UNAVAILABLE with backoff, as its join does."""
    import socket

    from diloco.learner.membership import join, register_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"

    async def scenario():
        async with running_coordinator(tmp_path, port=port):
            member = await asyncio.to_thread(join, address, auth.join_credential(SECRET, "test", 64), "", "", "host:1")
        back, done = asyncio.Event(), asyncio.Event()

        async def restart_later():
            await asyncio.sleep(1.5)
            async with running_coordinator(tmp_path, port=port):
                back.set()
                await done.wait()

        task = asyncio.create_task(restart_later())
        started = time.monotonic()
        try:
            topology = await asyncio.to_thread(register_model, address, member, model_plan(TINY)[0].to_json(), 30.0)
        finally:
            done.set()
            await task
        assert back.is_set() and time.monotonic() - started >= 1.5
        assert topology.manifest_json == model_plan(TINY)[0].to_json()
    run(scenario())
