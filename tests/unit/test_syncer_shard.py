"""The shard core with a fake clock: rounds, idempotence, the bit-identical downlink, validation."""

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from diloco.clock import VectorClock
from diloco.codec import decode, encode
from diloco.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from diloco.fragments import plan_fragments
from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig
from diloco.syncer.core.bounds import FALLBACK_PERIOD_S, FALLBACK_RATIO, FLOOR_RATIO, Push
from diloco.syncer.core.rounds import Close, Wait
from diloco.syncer.core.shard import (
    ACCEPTED,
    Ack,
    ACCEPTED_NEXT_ROUND,
    DUPLICATE,
    PushMeta,
    PushPayload,
    ShardCore,
    compute_round,
    inspect_payload,
)
from tests.checks import assert_same_tensors

PARAMS = [("tok_embed.weight", (16, 8)), ("block.w", (24, 8)), ("block.b", (24,))]


def make_shard(quorum=1, grace_mode="off", chain=4, num_fragments=2, validator=False, **merge):
    plan = plan_fragments(PARAMS, num_fragments)
    g = torch.Generator().manual_seed(0)
    model = {n: torch.randn(s, generator=g) for n, s in PARAMS}
    initial = {f.id: [t.clone() for t in plan.gather(f.id, model)] for f in plan.fragments}
    cfg = SyncerConfig(
        rounds=RoundConfig(quorum=quorum, grace_mode=grace_mode),
        merge=MergeConfig(update_chain_length=chain, **merge), validator=validator,
    )
    shard = ShardCore(cfg, plan, initial)
    shard.set_membership({"L0", "L1", "L2"}, set())  # pushes come only from live members
    return shard, initial


class Learner:
    """Just enough of a learner: an anchor per fragment, a clock, int4 pushes."""

    def __init__(self, name, shard, initial, seed):
        self.name, self.shard = name, shard
        self.anchor = {fid: [t.clone() for t in ts] for fid, ts in initial.items()}
        self.version = {fid: 0 for fid in initial}
        self.clock = VectorClock()
        self.g = torch.Generator().manual_seed(seed)

    def push(self, fid, now, tokens=64, steps=4, specs_override=None, scale=0.01, deltas=None, final=False):
        pieces = self.shard.plan.fragments[fid].pieces
        if deltas is None:
            deltas = [torch.randn(p.shape, generator=self.g) * scale for p in pieces]
        encoded = [encode(p.name, d) for p, d in zip(pieces, deltas)]
        self.clock = self.clock.tick(self.name)
        meta = PushMeta(
            self.name, fid, self.version[fid], tokens, steps, 0.1, self.clock,
            tuple(e.spec for e in encoded) if specs_override is None else specs_override, final=final,
        )
        self.shard.check_header(meta)
        payload = inspect_payload(meta.specs, b"".join(e.payload for e in encoded))
        return meta, payload, self.shard.accept(meta, payload, sum(len(e.payload) for e in encoded), now)

    def apply(self, update):
        for segment in update.segments:
            for i, tensor in enumerate(segment.tensors):
                value = decode(tensor.spec, tensor.payload)
                if segment.kind == "delta":
                    self.anchor[update.fragment][i] = self.anchor[update.fragment][i] + value
                else:
                    self.anchor[update.fragment][i] = value
        self.version[update.fragment] = update.version


def close(shard, fid, now):
    decision = shard.decide(fid, now)
    job = shard.begin_round(fid, decision, now)
    shard.finish_round(job, compute_round(job, shard.cfg), now + 0.01)
    return job


def test_round_closes_and_downlink_is_bit_identical():
    shard, initial = make_shard()
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    shard.set_membership({"L0", "L1", "L2"}, set())
    for rnd in range(6):
        for learner in learners:
            _, _, ack = learner.push(0, now=rnd)
            assert ack.outcome == ACCEPTED and ack.target_version == rnd + 1
        job = close(shard, 0, now=rnd + 0.5)
        assert job.reason == "all 3 live learners pushed"
        for learner in learners:
            learner.apply(shard.update_for(0, learner.version[0]))
    state = shard.fragments[0]
    assert state.version == 6
    for learner in learners:
        for mine, theirs in zip(learner.anchor[0], state.params):
            assert torch.equal(mine, torch.from_numpy(theirs))


def test_duplicate_push_is_acknowledged_not_applied():
    shard, initial = make_shard()
    learner = Learner("L0", shard, initial, seed=0)
    meta, decoded, ack = learner.push(0, now=0.0)
    assert ack.outcome == ACCEPTED
    again = shard.accept(meta, decoded, 10, now=0.1)
    assert again == dataclasses.replace(ack, outcome=DUPLICATE)
    assert len(shard.fragments[0].open) == 1 and shard.pushes_received == 1


def test_push_during_apply_joins_next_round():
    shard, initial = make_shard(quorum=1)
    a, b = Learner("L0", shard, initial, 0), Learner("L1", shard, initial, 1)
    shard.set_membership({"L0", "L1"}, set())
    a.push(0, now=0.0)
    job = shard.begin_round(0, shard.decide(0, 0.0), 0.0)  # grace off: closes at quorum 1
    _, _, ack = b.push(0, now=0.1)
    assert ack.outcome == ACCEPTED_NEXT_ROUND and ack.target_version == 2
    assert not shard.fragments[0].open
    shard.finish_round(job, compute_round(job, shard.cfg), 0.2)
    assert set(shard.fragments[0].open) == {"L1"}
    assert [p.meta.learner_id for p in job.pushes] == ["L0"]


def test_old_learner_gets_full_fragment():
    shard, initial = make_shard(chain=2)
    learner = Learner("L0", shard, initial, 0)
    for rnd in range(4):
        learner.push(0, now=rnd)
        close(shard, 0, rnd + 0.5)
    stale = shard.update_for(0, 0)
    assert [s.kind for s in stale.segments] == ["full"]
    recent = shard.update_for(0, 2)
    assert [(s.kind, s.version) for s in recent.segments] == [("delta", 3), ("delta", 4)]
    fresh = Learner("L9", shard, initial, 9)
    fresh.version[0] = 0
    fresh.apply(stale)
    for mine, theirs in zip(fresh.anchor[0], shard.fragments[0].params):
        assert torch.equal(mine, torch.from_numpy(theirs))
    assert shard.update_for(0, 4).segments == ()
    with pytest.raises(FailedPrecondition, match="future"):
        shard.update_for(0, 5)


def test_failed_learner_has_zero_weight():
    shard, initial = make_shard(quorum=2, grace_mode="fixed")
    a, b = Learner("L0", shard, initial, 0), Learner("L1", shard, initial, 1)
    shard.set_membership({"L0", "L1", "L2"}, set())
    a.push(0, now=0.0)
    b.push(0, now=0.0)
    shard.learner_failed("L1")
    # L1's push no longer counts towards the quorum...
    assert shard.decide(0, 0.0).reason == "1/2 pushes for quorum (2 live)"
    shard.learner_left("L2")
    # ...and once every live learner has pushed the round closes, with L1 weighted 0.
    decision = shard.decide(0, 0.0)
    assert decision.reason == "all 1 live learners pushed"
    job = shard.begin_round(0, decision, 0.0)
    weights = dict(zip([p.meta.learner_id for p in job.pushes], job.weights))
    assert weights == {"L0": 1.0, "L1": 0.0}


