"""Chaos for ``diloco local``: failures and elasticity injected into a running cluster
the way they happen to a real one, each action written to ``chaos.jsonl`` in the run
directory (``diloco timeline`` draws them).

- kill: SIGKILL a random active learner (its process, found through the pid it reported
  at join); the launcher starts a replacement through AddLearners that trains the steps
  the dead one had left. Kill times form a Poisson process with the given mean.
- scavenge: AddLearners(N) into the ``scavenged`` pool at a given time, as a user would.
- restart-shard: take a snapshot, SIGKILL shard 0, start it again from that snapshot on
  (or, with ``--restart-from learners``, SIGKILL it and start it with no snapshot: it
  recovers from the learners' anchors)
  the same address; learners find it down, probe it and re-sync.

Slow learners and wire delay are learner flags set at launch (``tools.local.run``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import DilocoError, InvalidArgument

logger = logging.getLogger(__name__)

SCAVENGED_POOL = "scavenged"


RESTART_SOURCES = ("snapshot", "learners")
"""Where a restarted shard gets its state: a snapshot taken just before, or no state (the
learners' anchors)."""


@dataclass(frozen=True)
class ChaosConfig:
    kill_every_s: float | None = None
    """Mean seconds between two learner kills (None: no kills)."""
    restart_shard_at_s: float | None = None
    restart_from: str = "snapshot"
    """How the restarted shard comes back: ``snapshot`` (snapshot first, then --restore)
    or ``learners`` (no snapshot, no --restore: it recovers from the learners' anchors)."""
    max_kills: int | None = None
    """Stop killing after this many kills (None: no limit)."""
    scavenge: tuple[int, float] | None = None
    """(learners, seconds): AddLearners(learners) at that time."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kill_every_s is not None and not self.kill_every_s > 0:
            raise InvalidArgument(f"--kill-learner-every must be > 0 seconds, got {self.kill_every_s}")
        if self.max_kills is not None and self.max_kills < 0:
            raise InvalidArgument(f"--max-kills must be >= 0, got {self.max_kills}")
        if self.restart_shard_at_s is not None and not self.restart_shard_at_s >= 0:
            raise InvalidArgument(f"--restart-shard-at must be >= 0 seconds, got {self.restart_shard_at_s}")
        if self.restart_from not in RESTART_SOURCES:
            raise InvalidArgument(f"--restart-from must be snapshot or learners, got {self.restart_from!r}")
        if self.scavenge is not None and (self.scavenge[0] < 1 or self.scavenge[1] < 0):
            raise InvalidArgument(f"--scavenge needs N >= 1 learners at SECONDS >= 0, got {self.scavenge}")

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.kill_every_s, self.restart_shard_at_s, self.scavenge))


def parse_scavenge(text: str) -> tuple[int, float]:
    """``"3@40"`` -> (3, 40.0)."""
    count, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        return int(count), float(at)
    except ValueError:
        raise InvalidArgument(f"--scavenge takes N@SECONDS, e.g. 3@40, got {text!r}") from None


def _learner_number(text: str, flag: str, what: str, example: str) -> tuple[int, float]:
    """``"L1:1.5"`` or ``"1:1.5"`` -> (1, 1.5), for ``flag ID:WHAT``."""
    which, sep, number = text.partition(":")
    try:
        if not sep:
            raise ValueError
        index, value = int(which.removeprefix("L")), float(number)
    except ValueError:
        raise InvalidArgument(f"{flag} takes ID:{what}, e.g. {example}, got {text!r}") from None
    if index < 0:
        raise InvalidArgument(f"{flag} needs a learner index >= 0, got {text!r}")
    return index, value


def parse_slow(text: str) -> tuple[int, float]:
    """``"1:1.5"`` or ``"L1:1.5"`` -> (1, 1.5): the learner launched second is 1.5x slower."""
    index, value = _learner_number(text, "--slow-learner", "FACTOR", "L1:1.5")
    if not value >= 1:
        raise InvalidArgument(f"--slow-learner needs a learner index >= 0 and a factor >= 1, got {text!r}")
    return index, value


def parse_link(text: str) -> tuple[int, float]:
    """``"1:5"`` or ``"L1:5"`` -> (1, 5.0): the learner launched second is on a 5 Mbit/s site
    (the rate is checked with the config, ``diloco.sites.check_mbit``)."""
    return _learner_number(text, "--link", "MBIT", "L1:5")


def parse_learner_device(text: str) -> tuple[int, str]:
    """``"0:xla"`` or ``"L0:xla"`` -> (0, "xla"): the learner launched first trains on XLA."""
    which, sep, device = text.partition(":")
    try:
        index = int(which.removeprefix("L"))
    except ValueError:
        index = -1
    if not sep or index < 0 or device not in ("cpu", "cuda", "xla"):
        raise InvalidArgument(f"--learner-device takes ID:DEVICE (a learner index >= 0; cpu, cuda or xla), e.g. L0:xla, got {text!r}")
    return index, device


def learner_pid(member: dict) -> int | None:
    """Learners report ``host:pid`` as their address when they join."""
    try:
        return int(member.get("address", "").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


class ChaosMonkey(threading.Thread):
    """Runs the schedule in the background until ``halt``; never raises (a failed action
    is logged and recorded)."""

    def __init__(self, cfg: ChaosConfig, admin, restart_shard: Callable[[int], None], steps: int,
                 log_path: Path, started: float) -> None:
        super().__init__(name="diloco-chaos", daemon=True)
        self.cfg, self.admin, self.restart_shard, self.steps = cfg, admin, restart_shard, steps
        self.log_path, self.started = log_path, started
        self.rng = random.Random(cfg.seed)
        self.halted = threading.Event()
        self.launched = 0
        """Learners this monkey launched (replacements and scavenged)."""
        self.kills = 0
        self._lock = threading.Lock()
        self.acting = threading.Lock()
        """Held during an action: a kill and its replacement are one step for observers."""

    def halt(self) -> None:
        self.halted.set()

    def record(self, kind: str, t: float | None = None, **fields) -> None:
        with self._lock, open(self.log_path, "a") as f:
            f.write(json.dumps({"kind": kind, "t": round(t or time.time(), 6), **fields}) + "\n")

    def run(self) -> None:
        pending = []
        if self.cfg.scavenge is not None:
            pending.append((self.cfg.scavenge[1], "scavenge"))
        if self.cfg.restart_shard_at_s is not None:
            pending.append((self.cfg.restart_shard_at_s, "restart"))
        next_kill = self.rng.expovariate(1 / self.cfg.kill_every_s) if self.cfg.kill_every_s else None
        while not self.halted.wait(0.2):
            elapsed = time.monotonic() - self.started
            for item in sorted(pending):
                if item[0] <= elapsed:
                    pending.remove(item)
                    self._act(item[1])
            if self.cfg.max_kills is not None and self.kills >= self.cfg.max_kills:
                next_kill = None
            if next_kill is not None and next_kill <= elapsed:
                # No learner active yet (or any more): try again in a second.
                killed = self._act("kill")
                next_kill = elapsed + (self.rng.expovariate(1 / self.cfg.kill_every_s) if killed else 1.0)

    def _act(self, what: str) -> bool:
        with self.acting:
            return self._act_unlocked(what)

    def _act_unlocked(self, what: str) -> bool:
        try:
            if what == "kill":
                return self._kill()
            elif what == "scavenge":
                count = self.cfg.scavenge[0]
                results = self.admin.add_learners(count, pool=SCAVENGED_POOL)
                self.launched += sum(r["ok"] for r in results)
                self.record("scavenge", count=count, launched=[r["launch_id"] for r in results if r["ok"]])
            elif what == "restart":
                self.restart_shard(0)
            return True
        except (DilocoError, OSError, subprocess.SubprocessError) as error:
            logger.warning("chaos: %s failed: %s", what, error)
            self.record(f"{what}_failed", detail=str(error))
            return True

    def _kill(self) -> bool:
        active = [m for m in self.admin.members() if m["state"] == "active" and learner_pid(m)]
        if not active:
            return False
        victim = self.rng.choice(sorted(active, key=lambda m: m["id"]))
        pid = learner_pid(victim)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills += 1
        remaining = max(self.steps - int(victim.get("inner_steps", 0)), 1)
        self.record("kill", learner=victim["id"], pid=pid, inner_steps=victim.get("inner_steps", 0))
        results = self.admin.add_learners(1, pool=victim.get("pool", ""), overrides={"steps": str(remaining)})
        self.launched += sum(r["ok"] for r in results)
        self.record("replace", learner=victim["id"], steps=remaining,
                    launched=[r["launch_id"] for r in results if r["ok"]])
        return True
