"""A shard's side of Chandy-Lamport: what is recorded at the cut, which later pushes are
channel state, and a restore that reproduces the run bit for bit with every push
counted once."""

import torch

from diloco.codec import encode
from syncer import snapshot as snapshot_files
from syncer.core.shard import ACCEPTED, DUPLICATE, PushMeta, inspect_payload
from syncer.core.snapshot import ChannelRecorder, capture, push_in, restore
from tests.unit.test_syncer_shard import Learner, close, make_shard
from tests.checks import assert_same_tensors


def push(learner, fid, now, epoch=0, base=None):
    """Learner.push, stamped with the learner's snapshot epoch."""
    pieces = learner.shard.plan.fragments[fid].pieces
    encoded = [encode(p.name, torch.randn(p.shape, generator=learner.g) * 0.01) for p in pieces]
    learner.clock = learner.clock.tick(learner.name)
    version = learner.version[fid] if base is None else base
    meta = PushMeta(learner.name, fid, version, 64, 4, 0.1, learner.clock, tuple(e.spec for e in encoded), epoch)
    payload = inspect_payload(meta.specs, b"".join(e.payload for e in encoded))
    return meta, payload, learner.shard.accept(meta, payload, 1000, now)


def observe(recorder, pushed):
    meta, payload, ack = pushed
    return recorder.observe(meta, payload, ack.outcome)


def test_channel_recorder_as_a_state_machine():
    shard, initial = make_shard(quorum=3)
    l0, l1, l2 = (Learner(f"L{i}", shard, initial, seed=i) for i in range(3))
    recorder = ChannelRecorder(snapshot_id=2, cut_versions={0: 0, 1: 0}, open_channels={"L0", "L1"})

    first = push(l0, 0, now=1.0, epoch=1)
    decision = observe(recorder, first)
    assert decision.recorded and decision.reason == "in flight at the cut: recorded as channel state of L0"
    meta, payload, _ = first
    again = (meta, payload, shard.accept(meta, payload, 1000, 1.1))
    assert again[2].outcome == DUPLICATE
    assert observe(recorder, again).reason == "duplicate: already counted in the recorded state"
    assert observe(recorder, push(l2, 0, now=1.2)).reason == "no open channel from L2: after the cut"
    # L0 has recorded: its pushes are stamped with epoch 2 and close its channel.
    assert observe(recorder, push(l0, 1, now=1.3, epoch=2)).reason == "marker 2 reached L0: its channel is closed"
    assert observe(recorder, push(l0, 0, now=1.4, epoch=1)).reason == "no open channel from L0: after the cut"
    assert not recorder.done
    # A push built on an update sent after the cut is itself after the cut.
    shard.fragments[1].version = 1
    late = observe(recorder, push(l1, 1, now=1.5, epoch=1, base=1))
    assert not late.recorded and "after the cut" in late.reason and recorder.excluded == 1
    recorder.learner_gone("L1")
    assert recorder.done
    assert [m.learner_id for m, _ in recorder.recorded] == ["L0"]


def test_restore_reproduces_the_run_and_counts_in_flight_pushes_once(tmp_path):
    shard, initial = make_shard(quorum=2)
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(2)]
    l0, l1 = learners
    # Round 1 closes; round 2 is open with L0's push when the marker arrives.
    push(l0, 0, now=1.0)
    push(l1, 0, now=1.0)
    close(shard, 0, now=1.1)
    for learner in learners:
        learner.apply(shard.update_for(0, 0))
    push(l0, 0, now=2.0)
    shard.set_membership({"L0", "L1"}, set())
    state = capture(shard, snapshot_id=1)
    recorder = ChannelRecorder(1, {f: s.version for f, s in shard.fragments.items()}, {"L0", "L1"})
    written = snapshot_files.write(tmp_path, snapshot_files.state_name(0), state)

    # L1's push was sent before L1 saw the marker: in flight at the cut.
    in_flight = push(l1, 0, now=3.0, epoch=0)
    assert observe(recorder, in_flight).recorded
    close(shard, 0, now=3.1)  # the live run closes round 2 with {L0, L1}
    # After the cut: L0 recorded and pushes fragment 1 with epoch 1; not in the snapshot.
    assert not observe(recorder, push(l0, 1, now=4.0, epoch=1)).recorded
    channel = snapshot_files.write_channel(tmp_path, 0, 1, recorder.recorded)
    assert written.size_bytes == (tmp_path / written.path).stat().st_size
    assert len(channel.sha256) == 64

    fresh, _ = make_shard(quorum=2)
    loaded = snapshot_files.loads(tmp_path / written.path)
    restore(fresh, loaded, now=10.0)
    assert {f: s.version for f, s in fresh.fragments.items()} == {0: 1, 1: 0}
    assert sorted(fresh.fragments[0].open) == ["L0"]
    for meta, payload, wire_bytes in (push_in(p) for p in snapshot_files.loads(tmp_path / channel.path)["pushes"]):
        assert fresh.accept(meta, payload, wire_bytes, now=10.0).outcome == ACCEPTED
        # The same push once more (a learner retrying it) is not counted again.
        assert fresh.accept(meta, payload, wire_bytes, now=10.0).outcome == DUPLICATE
    close(fresh, 0, now=10.1)
    original = shard.fragments[0]
    restored = fresh.fragments[0]
    assert restored.version == original.version == 2
    for name in ("params", "momentum", "residual"):
        assert_same_tensors(getattr(restored, name), getattr(original, name), name)
    assert [s.version for s in restored.chain] == [s.version for s in original.chain]
    assert torch.equal(torch.from_numpy(fresh.fragments[1].params[0]), initial[1][0])  # L0's post-cut push is not there
    assert fresh.fragments[1].open == {}
