"""A shard's memory of each learner's anchor (``diloco.syncer.core.mirrors``): the int8 residual
codec, the drift it accounts for measured against learners that apply their replies as real
learners do, the full reply that ends a drift, and what a shard holds per learner."""

import numpy as np
import pytest
import torch

from diloco.codec import dequantize_payload, encode, int4_scales
from diloco.syncer.core.mirrors import BLOCK, dequantize8, int4_rounding_sq, quantize8
from diloco.syncer.core.shard import compute_round, condense_replies
from tests.unit.test_syncer_shard import Learner, make_shard


@pytest.mark.parametrize("size", [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 77])
def test_quantize8_rounds_each_value_to_half_a_step(size):
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * rng.uniform(1e-6, 10, size)).astype(np.float32)
    if size > BLOCK:
        x[:BLOCK] = 0  # a block of zeros comes back as zeros
    codes, scales = np.empty(size, np.int8), np.empty(-(-size // BLOCK), np.float32)
    quantize8(x.copy(), codes, scales)
    back = dequantize8(codes, scales, np.empty(size, np.float32))
    assert np.abs(codes.astype(int)).max() == 127  # each block's largest value is +-127 steps
    step = np.repeat(scales, BLOCK)[:size]
    assert np.all(np.abs(x - back) <= step / 2 * (1 + 1e-5) + 1e-30)
    if size > BLOCK:
        assert not back[:BLOCK].any() and scales[0] == 0


def test_quantize8_reports_the_expected_loss_which_matches_the_real_one():
    x = np.random.default_rng(0).standard_normal(200 * BLOCK + 77).astype(np.float32)
    codes, scales = np.empty(x.size, np.int8), np.empty(-(-x.size // BLOCK), np.float32)
    expected = quantize8(x.copy(), codes, scales)
    real = float(np.sum((x.astype(np.float64) - dequantize8(codes, scales, np.empty_like(x))) ** 2))
    assert expected == pytest.approx(real, rel=0.05)


def test_int4_rounding_is_expected_from_the_scales():
    update = np.random.default_rng(1).standard_normal(100 * 128 + 5).astype(np.float32)
    encoded = encode("w", update, encoding="int4", block_size=128, scale_dtype="float16")
    back = dequantize_payload(encoded.payload, update.size, 128, "float16", out=np.empty_like(update))
    real = float(np.sum((update.astype(np.float64) - back) ** 2))
    scales = int4_scales(encoded.payload, update.size, 128, "float16")
    assert len(scales) == 101
    assert int4_rounding_sq(scales, update.size, 128) == pytest.approx(real, rel=0.1)


def close_condensed(shard, fid, now):
    """A round as the runtime runs it with condensed replies."""
    job = shard.begin_round(fid, shard.decide(fid, now), now)
    update = compute_round(job, shard.cfg)
    replies, base = condense_replies(job, shard.cfg)
    shard.finish_round(job, update, now + 0.01, replies, base)
    return job


def sq(values):
    return sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in values)


def test_condensed_replies_keep_learners_near_the_global_values_and_the_drift_is_what_the_shard_accounts():
    """Three learners take turns (each misses the others' rounds), for 120 rounds, and apply
    their replies exactly as a learner does. Each time, the gap between a learner's real
    anchor and the shard's belief of it has the squared norm the shard accounts for
    (``drift_sq``: a sum of independent roundings, so within a factor of 2 here), and the
    learner is as near the global values as the int4 rounding and that drift allow."""
    shard, initial = make_shard(num_fragments=1, chain=2)
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    state = shard.fragments[0]
    for learner in learners:
        shard.mirror(0, learner.name, shard.full(0))
    ratios, offs, full_replies = [], [], 0
    for rnd in range(120):
        learner = learners[rnd % 3]
        learner.push(0, now=rnd, scale=0.02)
        close_condensed(shard, 0, now=rnd + 0.5)
        update = shard.update_for(0, learner.version[0], learner.name)
        full_replies += [s.kind for s in update.segments] == ["full"]
        learner.apply(update)
        mirror = state.mirrors[learner.name]
        gap = sq(a.numpy().reshape(-1) - b for a, b in zip(learner.anchor[0], mirror.believed()))
        if mirror.drift_sq:
            ratios.append(gap / mirror.drift_sq)
        else:
            assert gap == 0  # a full reply: exact
        off = sq(a.numpy() - p for a, p in zip(learner.anchor[0], state.params))
        assert off <= 3 * (mirror.rounding_sq + mirror.drift_sq) + 1e-12
        if update.version - update.base_version > 1 and update.segments[0].kind == "delta":
            # Off the global values by about what int4 rounding of the reply was expected to
            # cost (the drift is far smaller): error feedback keeps it from adding up.
            offs.append(off / mirror.rounding_sq)
    assert len(ratios) > 60
    assert 0.5 < float(np.median(ratios)) < 2 and max(ratios) < 4, ratios
    assert len(offs) > 60 and 0.5 < float(np.median(offs)) < 2, offs
    drifts = [m.drift_sq / m.rounding_sq for m in state.mirrors.values() if m.rounding_sq]
    assert 0 < max(drifts) <= shard.drift_peak < 1
    # With the base refreshed once per three rounds, the drift stays well below the int4
    # rounding: the full reply that would end it is rare.
    assert full_replies <= 3


def test_a_drifted_mirror_gets_full_values_and_is_exact_again():
    shard, initial = make_shard(num_fragments=1)
    learner = Learner("L0", shard, initial, seed=0)
    shard.mirror(0, "L0", shard.full(0))
    learner.push(0, now=0)
    close_condensed(shard, 0, now=0.5)
    learner.apply(update := shard.update_for(0, 0, "L0"))
    assert [s.kind for s in update.segments] == ["delta"]
    mirror = shard.fragments[0].mirrors["L0"]
    mirror.drift_sq = 2 * mirror.rounding_sq  # as after many roundings
    learner.push(0, now=1)
    job = close_condensed(shard, 0, now=1.5)
    assert job.mirrors == () and shard.drift_resets == 1  # not answered condensed
    update = shard.update_for(0, 1, "L0")
    assert [s.kind for s in update.segments] == ["full"]
    learner.apply(update)
    mirror = shard.fragments[0].mirrors["L0"]
    assert mirror.drift_sq == 0 and not mirror.drifted
    for mine, theirs in zip(learner.anchor[0], mirror.believed()):
        assert torch.equal(mine.reshape(-1), torch.from_numpy(theirs))


def test_a_shard_holds_about_a_byte_per_parameter_per_learner_and_at_most_two_bases():
    """32 learners, most of whom miss many rounds: each mirror is its int8 codes and scales
    (1 + 4/BLOCK bytes per parameter); every mirror sits on one of the two newest bases."""
    names = [f"L{i}" for i in range(32)]
    shard, initial = make_shard(num_fragments=1)
    shard.set_membership(set(names), set())
    learners = [Learner(n, shard, initial, seed=i) for i, n in enumerate(names)]
    state = shard.fragments[0]
    numel = sum(p.size for p in state.params)
    for learner in learners:
        shard.mirror(0, learner.name, shard.full(0))
    rng = np.random.default_rng(0)
    for rnd in range(100):
        pushers = rng.choice(learners, size=3, replace=False)
        for learner in pushers:
            learner.push(0, now=rnd)
        close_condensed(shard, 0, now=rnd + 0.5)
        assert {id(m.base) for m in state.mirrors.values()} <= {id(state.base), id(state.previous_base)}
        for learner in pushers:
            learner.apply(shard.update_for(0, learner.version[0], learner.name))
    assert len(state.mirrors) == 32
    for mirror in state.mirrors.values():
        assert mirror.nbytes <= numel * (1 + 4 / BLOCK) + 4 * len(state.params)


def test_the_c_kernel_stores_and_loads_mirrors_bit_for_bit_as_the_numpy_path():
    from diloco.codec.int4 import native

    kernel = native()
    assert kernel is not None, "the C extension is built by pip install -e ."
    rng = np.random.default_rng(2)
    size = 7 * BLOCK + 301
    anchor = rng.standard_normal(size).astype(np.float32)
    base = (anchor + rng.standard_normal(size).astype(np.float32) * np.float32(0.01)).astype(np.float32)
    base[:BLOCK] = anchor[:BLOCK]  # a block with nothing to store
    codes, scales = np.empty(size, np.int8), np.empty(-(-size // BLOCK), np.float32)
    lost = kernel.mirror_store(anchor, base, codes, scales, size, BLOCK)
    codes_np, scales_np = np.empty_like(codes), np.empty_like(scales)
    lost_np = quantize8(anchor - base, codes_np, scales_np)
    assert np.array_equal(codes, codes_np) and np.array_equal(scales, scales_np) and lost == pytest.approx(lost_np)
    loaded = np.empty_like(anchor)
    kernel.mirror_load(codes, scales, base, loaded, size, BLOCK)
    assert np.array_equal(loaded, dequantize8(codes_np, scales_np, np.empty_like(anchor)) + base)
    with pytest.raises(ValueError):
        kernel.mirror_store(anchor, base, codes[:-1], scales, size, BLOCK)


@pytest.mark.parametrize("size,kept,scale_dtype", [(40 * BLOCK, 128, "float16"), (7 * BLOCK + 300, 16, "float16"),
                                                   (3 * BLOCK + 77, 128, "float32"), (100, 16, "float16")])
@pytest.mark.parametrize("same_base", [False, True])
def test_a_sparse_reply_and_its_mirror_in_one_pass_are_the_three_passes_it_fuses(size, kept, scale_dtype, same_base):
    """``condense_sparse`` in the C kernel (``mirror_condense``) against the three passes it
    fuses (load the anchor, ``sparse.condense``, store it against the new base): the same
    payload, the same mirror codes and scales, the same drift and left-out norm, bit for bit."""
    import copy

    from diloco.codec import sparse
    from diloco.codec.int4 import native
    from diloco.syncer.core.mirrors import base_of, condense_sparse, exact, store

    assert native() is not None, "the C kernel is not built"
    rng = np.random.default_rng(size + kept)
    old = base_of(3, [rng.standard_normal(size).astype(np.float32)], copy=True)
    mirror = exact(old)
    store(mirror, 0, old.values[0] + (rng.standard_normal(size) * 1e-3).astype(np.float32), old)  # codes != 0
    goal = old.values[0] + (rng.standard_normal(size) * 1e-2).astype(np.float32)
    new = old if same_base else base_of(4, [goal - (rng.standard_normal(size) * 1e-4).astype(np.float32)], copy=True)
    fused, reference = mirror, copy.deepcopy(mirror)
    reference.base = mirror.base  # deepcopy copied the base: share it, as mirrors do
    if same_base:
        new = mirror.base
    scratch = np.empty(size, np.float32)
    payload, left = condense_sparse(fused, 0, goal, new, scratch, block_size=128, kept=kept, scale_dtype=scale_dtype,
                                    name="w")
    values = reference.anchor_into(0, np.empty(size, np.float32))
    want_payload, want_left = sparse.condense(goal, values, 128, kept, scale_dtype, "w")
    store(reference, 0, values, new)
    assert payload == want_payload and left == want_left and fused.drift_sq == reference.drift_sq
    assert np.array_equal(fused.codes[0], reference.codes[0])
    assert np.array_equal(fused.scales[0].view(np.uint32), reference.scales[0].view(np.uint32))


def test_the_reference_direction_follows_a_round_in_one_pass_as_numpy_computes_it():
    """``follow_`` (the fragment's reference direction after a round) in the C kernel: the
    float32 products and sum numpy's two in-place steps compute, bit for bit."""
    from diloco.codec.int4 import native
    from diloco.syncer.core.bounds import REFERENCE_DECAY
    from diloco.syncer.core.shard import follow_

    assert native() is not None, "the C kernel is not built"
    rng = np.random.default_rng(3)
    reference, delta = rng.standard_normal((2, 10_003)).astype(np.float32)
    weight = np.float32((1 - REFERENCE_DECAY) * 0.731)
    want = reference.copy()
    want *= REFERENCE_DECAY
    want += weight * delta
    follow_(reference, delta, weight)
    assert np.array_equal(reference.view(np.uint32), want.view(np.uint32))
