"""A shard's side of Chandy-Lamport: what is recorded at the cut, which later pushes are
channel state, and a restore that reproduces the run bit for bit with every push
counted once."""

import json

import pytest
import torch

from diloco.codec import encode
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.manifest import Manifest
from diloco.syncer import snapshot as snapshot_files
from diloco.syncer.core.rounds import RoundView
from diloco.wire import PushMeta
from diloco.syncer.core.shard import ACCEPTED, DUPLICATE, Pending, ShardCore, compute_round, inspect_payload
from diloco.syncer.core.snapshot import ChannelRecorder, Decision, capture, push_in, push_out, restore
from tests.unit.test_syncer_shard import PARAMS, Learner, close, make_shard
import numpy as np
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
    state = capture(shard, snapshot_id=1, now=2.0)
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


# --- more of the recorder, capture and restore, pinned exactly ------------------------


def manifest_text():
    return json.dumps({"entries": [{"name": n, "shape": list(s), "dtype": "float32", "kind": "parameter"} for n, s in PARAMS]})


def shard_from_manifest(num_fragments=2, initialised=(0, 1)):
    """A shard that learnt its model from the run's manifest; only ``initialised``
    fragments have values (the others wait for their first learner)."""
    text = manifest_text()
    cfg = make_shard()[0].cfg
    shard = ShardCore(cfg)
    shard.adopt_plan(Manifest.from_json(text).plan(num_fragments), text)
    _, initial = make_shard(num_fragments=num_fragments)
    for fid in initialised:
        shard.add_fragment(fid, initial[fid])
    shard.set_membership({"L0", "L1"}, {"L9"})
    return shard, initial


def test_channel_recorder_decisions_are_exact_and_exclusions_are_counted():
    shard, initial = make_shard(quorum=3)
    l0, l1, l2 = (Learner(f"L{i}", shard, initial, seed=i) for i in range(3))
    recorder = ChannelRecorder(snapshot_id=2, cut_versions={0: 0, 1: 0}, open_channels={"L0", "L1"})

    first = push(l0, 0, now=1.0, epoch=1)
    assert observe(recorder, first) == Decision(True, "in flight at the cut: recorded as channel state of L0")
    meta, payload, _ = first
    again = (meta, payload, shard.accept(meta, payload, 1000, 1.1))
    assert observe(recorder, again) == Decision(False, "duplicate: already counted in the recorded state")
    assert observe(recorder, push(l2, 0, now=1.2)) == Decision(False, "no open channel from L2: after the cut")
    assert observe(recorder, push(l0, 1, now=1.3, epoch=2)) == Decision(False, "marker 2 reached L0: its channel is closed")
    # Two pushes built on updates sent after the cut: both excluded, both counted.
    shard.fragments[1].version = 1
    for now in (1.5, 1.6):
        late = observe(recorder, push(l1, 1, now=now, epoch=1, base=1))
        assert late == Decision(False, "base version 1 is after the cut: not recorded")
    assert recorder.excluded == 2
    assert [m.learner_id for m, _ in recorder.recorded] == ["L0"]


def test_a_channel_push_without_wire_size_replays_as_zero_bytes():
    shard, initial = make_shard()
    meta, payload, _ = push(Learner("L0", shard, initial, seed=0), 0, now=1.0)
    assert push_in(push_out(meta, payload))[2] == 0
    assert push_in(push_out(meta, payload, 1234))[2] == 1234


def test_capture_refuses_a_fragment_whose_round_is_being_applied():
    shard, initial = make_shard()
    Learner("L0", shard, initial, seed=0).push(0, now=1.0)
    job = shard.begin_round(0, shard.decide(0, 1.0), 1.0)
    with pytest.raises(FailedPrecondition) as error:
        capture(shard, snapshot_id=1, now=0.0)
    assert str(error.value) == "fragment 0 is applying a round: cannot record it"
    shard.finish_round(job, compute_round(job, shard.cfg), 1.1)
    assert capture(shard, snapshot_id=1, now=0.0)["snapshot_id"] == 1


def test_a_shard_with_no_model_is_recorded_and_restored_as_such():
    cfg = make_shard()[0].cfg
    state = capture(ShardCore(cfg), snapshot_id=3, now=0.0)
    assert (state["snapshot_id"], state["plan_hash"], state["manifest"], state["num_fragments"], state["fragments"]) == (
        3, "", "", 0, []
    )
    fresh = ShardCore(cfg)
    restore(fresh, state, now=1.0)
    assert fresh.plan is None and fresh.fragments == {}


