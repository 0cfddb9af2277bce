"""Configuration of the validator process."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.errors import InvalidArgument


@dataclass(frozen=True)
class ValidatorConfig:
    shards: tuple[str, ...] = ()
    """The run's shards (HOST:PORT, in shard order)."""
    interval_s: float = 0.25
    """Seconds between two scoring passes: each reads the global model and the pushes kept
    since, and scores the new ones against the outer gradient it trained last pass. A pass
    that takes longer starts the next at once. The direction a push is judged by is about
    one pass older than the push: at 1 s on the CI's tiny model (about 12 rounds a second
    per fragment), honest pushes scored a median cosine of 0.06 and one in ten of them 0 or
    below; at 0.25 s, 0.08-0.22 and one in 20 to 40 (docs/results/trust/judge-order/)."""
    steps: int = 8
    """Inner steps the validator trains each pass, from the current global values, on the
    task's batches at a seed no learner uses: its trusted outer gradient (about a
    learner's sync period H). Each costs what a learner's inner step costs."""
    agreement: float = 0.05
    """A push whose delta has this cosine with the validator's outer gradient, or more,
    counts in full; at 0 and below (against it or unrelated) it counts nothing; linear
    between. Measured (docs/results/trust/, 6 runs of 2 honest learners, 3 of them beside 3
    learners pushing their negated outer gradient): honest pushes at a median of 0.213
    (5th percentile 0.067; 106 of 3,416 under 0.05, 15 at 0 or below), negated ones at
    -0.088 (95th percentile -0.038; 11 of 1,717 above 0)."""
    timeout_s: float = 60.0
    """Each call to a shard."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise InvalidArgument(f"validator interval must be a positive number of seconds, got {self.interval_s}")
        if self.steps < 1:
            raise InvalidArgument(f"validator steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.agreement) and 0 < self.agreement <= 1):
            raise InvalidArgument(f"validator agreement must be a cosine in (0, 1], got {self.agreement}")
