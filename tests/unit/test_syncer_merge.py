import math

import numpy as np
import pytest
import torch

from diloco.codec import dequantize_int4, quantize_int4
from diloco.syncer.core.merge import Contribution, merge_piece, token_weights
from diloco.syncer.core.outer import apply_quantized_, nesterov_
from tests.unit.test_codec import _message, kernel_path, needs_kernel


def merged(deltas, weights, rda=True):
    out = torch.empty_like(deltas[0])
    def add(terms, acc):
        acc.zero_()
        for i, a in terms:
            acc.add_(deltas[i], alpha=a)
        return float(acc.double().square().sum())

    return out.mul_(merge_piece(add, [float(d.norm()) for d in deltas], weights, rda, out))


def test_token_weights_formula_and_normalisation():
    w = token_weights([Contribution("a", 100, 10, 0), Contribution("b", 200, 10, 0)])
    # w_a = 100 * 10 = 1000, w_b = 200 * 20 = 4000
    assert w == pytest.approx([0.2, 0.8])


def test_zero_steps_and_failed_learners_get_zero_weight():
    w = token_weights(
        [Contribution("a", 100, 0, 0), Contribution("b", 50, 5, 0, failed=True), Contribution("c", 10, 1, 0)]
    )
    assert w == [0.0, 0.0, 1.0]
    assert token_weights([Contribution("a", 0, 0, 0)]) == [0.0]


def test_staleness_discount():
    fresh, stale = Contribution("a", 100, 10, 0), Contribution("b", 100, 10, 3)
    assert token_weights([fresh, stale]) == pytest.approx([0.5, 0.5])
    assert token_weights([fresh, stale], staleness_lambda=1.0) == pytest.approx([4 / 5, 1 / 5])


def test_rda_matches_formula():
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(50, generator=g) * s for s in (1.0, 3.0, 0.5)]
    w = [0.2, 0.5, 0.3]
    mag = sum(wi * d.norm() for wi, d in zip(w, deltas)) / sum(w)
    direction = sum(wi * d / d.norm() for wi, d in zip(w, deltas))
    expected = mag * direction / direction.norm()
    out = merged(deltas, w)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # The merged step keeps the mean length of the learners' steps; a plain mean is shorter.
    assert out.norm() == pytest.approx(float(mag), rel=1e-5)
    assert merged(deltas, w, rda=False).norm() < out.norm()


def test_rda_of_identical_deltas_is_that_delta():
    d = torch.randn(32)
    torch.testing.assert_close(merged([d, d.clone()], [0.3, 0.7]), d)


def test_rda_falls_back_to_mean_when_direction_vanishes():
    d = torch.randn(16)
    out = merged([d, -d], [0.5, 0.5])
    # The unit vectors cancel up to rounding; normalising that noise would invent a step.
    assert torch.all(out.abs() < 1e-6)


def test_mean_mode_is_the_weighted_mean():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    torch.testing.assert_close(merged([a, b], [0.25, 0.75], rda=False), torch.tensor([0.25, 2.25]))


def test_zero_weights_give_zero_merge():
    assert torch.all(merged([torch.ones(4)], [0.0]) == 0)


def test_nesterov_equals_torch_sgd():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(100, generator=g)
    reference = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    ours, buf = theta.clone(), torch.zeros(100)
    for _ in range(20):
        delta = torch.randn(100, generator=g) * 0.01  # outer gradients are small
        reference.grad = delta.clone()
        opt.step()
        ours -= nesterov_(buf, delta.clone(), lr=0.7, decay=0.9, look=0.9)
    torch.testing.assert_close(ours, reference.detach(), rtol=0, atol=1e-6)


