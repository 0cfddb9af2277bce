"""What a learner reports when it ends (RUN_DIR/learners/<id>.json): its counts, rates and
evaluations. Kept apart from ``diloco.learner.api`` so that the slice follower, which is not a
``Learner``, writes the same record."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from diloco.errors import InvalidArgument


@dataclass
class Summary:
    learner_id: str
    inner_steps: int = 0
    planned_steps: int | None = None
    """The inner steps the learner was launched to train (the ``--task`` runner's
    ``steps``; None for an own loop): a resumed ``diloco local`` gives it what is left."""
    tokens: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    """Seconds inside the inner-step loop (the wall time minus bootstrap and draining)."""
    tokens_per_s: float = 0.0
    """Tokens per second of the inner-step loop."""
    eval_unit: str = "loss"
    eval_loss_start: float | None = None
    """The task's eval loss (in ``eval_unit``) before the first inner step."""
    eval_loss_final: float | None = None
    train_loss: float | None = None
    """The task's training loss, the mean over the last ``LearnerConfig.train_loss_every_steps``
    inner steps, in ``eval_unit`` (times the task's ``eval_scale``); None before the first
    such window ends."""
    eval_history: list[tuple[int, int, float]] = field(default_factory=list)
    """(inner step, tokens, eval loss)."""
    pushes_sent: int = 0
    pushes_acked: int = 0
    pushes_dropped: int = 0
    replies_applied: int = 0
    replies_late: int = 0
    sends_deferred: int = 0
    """Sends skipped because the fragment's previous push still awaited its reply."""
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_initialize: int = 0
    """fp32 values offered to shards with Initialize (initial values, anchors), taken or not."""
    mean_staleness: float = 0.0
    blocked_s: float = 0.0
    """Time the training loop spent on the network (submitting, never waiting): ~0."""
    sync_latency_s_p50: float | None = None
    initialized_fragments: list[int] = field(default_factory=list)
    """Fragments whose version 0 is this learner's values (it found them empty)."""


class Pace:
    """Tokens per second over the last few seconds of a learner's steps, on its own clock:
    what its heartbeats report as its rate."""

    WINDOW_S = 3.0

    def __init__(self) -> None:
        self.points: collections.deque[tuple[float, int]] = collections.deque()
        self.rate = 0.0
        """As of the last count added (another thread may read it)."""

    def add(self, t: float, tokens: int) -> float:
        if not self.points or t > self.points[-1][0]:  # a count seen again is no new point
            self.points.append((t, tokens))
        while len(self.points) > 2 and t - self.points[1][0] >= self.WINDOW_S:
            self.points.popleft()
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        self.rate = max(n1 - n0, 0) / (t1 - t0) if t1 > t0 else 0.0
        return self.rate


class LossReports:
    """``report_loss``, the same for a ``Learner`` and a slice's follower host (each has
    ``summary``, ``telemetry`` and ``event``)."""

    def report_loss(self, *, train: float | None = None, eval: float | None = None, unit: str | None = None,
                    step: int | None = None) -> None:
        """Losses for the run's curves (``curves.jsonl``), the status page and the metrics:
        ``train``, the loop's training loss (the ``--task`` runner gives the mean over each
        ``train_loss_every_steps`` inner steps), and ``eval``, an evaluation of the model; in
        ``unit`` (kept as the summary's ``eval_unit``; default: the one it has). Each is kept
        in the summary, set on its gauge, recorded as an event (``train``, ``eval``) at
        ``step`` (default: the inner steps so far) and sent with the next heartbeat. Not a
        finite number: InvalidArgument."""
        s = self.summary
        unit = s.eval_unit = unit or s.eval_unit  # what the heartbeats say they are in
        step = s.inner_steps if step is None else step
        for name, value in (("train", train), ("eval", eval)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise InvalidArgument(f"report_loss: {name} must be a finite number, got {value!r}")
        if train is not None:
            s.train_loss = float(train)
            self.telemetry.train_loss(s.train_loss, unit)
            self.event("train", step=step, tokens=s.tokens, loss=round(s.train_loss, 5), unit=unit,
                       tokens_per_s=round(s.tokens / s.wall_s, 1) if s.wall_s else 0.0)
        if eval is not None:
            if s.eval_loss_start is None:
                s.eval_loss_start = float(eval)
            s.eval_loss_final = float(eval)
            s.eval_history.append((step, s.tokens, round(eval, 5)))
            self.telemetry.eval_loss(s.eval_loss_final, unit)
            self.event("eval", step=step, tokens=s.tokens, loss=round(eval, 5), unit=unit)