def test_a_shard_with_no_model_learns_it_from_the_snapshot():
    shard, initial = shard_from_manifest(initialised=(0,))  # fragment 1 still waits for a learner
    state = capture(shard, snapshot_id=1, now=0.0)
    assert state["num_fragments"] == 2 and state["manifest"] == manifest_text()

    fresh = ShardCore(shard.cfg)
    restore(fresh, state, now=5.0)
    assert fresh.plan.plan_hash == shard.plan.plan_hash
    assert fresh.manifest_json == manifest_text()
    assert sorted(fresh.fragments) == [0]
    assert_same_tensors(fresh.fragments[0].params, shard.fragments[0].params, "params")
    assert all(p.dtype.name == "float32" for p in fresh.fragments[0].params)
    with pytest.raises(FailedPrecondition, match="fragment 1 has no value yet"):
        fresh.state_of(1)
    assert (fresh.live, fresh.failed) == ({"L0", "L1"}, {"L9"})


def test_restore_refuses_what_does_not_fit_with_exact_messages():
    shard, _ = make_shard()
    good = capture(shard, snapshot_id=1, now=0.0)

    def refused(change, error_type):
        state = {**good, **change}
        with pytest.raises(error_type) as error:
            restore(make_shard()[0], state, now=1.0)
        return str(error.value)

    assert refused({"format": 7}, InvalidArgument) == "unknown shard snapshot format 7"
    assert refused({"shard_id": 2, "num_shards": 3}, FailedPrecondition) == (
        "snapshot is of shard 2 of 3, this is shard 0 of 1"
    )
    # A snapshot of a run planned into three fragments, restored into a two-fragment shard.
    other, _ = shard_from_manifest(num_fragments=3, initialised=(0, 1, 2))
    assert refused(capture(other, snapshot_id=1, now=0.0), FailedPrecondition) == (
        "snapshot was taken with another fragment plan: check the model flags"
    )
    assert refused({"fragments": good["fragments"][:1]}, FailedPrecondition) == (
        "snapshot holds fragments [0], this shard owns [0, 1]"
    )
    bad_shape = {**good["fragments"][1], "momentum": [t[:1] for t in good["fragments"][1]["momentum"]]}
    assert refused({"fragments": [good["fragments"][0], bad_shape]}, FailedPrecondition) == (
        "fragment 1: recorded momentum shapes do not match the plan"
    )


@pytest.mark.parametrize("quorum", [1, 2])
def test_restored_open_round_reopens_at_restore_time(quorum):
    shard, initial = make_shard(quorum=quorum)
    meta, payload, _ = Learner("L0", shard, initial, seed=0).push(0, now=1.0)
    wire_bytes = shard.fragments[0].open["L0"].wire_bytes
    fresh, _ = make_shard(quorum=quorum)
    restore(fresh, capture(shard, snapshot_id=1, now=1.0), now=10.0)
    assert fresh.fragments[0].open == {"L0": Pending(meta, payload, 10.0, wire_bytes)}
    # The round reopens now; with the quorum already there, it was reached now too.
    assert fresh.view(0) == RoundView(
        pushed=frozenset({"L0"}),
        live=frozenset({"L0", "L1", "L2"}),
        opened_at=10.0,
        quorum_at=10.0 if quorum == 1 else None,
        grace_s=shard.view(0).grace_s,
    )


def test_restored_chain_serves_the_same_updates_and_keeps_its_length():
    shard, initial = make_shard(quorum=1, chain=1)
    learner = Learner("L0", shard, initial, seed=0)
    for round_ in (1, 2):
        learner.push(0, now=float(round_))
        close(shard, 0, now=round_ + 0.1)
        learner.apply(shard.update_for(0, learner.version[0]))
    fresh, _ = make_shard(quorum=1, chain=1)
    restore(fresh, capture(shard, snapshot_id=1, now=2.1), now=10.0)
    # Base 1: the recorded delta segment; base 0: older than the chain, the full values.
    assert [s.kind for s in fresh.update_for(0, 1).segments] == ["delta"]
    assert fresh.update_for(0, 1) == shard.update_for(0, 1)
    assert [s.kind for s in fresh.update_for(0, 0).segments] == ["full"]
    assert fresh.update_for(0, 0) == shard.update_for(0, 0)
    # One more round in both: the chain still holds one segment, so base 1 gets full values.
    meta, payload, _ = learner.push(0, now=11.0)
    fresh.accept(meta, payload, 100, now=11.0)
    close(shard, 0, now=11.1)
    close(fresh, 0, now=11.1)
    assert [s.kind for s in fresh.update_for(0, 1).segments] == ["full"]
    assert fresh.update_for(0, 1) == shard.update_for(0, 1)