def test_error_feedback_keeps_params_plus_residual_on_the_true_trajectory():
    nesterov = {"outer_lr": 0.7, "outer_momentum": 0.9}  # momentum carries the error too
    shard, initial = make_shard(**nesterov)
    reference = make_shard(**nesterov)[0]  # the same rounds without quantizing the downlink
    shard.set_membership({"L0"}, set())  # every round merges all live learners: lr unscaled
    learner = Learner("L0", shard, initial, 0)
    for rnd in range(5):
        _, payload, _ = learner.push(0, now=rnd)
        job = shard.begin_round(0, shard.decide(0, rnd), rnd)
        segment = compute_round(job, shard.cfg)
        shard.finish_round(job, segment, rnd + 0.1)
        # The update on the wire is exactly what moved the parameters.
        ref_state = reference.fragments[0]
        from diloco.syncer.core.merge import merge_piece
        from diloco.syncer.core.outer import nesterov_

        for i, piece in enumerate(ref_state.fragment.pieces):
            t = payload.tensors[i]
            step = torch.empty(piece.numel)
            delta = decode(t.spec, t.payload).view(-1)
            step.mul_(merge_piece(lambda terms, acc: float(acc.copy_(delta).mul_(terms[0][1]).double().square().sum()), [payload.norms[i]], [1.0], not piece.embedding, step))
            # The shard's state is numpy; torch.from_numpy views update it in place.
            ref_params = torch.from_numpy(ref_state.params[i]).view(-1)
            ref_momentum = torch.from_numpy(ref_state.momentum[i]).view(-1)
            ref_params.sub_(nesterov_(ref_momentum, step, nesterov["outer_lr"], nesterov["outer_momentum"],
                                      nesterov["outer_momentum"]))
    state = shard.fragments[0]
    for i in range(len(state.params)):
        params, residual = torch.from_numpy(state.params[i]), torch.from_numpy(state.residual[i])
        # Quantized trajectory + carried residual == unquantized trajectory (to fp32 rounding).
        torch.testing.assert_close(params + residual, torch.from_numpy(reference.fragments[0].params[i]), atol=1e-6, rtol=0)
        assert residual.abs().max() > 0  # the quantization really dropped something


def header_case(shard, initial, mutate):
    pieces = shard.plan.fragments[0].pieces
    specs = [encode(p.name, torch.zeros(p.shape)).spec for p in pieces]
    meta = PushMeta("L0", 0, 0, 64, 4, 0.1, VectorClock({"L0": 1}), tuple(specs))
    return mutate(meta, specs)


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda m, s: dataclasses.replace(m, fragment=7), InvalidArgument, "not in the plan"),
        (lambda m, s: dataclasses.replace(m, fragment=1), FailedPrecondition, "owned by shard 1"),
        (lambda m, s: dataclasses.replace(m, base_version=3), FailedPrecondition, "future"),
        (lambda m, s: dataclasses.replace(m, tokens=10**13), InvalidArgument, "absurd"),
        (lambda m, s: dataclasses.replace(m, tokens=1, inner_steps=5), InvalidArgument, "cannot come from"),
        (lambda m, s: dataclasses.replace(m, step_time_s=float("nan")), InvalidArgument, "step time"),
        (lambda m, s: dataclasses.replace(m, clock=VectorClock({"L9": 1})), InvalidArgument, "own entry"),
        (lambda m, s: dataclasses.replace(m, specs=tuple(s[:-1])), InvalidArgument, "tensors, the push has"),
        (
            lambda m, s: dataclasses.replace(m, specs=(dataclasses.replace(s[0], shape=(3, 3)), *s[1:])),
            InvalidArgument,
            "shape",
        ),
        (
            lambda m, s: dataclasses.replace(m, specs=(dataclasses.replace(s[0], block_size=32), *s[1:])),
            InvalidArgument,
            "block size",
        ),
        (
            lambda m, s: dataclasses.replace(m, specs=(dataclasses.replace(s[0], byte_length=5), *s[1:])),
            InvalidArgument,
            "byte length",
        ),
        (
            lambda m, s: dataclasses.replace(m, specs=(dataclasses.replace(s[0], name="x"), *s[1:])),
            InvalidArgument,
            "expected tensor",
        ),
    ],
)
def test_bad_headers_rejected_without_state_change(mutate, error, match):
    plan = plan_fragments(PARAMS, 2)
    shard, initial = make_shard()
    shard = ShardCore(dataclasses.replace(shard.cfg, num_shards=2), plan, initial)
    shard.set_membership({"L0"}, set())
    before = (shard.clock, shard.pushes_received, {f: s.version for f, s in shard.fragments.items()})
    meta = header_case(shard, initial, mutate)
    with pytest.raises(error, match=match):
        shard.check_header(meta)
    assert before == (shard.clock, shard.pushes_received, {f: s.version for f, s in shard.fragments.items()})


def test_oversized_push_is_resource_exhausted():
    shard, initial = make_shard()
    shard.cfg = dataclasses.replace(shard.cfg, max_push_bytes=10)
    meta = header_case(shard, initial, lambda m, s: m)
    with pytest.raises(ResourceExhausted):
        shard.check_header(meta)


def test_nonfinite_payload_rejected_without_state_change():
    shard, initial = make_shard()
    meta = header_case(shard, initial, lambda m, s: m)
    pieces = shard.plan.fragments[0].pieces
    bad = PushPayload(tuple(encode(p.name, torch.zeros(p.shape)) for p in pieces), (float("nan"),) * len(pieces))
    clock = shard.clock
    with pytest.raises(InvalidArgument, match="non-finite"):
        shard.accept(meta, bad, 10, 0.0)
    assert not shard.fragments[0].open and shard.clock == clock


def test_outer_lr_scales_with_the_rounds_share_of_live_learners():
    """One push of three live learners moves the global model a third as far as the same
    push counted in full (scale_by round), before int4 rounding of the update."""
    moved = {}
    for scale_by in ("live", "round"):
        shard, initial = make_shard(outer_lr=1.0, outer_momentum=0.0, scale_by=scale_by)
        shard.set_membership({"L0", "L1", "L2"}, set())
        Learner("L0", shard, initial, seed=1).push(0, now=1.0)
        job = shard.begin_round(0, Close("test", 0.0), 1.0)
        assert job.participation == pytest.approx(1 / 3)
        before = [torch.from_numpy(t.copy()) for t in job.params]
        shard.finish_round(job, compute_round(job, shard.cfg), 1.1)
        moved[scale_by] = torch.cat(
            [(torch.from_numpy(a) - b).flatten() for a, b in zip(shard.fragments[0].params, before)]
        )
    ratio = moved["live"].norm() / moved["round"].norm()
    assert ratio == pytest.approx(1 / 3, rel=0.02)


def test_buffer_pieces_become_the_weighted_mean_of_the_pushed_values():
    """Running statistics (BatchNorm) travel as values and the global one is the learners'
    weighted mean, a convex combination: whatever the outer lr and momentum, and however
    stale a learner's base, a variance stays within the learners' values (never negative).
    The fp32 update keeps learners bit-identical. A parameter takes its outer step."""
    params = [("block.w", (24, 8)), ("norm.running_var", (24,))]
    plan = plan_fragments(params, 1, is_buffer=lambda name: "running" in name)
    assert [p.buffer for p in plan.fragments[0].pieces] == [False, True]
    initial = {0: [torch.full((24, 8), 0.5), torch.full((24,), 1.0)]}
    cfg = SyncerConfig(rounds=RoundConfig(quorum=2, grace_mode="off"),
                       merge=MergeConfig(merge="mean", outer_lr=0.7, outer_momentum=0.9, scale_by="round"))
    shard = ShardCore(cfg, plan, initial)
    shard.set_membership({"L0", "L1"}, set())
    g = torch.Generator().manual_seed(0)
    clocks = {"L0": VectorClock(), "L1": VectorClock()}
    anchor = [t.clone() for t in initial[0]]
    for rnd in range(4):
        pushed = {}
        for name, tokens in (("L0", 64), ("L1", 128)):
            delta = torch.randn((24, 8), generator=g) * 0.01
            values = torch.rand((24,), generator=g) * 0.05  # small variances, as a late layer's
            encoded = [encode("block.w", delta), encode("norm.running_var", values, encoding="fp32")]
            clocks[name] = clocks[name].tick(name)
            meta = PushMeta(name, 0, 0, tokens, 4, 0.1, clocks[name], tuple(e.spec for e in encoded))  # base 0: stale
            shard.check_header(meta)
            shard.accept(meta, inspect_payload(meta.specs, b"".join(e.payload for e in encoded)), 1, now=rnd)
            pushed[name] = (tokens * tokens / 4, values)
        before = shard.fragments[0].params[0].copy()
        close(shard, 0, now=rnd + 0.5)
        state = shard.fragments[0]
        (w0, v0), (w1, v1) = pushed.values()
        expected = (w0 * v0 + w1 * v1) / (w0 + w1)
        assert torch.allclose(torch.from_numpy(state.params[1]), expected, atol=1e-7)
        assert (state.params[1] >= 0).all()
        assert not np.array_equal(before, state.params[0])  # the parameter moved by its outer step
        update = shard.update_for(0, rnd)
        anchor = [a + decode(t.spec, t.payload) for a, t in zip(anchor, update.segments[-1].tensors)]
        assert_same_tensors(anchor, state.params)
    bad = [encode("block.w", torch.zeros(24, 8)), encode("norm.running_var", torch.zeros(24))]  # int4 buffer
    clocks["L0"] = clocks["L0"].tick("L0")
    with pytest.raises(InvalidArgument, match="buffer: its values travel in fp32"):
        shard.check_header(PushMeta("L0", 0, 4, 64, 4, 0.1, clocks["L0"], tuple(e.spec for e in bad)))


