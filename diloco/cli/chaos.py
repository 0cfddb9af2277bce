"""Chaos for ``diloco local``: failures and elasticity injected into a running cluster
the way they happen to a real one, each action written to ``chaos.jsonl`` in the run
directory (``diloco timeline`` draws them; ``diloco.cli.check`` checks the run against them).

- kill: SIGKILL a random active learner (its process, found through the pid it reported
  at join); the launcher starts a replacement through AddLearners that trains the steps
  the dead one had left. Kill times form a Poisson process with the given mean.
- scavenge: AddLearners(N) into the ``scavenged`` pool at a given time, as a user would.
- restart-shard: take a snapshot, SIGKILL a shard, start it again from that snapshot on
  the same address (or, with ``--restart-from learners``, with no snapshot: it recovers
  from the learners' anchors); learners find it down, probe it and re-sync.
- network faults, on emulated sites (``diloco.coordinator.sites``), each for a duration: ``cut`` a
  learner's link (both ways), ``cut-shard`` (the learner cannot reach one shard),
  ``cut-coordinator`` (it cannot reach the coordinator), ``isolate-coordinator`` (no
  learner can), ``flap`` (its link down and up every ``FLAP_PERIOD_S``) and ``starve``
  (its link shaped to ``STARVE_FACTOR`` of its rate). ``--chaos SPEC`` mixes them with
  kills and shard restarts in one seeded schedule (``parse_chaos``).

A learner the coordinator fails while a fault keeps its heartbeats away is stopped by its
launcher, as any failed learner; once the fault is healed the monkey launches a
replacement with the steps it had left, as after a kill (docs/ARCHITECTURE.md,
"Partitions").

Slow learners and wire delay are learner flags set at launch (``diloco.cli.local.run``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.coordinator import sites
from diloco.errors import DilocoError, InvalidArgument
from diloco.coordinator.sites import HubSpec

logger = logging.getLogger(__name__)

SCAVENGED_POOL = "scavenged"


PROCESS_FAULTS = ("kill", "restart-shard")
NETWORK_FAULTS = ("cut", "cut-shard", "cut-coordinator", "isolate-coordinator", "flap", "starve")
FAULT_KINDS = PROCESS_FAULTS + NETWORK_FAULTS
SHARD_TARGETED = ("restart-shard", "cut-shard")
"""Faults aimed at a shard (``@S1``); the others at a learner (``@L1``), but for
``isolate-coordinator``, which hits every learner."""
DEFAULT_FAULT_S = 10.0
"""A network fault's default duration: two leases (5 s), so a cut learner is failed."""
FLAP_PERIOD_S = 2.0
"""A flapping link is down this long, then up this long, over and over."""
STARVE_FACTOR = 0.01
"""A starved link keeps this fraction of its rate."""
SETTLE_S = 8.0
"""After a fault heals, how long its victims are watched for a failure (the coordinator's
lease is 5 s by default) before the run may end."""

RESTART_SOURCES = ("snapshot", "learners")
"""Where a restarted shard gets its state: a snapshot taken just before, or no state (the
learners' anchors)."""


@dataclass(frozen=True)
class FaultSpec:
    """One kind of fault of a ``--chaos`` schedule: ``kind[:SECONDS][@TARGET]``."""

    kind: str
    duration_s: float | None = None
    """How long a network fault lasts (None: process faults, which are instant)."""
    target: str | None = None
    """``L<n>`` (a learner) or ``S<m>`` (a shard); None: chosen by the seeded schedule."""

    @property
    def network(self) -> bool:
        return self.kind in NETWORK_FAULTS


