"""When does a round close? Quorum K, then an adaptive grace window for stragglers.

``decide_round`` is a pure function of (round, now, config); it returns ``Close`` or
``Wait`` with a reason a human can read in the log, the tape and the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.syncer.config import RoundConfig


@dataclass(frozen=True)
class Close:
    reason: str
    grace_s: float
    """Grace time actually spent (0 when the round closed without one)."""


@dataclass(frozen=True)
class Wait:
    reason: str
    deadline: float | None
    """When to decide again if no push arrives first; None: only a push can change it."""


@dataclass
class Timings:
    """Exponential moving averages feeding the adaptive grace window."""

    step_time_s: float | None = None
    quorum_time_s: float | None = None
    sync_time_s: float | None = None

    def observe(self, name: str, value: float, factor: float) -> None:
        old = getattr(self, name)
        setattr(self, name, value if old is None else (1 - factor) * old + factor * value)

    def grace_s(self, cfg: RoundConfig) -> float:
        if cfg.grace_mode == "off":
            return 0.0
        if cfg.grace_mode == "fixed":
            return cfg.grace_fixed_s
        if self.step_time_s is None:
            return 0.0
        slack = cfg.overlap_steps * self.step_time_s - ((self.quorum_time_s or 0.0) + (self.sync_time_s or 0.0))
        return min(max(cfg.grace_gamma * slack, 0.0), cfg.grace_max_s)


@dataclass(frozen=True)
class RoundView:
    """What the decision looks at: who pushed, who is alive, when things happened."""

    pushed: frozenset[str]
    live: frozenset[str]
    opened_at: float
    quorum_at: float | None
    grace_s: float
    draining: frozenset[str] = frozenset()
    """Learners leaving the run: their pushes count, but no round waits for them."""


def decide_round(view: RoundView, now: float, cfg: RoundConfig) -> Close | Wait:
    members = view.live | view.draining
    counted = view.pushed & members if members else view.pushed
    n, live = len(counted), len(view.live)
    if not view.pushed:
        return Wait("no pushes yet", None)
    if view.live and view.live <= view.pushed:
        return Close(f"all {live} live learners pushed", _spent(view, now))
    if not view.live and view.draining:
        return Close(f"every learner is draining ({len(view.draining)}): none left to wait for", _spent(view, now))
    if n < cfg.quorum:
        return Wait(f"{n}/{cfg.quorum} pushes for quorum ({live} live)", None)
    quorum_at = view.quorum_at if view.quorum_at is not None else now
    if view.grace_s <= 0:
        return Close(f"quorum {n}/{live} reached, no grace", 0.0)
    ends = quorum_at + view.grace_s
    if now >= ends:
        return Close(f"quorum {n}/{live} + grace {view.grace_s:.2f} s expired", view.grace_s)
    return Wait(f"{n}/{live} learners; grace ends in {ends - now:.2f} s", ends)


def _spent(view: RoundView, now: float) -> float:
    return max(0.0, now - view.quorum_at) if view.quorum_at is not None else 0.0