# --- pinned behaviours of the shard core (mutation testing) ----------------------------


def exactly(message):
    """A ``pytest.raises(match=...)`` pattern for exactly this message."""
    return "^" + re.escape(message) + "$"


def push_values(shard, name, fid, values, now, clock, base=0, tokens=64, steps=4, encodings=None):
    """Push these exact deltas (or buffer values) as ``name``; returns (meta, payload, ack)."""
    pieces = shard.plan.fragments[fid].pieces
    encodings = encodings or ["int4"] * len(pieces)
    encoded = [encode(p.name, v, encoding=e) for p, v, e in zip(pieces, values, encodings)]
    meta = PushMeta(name, fid, base, tokens, steps, 0.1, clock, tuple(e.spec for e in encoded))
    shard.check_header(meta)
    payload = inspect_payload(meta.specs, b"".join(e.payload for e in encoded))
    return meta, payload, shard.accept(meta, payload, meta.payload_bytes, now)


def test_initial_numpy_values_become_float32_c_arrays_the_shard_owns():
    """Initial values may be numpy arrays of any float dtype and layout: the shard keeps
    float32 C-contiguous copies of its own (the caller's arrays stay untouched by rounds,
    and later changes to them do not reach the shard)."""
    plan = plan_fragments(PARAMS, 2)
    rng = np.random.default_rng(0)
    initial = {
        0: [rng.standard_normal((16, 8)), rng.standard_normal(24).astype(np.float32)],  # float64, float32
        1: [np.asfortranarray(rng.standard_normal((12, 8)), dtype=np.float32), rng.standard_normal((12, 8)).astype(np.float32)],
    }
    given = {f: [a.copy() for a in arrays] for f, arrays in initial.items()}
    shard = ShardCore(SyncerConfig(), plan, initial)
    assert shard.manifest_json == "" and shard.rounds_closed == 0 and shard.pushes_received == 0
    for fid, arrays in initial.items():
        for mine, theirs in zip(shard.fragments[fid].params, arrays):
            assert mine.dtype == np.float32 and mine.flags.c_contiguous
            assert not np.shares_memory(mine, theirs)
            np.testing.assert_array_equal(mine, theirs.astype(np.float32))
            theirs += 1.0
            assert not np.array_equal(mine, theirs.astype(np.float32))
    shard.set_membership({"L0"}, set())
    Learner("L0", shard, {0: [torch.from_numpy(a.astype(np.float32)) for a in given[0]]}, 0).push(0, now=0.0)
    close(shard, 0, 0.5)
    for arrays, before in zip(initial[0], given[0]):
        np.testing.assert_array_equal(arrays, before + 1.0)  # the round moved the shard's copy only
    assert ShardCore(SyncerConfig(), plan, initial, manifest_json='{"run": 1}').manifest_json == '{"run": 1}'
    with pytest.raises(InvalidArgument, match=exactly("no initial parameters for fragment 1")):
        ShardCore(SyncerConfig(), plan, {0: initial[0]})


def test_a_shard_without_a_model_adopts_a_plan_then_takes_fragment_values():
    """A shard started without a model: membership works, state is refused with a clear
    message, the plan is adopted once (a different one is refused), and each owned fragment
    takes its values once, at the version given."""
    cfg = SyncerConfig(num_shards=2)
    shard = ShardCore(cfg)
    assert shard.plan is None and shard.manifest_json == "" and shard.owned == []
    assert shard.live == set() and shard.failed == set()
    shard.learner_joined("L0")
    assert shard.live == {"L0"}
    with pytest.raises(FailedPrecondition, match=exactly("shard 0 holds no model yet: the first learner initialises it")):
        shard.state_of(0)
    with pytest.raises(FailedPrecondition, match=exactly("shard 0 has no fragment plan yet")):
        shard.add_fragment(0, [])
    plan = plan_fragments(PARAMS, 2)
    shard.adopt_plan(plan, "manifest")
    shard.adopt_plan(plan, "another manifest")  # the same plan again: nothing changes
    assert shard.plan is plan and shard.manifest_json == "manifest"
    other = plan_fragments(PARAMS[:2], 2)
    with pytest.raises(FailedPrecondition, match=exactly(
        f"shard 0 plans from another model (plan {plan.plan_hash[:12]}, this one {other.plan_hash[:12]}): "
        "every learner of a run trains the same model"
    )):
        shard.adopt_plan(other, "")
    with pytest.raises(FailedPrecondition, match=exactly("fragment 0 has no value yet: the first learner initialises it")):
        shard.state_of(0)
    with pytest.raises(FailedPrecondition, match=exactly("fragment 1 is owned by shard 1, not shard 0")):
        shard.state_of(1)
    for bad in (2, -1):
        with pytest.raises(InvalidArgument, match=exactly(f"fragment {bad} is not in the plan (2 fragments)")):
            shard.state_of(bad)
        with pytest.raises(InvalidArgument, match=exactly(f"fragment {bad} is not in the plan (2 fragments)")):
            shard.add_fragment(bad, [])
    values = [np.ones(p.shape, np.float32) for p in plan.fragments[0].pieces]
    with pytest.raises(FailedPrecondition, match=exactly("fragment 1 is owned by shard 1")):
        shard.add_fragment(1, [np.ones(p.shape, np.float32) for p in plan.fragments[1].pieces])
    with pytest.raises(InvalidArgument, match=exactly(
        "initial values of fragment 0 have shapes [(16, 8)], the plan [(16, 8), (24,)]"
    )):
        shard.add_fragment(0, values[:1])
    with pytest.raises(InvalidArgument, match=exactly("initial values of fragment 0 are not all finite")):
        shard.add_fragment(0, [values[0], np.full(24, np.inf, np.float32)])
    assert shard.add_fragment(0, values, version=7) is True
    assert shard.add_fragment(0, [v * 2 for v in values]) is False
    state = shard.state_of(0)
    assert state.version == 7
    assert_same_tensors(state.params, values)


def test_membership_changes_who_may_push():
    """A failed learner leaves the live set and may not push; joining again restores it."""
    shard, initial = make_shard()
    learner = Learner("L1", shard, initial, 1)
    shard.learner_failed("L1")
    assert shard.live == {"L0", "L2"} and shard.failed == {"L1"}
    with pytest.raises(PermissionDenied, match=exactly("L1 was marked failed or removed: it may no longer push")):
        learner.push(0, now=0.0)
    shard.learner_joined("L1")
    assert shard.live == {"L0", "L1", "L2"} and shard.failed == set()
    assert learner.push(0, now=0.0)[2].outcome == ACCEPTED
    shard.learner_left("L2")
    assert shard.view(0).live == frozenset({"L0", "L1"})


