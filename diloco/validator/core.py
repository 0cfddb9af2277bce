"""What a push counts for, from how it agrees with a trusted direction: pure, no I/O.

Each pass the validator trains a few inner steps of its own, from the current global
values, on the task's batches at a seed no learner uses: ``v = w - w_trained`` is an outer
gradient it knows to be honest. A learner's push carries ``d = anchor - params``, its own
outer gradient; an honest one points where ``v`` points (the same objective from nearby
values), one that climbs (an outer gradient negated), wanders (a random direction) or
drags the values elsewhere does not. The score of a push is the cosine of ``d`` with ``v``
on the push's fragment.

A trusted direction, not the loss at ``w - d``: the global values already hold most of
the pushes the validator sees (rounds close within milliseconds), and from there a second
step along an honest delta often overshoots, or the gradient has turned: tried first, the
loss at ``w - d`` against ``w + d`` and the first-order change ``-g . d`` both scored many
honest pushes as raising the loss, by as much as a negated push would
(docs/results/trust/README.md)."""

from __future__ import annotations

import math


def cosine(dot: float, norm_sq_a: float, norm_sq_b: float) -> float | None:
    """None when either vector is zero (nothing to judge: a zero push moves nothing)."""
    if not (math.isfinite(dot) and math.isfinite(norm_sq_a) and math.isfinite(norm_sq_b)):
        return -1.0
    if norm_sq_a <= 0 or norm_sq_b <= 0:
        return None
    return dot / math.sqrt(norm_sq_a * norm_sq_b)


def trust(score: float | None, agreement: float) -> float:
    """What a push with cosine ``score`` counts for: nothing at 0 and below (against the
    trusted direction, or unrelated to it), in full from ``agreement`` up, linear between;
    1 for a push with nothing to judge."""
    if score is None:
        return 1.0
    return min(1.0, max(0.0, score / agreement))
