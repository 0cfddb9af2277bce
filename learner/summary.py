"""What a learner reports when it ends (RUN_DIR/learners/<id>.json): its counts, rates and
evaluations. Kept apart from ``learner.api`` so that the slice follower, which is not a
``Learner``, writes the same record."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Summary:
    learner_id: str
    inner_steps: int = 0
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
