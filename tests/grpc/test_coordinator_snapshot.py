"""Chandy-Lamport end to end over real servers on 127.0.0.1:0: a coordinator, a shard
and fake learners pushing real int4 payloads. A push in flight at the cut is recorded
as channel state; restoring the shard from the snapshot reproduces the run's parameters
bit for bit, with every push counted once."""

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math


from diloco.tape import read_tape
from diloco.v1 import coordinator_pb2
from diloco.syncer.config import RoundConfig, SyncerConfig
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, TINY, client_for, run
from tests.seeded import model_plan, seeded_core
from tests.grpc.coordinator_fixtures import admin_stub, joined, running_coordinator, wait_for
from tests.grpc.test_syncer_service import FakeLearner
from tests.checks import assert_same_tensors

# Bounds that never bind: a snapshot does not carry a fragment's Influence (its learners'
# latest norms and push intervals, syncer.core.bounds), and the live round's time-based
# clip depends on how long the snapshot took; restored, the round would be bounded anew.
SHARD_CFG = SyncerConfig(rounds=RoundConfig(quorum=2, grace_mode="off"), robust_multiple=math.inf)


class EpochLearner(FakeLearner):
    """A fake learner that stamps its pushes with the newest marker it has seen."""

    epoch = 0

    def next_push(self, **kw):
        meta, encoded = super().next_push(**kw)
        return dataclasses.replace(meta, snapshot_epoch=self.epoch), encoded