def test_a_draining_learner_still_pushes_its_last_progress_until_it_leaves():
    """Drained (a budget met, an operator's remove), a learner's in-flight and last pushes
    are merged, not refused; no round waits for it; once it has left it may not push."""
    shard, initial = make_shard(quorum=2, grace_mode="fixed")
    leaving, staying = Learner("L1", shard, initial, 1), Learner("L0", shard, initial, 0)
    shard.learner_draining("L1")
    assert shard.live == {"L0", "L2"} and shard.draining == {"L1"}
    assert leaving.push(0, now=0.0)[2].outcome == ACCEPTED
    assert staying.push(0, now=0.0)[2].outcome == ACCEPTED  # L1's push counts towards K = 2
    shard.learner_left("L2")
    job = close(shard, 0, now=0.1)
    assert job.reason == "all 1 live learners pushed"
    assert sorted(p.meta.learner_id for p in job.pushes) == ["L0", "L1"] and job.weights[0] > 0
    assert job.participation == 1.0  # L0 and L1 of the 2 members (L1 draining)
    shard.learner_left("L1")
    assert shard.draining == set()
    with pytest.raises(FailedPrecondition, match="L1 is not a live member"):
        leaving.push(0, now=1.0)
    shard.learner_joined("L2")
    shard.learner_draining("L0")
    shard.learner_draining("L2")  # every learner is draining: a push closes its round at once
    assert staying.push(0, now=2.0)[2].outcome == ACCEPTED
    job = close(shard, 0, now=2.0)
    assert job.reason == "every learner is draining (2): none left to wait for"
    assert job.participation == 0.5  # one of two draining learners: its share, not the whole step
    shard.learner_joined("L0")
    assert shard.live == {"L0"} and shard.draining == {"L2"}


def test_a_final_push_is_merged_at_its_share_of_the_cycle_after_the_others_left():
    """The run's end: every learner drains, sends its final push and leaves. The last one's
    final push is its share of the cycle, as the others' were (it was merged at the whole
    step once they had left); once the cycle is over, the departed no longer count."""
    shard, initial = make_shard()
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    for learner in learners:
        shard.learner_draining(learner.name)
    shares = []
    for t, learner in enumerate(learners):
        assert learner.push(0, now=t, final=True)[2].outcome == ACCEPTED
        shares.append(close(shard, 0, now=t).participation)
        shard.learner_left(learner.name)
    assert shares == [pytest.approx(1 / 3)] * 3  # before: 1/3, 1/2, 1
    shard.learner_joined("L3")  # a new learner's rounds: the departed count until their cycle ends
    newcomer = Learner("L3", shard, initial, seed=3)
    shares = []
    for t in range(3):
        newcomer.push(0, now=10 + t)
        shares.append(close(shard, 0, now=10 + t).participation)
    assert shares == [pytest.approx(1 / 3), 0.5, 1.0]


@pytest.mark.parametrize("final_push", [True, False])
def test_at_a_runs_end_the_learners_gone_keep_their_share_until_the_last_has_left(final_push):
    """Every learner draining (a met budget), they leave one by one, each after its own
    allotment: the last one keeps pushing its share of the step for as many rounds as it
    trains on, not the whole step once the cycle after the others' final pushes is over
    (before: 1/3, 1/2, then the whole step). So does a learner that leaves with no final
    push to a fragment (none was due, or its last push was merged already; seen on the
    long workload's end: the last learner's rounds of such a fragment at 1/2, the others'
    at 1/4; before: the whole step once both had left)."""
    shard, initial = make_shard()
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    for learner in learners:
        shard.learner_draining(learner.name)
    for t, learner in enumerate(learners[:2]):
        learner.push(0, now=t, final=final_push)
        close(shard, 0, now=t)
        shard.learner_left(learner.name)
    last = learners[2]
    shares = []
    for t in range(5):
        last.push(0, now=10 + t, final=t == 4)
        shares.append(close(shard, 0, now=10 + t).participation)
        last.apply(shard.update_for(0, last.version[0], last.name))
    assert shares == [pytest.approx(1 / 3)] * 5


def test_a_failed_learner_s_final_push_leaves_no_share_behind():
    shard, initial = make_shard()
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    learners[0].push(0, now=0.0, final=True)
    close(shard, 0, now=0.0)
    shard.learner_failed("L0")  # removed after all: its share goes with it
    learners[1].push(0, now=1.0)
    assert close(shard, 0, now=1.0).participation == 0.5  # L1 of L1, L2


def test_header_limits_are_inclusive_and_errors_name_the_problem():
    """Counters, step time and payload size may reach their limits exactly; past them,
    and for a dtype or membership problem, the error says what is wrong."""
    shard, initial = make_shard()
    ok = header_case(shard, initial, lambda m, s: m)
    cfg = shard.cfg
    for meta in (
        dataclasses.replace(ok, step_time_s=0.0),
        dataclasses.replace(ok, tokens=4, inner_steps=4),
        dataclasses.replace(ok, tokens=cfg.max_tokens_per_push, inner_steps=cfg.max_steps_per_push),
    ):
        shard.check_header(meta)
    with pytest.raises(InvalidArgument, match=exactly("step time must be a finite number >= 0, got inf")):
        shard.check_header(dataclasses.replace(ok, step_time_s=float("inf")))
    with pytest.raises(InvalidArgument, match=exactly("tensor 'tok_embed.weight': dtype 'float16', expected 'float32'")):
        shard.check_header(dataclasses.replace(ok, specs=(dataclasses.replace(ok.specs[0], dtype="float16"), *ok.specs[1:])))
    with pytest.raises(FailedPrecondition, match=exactly(
        "L5 is not a live member of the run as this shard knows it (3 live learners): join the coordinator first"
    )):
        shard.check_header(dataclasses.replace(ok, learner_id="L5", clock=VectorClock({"L5": 1})))
    shard.cfg = dataclasses.replace(cfg, max_push_bytes=ok.payload_bytes)
    shard.check_header(ok)
    shard.cfg = dataclasses.replace(cfg, max_push_bytes=ok.payload_bytes - 1)
    with pytest.raises(ResourceExhausted, match=exactly(
        f"push of {ok.payload_bytes} bytes exceeds the limit of {ok.payload_bytes - 1}"
    )):
        shard.check_header(ok)


def test_payload_longer_than_its_header_is_refused():
    shard, initial = make_shard()
    pieces = shard.plan.fragments[0].pieces
    encoded = [encode(p.name, torch.zeros(p.shape)) for p in pieces]
    specs = [e.spec for e in encoded]
    n = sum(s.byte_length for s in specs)
    with pytest.raises(InvalidArgument, match=exactly(f"push payload is {n + 1} bytes, its header announces {n}")):
        inspect_payload(specs, b"".join(e.payload for e in encoded) + b"\0")


def test_delta_norm_bound_is_inclusive_and_takes_the_fragment_norm_as_at_least_one():
    """A push may be as long as max_delta_ratio x max(fragment norm, 1), not longer."""
    plan = plan_fragments(PARAMS, 2)
    zeros = {f.id: [np.zeros(p.shape, np.float32) for p in f.pieces] for f in plan.fragments}
    shard = ShardCore(SyncerConfig(), plan, zeros)  # fragment norm 0: the bound is 10 x 1
    shard.set_membership({"L0", "L1"}, set())
    pieces = plan.fragments[0].pieces
    tensors = tuple(encode(p.name, torch.zeros(p.shape)) for p in pieces)
    meta0 = header_case(shard, zeros, lambda m, s: m)
    assert shard.accept(meta0, PushPayload(tensors, (6.0, 8.0)), 1, 0.0).outcome == ACCEPTED  # exactly 10
    meta1 = dataclasses.replace(meta0, learner_id="L1", clock=VectorClock({"L1": 1}))
    with pytest.raises(InvalidArgument, match=exactly(
        "push from L1: delta norm 10 exceeds 10 x the fragment's norm (10); refused"
    )):
        shard.accept(meta1, PushPayload(tensors, (6.0, 8.00001)), 1, 0.0)
    with pytest.raises(InvalidArgument, match=exactly("push carries 1 tensors, fragment 0 has 2")):
        shard.accept(meta1, PushPayload(tensors[:1], (1.0,)), 1, 0.0)
    # A fragment with norm N > 1 takes pushes up to 10 N.
    shard, initial = make_shard()
    norm = shard.fragment_norm(shard.fragments[0])
    assert norm > 1
    meta0 = header_case(shard, initial, lambda m, s: m)
    assert shard.accept(meta0, PushPayload(tensors, (0.0, 5.0)), 1, 0.0).outcome == ACCEPTED
    with pytest.raises(InvalidArgument, match="exceeds 10 x"):
        shard.accept(meta1, PushPayload(tensors, (0.0, 10 * norm * 1.001)), 1, 0.0)


