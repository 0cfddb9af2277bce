"""Inner learning-rate schedule and the fragment send schedule."""

from __future__ import annotations

import math


def inner_lr(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``peak * min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def send_offsets(num_fragments: int, sync_every_steps: int) -> list[int]:
    """Offset of each fragment in the H-step cycle, spread evenly (P = H: one per step)."""
    return [(p * sync_every_steps) // num_fragments for p in range(num_fragments)]


def fragments_due(step: int, offsets: list[int], sync_every_steps: int) -> list[int]:
    """Fragments sent at inner step ``step``: those with ``step ≡ offset (mod H)``."""
    phase = step % sync_every_steps
    return [p for p, offset in enumerate(offsets) if offset == phase]