@pytest.mark.parametrize("spec", ["latest", "2"])
def test_a_snapshot_copied_under_a_higher_id_is_refused_naming_both_ids(tmp_path, spec):
    """Issue 39: the mac covers the manifest, not its directory's name, so a genuine older
    snapshot copied to ``000002/`` was restored as ``latest``. Refused, so that an operator
    notices; the genuine one still restores by its own id."""
    from diloco.snapshots import find_manifest, read_manifest, sign_manifest

    secret = "run secret"
    manifest = sign_manifest(secret, {"format": 1, "snapshot_id": 1, "files": []})
    for directory in ("000001", "000002"):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match=r"directory 000002 holds the signed manifest of snapshot 1\b"):
        snapshot_files.load_for_restore(spec, tmp_path, 0, secret)
    assert read_manifest(find_manifest(tmp_path, "1"), secret)["snapshot_id"] == 1


def test_a_snapshot_carries_the_influence_bounds_and_a_restored_shard_continues_them():
    """The other learners' latest pushes (norms, weights, times as ages), the reference
    direction and the departed learners come back with the snapshot, on the restored shard's
    own clock: its next push is held to the same bound as on the shard that never stopped,
    not to the lone-learner fallback (issue #56: a restored shard restarted its bounds)."""
    from diloco.syncer.core.bounds import Push

    shard, initial = make_shard()
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    for rnd in range(3):
        for learner in learners:
            learner.push(0, now=10.0 * rnd + float(learner.name[1]))
            close(shard, 0, now=10.0 * rnd + 5)
            learner.apply(shard.update_for(0, learner.version[0]))
    state = shard.fragments[0]
    assert len(state.influence.latest) == 3 and any(np.any(r) for r in state.reference)
    state.departed = {"L9": state.version + 2}
    saved = capture(shard, snapshot_id=1, now=100.0)
    fresh, _ = make_shard()
    restore(fresh, saved, now=5000.0)  # another process: its clock is its own
    back = fresh.fragments[0]
    for (learner, mine), (_, theirs) in zip(back.influence.latest.items(), state.influence.latest.items()):
        assert (mine.norm, mine.weight, mine.interval, mine.cos, mine.counted) \
            == (theirs.norm, theirs.weight, theirs.interval, theirs.cos, theirs.counted)
        assert mine.at - 5000.0 == pytest.approx(theirs.at - 100.0)
    assert list(back.influence.latest) == list(state.influence.latest)
    assert back.influence.last_at - 5000.0 == pytest.approx(state.influence.last_at - 100.0)
    assert back.influence.turned_by == state.influence.turned_by and len(state.influence.turned_by) == 2
    assert state.influence.unvouched_at is not None  # the second learner's first push had nothing to judge it
    assert back.influence.unvouched_at - 5000.0 == pytest.approx(state.influence.unvouched_at - 100.0)
    assert_same_tensors(back.reference, state.reference, "reference")
    assert back.departed == state.departed
    push = Push("L0", norm=1.0, weight=64.0, at=101.0)
    before = state.influence.bounds([push], 3.0, lambda: 1.0)
    after = back.influence.bounds([dataclasses_replace(push, at=5001.0)], 3.0, lambda: 1.0)
    assert after == before and before[0].weight_cap < float("inf")  # the others' bound, not the fallback's


def test_a_snapshot_carries_the_validators_judgements():
    """What the validator said of each learner: a restored shard keeps distrusting a
    learner it distrusted, and keeps the unjudged on probation."""
    shard, initial = make_shard(validator=True)
    shard.set_trust("L1", 0, 0.0)
    shard.set_trust("L0", 0, 0.75)
    saved = capture(shard, snapshot_id=1, now=100.0)
    fresh, _ = make_shard(validator=True)
    restore(fresh, saved, now=5000.0)
    state = fresh.fragments[0]
    assert state.trust == {"L1": 0.0, "L0": 0.75}
    assert fresh.trust_of(state, "L0") == 0.75 and fresh.trust_of(state, "L1") == 0.0
    assert fresh.trust_of(state, "L2") == 0.0  # never judged
    # A snapshot from before judgements were kept: everyone on probation until judged again.
    del saved["fragments"][0]["trust"]
    older, _ = make_shard(validator=True)
    restore(older, saved, now=5000.0)
    assert older.trust_of(older.fragments[0], "L0") == 0.0


def dataclasses_replace(push, **changes):
    import dataclasses

    return dataclasses.replace(push, **changes)