def test_a_push_without_its_own_clock_entry_is_never_merged():
    """seq 0 is never newer than what the shard saw: the push is acknowledged as a
    duplicate at the fragment's version and joins no round."""
    shard, initial = make_shard()
    meta = header_case(shard, initial, lambda m, s: dataclasses.replace(m, clock=VectorClock({"L9": 1})))
    pieces = shard.plan.fragments[0].pieces
    payload = PushPayload(tuple(encode(p.name, torch.zeros(p.shape)) for p in pieces), (0.0, 0.0))
    assert shard.accept(meta, payload, 1, 0.0) == Ack(DUPLICATE, 0)
    assert not shard.fragments[0].open and shard.pushes_received == 0


def test_round_timings_and_the_closed_rounds_record():
    """When the round opened (first push), reached its quorum (and how long that took),
    closed and finished are measured, and the update names why it closed and who was in."""
    shard, initial = make_shard(quorum=2, grace_mode="fixed")
    a, b, c = (Learner(f"L{i}", shard, initial, i) for i in range(3))
    empty = shard.view(0)
    assert (empty.opened_at, empty.quorum_at, empty.pushed) == (0.0, None, frozenset())
    a.push(0, now=1.0)
    assert (shard.view(0).opened_at, shard.view(0).quorum_at) == (1.0, None)
    b.push(0, now=1.5)
    c.push(0, now=1.75)
    view = shard.view(0)
    assert (view.opened_at, view.quorum_at, view.grace_s) == (1.0, 1.5, 0.5)
    state = shard.fragments[0]
    assert state.timings.step_time_s == pytest.approx(0.1) and state.timings.quorum_time_s == 0.5
    assert shard.pushes_received == 3
    decision = shard.decide(0, 2.0)
    assert decision == Close("all 3 live learners pushed", 0.5)
    job = shard.begin_round(0, decision, 2.0)
    assert (job.opened_at, job.quorum_s, job.closed_at, job.grace_s, job.reason) == (1.0, 0.5, 2.0, 0.5, decision.reason)
    assert state.opened_at is None and state.quorum_at is None and not state.open
    assert shard.decide(0, 2.1) == Wait("a round is being applied", None)
    with pytest.raises(FailedPrecondition, match=exactly("fragment 0 has no round to close")):
        shard.begin_round(0, decision, 2.1)
    shard.finish_round(job, compute_round(job, shard.cfg), 2.25)
    assert state.timings.sync_time_s == 0.25 and shard.rounds_closed == 1
    update = shard.update_for(0, 0)
    assert (update.base_version, update.version, update.close_reason, update.participants) == (0, 1, decision.reason, 3)
    with pytest.raises(FailedPrecondition, match=exactly("fragment 0 has no round to close")):
        shard.begin_round(0, decision, 2.5)
    # A round that closes before its quorum (every live learner pushed) took until now.
    shard, initial = make_shard(quorum=3)
    shard.set_membership({"L0"}, set())
    Learner("L0", shard, initial, 0).push(0, now=1.0)
    job = shard.begin_round(0, shard.decide(0, 1.5), 1.5)
    assert (job.opened_at, job.quorum_s) == (1.0, 0.5)


def test_weights_discount_staleness_and_participation_counts_weighted_pushes():
    shard, initial = make_shard(staleness_lambda=1.0)
    fresh, stale = Learner("L0", shard, initial, 0), Learner("L1", shard, initial, 1)
    for rnd in range(2):
        fresh.push(0, now=rnd)
        close(shard, 0, rnd + 0.5)
        fresh.apply(shard.update_for(0, fresh.version[0]))
    fresh.push(0, now=3.0)  # base 2, staleness 0
    stale.push(0, now=3.0)  # base 0, staleness 2: weight / (1 + 2)
    job = shard.begin_round(0, Close("test", 0.0), 3.5)
    assert job.weights == pytest.approx((0.75, 0.25))
    shard, initial = make_shard()
    Learner("L0", shard, initial, 0).push(0, now=0.0)
    Learner("L1", shard, initial, 1).push(0, now=0.0)
    shard.learner_failed("L1")
    job = shard.begin_round(0, Close("test", 0.0), 0.5)
    assert job.weights == (1.0, 0.0) and job.participation == 1 / 2  # L0 of live L0, L2


def test_buffer_first_in_its_fragment_and_a_round_without_weight():
    """A 2-D buffer piece ahead of a parameter: its value becomes the weighted mean of the
    pushed values (for any positive weights, normalised or not) and both pieces are sent.
    A round in which every pusher failed takes no step: buffer and momentum stay as they are."""
    params = [("norm.running_var", (4, 6)), ("block.w", (24, 8))]
    plan = plan_fragments(params, 1, is_buffer=lambda name: "running" in name)
    initial = {0: [np.full((4, 6), 1.0, np.float32), np.full((24, 8), 0.5, np.float32)]}
    cfg = SyncerConfig(rounds=RoundConfig(quorum=2, grace_mode="off"), merge=MergeConfig(merge="mean", scale_by="round"))
    shard = ShardCore(cfg, plan, initial)
    shard.set_membership({"L0", "L1"}, set())
    clocks = {"L0": VectorClock({"L0": 1}), "L1": VectorClock({"L1": 1})}
    g = torch.Generator().manual_seed(0)
    values = {}
    for name in clocks:
        values[name] = torch.rand((4, 6), generator=g)
        push_values(shard, name, 0, [values[name], torch.randn((24, 8), generator=g) * 0.01], 0.0, clocks[name],
                    encodings=["fp32", "int4"])
    job = dataclasses.replace(shard.begin_round(0, Close("test", 0.0), 0.5), weights=(3.0, 1.0))
    segment = compute_round(job, cfg)
    shard.finish_round(job, segment, 0.6)
    state = shard.fragments[0]
    expected = ((3 * values["L0"] + values["L1"]) / 4).numpy()
    np.testing.assert_allclose(state.params[0], expected, atol=1e-6)
    assert [(t.spec.name, t.spec.shape, t.spec.encoding) for t in segment.tensors] == [
        ("norm.running_var", (4, 6), "fp32"), ("block.w", (24, 8), "int4"),
    ]
    np.testing.assert_allclose(decode(segment.tensors[0].spec, segment.tensors[0].payload).numpy(), expected - 1.0, atol=1e-6)
    before = [state.params[0].copy(), state.momentum[1].copy(), state.params[1] + state.residual[1]]
    assert np.abs(state.momentum[1]).max() > 0
    for name in clocks:
        clocks[name] = clocks[name].tick(name)
        push_values(shard, name, 0, [torch.rand((4, 6), generator=g), torch.randn((24, 8), generator=g) * 0.01], 1.0,
                    clocks[name], encodings=["fp32", "int4"])
        shard.learner_failed(name)
    job = shard.begin_round(0, Close("every pusher failed", 0.0), 1.5)
    assert job.weights == (0.0, 0.0) and job.participation == 1.0
    segment = compute_round(job, cfg)
    shard.finish_round(job, segment, 1.6)
    # No step: only the carried residual may move into the parameters (error feedback).
    assert_same_tensors([state.params[0], state.momentum[1]], before[:2])
    np.testing.assert_allclose(state.params[1] + state.residual[1], before[2], atol=1e-7)
    assert not decode(segment.tensors[0].spec, segment.tensors[0].payload).any()


@pytest.mark.parametrize("mode", ["rda", "mean"])
def test_merge_mode_per_piece(mode):
    """RDA (mean length times mean direction) merges non-embedding pieces in mode "rda";
    embedding pieces, and every piece in mode "mean", take the weighted mean. With lr 1
    and no momentum, params + residual == initial - merged."""
    shard, initial = make_shard(num_fragments=1, merge=mode, outer_lr=1.0, outer_momentum=0.0, scale_by="round")
    pushes = [Learner(f"L{i}", shard, initial, seed=i).push(0, now=0.0)[1] for i in range(2)]
    job = shard.begin_round(0, Close("test", 0.0), 0.5)
    assert job.weights == (0.5, 0.5)
    segment = compute_round(job, shard.cfg)
    shard.finish_round(job, segment, 0.6)
    state = shard.fragments[0]
    pieces = state.fragment.pieces
    assert [t.spec.name for t in segment.tensors] == [p.name for p in pieces]
    for i, piece in enumerate(pieces):
        deltas = [decode(p.tensors[i].spec, p.tensors[i].payload).double() for p in pushes]
        norms = [p.norms[i] for p in pushes]
        if mode == "rda" and not piece.embedding:
            direction = sum(0.5 * d / n for d, n in zip(deltas, norms))
            merged = sum(0.5 * n for n in norms) * direction / direction.norm()
        else:
            merged = sum(0.5 * d for d in deltas)
        moved = torch.from_numpy(state.params[i] + state.residual[i]).double() - initial[0][i].double()
        torch.testing.assert_close(moved, -merged, atol=1e-6, rtol=0)


