"""The outer optimizer and the int4 downlink with error feedback, in place on flat fp32
arrays (the shard's state is the only copy; no per-round allocation of the model).

The C kernel runs the step on numpy arrays; without it (or for a block size it does not
take) the same math runs in torch ops, imported only then."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from diloco.codec import dequantize_int4, quantize_int4
from diloco.codec.int4 import fused_outer_step

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
