"""The outer optimizer and the int4 downlink with error feedback, in place on flat fp32
arrays (the shard's state is the only copy; no per-round allocation of the model).

The C kernel runs the step on numpy arrays; without it (or for a block size it does not
take) the same math runs in torch ops, imported only then."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from diloco.codec import dequantize_int4, quantize_int4
from diloco.codec.int4 import SCALE_BYTES, native, num_blocks, packed_nbytes
from diloco.codec.threads import math_threads
from diloco.errors import CodecError

if TYPE_CHECKING:
    import torch

SHARE_EPS = 1e-9
"""A period's shares (1/M each) sum to 1 up to rounding."""


@dataclass(frozen=True)
class MomentumStep:
    """How one round's outer step treats the momentum buffer: ``buf <- decay*buf + d``, the
    step ``lr*(d + look*buf)``; ``share``, the participation the fragment's current
    momentum period has gathered after this round (0: a momentum step closed it)."""

    decay: float
    look: float
    share: float = 0.0


def momentum_step(optimizer: str, mu: float, share: float, participation: float) -> MomentumStep:
    """The round's ``MomentumStep`` from the fragment's period so far (``share``) and the
    round's participation (its merged pushes over the live learners).

    nesterov: every round is a Nesterov step (``decay = look = mu``).

    delayed-nesterov: the momentum is applied once per period, a period being as many
    rounds as make up one share of every live learner (M single-push rounds at K = 1;
    one round at K = M). Within a period each round moves the parameters by its plain
    step ``lr*c*delta`` and adds ``c*delta`` to the buffer; the round that completes the
    period also moves them by ``lr*mu*buf``. Over a period that is exactly one Nesterov
    step on the period's summed (share-weighted) deltas, ``buf <- mu*buf + sum``, ``step
    = lr*(sum + mu*buf)``, as synchronous DiLoCo takes once per round: the momentum sees
    one averaged delta per period instead of every stale single push, and its loop runs
    at the period's rate (docs/ARCHITECTURE.md, "The outer optimizer")."""
    if optimizer == "nesterov":
        return MomentumStep(mu, mu)
    decay = mu if share <= 0 else 1.0  # the first round of a period decays the buffer once
    share += participation
    if share >= 1 - SHARE_EPS:
        return MomentumStep(decay, mu)
    return MomentumStep(decay, 0.0, share)


def nesterov_(momentum: torch.Tensor, delta: torch.Tensor, lr: float, decay: float, look: float) -> torch.Tensor:
    """The outer step on the outer gradient ``delta``: ``buf <- decay*buf + delta`` and
    ``delta`` becomes ``step = lr*(delta + look*buf)`` (returned); the parameters move by
    ``-step``. With ``decay = look = mu`` it is Nesterov SGD, torch.optim.SGD(momentum=mu,
    nesterov=True); a delayed Nesterov round (``MomentumStep``) takes other values."""
    momentum.mul_(decay).add_(delta)
    return delta.add_(momentum, alpha=look).mul_(lr)


def apply_quantized_(
    params: torch.Tensor, residual: torch.Tensor, step: torch.Tensor, block_size: int, scale_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move ``params`` by ``-step`` as exactly as int4 can say, keeping the rest as error
    feedback: ``u = residual - step``; ``q = int4(u)``; ``params += dequant(q)``;
    ``residual = u - dequant(q)``. A learner that decodes ``q`` gets the same fp32 values
    bit for bit, so applying the chain of q's keeps it identical to the shard. ``step`` is
    overwritten (it holds the applied update afterwards). Returns q as (packed, scales)."""
    residual.sub_(step)
    packed, scales = quantize_int4(residual, block_size=block_size, scale_dtype=scale_dtype)
    applied = dequantize_int4(packed, scales, residual.numel(), block_size, out=step)
    residual.sub_(applied)
    params.add_(applied)
    return packed, scales


def fused_outer_step(
    delta: np.ndarray, momentum: np.ndarray, residual: np.ndarray, params: np.ndarray,
    block_size: int, scale_dtype: str, c: float, lr: float, decay: float, look: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``nesterov_`` on ``c * delta`` and ``apply_quantized_`` in one pass of the C kernel
    (``diloco/codec/_int4.c``): momentum, residual and params (flat float32 arrays) updated
    in place; returns the int4 update (packed, scales) that was added to params. None when
    the kernel is unavailable or the block size does not suit it (even, at most 1024)."""
    kernel = native()
    if kernel is None or block_size % 2 or block_size > 1024:
        return None
    numel = params.size
    packed = np.empty(packed_nbytes(numel), np.uint8)
    scales = np.empty(num_blocks(numel, block_size), scale_dtype)
    status = kernel.outer_step(
        delta, momentum, residual, params, packed, scales,
        numel, block_size, SCALE_BYTES[scale_dtype], c, lr, decay, look, math_threads(),
    )
    if status:
        # The parameters diverged (a block's update is non-finite or beyond float16 scales).
        raise CodecError(f"outer update cannot be quantized (status {status}): values are non-finite or too large")
    return packed, scales


def outer_step_(
    delta: np.ndarray, momentum: np.ndarray, residual: np.ndarray, params: np.ndarray,
    scale: float, lr: float, decay: float, look: float, block_size: int, scale_dtype: str,
) -> tuple[np.ndarray, np.ndarray] | tuple[torch.Tensor, torch.Tensor]:
    """``nesterov_`` on ``scale * delta`` followed by ``apply_quantized_``, fused into one
    pass by the C kernel when it is built (the same math, up to float rounding order).
    All arrays flat float32, updated in place; ``delta`` may be overwritten. Returns q as
    (packed, scales)."""
    fused = fused_outer_step(delta, momentum, residual, params, block_size, scale_dtype, scale, lr, decay, look)
    if fused is not None:
        return fused
    import torch

    delta, momentum, residual, params = (torch.from_numpy(a) for a in (delta, momentum, residual, params))
    if scale != 1.0:
        delta.mul_(scale)
    step = nesterov_(momentum, delta, lr, decay, look)
    return apply_quantized_(params, residual, step, block_size, scale_dtype)