def test_outer_step_without_the_c_kernel(monkeypatch):
    """Without the C extension the outer step runs in torch ops on the same flat state
    (2-D pieces included): learners stay bit-identical, and the trajectory is the kernel's
    up to float rounding order."""
    from diloco.syncer.core import outer

    shards = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(outer, "fused_outer_step", lambda *args: None)
        shard, initial = make_shard()
        learner = Learner("L0", shard, initial, 0)
        for rnd in range(2):
            learner.push(0, now=rnd)
            close(shard, 0, rnd + 0.5)
            learner.apply(shard.update_for(0, learner.version[0]))
        assert_same_tensors(learner.anchor[0], shard.fragments[0].params)
        shards[kernel] = shard.fragments[0]
    for i in range(len(shards[True].params)):
        np.testing.assert_allclose(shards[False].momentum[i], shards[True].momentum[i], atol=1e-6)
        np.testing.assert_allclose(shards[False].params[i] + shards[False].residual[i],
                                   shards[True].params[i] + shards[True].residual[i], atol=1e-6)


def test_failed_round_moves_the_version_on_and_serves_full_values():
    """A round whose computation failed: the version moves on with no delta, every learner
    gets the full (possibly touched) values, waiting pushes open the next round, and the
    shard keeps serving. A job that does not fit the fragment is refused."""
    shard, initial = make_shard(quorum=1)
    a, b = Learner("L0", shard, initial, 0), Learner("L1", shard, initial, 1)
    a.push(0, now=0.0)
    close(shard, 0, 0.5)
    a.apply(shard.update_for(0, 0))
    a.push(0, now=1.0)
    job = shard.begin_round(0, shard.decide(0, 1.0), 1.0)
    assert b.push(0, now=1.25)[2].outcome == ACCEPTED_NEXT_ROUND
    segment = compute_round(job, shard.cfg)
    wrong = dataclasses.replace(job, version=3)
    for finish in (shard.finish_round, lambda j, s, now: shard.fail_round(j, "boom", now)):
        with pytest.raises(FailedPrecondition, match=exactly("round for version 3 does not fit fragment at 1")):
            finish(wrong, segment, 1.5)
    clock = shard.clock
    shard.fail_round(job, "boom", now=1.5)
    state = shard.fragments[0]
    assert state.version == 2 and not state.applying and shard.clock == clock.tick("S0")
    assert set(state.open) == {"L1"} and (state.opened_at, state.quorum_at) == (1.25, 1.5)
    assert shard.rounds_closed == 1
    with pytest.raises(FailedPrecondition, match=exactly("round for version 2 does not fit fragment at 2")):
        shard.fail_round(job, "again", 1.5)
    update = shard.update_for(0, 1)
    assert [(s.kind, s.version) for s in update.segments] == [("full", 2)]
    assert (update.close_reason, update.participants) == ("round failed (boom): its deltas were dropped", 0)
    a.apply(update)
    assert_same_tensors(a.anchor[0], state.params)
    assert a.push(0, now=2.0)[2] == Ack(ACCEPTED, 3)
    close(shard, 0, 2.5)
    assert state.version == 3 and shard.rounds_closed == 2


def test_update_for_a_learner_just_past_the_chain_gets_the_full_fragment():
    shard, initial = make_shard(chain=2)
    learner = Learner("L0", shard, initial, 0)
    for rnd in range(4):
        learner.push(0, now=rnd)
        job = close(shard, 0, rnd + 0.5)
    update = shard.update_for(0, 1)  # the chain holds versions 3 and 4: version 2 is gone
    assert (update.base_version, update.version, update.close_reason, update.participants) == (1, 4, job.reason, 1)
    [full] = update.segments
    assert (full.kind, full.version) == ("full", 4)
    assert [t.spec.name for t in full.tensors] == [p.name for p in shard.fragments[0].fragment.pieces]
    assert shard.full(0) is full  # encoded once per version


def test_push_bound_uses_the_fragment_norm_of_its_version():
    """The delta bound follows the fragment's norm version by version; while a round is
    applying (its params changing in place) the last computed norm holds."""
    shard, initial = make_shard(merge="mean", outer_lr=1.0, outer_momentum=0.0, scale_by="round")
    shard.cfg = dataclasses.replace(shard.cfg, max_delta_ratio=1.0)
    state = shard.fragments[0]
    # Others on record with huge deltas: the robust clip (syncer.core.bounds) never binds here.
    state.influence.record([Push("L8", 1e9, 1.0, -10.0), Push("L9", 1e9, 1.0, -10.0)])
    for learner in ("L8", "L9"):  # and agree with a reference they turned: the directions are judged
        state.influence.agreed(learner, 0.5)
    state.influence.turned(["L8", "L9"])
    norm0 = shard.fragment_norm(state)
    pieces = state.fragment.pieces
    clocks = {n: VectorClock() for n in ("L0", "L1", "L2")}

    def push(name, values, now):
        clocks[name] = clocks[name].tick(name)
        return push_values(shard, name, 0, values, now, clocks[name], base=state.version)[2]

    def probe(name, length, now):
        """A push claiming a delta norm of ``length``."""
        clocks[name] = clocks[name].tick(name)
        meta = PushMeta(name, 0, state.version, 64, 4, 0.1, clocks[name],
                        tuple(encode(p.name, torch.zeros(p.shape)).spec for p in pieces))
        payload = PushPayload(tuple(encode(p.name, torch.zeros(p.shape)) for p in pieces), (length, 0.0))
        return shard.accept(meta, payload, 1, now)

    push("L0", [torch.from_numpy(p) * 0.5 for p in state.params], 0.0)  # halves the fragment
    job = shard.begin_round(0, Close("test", 0.0), 0.1)
    assert push("L1", [torch.zeros(p.shape) for p in pieces], 0.2).outcome == ACCEPTED_NEXT_ROUND
    shard.finish_round(job, compute_round(job, shard.cfg), 0.3)
    assert 0.4 * norm0 < math.sqrt(sum(float((p * p).sum()) for p in state.params)) < 0.6 * norm0
    # L1's round: closing it weighs its push against the floor, which reads version 1's norm.
    job = shard.begin_round(0, Close("test", 0.0), 0.4)
    norm1 = state.norm_cache[1]
    assert state.norm_cache[0] == 1 and 0.4 * norm0 < norm1 < 0.6 * norm0
    for p in state.params:
        p *= 4.0  # as a round's step would, in place: the norm computed before it holds while it applies
    assert probe("L2", 0.9 * norm1, 0.5).outcome == ACCEPTED_NEXT_ROUND
    with pytest.raises(InvalidArgument, match="exceeds 1 x"):
        probe("L0", 1.1 * norm1, 0.55)
    for p in state.params:
        p /= 4.0
    shard.finish_round(job, compute_round(job, shard.cfg), 0.6)
    with pytest.raises(InvalidArgument, match="exceeds 1 x"):
        probe("L0", 0.75 * norm0, 0.7)  # version 2's norm is about half


def test_fragment_norm_is_recomputed_for_each_version():
    """Even a cached norm that happens to equal the next version number is recomputed."""
    plan = plan_fragments(PARAMS, 2)
    values = {f.id: [np.zeros(p.shape, np.float32) for p in f.pieces] for f in plan.fragments}
    values[0][1][0] = 1.0  # fragment 0's norm is exactly 1
    shard = ShardCore(SyncerConfig(), plan, values)
    shard.set_membership({"L0"}, set())
    state = shard.fragments[0]
    assert shard.fragment_norm(state) == 1.0
    Learner("L0", shard, {f: [torch.from_numpy(v) for v in vs] for f, vs in values.items()}, 0).push(0, now=0.0)
    close(shard, 0, 0.5)
    assert state.version == 1
    expected = math.sqrt(sum(float((p.astype(np.float64) ** 2).sum()) for p in state.params))
    assert expected != pytest.approx(1.0)
    assert shard.fragment_norm(state) == pytest.approx(expected, rel=1e-6)