def test_quantized_apply_is_exact_and_keeps_the_rest_as_residual():
    g = torch.Generator().manual_seed(2)
    params, residual = torch.randn(256, generator=g), torch.randn(256, generator=g) * 1e-3
    start, r0 = params.clone(), residual.clone()
    step = torch.randn(256, generator=g) * 1e-2
    true_move = r0 - step
    packed, scales = apply_quantized_(params, residual, step.clone(), 64, "float16")
    applied = dequantize_int4(packed, scales, 256, 64)
    assert torch.equal(params, start + applied)
    torch.testing.assert_close(applied + residual, true_move, rtol=0, atol=1e-7)
    assert torch.equal(quantize_int4(true_move, 64, "float16")[0], packed)


def test_fused_outer_step_matches_the_torch_ops():
    from diloco.syncer.core import outer

    g = torch.Generator().manual_seed(3)
    n = 64 * 100 + 10  # a partial last block
    state = [torch.randn(n, generator=g) * s for s in (1e-3, 1e-4, 1.0)]  # momentum, residual, params
    delta = torch.randn(n, generator=g) * 1e-2
    fused_state = [t.clone() for t in state]
    # outer_step_ takes flat float32 numpy arrays and updates them in place; the numpy
    # views share memory with the tensors, so fused_state sees the update.
    packed, scales = outer.outer_step_(
        delta.clone().numpy(), *(t.numpy() for t in fused_state), 1.7, 0.7, 0.9, 0.9, 64, "float16"
    )
    # numpy from the C kernel, torch tensors from the torch fallback.
    packed, scales = torch.as_tensor(packed), torch.as_tensor(scales)
    m, r, p = state
    step = outer.nesterov_(m, delta.clone().mul_(1.7), 0.7, 0.9, 0.9)
    ref_packed, ref_scales = outer.apply_quantized_(p, r, step, 64, "float16")
    for fused, ref in zip(fused_state, state):
        torch.testing.assert_close(fused, ref, rtol=0, atol=1e-6)
    # What the fused step added to params is the int4 update it returns.
    original_params = state[2] - dequantize_int4(ref_packed, ref_scales, n, 64)
    torch.testing.assert_close(fused_state[2], original_params + dequantize_int4(packed, scales, n, 64), rtol=0, atol=1e-6)


def test_token_weights_of_small_counts_and_different_step_counts():
    # Tokens per step matter: the same tokens over 5x the steps weigh 5x less.
    assert token_weights([Contribution("a", 100, 10, 0), Contribution("b", 100, 50, 0)]) == pytest.approx([5 / 6, 1 / 6])
    # A lone learner with one token (raw weight 1, or 0.5 over two steps) still gets it all.
    assert token_weights([Contribution("a", 1, 1, 0)]) == [1.0]
    assert token_weights([Contribution("a", 1, 2, 0)]) == [1.0]


