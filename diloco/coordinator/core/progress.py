"""What the status page shows of a run's history, kept by the coordinator in bounded
memory whatever its learners send: each learner's training loss against the run's tokens
(from its heartbeats) and the run's recent events (joins, failures, shard restarts,
snapshots)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

MAX_POINTS = 512
"""Points kept per learner's curve; when one more comes, every other point goes (the
curve keeps its shape over the whole run at half the resolution)."""
MAX_CURVES = 256
"""Learners with a curve; a new one drops the curve that was extended longest ago."""
MAX_EVENTS = 200
SHOWN_CURVES = 64
SHOWN_POINTS = 160
"""What the page is sent of them: the curves extended most recently, each thinned evenly
to at most this many points (its first and last kept): a page refreshed every 2 s stays
well under a megabyte, where every point of every curve would be ~4 MB."""


@dataclass(frozen=True)
class Point:
    t: float
    tokens: int
    """The run's tokens (every learner's, ``Membership.tokens_total``) when it was reported."""
    loss: float


class LossCurves:
    """Each learner's training loss (its heartbeats' mean over its last few steps)."""

    def __init__(self) -> None:
        self.curves: dict[str, list[Point]] = {}

    def add(self, learner_id: str, t: float, tokens: int, loss: float) -> None:
        curve = self.curves.get(learner_id)
        if curve is None:
            if len(self.curves) >= MAX_CURVES:
                del self.curves[min(self.curves, key=lambda i: self.curves[i][-1].t)]
            curve = self.curves[learner_id] = []
        elif curve[-1].loss == loss:
            return  # the same window's mean again (heartbeats come more often than windows end)
        curve.append(Point(t, tokens, loss))
        if len(curve) > MAX_POINTS:
            curve[:] = curve[:-1:2] + curve[-1:]

    def to_json(self) -> dict[str, list[list]]:
        """``{learner: [[tokens, loss], ...]}``: the ``SHOWN_CURVES`` extended most recently,
        each at most ``SHOWN_POINTS`` points."""
        shown = sorted(self.curves, key=lambda i: self.curves[i][-1].t)[-SHOWN_CURVES:]
        return {i: [[p.tokens, p.loss] for p in _thinned(self.curves[i])] for i in shown}


def _thinned(curve: list[Point]) -> list[Point]:
    if len(curve) <= SHOWN_POINTS:
        return curve
    step = (len(curve) - 1) / (SHOWN_POINTS - 1)
    return [curve[round(k * step)] for k in range(SHOWN_POINTS)]


class RecentEvents:
    def __init__(self) -> None:
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)

    def add(self, t: float, kind: str, text: str) -> None:
        self.events.append({"t": t, "kind": kind, "text": text})

    def to_json(self) -> list[dict]:
        """Newest first."""
        return list(reversed(self.events))