def test_mirrors_go_with_their_learner_and_with_a_failed_round():
    """Condensed replies: a learner that left or failed leaves no mirror behind (memory no
    reply would use), and a round whose computation failed forgets the mirrors it may have
    advanced, so their learners get full values next."""
    shard, initial = make_shard()
    for name in ("L0", "L1"):
        shard.mirror(0, name, shard.full(0))
    learner = Learner("L0", shard, initial, 0)
    learner.push(0, now=0.0)
    job = shard.begin_round(0, shard.decide(0, 0.0), 0.0)
    assert [(name, base) for name, base, _ in job.mirrors] == [("L0", 0)]
    shard.fail_round(job, "boom", 0.1)
    assert sorted(shard.fragments[0].mirrors) == ["L1"]
    assert [s.kind for s in shard.update_for(0, 0, "L0").segments] == ["full"]
    assert sorted(shard.fragments[0].mirrors) == ["L0", "L1"]  # mirrored from the full reply on
    shard.learner_left("L0")
    shard.learner_failed("L1")
    assert shard.fragments[0].mirrors == {}
    shard.mirror(0, "L0", shard.full(0))  # not a member any more (nor one never seen)
    shard.mirror(0, "L7", shard.full(0))
    assert shard.fragments[0].mirrors == {}


def test_a_final_push_is_merged_and_answered_with_the_version_alone():
    """A learner leaving pushes each fragment once more, marked final: the round merges it;
    the reply carries no values (nobody will apply them) and its mirror stays as it was."""
    shard, initial = make_shard()
    shard.mirror(0, "L0", shard.full(0))
    learner = Learner("L0", shard, initial, 0)
    meta, payload, _ = learner.push(0, now=0.0)
    final = dataclasses.replace(meta, clock=meta.clock.tick("L0"), final=True)
    assert shard.accept(final, payload, 0, now=0.0).outcome == ACCEPTED  # supersedes the first
    job = close(shard, 0, now=0.1)
    assert [p.meta.final for p in job.pushes] == [True] and job.weights == (1.0,) and job.mirrors == ()
    update = shard.update_for(0, 0, "L0", final=True)
    assert (update.base_version, update.version, update.segments) == (0, 1, ())
    assert shard.fragments[0].mirrors["L0"].version == 0


def test_the_shards_clock_keeps_only_the_processes_the_run_issued():
    """A push may name thousands of made-up learners: the merged clock keeps the shards,
    the coordinator and the learners that may push, and forgets a learner gone."""
    shard, initial = make_shard()
    learner = Learner("L1", shard, initial, seed=1)
    learner.clock = VectorClock({"C": 4, "S1": 2, "L2": 3, **{f"L{10**8 + i}": 1 for i in range(4000)}})
    learner.push(0, now=0.0)
    assert shard.clock == VectorClock({"C": 4, "S0": 1, "L1": 1, "L2": 3})  # S0 ticked; S1: 1 shard in this run
    shard.learner_left("L2")
    learner.push(1, now=0.1)
    assert set(shard.clock.entries) == {"C", "S0", "L1"}


def test_a_fragment_version_out_of_range_is_refused():
    shard, initial = make_shard()
    shard.fragments.pop(0)
    with pytest.raises(InvalidArgument, match="out of range"):
        shard.add_fragment(0, initial[0], 2**53)
    assert 0 not in shard.fragments
    assert shard.add_fragment(0, initial[0], 2**53 - 1) and shard.fragments[0].version == 2**53 - 1


def test_an_anchor_version_from_the_wire_is_bounded():
    from diloco.v1 import syncer_pb2
    from diloco.syncer.convert import anchor_version_from_proto

    assert anchor_version_from_proto(syncer_pb2.InitializeHeader(anchor_version=2**64 - 1)) is None  # not an anchor
    assert anchor_version_from_proto(syncer_pb2.InitializeHeader(anchor=True, anchor_version=7)) == 7
    for version in (2**53, 2**64 - 1):
        with pytest.raises(InvalidArgument, match="out of range"):
            anchor_version_from_proto(syncer_pb2.InitializeHeader(anchor=True, anchor_version=version))


def fragment_moved(shard, fid, before):
    return math.sqrt(sum(float(np.sum((after - was) ** 2)) for after, was in zip(shard.fragments[fid].params, before)))


def honest_round(shard, honest, direction, rnd, g):
    """Each honest learner pushes the common ``direction`` plus its own noise, in a round of
    its own (K = 1), and applies the reply. Returns the norms of their deltas."""
    norms = []
    for i, learner in enumerate(honest):
        deltas = [d + 0.5 * torch.randn(d.shape, generator=g) * d.abs().mean() for d in direction]
        _, payload, _ = learner.push(0, now=rnd + i * 0.1, deltas=deltas)
        norms.append(math.sqrt(sum(n * n for n in payload.norms)))
        job = close(shard, 0, now=rnd + i * 0.1 + 0.01)
        assert job.clip == (1.0,) and job.measured[0][1] == 1.0
        learner.apply(shard.update_for(0, learner.version[0], learner.name))
    return norms


def hostile_setup():
    shard, initial = make_shard(num_fragments=1)
    shard.set_membership({"L0", "L1", "L2", "L3"}, set())
    honest = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    g = torch.Generator().manual_seed(7)
    direction = [torch.randn(p.shape, generator=g) * 0.01 for p in shard.plan.fragments[0].pieces]
    norms = [honest_round(shard, honest, direction, rnd, g) for rnd in range(3)]
    return shard, initial, honest, direction, g, sorted(norms[-1])[1]


def test_a_learner_pushing_huge_deltas_moves_a_fragment_as_far_as_three_honest_ones_at_most():
    """1 of 4 learners pushes the honest direction at 800x the others' norm (accepted: under
    max_delta_ratio x the fragment's norm); its round moves the fragment by the robust
    multiple (3) x the median honest delta, scaled by the round's share of the live
    learners, not by 800x."""
    shard, initial, honest, direction, g, latest = hostile_setup()
    attacker = Learner("L3", shard, initial, seed=3)
    before = [p.copy() for p in shard.fragments[0].params]
    _, payload, ack = attacker.push(0, now=3.0, deltas=[d * 800 for d in direction])
    assert ack.outcome == ACCEPTED
    pushed = math.sqrt(sum(n * n for n in payload.norms))
    assert pushed > 400 * latest
    # The others' median, or the floor where the fragment's norm puts it higher (here: the
    # honest deltas are 1 % of the fragment's norm, under the floor's 5 %).
    reference = max(latest, FLOOR_RATIO * max(shard.fragment_norm(shard.fragments[0]), 1.0))
    job = close(shard, 0, now=3.01)
    assert job.clip == (pytest.approx(3 * reference / pushed),) and job.measured[0][1] == 1.0
    moved = fragment_moved(shard, 0, before)
    assert 0.9 * 3 * reference / 4 < moved < 1.1 * 3 * reference / 4  # lr 1 x participation 1/4; int4 rounding
    # An honest push after it is held to the same reference and passes whole.
    honest_round(shard, honest[:1], direction, 4, g)


@pytest.mark.parametrize("attack", ["random", "grow"])
def test_a_learner_pushing_against_where_the_fragment_goes_is_gated_out(attack):
    """Pushes at an honest norm but in a direction the others do not take (a random one,
    or along the model's own values, which grows it) agree with the fragment's reference
    direction at a cosine near 0: their gate is 0 and the fragment does not move. The
    reference does not follow those rounds; the honest pushes after them pass whole."""
    shard, initial, honest, direction, g, latest = hostile_setup()
    attacker = Learner("L3", shard, initial, seed=3)
    state = shard.fragments[0]
    for rnd in range(3):
        if attack == "random":
            deltas = [torch.randn(p.shape, generator=g) for p in state.params]
        else:  # delta = anchor - params = -params: the merged step adds the values to themselves
            deltas = [-torch.from_numpy(p.copy()) for p in state.params]
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in deltas))
        before, reference = [p.copy() for p in state.params], [r.copy() for r in state.reference]
        attacker.push(0, now=3.0 + rnd, deltas=[d * latest / norm for d in deltas])
        job = close(shard, 0, now=3.01 + rnd)
        cos, gate = job.measured[0]
        assert abs(cos) < 0.1 and gate == 0.0
        assert fragment_moved(shard, 0, before) < 0.01 * latest  # only what int4 left over from earlier rounds
        assert all(np.array_equal(r, was) for r, was in zip(state.reference, reference))
        attacker.apply(shard.update_for(0, attacker.version[0], attacker.name))
    honest_round(shard, honest, direction, 10, g)