def parse_chaos(text: str) -> tuple[FaultSpec, ...]:
    """``"cut:20,flap,kill@L1,cut-shard@S0"`` -> the fault kinds a schedule mixes, each with
    its duration (network faults: ``DEFAULT_FAULT_S`` unless given) and optional target."""
    specs = []
    for item in (part.strip() for part in text.split(",")):
        body, _, target = item.partition("@")
        kind, sep, seconds = body.partition(":")
        if kind not in FAULT_KINDS:
            raise InvalidArgument(f"--chaos: unknown fault {kind!r} in {text!r}; faults: {', '.join(FAULT_KINDS)}")
        duration = None
        if sep:
            if kind in PROCESS_FAULTS:
                raise InvalidArgument(f"--chaos: {kind} is instant: it takes no duration, got {item!r}")
            try:
                duration = float(seconds)
            except ValueError:
                raise InvalidArgument(f"--chaos: the duration of {kind} must be a number of seconds, got {seconds!r}") from None
            if not (math.isfinite(duration) and duration > 0):
                raise InvalidArgument(f"--chaos: the duration of {kind} must be > 0 seconds, got {seconds!r}")
        elif kind in NETWORK_FAULTS:
            duration = DEFAULT_FAULT_S
        if target:
            prefix = "S" if kind in SHARD_TARGETED else "L"
            if kind == "isolate-coordinator" or not (target.startswith(prefix) and target[1:].isdigit()):
                wanted = "no target" if kind == "isolate-coordinator" else f"{prefix}<n>"
                raise InvalidArgument(f"--chaos: {kind} takes {wanted}, got @{target}")
        specs.append(FaultSpec(kind, duration, target or None))
    return tuple(specs)


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
    faults: tuple[FaultSpec, ...] = ()
    """``--chaos``: the kinds of fault one seeded schedule mixes (``parse_chaos``)."""
    fault_every_s: float = 15.0
    """Mean seconds between two `--chaos` faults (Poisson)."""
    seed: int = 0
    """Seed of the kill and fault schedules and their victims."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fault_every_s) and self.fault_every_s > 0):
            raise InvalidArgument(f"--chaos-every must be > 0 seconds, got {self.fault_every_s}")
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
        return bool(self.faults) or any(x is not None for x in (self.kill_every_s, self.restart_shard_at_s, self.scavenge))

    @property
    def network(self) -> bool:
        """Some fault needs emulated sites."""
        return any(f.network for f in self.faults)

    def check_targets(self, learners: int, shards: int) -> None:
        """Every fault aimed at a process aims at one the run starts."""
        for f in self.faults:
            if f.target is not None:
                count, what = (shards, "shards") if f.kind in SHARD_TARGETED else (learners, "learners")
                if int(f.target[1:]) >= count:
                    raise InvalidArgument(f"--chaos {f.kind}@{f.target}: there are only {count} {what} "
                                          f"({f.target[0]}0..{f.target[0]}{count - 1})")


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
    (the rate is checked with the config, ``diloco.coordinator.sites.check_mbit``)."""
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


def fault_spans(chaos: list[dict], end: float | None = None) -> list[tuple[dict, str, float, float | None]]:
    """From ``chaos.jsonl``'s records: (the fault's record, a victim, when it began, when it
    healed) for each victim of each network fault; a fault never healed ends at ``end``."""
    opened: dict[tuple[str, str], tuple[dict, float]] = {}
    spans = []
    for c in chaos:
        for learner in c.get("learners", ()) if c["kind"] in ("fault", "heal") else ():
            if c["kind"] == "fault":
                opened[(c["fault"], learner)] = (c, c["t"])
            elif (began := opened.pop((c["fault"], learner), None)) is not None:
                spans.append((began[0], learner, began[1], c["t"]))
    spans += [(fault, learner, t, end) for (_, learner), (fault, t) in opened.items()]
    return spans


