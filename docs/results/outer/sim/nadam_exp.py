"""EXPERIMENT: AdamW whose denominator estimates the second moment of the mean of M learners' gradients."""
import math
import torch


class GlobalNoiseAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay, learners, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.learners = learners

    @torch.no_grad()
    def step(self):
        keep = 1.0 - 1.0 / self.learners
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                    st["n"] = torch.zeros_like(p)
                st["t"] += 1
                t = st["t"]
                m, v, n = st["m"], st["v"], st["n"]
                sample = getattr(p, "noise_sample", None)
                if sample is not None:
                    n.mul_(b2).add_(sample, alpha=1 - b2)
                elif t > 1:
                    d = g - m / (1 - b1 ** (t - 1))
                    n.mul_(b2).addcmul_(d, d, value=(1 - b2) * (1 + b1) / 2)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc2 = 1 - b2 ** t
                nb = (1 - b2 ** t) if sample is not None else (1 - b2 ** max(t - 1, 1))
                vh = v / bc2
                vg = torch.maximum(vh - keep * (n / nb), vh / self.learners)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m / (1 - b1 ** t), vg.sqrt().add_(group["eps"]), value=-group["lr"])
