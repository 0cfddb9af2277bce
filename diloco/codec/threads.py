"""How many cores the codec's math may use."""

from __future__ import annotations

import os
import sys


def math_threads() -> int:
    """torch's intra-op thread count where torch is loaded (a learner's one knob for how
    many cores math may use); otherwise, in a process without torch (a syncer shard), the
    CPUs this process may run on. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, torch.get_num_threads())
    return max(1, len(os.sched_getaffinity(0)))
