"""The outer optimizer and the int4 downlink with error feedback, in place on flat fp32
arrays (the shard's state is the only copy; no per-round allocation of the model).

The C kernel runs the step on numpy arrays; without it (or for a block size it does not
take) the same math runs in torch ops, imported only then."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from diloco.codec import dequantize_int4, quantize_int4
from diloco.codec.int4 import SCALE_BYTES, native, num_blocks, packed_nbytes
from diloco.codec.threads import math_threads
from diloco.errors import CodecError

if TYPE_CHECKING:
    import torch


def nesterov_(momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float) -> torch.Tensor:
    """Outer Nesterov SGD on the outer gradient ``delta``: ``buf <- mu*buf + delta`` and
    ``delta`` becomes ``step = lr*(delta + mu*buf)`` (returned); the parameters move by
    ``-step``. Equals torch.optim.SGD(momentum=mu, nesterov=True)."""
    momentum.mul_(mu).add_(delta)
    return delta.add_(momentum, alpha=mu).mul_(lr)


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
    block_size: int, scale_dtype: str, c: float, lr: float, mu: float,
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
        numel, block_size, SCALE_BYTES[scale_dtype], c, lr, mu, math_threads(),
    )
    if status:
        # The parameters diverged (a block's update is non-finite or beyond float16 scales).
        raise CodecError(f"outer update cannot be quantized (status {status}): values are non-finite or too large")
    return packed, scales


def outer_step_(
    delta: np.ndarray, momentum: np.ndarray, residual: np.ndarray, params: np.ndarray,
    scale: float, lr: float, mu: float, block_size: int, scale_dtype: str,
) -> tuple[np.ndarray, np.ndarray] | tuple[torch.Tensor, torch.Tensor]:
    """``nesterov_`` on ``scale * delta`` followed by ``apply_quantized_``, fused into one
    pass by the C kernel when it is built (the same math, up to float rounding order).
    All arrays flat float32, updated in place; ``delta`` may be overwritten. Returns q as
    (packed, scales)."""
    fused = fused_outer_step(delta, momentum, residual, params, block_size, scale_dtype, scale, lr, mu)
    if fused is not None:
        return fused
    import torch

    delta, momentum, residual, params = (torch.from_numpy(a) for a in (delta, momentum, residual, params))
    if scale != 1.0:
        delta.mul_(scale)
    step = nesterov_(momentum, delta, lr, mu)
    return apply_quantized_(params, residual, step, block_size, scale_dtype)