def learner_pid(member: dict) -> int | None:
    """Learners report ``host:pid`` as their address when they join."""
    try:
        return int(member.get("address", "").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ChaosNetwork:
    """Where the network faults act: the run's hub, and the ports its learners reach."""

    hub: HubSpec
    coordinator: str
    shards: tuple[str, ...]

    def port(self, address: str) -> int:
        return int(address.rsplit(":", 1)[1])


@dataclass
class _Fault:
    """A network fault in progress: healed by ``undo`` at ``ends``."""

    kind: str
    learners: list[str]
    netns: list[str]
    ends: float
    undo: Callable[[], None]
    toggle: Callable[[bool], None] | None = None
    """A flapping link: set up (True) or down, every ``FLAP_PERIOD_S``."""
    next_toggle: float = 0.0
    up: bool = False


class ChaosMonkey(threading.Thread):
    """Runs the schedule in the background until ``halt``; never raises (a failed action
    is logged and recorded). At the end every network fault still in progress is healed."""

    def __init__(self, cfg: ChaosConfig, admin, restart_shard: Callable[[int], None], steps: int,
                 log_path: Path, started: float, network: ChaosNetwork | None = None, shards: int = 1) -> None:
        super().__init__(name="diloco-chaos", daemon=True)
        self.cfg, self.admin, self.restart_shard, self.steps = cfg, admin, restart_shard, steps
        self.log_path, self.started, self.network, self.shards = log_path, started, network, shards
        self.rng = random.Random(cfg.seed)
        self.halted = threading.Event()
        self.launched = 0
        """Learners this monkey launched (replacements and scavenged)."""
        self.kills = 0
        self.faults: list[_Fault] = []
        """Network faults in progress."""
        self.watched: dict[str, float] = {}
        """Victims of network faults -> until when a failure of theirs gets them replaced."""
        self.replaced: set[str] = set()
        self.budgets: dict[str, int] = {}
        """Launch id -> the inner steps this monkey launched it with (a replacement's are
        what its predecessor had left; every other learner's are ``steps``)."""
        self._cycle: list[FaultSpec] = []
        self._lock = threading.Lock()
        self._faults_lock = threading.Lock()
        """Guards ``faults``: the healer thread heals them on time while actions run."""
        self.acting = threading.Lock()
        """Held during an action: a kill and its replacement are one step for observers."""

    def halt(self) -> None:
        self.halted.set()

    def settled(self) -> bool:
        """No network fault in progress and no victim of one still watched: the run may end."""
        return not self.faults and not self.watched

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
        next_fault = self.rng.expovariate(1 / self.cfg.fault_every_s) if self.cfg.faults else None
        last_watch = 0.0
        # Heals and flaps keep their times while an action blocks (a shard restart waits
        # for its snapshot, which waits for the learners a fault cuts off).
        healer = threading.Thread(target=self._heal_until_halted, name="diloco-chaos-heal", daemon=True)
        healer.start()
        try:
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
                if next_fault is not None and next_fault <= elapsed:
                    spec = self._next_spec()
                    done = self._act("fault", spec)
                    if not done:
                        self._cycle.insert(0, spec)  # the same kind when a victim is there
                    next_fault = elapsed + (self.rng.expovariate(1 / self.cfg.fault_every_s) if done else 1.0)
                if self.watched and time.monotonic() - last_watch >= 1.0:
                    last_watch = time.monotonic()
                    self._act("watch")
        finally:
            healer.join()
            self._heal_all()  # one begun as the healer made its last pass
            self.watched.clear()

    def _heal_until_halted(self) -> None:
        while not self.halted.wait(0.1):
            self._tick_faults()
        self._heal_all()

    def _heal_all(self) -> None:
        with self._faults_lock:
            for fault in list(self.faults):
                self._heal(fault)

    def _next_spec(self) -> FaultSpec:
        """Every kind once per cycle, in a seeded order: a short run sees each of them."""
        if not self._cycle:
            self._cycle = list(self.cfg.faults)
            self.rng.shuffle(self._cycle)
        return self._cycle.pop(0)

    def _act(self, what: str, spec: FaultSpec | None = None) -> bool:
        with self.acting:
            return self._act_unlocked(what, spec)

    def _act_unlocked(self, what: str, spec: FaultSpec | None) -> bool:
        try:
            if what == "kill":
                return self._kill()
            elif what == "fault":
                return self._fault(spec)
            elif what == "watch":
                self._replace_failed()
            elif what == "scavenge":
                count = self.cfg.scavenge[0]
                results = self.admin.add_learners(count, pool=SCAVENGED_POOL)
                self.launched += sum(r["ok"] for r in results)
                self.record("scavenge", count=count, launched=[r["launch_id"] for r in results if r["ok"]])
            elif what == "restart":
                self.restart_shard(0)
            return True
        except (DilocoError, OSError, subprocess.SubprocessError) as error:
            name = spec.kind if spec is not None else what
            logger.warning("chaos: %s failed: %s", name, error)
            self.record(f"{name}_failed", detail=str(error))
            return True

    def _active(self) -> list[dict]:
        return [m for m in self.admin.members() if m["state"] == "active" and learner_pid(m)]

    def _kill(self, target: str | None = None) -> bool:
        active = self._active()
        if target is not None:
            active = [m for m in active if m["id"] == target]
            if not active:
                self.record("fault_skipped", fault="kill", learner=target, detail=f"{target} is not active")
                return True
        if not active:
            return False
        victim = self.rng.choice(sorted(active, key=lambda m: m["id"]))
        pid = learner_pid(victim)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills += 1
        self.record("kill", learner=victim["id"], pid=pid, inner_steps=victim.get("inner_steps", 0))
        self._replace(victim, "kill")
        return True

    def _replace(self, member: dict, cause: str) -> None:
        """Launch a learner that trains the steps ``member`` had left."""
        self.replaced.add(member["id"])
        budget = self.budgets.get(member.get("launch_id", ""), self.steps)
        remaining = max(budget - int(member.get("inner_steps", 0)), 1)
        results = self.admin.add_learners(1, pool=member.get("pool", ""), overrides={"steps": str(remaining)})
        self.launched += sum(r["ok"] for r in results)
        self.budgets.update({r["launch_id"]: remaining for r in results if r["ok"]})
        self.record("replace", learner=member["id"], steps=remaining, cause=cause,
                    launched=[r["launch_id"] for r in results if r["ok"]])

    def _replace_failed(self) -> None:
        """Victims of network faults the coordinator failed meanwhile: replaced once the
        fault is healed (a replacement on a cut site would fail the same way)."""
        now, faulted = time.monotonic(), {l for f in self.faults for l in f.learners}
        members = {m["id"]: m for m in self.admin.members(include_gone=True)}
        for learner, until in list(self.watched.items()):
            member = members.get(learner)
            if learner in faulted:
                continue
            if member is not None and member["state"] == "failed" and learner not in self.replaced:
                self._replace(member, "partition")
            if now > until or learner in self.replaced or (member is not None and member["state"] == "left"):
                del self.watched[learner]

    # --- network faults ---------------------------------------------------------------

    def _fault(self, spec: FaultSpec) -> bool:
        if spec.kind == "kill":
            return self._kill(spec.target)
        if spec.kind == "restart-shard":
            m = int(spec.target[1:]) if spec.target else self.rng.randrange(self.shards)
            self.restart_shard(m)
            return True
        if self.network is None:
            raise DilocoError(f"{spec.kind} needs emulated sites")
        busy = {l for f in self.faults for l in f.learners}
        sited = []
        for m in sorted(self._active(), key=lambda m: m["id"]):
            site = sites.site_of(learner_pid(m), self.network.hub)
            if site is not None:
                sited.append((m, *site))
        if spec.kind == "isolate-coordinator":
            if busy or not sited:
                return False
            victims = sited
        else:
            free = [v for v in sited if v[0]["id"] not in busy]
            if spec.target is not None:
                free = [v for v in free if v[0]["id"] == spec.target]
                if not free:
                    self.record("fault_skipped", fault=spec.kind, learner=spec.target,
                                detail=f"{spec.target} is not active on a site, or already under a fault")
                    return True
            if not free:
                return False
            victims = [self.rng.choice(free)]
        fields = self._apply(spec, victims)
        now = time.monotonic()
        ids = [m["id"] for m, _, _ in victims]
        self.record("fault", fault=spec.kind, learners=ids, netns=[n for _, n, _ in victims],
                    duration_s=spec.duration_s, **{k: v for k, v in fields.items() if k != "fault"})
        fault = fields["fault"]
        fault.ends = now + spec.duration_s
        with self._faults_lock:
            self.faults.append(fault)
        for learner in ids:
            self.watched[learner] = fault.ends + SETTLE_S
        return True

    def _apply(self, spec: FaultSpec, victims: list[tuple[dict, str, str]]) -> dict:
        """Start the fault on the victims' sites; returns the record's extra fields and the
        ``_Fault`` (under ``fault``) that heals it."""
        ids, names = [m["id"] for m, _, _ in victims], [n for _, n, _ in victims]
        _, netns, host = victims[0]
        pid, hub, kind = learner_pid(victims[0][0]), self.network.hub, spec.kind

        def own(action: Callable) -> Callable:
            """``action`` on the victim's site while it is the victim's: once its learner is
            gone, the site's number (and names) go to the next learner launched."""
            def guarded(*args) -> None:
                if sites.site_of(pid, hub) != (netns, host):
                    raise DilocoError(f"{ids[0]} left its site {netns}")
                action(*args)
            return guarded

        if kind in ("cut", "flap"):
            sites.set_link(host, False)
            toggle = own(lambda up: sites.set_link(host, up)) if kind == "flap" else None
            fault = _Fault(kind, ids, names, 0.0, own(lambda: sites.set_link(host, True)), toggle,
                           time.monotonic() + FLAP_PERIOD_S)
            return {"fault": fault}
        if kind == "starve":
            mbit = sites.link_mbit(host)
            sites.set_rate(netns, host, mbit * STARVE_FACTOR)
            return {"fault": _Fault(kind, ids, names, 0.0, own(lambda: sites.set_rate(netns, host, mbit))),
                    "mbit": mbit, "starved_mbit": mbit * STARVE_FACTOR}
        if kind == "cut-shard":
            m = int(spec.target[1:]) if spec.target else self.rng.randrange(len(self.network.shards))
            port = self.network.port(self.network.shards[m])
            sites.block_port(netns, port, True)
            return {"fault": _Fault(kind, ids, names, 0.0, own(lambda: sites.block_port(netns, port, False))),
                    "shard": m}
        port = self.network.port(self.network.coordinator)  # cut-coordinator, isolate-coordinator
        for _, n, _ in victims:
            sites.block_port(n, port, True)

        def undo() -> None:
            gone = []
            for n in names:
                try:
                    sites.block_port(n, port, False)
                except DilocoError as error:
                    gone.append(error)
            if gone:
                raise gone[0]

        return {"fault": _Fault(kind, ids, names, 0.0, undo)}

    def _tick_faults(self) -> None:
        with self._faults_lock:
            self._tick_faults_locked()

    def _tick_faults_locked(self) -> None:
        now = time.monotonic()
        for fault in list(self.faults):
            if now >= fault.ends:
                self._heal(fault)
            elif fault.toggle is not None and now >= fault.next_toggle:
                fault.up = not fault.up
                fault.next_toggle = now + FLAP_PERIOD_S
                try:
                    fault.toggle(fault.up)
                except DilocoError:  # its learner and site are gone: nothing left to flap
                    fault.toggle = None

    def _heal(self, fault: _Fault) -> None:
        self.faults.remove(fault)
        gone = False
        try:
            fault.undo()
        except DilocoError:  # the site went with its learner (failed, stopped, killed)
            gone = True
        self.record("heal", fault=fault.kind, learners=fault.learners, site_gone=gone)
