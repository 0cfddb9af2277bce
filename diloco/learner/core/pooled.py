"""AdamW normalised by the second moment of the learners' mean gradient (``adamw-pooled``).

Averaging M learners' AdamW steps is not DP's AdamW step on the M batches' mean
gradient: each learner divides by the running second moment of its own batch's gradient,
``s² + σ²`` per coordinate (signal, sampling noise), where DP divides by ``s² + σ²/M``.
Wherever the gradient is mostly noise each learner's step is up to √M times shorter, and
their average stays short: on the long workload averaged AdamW ends 6.7 % above DP with
the learners averaged after every step and nothing on the wire
(docs/results/outer/README.md, "A model without the wire").

This optimizer estimates σ² per coordinate from the batch itself: the runner takes the
gradient of each half of the batch, and ``(g_a − g_b)²/4`` is an unbiased sample of the
full batch's gradient noise. Its running mean ``n`` (AdamW's β2) turns the denominator
into ``v − (1 − 1/M)·n``, floored at ``v/M`` (the most averaging can remove), what DP's
AdamW would divide by. A noise estimate from the gradient's own time series (``g`` against
its running mean) cannot stand in: at the largest stable learning rate the sharp
directions oscillate, and the oscillation read as noise enlarged exactly the steps that
must stay small (3.10 against 2.44 bits/byte, same README).

With M = 1 it is AdamW exactly (``tests/unit/test_pooled_adamw.py``).
"""

from __future__ import annotations

import torch


class PooledAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose denominator is the
    second moment DP's mean gradient over ``learners`` learners would have. Call
    ``observe_noise`` with each parameter's noise sample before every ``step``."""

    def __init__(self, params, lr: float, weight_decay: float, learners: int,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if learners < 1:
            raise ValueError(f"learners must be >= 1, got {learners}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.learners = learners
        self._noise: dict[torch.Tensor, torch.Tensor] = {}

    def observe_noise(self, samples: dict[torch.Tensor, torch.Tensor]) -> None:
        """This step's noise sample of each parameter's gradient (``(g_a − g_b)²/4``,
        scaled as the gradient was clipped)."""
        self._noise = samples

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PooledAdamW takes no closure: the runner computes the gradient and its noise")
        keep = 1.0 - 1.0 / self.learners
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["noise_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v, n = state["exp_avg"], state["exp_avg_sq"], state["noise_sq"]
                g = p.grad
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                sample = self._noise.get(p)
                if sample is not None:
                    n.mul_(beta2).add_(sample, alpha=1 - beta2)
                correction2 = 1 - beta2 ** t
                v_hat = v / correction2
                pooled = torch.maximum(v_hat - keep * (n / correction2), v_hat / self.learners)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, pooled.sqrt_().add_(group["eps"]), value=-group["lr"] / (1 - beta1 ** t))
        self._noise = {}
