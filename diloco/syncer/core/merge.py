"""Merging a round's deltas (outer gradients): token weights and radial-directional
averaging, one piece at a time so a round never holds every fp32 delta at once."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# The weighted sum of unit vectors has norm in [0, sum(w)]; below this fraction of sum(w)
# the mean direction is rounding noise (the deltas cancel out) and must not be normalised.
DIRECTION_EPS = 1e-6


@dataclass(frozen=True)
class Contribution:
    """What the weighting needs to know about one push."""

    learner_id: str
    tokens: int
    inner_steps: int
    staleness: int
    failed: bool = False
    weight_cap: float = math.inf
    """The most its raw weight may count for (``diloco.syncer.core.bounds``)."""


def raw_weight(tokens: int, inner_steps: int) -> float:
    """``tokens * (tokens / steps)``: a push's weight before its cap, staleness and
    normalisation (0 for a push that trained nothing)."""
    return tokens * (tokens / inner_steps) if inner_steps > 0 and tokens > 0 else 0.0


def token_weights(contributions: Sequence[Contribution], staleness_lambda: float = 0.0) -> list[float]:
    """``w = min(tokens * (tokens / steps), weight_cap)``, discounted by
    ``1 / (1 + lambda * staleness)``, normalised to sum 1.

    Learners that took no inner steps, and learners marked failed, get weight 0. When every
    weight is 0 the result is all zeros (the round changes nothing).
    """
    raw = []
    for c in contributions:
        if c.failed:
            raw.append(0.0)
            continue
        w = min(raw_weight(c.tokens, c.inner_steps), c.weight_cap)
        if staleness_lambda:
            w /= 1.0 + staleness_lambda * max(c.staleness, 0)
        raw.append(w)
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else [0.0] * len(raw)


def merge_piece(
    add: Callable[[list[tuple[int, float]], np.ndarray], float],
    norms: Sequence[float],
    weights: Sequence[float],
    rda: bool,
    out: np.ndarray,
) -> float:
    """Write the merged delta of one piece into ``out`` (flat fp32), up to the returned
    factor: the merge is ``factor * out`` (the caller folds the factor into its next pass
    over the data instead of spending one on it).

    ``add([(i, alpha), ...], out)`` overwrites ``out`` with ``sum alpha * delta_i`` (straight
    from the encoded bytes, in one pass: no fp32 delta is ever materialised) and returns
    its squared norm; ``norms[i]`` is delta_i's norm. RDA:
    ``(sum w|d|)/(sum w) * unit(sum w unit(d))`` — averaging directions and lengths
    separately keeps the merged step as long as the learners' steps where a plain mean
    would shrink it. The weighted mean is used for embedding pieces, in mode "mean", and
    when the mean direction vanishes.
    """
    total = sum(weights)
    if total <= 0:
        add([], out)
        return 1.0
    if rda:
        terms = [(i, w / norms[i]) for i, w in enumerate(weights) if w and norms[i] > 0]
        magnitude = sum(weights[i] * norms[i] for i, _ in terms)
        direction_norm = math.sqrt(add(terms, out))
        if direction_norm > DIRECTION_EPS * total:
            return magnitude / total / direction_norm
    add([(i, w / total) for i, w in enumerate(weights) if w], out)
    return 1.0
