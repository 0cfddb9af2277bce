"""How long this process did not run: a watch ticks every ``every_s`` while the event
loop runs, so a gap between two looks at the clock longer than that (and a slack) is time
the loop did not run: the host stalled (a VM pause, SIGSTOP, a laptop's sleep) or a
callback blocked it. The coordinator moves its leases on by that time
(``Membership.pause``): nobody could heartbeat to a coordinator that was not running.

Pure: the caller gives the time; ``stalled`` is called at every look (each tick and each
request), so it reports a stall once, at the first look after it.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_TICK_S = 0.5
"""How often the coordinator's loop ticks the watch."""
STALL_SLACK_S = 1.0
"""A gap this much longer than a tick counts as a stall: a busy loop's late tick does not."""


@dataclass
class StallWatch:
    last_s: float
    """When the loop last looked at the clock."""
    every_s: float = STALL_TICK_S
    slack_s: float = STALL_SLACK_S
    total_s: float = 0.0
    """Every stall so far."""

    def stalled(self, now: float) -> float:
        """Seconds the loop did not run since its last look, beyond a tick (0: it ran)."""
        gap, self.last_s = now - self.last_s, max(self.last_s, now)
        if gap <= self.every_s + self.slack_s:
            return 0.0
        self.total_s += gap - self.every_s
        return gap - self.every_s