def test_snapshot_records_in_flight_pushes_and_restore_counts_each_once(tmp_path):
    async def scenario():
        shard = ShardServer(TINY, SHARD_CFG, ShardServerConfig(secret=SECRET, data_dir=tmp_path / "shard"),
                            seeded_core(TINY, SHARD_CFG))
        model_manifest, plan, initial_state = model_plan(TINY)
        shard_address = f"127.0.0.1:{await shard.start()}"
        try:
            async with running_coordinator(tmp_path, shards=(shard_address,), snapshot_timeout_s=30) as coordinator:
                shard.follow(coordinator.address)
                sessions = [await joined(coordinator.address) for _ in range(2)]
                for session in sessions:
                    await session.register_model(model_manifest.to_json())
                    await session.heartbeat()
                await wait_for(lambda: shard.runtime.core.live == {"L0", "L1"}, "the shard to learn of L0 and L1")
                frag0 = [EpochLearner.of(shard, f"L{i}", fragment=0, seed=i) for i in range(2)]
                frag1 = [EpochLearner.of(shard, f"L{i}", fragment=1, seed=10 + i) for i in range(2)]
                async with client_for(shard_address, "L0") as c0, client_for(shard_address, "L1") as c1:
                    await asyncio.gather(frag0[0].push(c0), frag0[1].push(c1))  # fragment 0 -> version 1
                    # L0's next push waits in the open round (quorum 2) when the marker arrives.
                    acked = asyncio.Event()
                    waiting = asyncio.ensure_future(frag0[0].push_with_ack(c0, acked))
                    await asyncio.wait_for(acked.wait(), 10)

                    async with admin_stub(coordinator.address) as (stub, md):
                        reply = await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
                    assert reply.snapshot_id == 1
                    await wait_for(lambda: shard.runtime.snapshot_epoch == 1, "the shard to record its state")

                    # L1 sent this before it saw the marker: in flight at the cut.
                    in_flight = frag0[1].next_push()
                    result = await c1.push(*in_flight)
                    frag0[1].anchor = result.update.apply_to(frag0[1].anchor)
                    assert result.update.version == 2 and (await waiting).update.version == 2

                    # The learners get the marker with their heartbeat, record, report, and
                    # from then on stamp epoch 1: their next pushes close their channels.
                    for session, learner in zip(sessions, frag1):
                        beat = await session.heartbeat()
                        (directive,) = beat.directives
                        assert directive.snapshot.snapshot_id == 1
                        assert directive.snapshot.directory.endswith("000001")
                        await session.report_snapshot(1)
                        learner.epoch = 1
                    await asyncio.gather(frag1[0].push(c0), frag1[1].push(c1))  # after the cut

                await wait_for(lambda: coordinator.runtime.snapshots.get(1).state == "complete", "snapshot 1 to complete")
                snapshot = coordinator.runtime.snapshots.get(1)
                live = {f: (s.version, [t.copy() for t in s.params]) for f, s in shard.runtime.core.fragments.items()}
                assert {f: v for f, (v, _) in live.items()} == {0: 2, 1: 1}

            manifest = json.loads((tmp_path / "coordinator" / "snapshots" / "000001" / "manifest.json").read_text())
            assert snapshot.manifest.endswith("000001/manifest.json")
            assert manifest["participants"] == ["S0", "L0", "L1"]
            assert set(manifest["cut"]) == {"S0", "L0", "L1"} and manifest["cut"]["S0"]["S0"] >= 1
            assert manifest["run"]["plan_hash"] == plan.plan_hash
            assert manifest["run"]["manifest"] == model_manifest.to_json()
            files = {f["path"]: f for f in manifest["files"]}
            assert set(files) == {"S0-state.npz", "S0-channel.npz"}
            for name, entry in files.items():
                assert hashlib.sha256((tmp_path / "coordinator" / "snapshots" / "000001" / name).read_bytes()).hexdigest() == entry["sha256"]
            shard.runtime.tape.flush()  # the tape fsyncs in batches
            marker = [r for r in read_tape(tmp_path / "shard" / "tape-S0.jsonl") if r["kind"] in ("marker", "snapshot")]
            assert [(r["kind"], r["snapshot"]) for r in marker] == [("marker", 1), ("snapshot", 1)]
            assert marker[0]["versions"] == {"0": 1, "1": 0} and marker[1]["channel_pushes"] == 1

            # Restore into a shard that holds no model: the plan comes from the snapshot's
            # manifest; versions at the cut, L0's open push from the state, L1's from the
            # channel; the round they form closes again and lands on the same bits.
            restored = ShardServer(
                TINY, SHARD_CFG,
                ShardServerConfig(secret=SECRET, snapshot_dir=tmp_path / "coordinator" / "snapshots", restore="latest"),
            )
            core = restored.runtime.core
            assert {f: s.version for f, s in core.fragments.items()} == {0: 1, 1: 0}
            assert sorted(core.fragments[0].open) == ["L0", "L1"]
            address = f"127.0.0.1:{await restored.start()}"
            try:
                await wait_for(lambda: core.fragments[0].version == 2, "the restored round to close")
                assert_same_tensors(core.fragments[0].params, live[0][1])
                initial = plan.gather(1, initial_state)
                assert_same_tensors(core.fragments[1].params, initial)
                async with client_for(address, "L1") as c1:
                    again = await c1.push(*in_flight)  # the in-flight push, retried: not counted twice
                assert again.outcome == "duplicate" and core.fragments[0].version == 2
            finally:
                await restored.stop()
        finally:
            await shard.stop()

    run(scenario())


def test_a_shard_that_cannot_be_reached_fails_the_snapshot(tmp_path):
    async def scenario():
        # A port nobody listens on: the marker fails with UNAVAILABLE after its retries.
        async with running_coordinator(tmp_path, shards=("127.0.0.1:1",), snapshot_timeout_s=10) as coordinator:
            async with admin_stub(coordinator.address) as (stub, md):
                await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
                await wait_for(lambda: coordinator.runtime.snapshots.get(1).state == "failed", "the snapshot to fail")
                (info,) = (await stub.ListSnapshots(coordinator_pb2.ListSnapshotsRequest(), metadata=md)).snapshots
            assert info.state == coordinator_pb2.SNAPSHOT_STATE_FAILED
            assert info.detail.startswith("marker to S0 at 127.0.0.1:1 failed") and "UNAVAILABLE" in info.detail

    run(scenario())


