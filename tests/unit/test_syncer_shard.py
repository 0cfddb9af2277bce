"""The shard core with a fake clock: rounds, idempotence, the bit-identical downlink, validation."""

import dataclasses

import numpy as np
import pytest
import torch

from diloco.clock import VectorClock
from diloco.codec import decode, encode
from diloco.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from diloco.fragments import plan_fragments
from syncer.config import MergeConfig, RoundConfig, SyncerConfig
from syncer.core.rounds import Close
from syncer.core.shard import (
    ACCEPTED,
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


def make_shard(quorum=1, grace_mode="off", chain=4, num_fragments=2, **merge):
    plan = plan_fragments(PARAMS, num_fragments)
    g = torch.Generator().manual_seed(0)
    model = {n: torch.randn(s, generator=g) for n, s in PARAMS}
    initial = {f.id: [t.clone() for t in plan.gather(f.id, model)] for f in plan.fragments}
    cfg = SyncerConfig(
        rounds=RoundConfig(quorum=quorum, grace_mode=grace_mode),
        merge=MergeConfig(update_chain_length=chain, **merge),
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

    def push(self, fid, now, tokens=64, steps=4, specs_override=None):
        pieces = self.shard.plan.fragments[fid].pieces
        deltas = [torch.randn(p.shape, generator=self.g) * 0.01 for p in pieces]
        encoded = [encode(p.name, d) for p, d in zip(pieces, deltas)]
        self.clock = self.clock.tick(self.name)
        meta = PushMeta(
            self.name, fid, self.version[fid], tokens, steps, 0.1, self.clock,
            tuple(e.spec for e in encoded) if specs_override is None else specs_override,
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
    shard, initial = make_shard()
    reference = make_shard()[0]  # the same rounds without quantizing the downlink
    shard.set_membership({"L0"}, set())  # every round merges all live learners: lr unscaled
    learner = Learner("L0", shard, initial, 0)
    for rnd in range(5):
        _, payload, _ = learner.push(0, now=rnd)
        job = shard.begin_round(0, shard.decide(0, rnd), rnd)
        segment = compute_round(job, shard.cfg)
        shard.finish_round(job, segment, rnd + 0.1)
        # The update on the wire is exactly what moved the parameters.
        ref_state = reference.fragments[0]
        from syncer.core.merge import merge_piece
        from syncer.core.outer import nesterov_

        for i, piece in enumerate(ref_state.fragment.pieces):
            t = payload.tensors[i]
            step = torch.empty(piece.numel)
            delta = decode(t.spec, t.payload).view(-1)
            step.mul_(merge_piece(lambda terms, acc: float(acc.copy_(delta).mul_(terms[0][1]).double().square().sum()), [payload.norms[i]], [1.0], not piece.embedding, step))
            # The shard's state is numpy; torch.from_numpy views update it in place.
            ref_params = torch.from_numpy(ref_state.params[i]).view(-1)
            ref_momentum = torch.from_numpy(ref_state.momentum[i]).view(-1)
            ref_params.sub_(nesterov_(ref_momentum, step, 0.7, 0.9))
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