def test_rda_and_mean_with_weights_that_do_not_sum_to_one():
    d = torch.randn(32, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(merged([d, d.clone()], [2.0, 6.0]), d)
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    torch.testing.assert_close(merged([a, b], [1.0, 3.0], rda=False), torch.tensor([0.25, 2.25]))


def test_rda_skips_a_zero_delta_but_keeps_its_weight_in_the_length():
    d = torch.randn(16, generator=torch.Generator().manual_seed(5))
    # Its direction is undefined (norm 0): only d's direction, at half d's length.
    torch.testing.assert_close(merged([torch.zeros(16), d], [0.5, 0.5]), 0.5 * d)


def test_rda_threshold_scales_with_the_total_weight():
    # Unit directions that nearly cancel: |sum w u| = 5e-5 < 1e-6 * 100; the mean is used,
    # not an RDA step of length 1 in a direction made of rounding.
    a = torch.tensor([1.0, 0.0])
    b = torch.tensor([-1.0, 1e-6])
    out = merged([a, b], [50.0, 50.0])
    assert float(out.norm()) < 1e-5, out


def test_apply_quantized_honours_block_size_and_scale_dtype_and_leaves_the_update_in_step():
    g = torch.Generator().manual_seed(6)
    params, residual, step = torch.randn(96, generator=g), torch.zeros(96), torch.randn(96, generator=g) * 1e-2
    move = -step.clone()
    packed, scales = apply_quantized_(params, residual, step, 32, "float32")
    assert scales.dtype == torch.float32 and scales.numel() == 96 // 32
    assert torch.equal(packed, quantize_int4(move, 32, "float32")[0])
    assert torch.equal(step, dequantize_int4(packed, scales, 96, 32))  # step holds the applied update


@pytest.mark.parametrize("block_size", [64, 3])  # 3: a block size the C kernel does not take
def test_outer_step_without_the_kernel_is_the_kernels_step(monkeypatch, block_size):
    from diloco.syncer.core import outer

    g = torch.Generator().manual_seed(7)
    n = 64 * 10 + 5
    state = [torch.randn(n, generator=g) * s for s in (1e-3, 1e-4, 1.0)]
    delta = torch.randn(n, generator=g) * 1e-2

    def step(fused):
        arrays = [t.clone().numpy() for t in state]
        if not fused:
            monkeypatch.setattr(outer, "fused_outer_step", lambda *a: None)
        q = outer.outer_step_(delta.clone().numpy(), *arrays, 2.0, 0.7, 0.9, 0.9, block_size, "float16")
        monkeypatch.undo()
        return [torch.from_numpy(a) for a in arrays], [torch.as_tensor(x) for x in q]

    (m, r, p), (packed, scales) = step(fused=False)
    # The same math by hand: Nesterov on 2 * delta, then the int4 move with error feedback.
    m0, r0, p0 = (t.clone() for t in state)
    update = outer.nesterov_(m0, delta.clone().mul_(2.0), 0.7, 0.9, 0.9)
    ref_packed, ref_scales = outer.apply_quantized_(p0, r0, update, block_size, "float16")
    for ours, ref in ((m, m0), (r, r0), (p, p0), (packed, ref_packed), (scales, ref_scales)):
        assert torch.equal(ours, ref)
    if block_size == 64:  # the kernel: the same step up to the order of float rounding
        (fm, fr, fp), _ = step(fused=True)
        for ours, ref in ((fm, m), (fr, r), (fp, p)):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@needs_kernel
def test_fused_outer_step_takes_even_blocks_up_to_1024():
    """The shard's fused step (in diloco.syncer.core.outer, on the codec's C kernel) runs for even block sizes up to 1024 (and returns the int4
    update it added to params); otherwise it touches nothing and leaves it to torch ops."""
    from diloco.syncer.core import outer

    n = 2100

    def state():
        return [(torch.randn(n, generator=torch.Generator().manual_seed(s)) * 0.1).numpy() for s in range(4)]

    for block_size in (64, 1024):
        delta, momentum, residual, params = state()
        before = params.copy()
        packed, scales = outer.fused_outer_step(delta, momentum, residual, params, block_size, "float16", 1.0, 0.7, 0.9, 0.9)
        applied = dequantize_int4(torch.from_numpy(packed), torch.from_numpy(scales), n, block_size)
        assert scales.size == -(-n // block_size)
        torch.testing.assert_close(torch.from_numpy(params), torch.from_numpy(before) + applied, rtol=0, atol=1e-6)
    for block_size in (3, 2048):
        arrays = state()
        assert outer.fused_outer_step(*arrays, block_size, "float16", 1.0, 0.7, 0.9, 0.9) is None
        assert all(np.array_equal(a, b) for a, b in zip(arrays, state()))
    with kernel_path("torch"):
        assert outer.fused_outer_step(*state(), 64, "float16", 1.0, 0.7, 0.9, 0.9) is None
    delta, *rest = state()
    delta[5] = math.nan
    assert _message(outer.fused_outer_step, delta, *rest, 64, "float16", 1.0, 0.7, 0.9, 0.9) == (
        "outer update cannot be quantized (status 1): values are non-finite or too large")