@contextlib.asynccontextmanager
async def _shard_with_two_learners(tmp_path):
    """A shard that follows a coordinator whose two learners it knows. Yields (shards,
    coordinator): ``shards[-1]`` is the shard's current process (``_restart`` appends the
    next one); it is stopped at the end."""
    model_manifest, _, _ = model_plan(TINY)
    shards = [ShardServer(TINY, SHARD_CFG, ShardServerConfig(secret=SECRET), seeded_core(TINY, SHARD_CFG))]
    port = await shards[0].start()
    try:
        async with running_coordinator(tmp_path, shards=(f"127.0.0.1:{port}",), snapshot_timeout_s=120) as coordinator:
            shards[0].follow(coordinator.address)
            for _ in range(2):
                session = await joined(coordinator.address)
                await session.register_model(model_manifest.to_json())
            await wait_for(lambda: shards[0].runtime.core.live == {"L0", "L1"}, "the shard to learn of L0 and L1")
            yield shards, coordinator
    finally:
        await shards[-1].stop()


async def _restart(shards: list[ShardServer]) -> ShardServer:
    """Stop the shard's process and start a new one, with no state, on the same port."""
    port = shards[-1].port
    await shards[-1].stop()
    shards.append(ShardServer(TINY, SHARD_CFG, ShardServerConfig(secret=SECRET, port=port), seeded_core(TINY, SHARD_CFG)))
    assert await shards[-1].start() == port
    return shards[-1]


def test_a_shard_that_restarts_before_it_reports_fails_the_snapshot_and_the_next_one_runs(tmp_path):
    """The shard recorded its state but waits for the learners' channels when it restarts:
    the channel state is gone with the process, and it will never report. The coordinator
    learns of the restart from the new process's WatchMembership and fails the snapshot at
    once (it used to hold every later snapshot until the timeout); the next snapshot's
    marker reaches the new process."""
    async def scenario():
        async with _shard_with_two_learners(tmp_path) as (shards, coordinator):
            shard, books = shards[-1], coordinator.runtime.snapshots
            async with admin_stub(coordinator.address) as (stub, md):
                await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
                await wait_for(lambda: shard.runtime.snapshot_epoch == 1, "the shard to record its state")
                await wait_for(lambda: "S0" in books.get(1).marked, "the marker's answer")
                assert books.get(1).marked["S0"] == shard.runtime.incarnation
                await asyncio.sleep(0.5)
                assert books.get(1).state == "running" and "S0" in books.get(1).waiting
                shard = await _restart(shards)
                shard.follow(coordinator.address)
                await wait_for(lambda: books.get(1).state == "failed", "the snapshot to fail")
                assert books.get(1).detail == "S0 restarted before it reported"
                reply = await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
                assert reply.snapshot_id == 2
                await wait_for(lambda: shard.runtime.snapshot_epoch == 2, "the restarted shard to record snapshot 2")
                assert books.get(1).state == "failed"  # the new process's stream fails nothing more

    run(scenario())


def test_a_shard_that_restarted_just_before_the_marker_records_it_and_the_snapshot_goes_on(tmp_path):
    """The new process got the marker before the coordinator heard of it: its answer names
    it, so learning of the restart afterwards fails nothing (it used to fail the snapshot)."""
    async def scenario():
        async with _shard_with_two_learners(tmp_path) as (shards, coordinator):
            runtime, books = coordinator.runtime, coordinator.runtime.snapshots
            old = shards[-1].runtime.incarnation
            assert runtime.incarnations == {"S0": old}
            shard = await _restart(shards)
            async with admin_stub(coordinator.address) as (stub, md):
                await stub.StartSnapshot(coordinator_pb2.StartSnapshotRequest(), metadata=md)
                await wait_for(lambda: "S0" in books.get(1).marked, "the marker's answer")
            assert books.get(1).marked["S0"] == shard.runtime.incarnation != old
            shard.follow(coordinator.address)
            await wait_for(lambda: runtime.incarnations["S0"] == shard.runtime.incarnation, "the new process to follow")
            assert books.get(1).state == "running" and "S0" in books.get(1).waiting

    run(scenario())
