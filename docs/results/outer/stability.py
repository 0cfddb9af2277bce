"""The delayed-feedback model of an asynchronous outer step (docs/ARCHITECTURE.md, "The
outer optimizer"): one stiff direction, M learners pushing in turn (K = 1), each push a
learner's progress c * (its anchor's error), its anchor the global value at its previous
reply (M - 1 pushes of the others ago); the shard merges each push at 1/M of the outer lr
(scale_by live). Prints, for each optimizer, the largest lr * c at which the error still
shrinks, over a grid of momenta, and the asymptotic rate (per push) at lr * c = 1.

    python docs/results/outer/stability.py > docs/results/outer/stability.txt
"""

import math

from diloco.syncer.core.outer import momentum_step


def rate(optimizer: str, gain: float, mu: float, learners: int, pushes: int = 4000) -> float:
    """Growth factor per push of the error after ``pushes`` pushes (< 1: it shrinks)."""
    errors = [1.0] * learners  # the anchors of the first pushes: all at the initial error
    buf, share = 0.0, 0.0
    for _ in range(pushes):
        delta = errors[-learners]  # c * (anchor error), c folded into gain
        step = momentum_step(optimizer, mu, share, 1 / learners)
        share = step.share
        d = delta / learners
        buf = step.decay * buf + d
        errors.append(errors[-1] - gain * (d + step.look * buf))
        if abs(errors[-1]) > 1e12 or not math.isfinite(errors[-1]):
            return math.inf
    tail = [abs(e) for e in errors[-4 * learners:]]
    head = [abs(e) for e in errors[-8 * learners:-4 * learners]]
    return (max(tail) / max(max(head), 1e-300)) ** (1 / (4 * learners))


def largest_stable_gain(optimizer: str, mu: float, learners: int) -> float:
    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(optimizer, mid, mu, learners) < 1 else (lo, mid)
    return lo


if __name__ == "__main__":
    for learners in (2, 4, 8):
        print(f"M = {learners} learners, K = 1: largest stable lr * c (and lr * c / (1 - mu), the total gain)")
        print(f"{'mu':>5} {'nesterov':>18} {'delayed-nesterov':>22}")
        for mu in (0.0, 0.5, 0.7, 0.8, 0.9, 0.95):
            per_push = largest_stable_gain("nesterov", mu, learners)
            delayed = largest_stable_gain("delayed-nesterov", mu, learners)
            print(f"{mu:5.2f} {per_push:8.3f} ({per_push / (1 - mu):6.2f}) {delayed:12.3f} ({delayed / (1 - mu):6.2f})")
        print()