def test_a_learner_gated_to_nothing_does_not_share_the_honest_rounds_step():
    """A learner whose latest push was gated out (the honest direction negated: the negate
    attack) counts for nothing, as a zero-pushing peer does: the honest rounds after it
    share the step among the three honest learners, not the four members. Once its push
    passes the gate again it shares again."""
    shard, initial, honest, direction, g, latest = hostile_setup()
    attacker = Learner("L3", shard, initial, seed=3)
    job = (honest[0].push(0, now=3.0, deltas=direction), close(shard, 0, now=3.01))[1]
    assert job.participation == pytest.approx(1 / 4)  # L3 is a member and not judged yet
    honest[0].apply(shard.update_for(0, honest[0].version[0], honest[0].name))
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in direction))
    attacker.push(0, now=3.1, deltas=[-2.9 * d for d in direction])
    job = close(shard, 0, now=3.11)
    assert job.measured[0][1] == 0.0 and job.clip == (1.0,)  # within 3x the others' norm: only the gate stops it
    assert shard.fragments[0].influence.latest["L3"].norm > 2 * norm  # its record is the raw push
    attacker.apply(shard.update_for(0, attacker.version[0], attacker.name))
    for i, learner in enumerate(honest):
        learner.push(0, now=4.0 + i * 0.1, deltas=direction)
        assert close(shard, 0, now=4.01 + i * 0.1).participation == pytest.approx(1 / 3)
        learner.apply(shard.update_for(0, learner.version[0], learner.name))
    attacker.push(0, now=5.0, deltas=direction)
    job = close(shard, 0, now=5.01)
    assert job.measured[0][1] == 1.0 and job.participation == pytest.approx(1 / 4)
    honest[0].apply(shard.update_for(0, honest[0].version[0], honest[0].name))
    honest[0].push(0, now=5.1, deltas=direction)
    assert close(shard, 0, now=5.11).participation == pytest.approx(1 / 4)


def test_a_learner_that_set_the_reference_alone_cannot_ride_it_once_the_others_arrive():
    """The negate attack as runs showed it: the attacker joins first and its pushes turn the
    fragment's reference alone; the honest learners that arrive disagree with that reference,
    so their agreement is negative and the gate judges nothing. Its cosine with a reference
    only it turned is not measured (so it cannot vouch against the first honest push), and
    while nothing judges directions every push shares the fragment's fallback: the attacker's
    pushes then move the fragment by at most that share, not whole. Once the honest pushes
    have turned the reference and agree with it, the attacker's are gated out."""
    shard, initial = make_shard(num_fragments=1)
    shard.set_membership({"L0"}, set())
    attacker = Learner("L0", shard, initial, seed=0)
    honest = [Learner(f"L{i}", shard, initial, seed=i) for i in (1, 2)]
    g = torch.Generator().manual_seed(7)
    direction = [torch.randn(p.shape, generator=g) * 0.01 for p in shard.plan.fragments[0].pieces]
    state = shard.fragments[0]

    def attack(now):
        before = [p.copy() for p in state.params]
        _, payload, _ = attacker.push(0, now=now, deltas=[-2.9 * d for d in direction])
        job = close(shard, 0, now=now + 0.01)
        attacker.apply(shard.update_for(0, attacker.version[0], attacker.name))
        return job, math.sqrt(sum(n * n for n in payload.norms)), fragment_moved(shard, 0, before)

    def honest_push(learner, now):
        deltas = [d + 0.3 * torch.randn(d.shape, generator=g) * d.abs().mean() for d in direction]
        learner.push(0, now=now, deltas=deltas)
        job = close(shard, 0, now=now + 0.01)
        learner.apply(shard.update_for(0, learner.version[0], learner.name))
        return job

    job, _, _ = attack(0.0)  # alone in the run: merged, and the reference is its own
    assert job.measured[0] == (None, 1.0) and state.influence.turned_by == {"L0"}
    shard.set_membership({"L0", "L1", "L2"}, set())
    job, _, _ = attack(1.0)
    assert job.measured[0][0] is None  # its own history does not vouch for it
    first = honest_push(honest[0], 2.0)
    cos, gated = first.measured[0]
    assert cos < 0 and gated == 1.0 and first.clip == (1.0,)  # nothing vouched against it
    second = honest_push(honest[1], 2.1)
    assert second.measured[0][1] == 1.0 and second.clip[0] < 1.0  # unvouched: a share of the fallback
    job, pushed, moved = attack(2.2)
    budget = FALLBACK_RATIO * max(shard.fragment_norm(state), 1.0) * 0.1 / FALLBACK_PERIOD_S
    assert job.clip[0] * job.measured[0][1] <= budget / pushed * 1.001 and moved < 1.1 * budget
    for rnd in range(4):  # the honest learners turn the reference
        for i, learner in enumerate(honest):
            honest_push(learner, 3.0 + 5 * rnd + i)
    job, _, moved = attack(30.0)
    assert job.measured[0][0] < 0 and job.measured[0][1] == 0.0 and moved < 0.01 * pushed
    for i, learner in enumerate(honest):
        job = honest_push(learner, 31.0 + i)
        assert job.clip == (1.0,) and job.measured[0][1] == 1.0


def test_claimed_tokens_count_at_most_three_times_the_other_learners():
    """A learner claiming 1e12 tokens in one step shares a round with an honest one: its
    weight is capped at 3**2 x the others' (tokens count 3x), so the honest learner keeps a
    tenth of the round instead of 1e-18 of it."""
    shard, initial = make_shard(quorum=2, num_fragments=1)
    shard.set_membership({"L0", "L1", "L3"}, set())
    a, b, attacker = (Learner(name, shard, initial, seed=i) for i, name in enumerate(("L0", "L1", "L3")))
    a.push(0, now=0.0)
    b.push(0, now=0.1)
    assert close(shard, 0, now=0.2).weights == (0.5, 0.5)
    for learner in (a, b):
        learner.apply(shard.update_for(0, learner.version[0], learner.name))
    a.push(0, now=1.0)
    attacker.push(0, now=1.1, tokens=10**12, steps=1)
    job = close(shard, 0, now=1.2)
    assert [p.meta.learner_id for p in job.pushes] == ["L0", "L3"]
    assert job.weights == (pytest.approx(0.1), pytest.approx(0.9))


def test_a_peer_pushing_zeros_or_a_distrusted_one_does_not_share_an_honest_rounds_step():
    """A round's step is shared among the live learners whose pushes count: a member whose
    latest push is under 1 % of the round's largest (zeros, crumbs) or that the validator
    distrusts is not one of them, so it cannot halve the honest learner's steps."""
    shard, initial = make_shard(num_fragments=1)
    shard.set_membership({"L0", "L1", "L2"}, set())
    honest, zero, sybil = (Learner(f"L{i}", shard, initial, seed=i) for i in range(3))
    job = (honest.push(0, now=0.0), close(shard, 0, now=0.01))[1]
    assert job.participation == pytest.approx(1 / 3)  # nothing known of the others yet
    zero.push(0, now=0.1, deltas=[torch.zeros(p.shape) for p in shard.plan.fragments[0].pieces])
    close(shard, 0, now=0.11)
    honest.push(0, now=0.2)
    assert close(shard, 0, now=0.21).participation == pytest.approx(1 / 2)
    shard.set_trust("L2", 0, 0.0)
    shard.set_trust("L0", 0, 1.0)
    honest.push(0, now=0.3)
    job = close(shard, 0, now=0.31)
    assert job.weights[0] > 0 and job.participation == 1.0
