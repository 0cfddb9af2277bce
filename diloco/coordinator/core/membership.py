"""Membership and leases: who is in the run, in which state, and until when.

Pure: every method takes ``now`` and records the transitions the shards must hear of in
an outbox (``take_changes``), so a call that raises still hands over what it changed
(a heartbeat from a learner whose lease just ran out fails it, then refuses it).

``now`` is wall-clock seconds: the same numbers are shown to operators and kept in the
state file, and leases are renewed for everyone when the coordinator restarts, so a
clock step can at worst fail a learner early, which then joins again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from diloco.auth import JoinCredential
from diloco.coordinator.config import CoordinatorConfig
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

JOINING, ACTIVE, DRAINING, FAILED, LEFT = "joining", "active", "draining", "failed", "left"
LIVE = (JOINING, ACTIVE, DRAINING)
STATES = (JOINING, ACTIVE, DRAINING, FAILED, LEFT)
# Departed learners kept for ListLearners(include_gone); older ones are forgotten.
MAX_GONE_KEPT = 1000
UNHEARD_LEASES = 0.75
"""Heard from no learner for this share of a lease, the coordinator suspects itself
(``Membership.unheard``). Learners heartbeat at most every half lease, so a quarter of a
lease is left for a late one; with the default interval (a fifth of the lease), every
lease of an isolated coordinator's learners runs out after this much silence, not before."""
MAX_REASON_CHARS = 500
"""A learner's own reason for leaving is cut to this (it is stored, listed and shown)."""


@dataclass
class Learner:
    id: str
    pool: str
    address: str
    launch_id: str
    state: str
    joined_s: float
    heartbeat_s: float
    tokens: int = 0
    inner_steps: int = 0
    version_lag: int = 0
    tokens_per_s: float = 0.0
    train_loss: float | None = None
    """Its last heartbeat's training loss (the mean over its last few steps); None before one."""
    eval_loss: float | None = None
    loss_unit: str = ""
    """The unit of both losses (the task's eval unit, e.g. bits/byte)."""
    reason: str = ""
    """Why the learner is draining, failed or left."""
    drain_deadline_s: float | None = None
    drain_after_tokens: int = 0
    """Draining: it trains until its own token count reaches this, then leaves (0: now)."""
    progress_s: float = 0.0
    """When its heartbeats last reported more tokens or steps than before (or it joined)."""
    claimed: int = 0
    """The most tokens it has reported; ``tokens`` is what of them is credited."""
    credential: str = ""
    """The name of the join credential that admitted it (its admissions are counted by it)."""
    max_tokens_per_s: float | None = None
    """That credential's ceiling on its credited tokens per second; None: as it reports."""
    counted_s: float = 0.0
    """When its last heartbeat's counts were taken (``HeartbeatStats.counted_s``, bounded)."""

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def number(self) -> int:
        return int(self.id[1:])


@dataclass(frozen=True)
class Change:
    """A transition: ``learner`` is a copy taken at the change (None for a launch that
    ended before its learner joined); ``stop_launch`` names a launched process or pod
    to stop: now, or ``gently`` (it left by itself and is exiting: only if it lingers)."""

    kind: str
    """joined | active | draining | failed | left | launch_ended | unheard | heard (the last
    two: no learner; the coordinator's own suspicion that it is cut off, and its end)"""
    learner: Learner | None
    reason: str
    stop_launch: str = ""
    gently: bool = False


@dataclass(frozen=True)
class Launch:
    """A learner asked of a launcher that has not joined yet; it holds a slot under the cap."""

    launch_id: str
    pool: str
    launched_s: float


@dataclass(frozen=True)
class FailedLaunch:
    """A launch that ended before its learner joined (what ``members`` shows for it)."""

    launch_id: str
    pool: str
    detail: str
    failed_s: float


FAILED_LAUNCHES_KEPT = 100
"""The most recent failed launches the coordinator remembers (in memory)."""


@dataclass(frozen=True)
class HeartbeatStats:
    tokens: int = 0
    inner_steps: int = 0
    version_lag: int = 0
    tokens_per_s: float = 0.0
    train_loss: float | None = None
    eval_loss: float | None = None
    loss_unit: str = ""
    counted_s: float | None = None
    """When the learner took these counts, by its clock (None: unknown)."""


def _drain_reason(after_tokens: int) -> str:
    return f"drained at {after_tokens:,} tokens" if after_tokens else "removed by an operator (drain)"


@dataclass(frozen=True)
class Alive:
    deadline_s: float
    reason: str


@dataclass(frozen=True)
class Expired:
    reason: str


def lease_deadline(learner: Learner, lease_s: float, idle_timeout_s: float = 0.0) -> float:
    """When the learner's lease ends (``decide_lease``), unless it heartbeats with progress first."""
    deadline = learner.heartbeat_s + lease_s
    if idle_timeout_s and learner.state != DRAINING:
        deadline = min(deadline, learner.progress_s + idle_timeout_s)
    return deadline


def decide_lease(learner: Learner, now: float, lease_s: float, idle_timeout_s: float = 0.0) -> Alive | Expired:
    """Is the learner's lease still running? A lease runs ``lease_s`` from the last
    heartbeat (or the join). A learner that heartbeats but trains nothing (no new token or
    step for ``idle_timeout_s``; 0: never checked) has lost it too: a silent member
    holds a slot, a quorum's count and a run's end. A draining learner has its own
    deadline."""
    if now >= learner.heartbeat_s + lease_s:
        return Expired(f"lease expired: no heartbeat for {now - learner.heartbeat_s:.1f} s (lease {lease_s:g} s)")
    if idle_timeout_s and learner.state != DRAINING and now >= learner.progress_s + idle_timeout_s:
        return Expired(f"trained nothing for {now - learner.progress_s:.1f} s (idle timeout {idle_timeout_s:g} s)")
    deadline = lease_deadline(learner, lease_s, idle_timeout_s)
    return Alive(deadline, f"lease ends in {deadline - now:.1f} s")


class Membership:
    def __init__(self, cfg: CoordinatorConfig, plan_hash: str, next_number: int = 0) -> None:
        self.cfg = cfg
        self.plan_hash = plan_hash
        self.next_number = next_number
        self.learners: dict[str, Learner] = {}
        self.launches: dict[str, Launch] = {}
        self.failed_launches: dict[str, FailedLaunch] = {}
        self._changes: list[Change] = []
        self.tokens_total = 0
        """The tokens credited to every learner the run has had (gone ones too, pruned or not)."""
        self._earliest: float | None = None
        """No lease, drain or launch deadline falls before this (``math.inf``: none at all),
        so ``expire``, which runs on every call, has nothing to do until then: a look at
        one number instead of every learner (with 256 learners the two scans of each
        heartbeat were half its cost). A heartbeat only moves its own learner's deadline
        later, so it keeps it; whatever may bring a deadline earlier (a join, a drain, a
        launch, a pause or a renewal) forgets it. None: not known, found at the next look."""
        self.heard_s: float | None = None
        """When a learner was last heard: a heartbeat, a join or a leave (None: none yet)."""
        self.heard_members = 0
        """How many learners were members then: a silence is every one of theirs, those that
        ended since included (say, finished while this coordinator was cut off)."""
        self.unheard_since: float | None = None
        """While failures are held because no learner is heard (``unheard``): ``heard_s``
        when the first was held. None: nothing held."""

    # --- reading ---------------------------------------------------------------------

    def learner(self, learner_id: str) -> Learner:
        learner = self.learners.get(learner_id)
        if learner is None:
            raise NotFound(f"unknown learner {learner_id!r}")
        return learner

    def live(self) -> list[Learner]:
        return [l for l in self._ordered() if l.live]

    def listing(self, include_gone: bool) -> list[Learner]:
        return [l for l in self._ordered() if include_gone or l.live]

    def occupied(self) -> int:
        """Slots taken under the cap: live learners plus launches not joined yet."""
        return len(self.live()) + len(self.launches)

    def take_changes(self) -> list[Change]:
        changes, self._changes = self._changes, []
        return changes

    def unheard(self, now: float) -> bool:
        """Does the coordinator suspect that it is the one cut off? Two or more learners were
        members when one was last heard, and none has been heard for ``UNHEARD_LEASES`` of a
        lease since (each heartbeats at least twice a lease, by default five times: one
        learner's silence that long is news, every learner's at once most likely this end's
        own network), and not yet for ``isolation_hold_s``: after that, learners that stay
        silent are failed as usual (a fleet that died together, too)."""
        if not self.cfg.isolation_hold_s or self.heard_s is None:
            return False
        silent = now - self.heard_s
        return self.heard_members >= 2 and UNHEARD_LEASES * self.cfg.lease_s <= silent < self.cfg.isolation_hold_s

    def _lease_ends(self, learner: Learner) -> float:
        """When its lease ends as ``expire`` acts on it: not before a hold ends."""
        deadline = lease_deadline(learner, self.cfg.lease_s, self.cfg.idle_timeout_s)
        if self.unheard_since is not None:
            deadline = max(deadline, self.unheard_since + self.cfg.isolation_hold_s)
        return deadline

    def next_deadline(self) -> float | None:
        """The earliest lease, drain or launch deadline (None: there is none); from the
        last look unless something since may have brought one earlier."""
        if self._earliest is None:
            deadlines = [self._lease_ends(l) for l in self.learners.values() if l.live]
            deadlines += [l.drain_deadline_s for l in self.learners.values() if l.state == DRAINING and l.drain_deadline_s]
            deadlines += [x.launched_s + self.cfg.join_timeout_s for x in self.launches.values()]
            self._earliest = min(deadlines, default=math.inf)
        return self._earliest if self._earliest != math.inf else None

    def _forget_deadline(self) -> None:
        self._earliest = None

    # --- learner calls ---------------------------------------------------------------

    def join(self, pool: str, address: str, launch_id: str, plan_hash: str, now: float,
             credential: JoinCredential) -> Learner:
        """``credential``: the join credential presented (checked): it admits at most its
        limit of live learners at once; one that left or failed frees its slot."""
        self.expire(now)
        pool = pool or self.cfg.default_pool
        self._check_pool(pool)
        admitted = sum(1 for l in self.learners.values() if l.live and l.credential == credential.name)
        if admitted >= credential.limit:
            raise PermissionDenied(f"join credential {credential.name!r} admits at most {credential.limit} learner"
                                   f"{'s' if credential.limit != 1 else ''} at once, and {admitted} are members")
        if plan_hash and self.plan_hash and plan_hash != self.plan_hash:
            raise FailedPrecondition(
                f"fragment plan {plan_hash[:12]} differs from the run's {self.plan_hash[:12]}: check the model flags"
            )
        launch = self.launches.pop(launch_id, None) if launch_id else None
        if launch is None and self.occupied() >= self.cfg.max_learners:
            raise ResourceExhausted(f"the run is at its cap of {self.cfg.max_learners} learners")
        # A launch id is the learner's only if that launch has not joined yet (waiting, or
        # timed out and late): one copied from another member (members see each other's)
        # would have that member's process stopped when this one leaves.
        late = self.failed_launches.pop(launch_id, None) if launch_id and launch is None else None
        owned = launch.launch_id if launch is not None else late.launch_id if late is not None else ""
        learner = Learner(f"L{self.next_number}", pool, address, owned, JOINING, now, now, progress_s=now,
                          credential=credential.name, max_tokens_per_s=credential.tokens_per_s)
        self.next_number += 1
        self.learners[learner.id] = learner
        self._heard(now)
        self._forget_deadline()
        self._emit("joined", learner, f"joined pool {pool}" + (f" (launch {launch_id})" if launch_id else ""))
        return learner

    def heartbeat(self, learner_id: str, stats: HeartbeatStats, now: float) -> Learner:
        """Renew the lease. The first heartbeat makes a joining learner active: it has
        bootstrapped and trains."""
        self.expire(now)
        learner = self.learner(learner_id)
        if learner.state == FAILED:
            raise FailedPrecondition(f"{learner_id} was marked failed ({learner.reason}); join again")
        if learner.state == LEFT:
            raise FailedPrecondition(f"{learner_id} has left ({learner.reason}); join again")
        self._heard(now)
        if stats.tokens > learner.tokens or stats.inner_steps > learner.inner_steps:
            learner.progress_s = now
        self.credit_tokens(learner, stats.tokens, now)
        # Taken after its previous heartbeat was answered, before this one arrived (a
        # heartbeat held by a stalled coordinator arrives with counts from before the stall).
        learner.counted_s = min(max(stats.counted_s or now, learner.heartbeat_s), now)
        learner.heartbeat_s = now
        learner.inner_steps = max(learner.inner_steps, stats.inner_steps)
        learner.version_lag, learner.tokens_per_s = stats.version_lag, stats.tokens_per_s
        if stats.train_loss is not None:
            learner.train_loss = stats.train_loss
        if stats.eval_loss is not None:
            learner.eval_loss = stats.eval_loss
        if stats.loss_unit:
            learner.loss_unit = stats.loss_unit
        if learner.state == JOINING:
            learner.state = ACTIVE
            self._emit("active", learner, "first heartbeat")
        return learner

    def leave(self, learner_id: str, reason: str, now: float, final: tuple[int, int] | None = None,
              failed: bool = False) -> None:
        """Idempotent: leaving twice, or after being marked failed, changes nothing.
        ``final``: the learner's last (tokens, inner steps), newer than its last heartbeat.
        ``failed``: it leaves because it failed (its task raised): marked failed, not left."""
        learner = self.learner(learner_id)
        if learner.live:
            if final is not None:
                self.credit_tokens(learner, final[0], now)
                learner.inner_steps = max(learner.inner_steps, final[1])
            reason = reason[:MAX_REASON_CHARS] or ("failed" if failed else "left")
            self._depart(learner, FAILED if failed else LEFT, reason, now, gently=True)
            self._heard(now)

    def credit_tokens(self, learner: Learner, reported: int, now: float) -> None:
        """Count the tokens a learner reports it has trained, as far as it could have:
        at most its credential's ``max_tokens_per_s`` times its time in the run (a ceiling
        the operator set, never another learner's claim); a learner the coordinator
        launched itself is credited as it reports. Credited counts never go down."""
        learner.claimed = max(learner.claimed, reported)
        credited = learner.tokens
        if learner.max_tokens_per_s is None:
            learner.tokens = learner.claimed
        else:
            bound = int(learner.max_tokens_per_s * max(now - learner.joined_s, 0.0))
            learner.tokens = max(credited, min(learner.claimed, bound))
        self.tokens_total += learner.tokens - credited

    # --- time ------------------------------------------------------------------------

    def _heard(self, now: float) -> None:
        """A learner was heard (a heartbeat, a join or a leave). If failures were held because none
        was, the coordinator was cut off rather than they: every lease moves on by the
        silence, as after a stall of its own (``pause``); a learner that stays silent is
        failed one lease after it was last heard of before it."""
        if self.unheard_since is not None:
            silent = now - self.unheard_since
            self.unheard_since = None
            self.pause(silent, now)
            self._changes.append(Change("heard", None, f"a learner was heard again after {silent:.1f} s of silence: "
                                                       f"every lease moves on by that"))
        self.heard_s = now if self.heard_s is None else max(self.heard_s, now)
        self.heard_members = sum(l.live for l in self.learners.values())

    def expire(self, now: float) -> None:
        """Fail learners whose lease ran out, stop drains that took too long and free the
        slots of launches that never joined."""
        earliest = self.next_deadline()
        if earliest is None or now < earliest:
            return
        self._forget_deadline()
        unheard = self.unheard(now)
        if not unheard:
            self.unheard_since = None  # heard, or held for isolation_hold_s: no longer
        for learner in list(self.learners.values()):
            if not learner.live or (now < lease_deadline(learner, self.cfg.lease_s, self.cfg.idle_timeout_s)
                                    and learner.state != DRAINING):
                continue  # the common case, without decide_lease's reason: this runs on every call
            decision = decide_lease(learner, now, self.cfg.lease_s, self.cfg.idle_timeout_s)
            if isinstance(decision, Expired) and unheard:
                if self.unheard_since is None:
                    self.unheard_since = self.heard_s
                    self._changes.append(Change(
                        "unheard", None, f"no learner heard for {now - self.heard_s:.1f} s: this coordinator may be "
                        f"the one cut off, so no lease fails before {self.cfg.isolation_hold_s:g} s of silence"))
            elif isinstance(decision, Expired):
                self._depart(learner, FAILED, decision.reason, now)
            elif learner.state == DRAINING and learner.drain_deadline_s is not None and now >= learner.drain_deadline_s:
                self._depart(learner, LEFT, f"drain timed out after {self.cfg.drain_timeout_s:g} s", now)
        for launch in list(self.launches.values()):
            if now >= launch.launched_s + self.cfg.join_timeout_s:
                del self.launches[launch.launch_id]
                self._launch_failed(launch, f"did not join within {self.cfg.join_timeout_s:g} s", now)
                self._changes.append(
                    Change("launch_ended", None, f"launch {launch.launch_id} did not join within "
                           f"{self.cfg.join_timeout_s:g} s", stop_launch=launch.launch_id)
                )

    def pause(self, stalled_s: float, now: float) -> None:
        """The coordinator did not run for ``stalled_s`` seconds up to ``now`` (its host or
        its event loop stalled: a VM pause, SIGSTOP, a laptop's sleep): nobody could
        heartbeat to it, so every live lease, drain and join deadline moves on by that
        much. A learner that was itself gone is still failed, one lease after it was last
        heard of when the coordinator ran."""
        for learner in self.learners.values():
            if learner.live:
                learner.heartbeat_s = min(learner.heartbeat_s + stalled_s, now)
                learner.progress_s = min(learner.progress_s + stalled_s, now)
                if learner.drain_deadline_s is not None:
                    learner.drain_deadline_s += stalled_s
        for launch_id, launch in list(self.launches.items()):
            self.launches[launch_id] = dataclasses.replace(launch, launched_s=min(launch.launched_s + stalled_s, now))
        if self.heard_s is not None:
            self.heard_s = min(self.heard_s + stalled_s, now)
        if self.unheard_since is not None:
            self.unheard_since = min(self.unheard_since + stalled_s, now)
        self._forget_deadline()

    def renew_all(self, now: float) -> None:
        """After a coordinator restart: everyone live gets a fresh lease, since nobody
        could heartbeat while it was down."""
        for learner in self.learners.values():
            if learner.live:
                learner.heartbeat_s = max(learner.heartbeat_s, now)
                learner.progress_s = max(learner.progress_s, now)
        for launch_id, launch in list(self.launches.items()):
            self.launches[launch_id] = dataclasses.replace(launch, launched_s=max(launch.launched_s, now))
        self.heard_s, self.unheard_since = now, None
        self.heard_members = sum(l.live for l in self.learners.values())
        self._forget_deadline()

    # --- launches and removal --------------------------------------------------------

    def check_launch(self, count: int, pool: str) -> str:
        """The pool to launch ``count`` learners into; raises if the request is bad."""
        if count <= 0:
            raise InvalidArgument(f"count must be >= 1, got {count}")
        pool = pool or self.cfg.default_pool
        self._check_pool(pool)
        free = self.cfg.max_learners - self.occupied()
        if count > free:
            raise ResourceExhausted(
                f"cannot add {count} learners: {self.occupied()} of the cap of {self.cfg.max_learners} are taken"
            )
        return pool

    def add_launch(self, launch_id: str, pool: str, now: float) -> None:
        self.launches[launch_id] = Launch(launch_id, pool, now)
        self._forget_deadline()

    def launch_ended(self, launch_id: str, detail: str, now: float, clean: bool = False) -> None:
        """A launched process or pod ended. Before joining, it frees its slot; after, its
        learner fails now rather than a lease later, unless it ended ``clean`` (exit code 0:
        it finished, or drained, and its Leave was lost, say while this coordinator was cut
        off): then it has left, and nobody replaces its work."""
        launch = self.launches.pop(launch_id, None)
        if launch is not None:
            self._launch_failed(launch, f"ended before joining: {detail}", now)
            self._changes.append(Change("launch_ended", None, f"launch {launch_id} ended before joining: {detail}"))
            return
        for learner in self.learners.values():
            if learner.launch_id == launch_id and learner.live and clean:
                self._depart(learner, LEFT, f"process ended cleanly ({detail}); its Leave was not heard", now)
            elif learner.launch_id == launch_id and learner.live:
                self._depart(learner, FAILED, f"process ended: {detail}", now)

    def _launch_failed(self, launch: Launch, detail: str, now: float) -> None:
        self.failed_launches[launch.launch_id] = FailedLaunch(launch.launch_id, launch.pool, detail, now)
        while len(self.failed_launches) > FAILED_LAUNCHES_KEPT:
            del self.failed_launches[next(iter(self.failed_launches))]

    def select(self, learner_ids: list[str], count: int) -> list[Learner]:
        """Learners to remove: the ones named, or the ``count`` newest live ones not yet
        draining."""
        if learner_ids and count:
            raise InvalidArgument("give learner ids or a count, not both")
        if learner_ids:
            chosen = [self.learner(i) for i in dict.fromkeys(learner_ids)]
            gone = [l.id for l in chosen if not l.live]
            if gone:
                raise FailedPrecondition(f"already gone: {', '.join(gone)}")
            return chosen
        if count <= 0:
            raise InvalidArgument(f"give learner ids or a count >= 1, got count {count}")
        candidates = [l for l in self.live() if l.state != DRAINING]
        if count > len(candidates):
            raise FailedPrecondition(f"cannot remove {count} learners: {len(candidates)} are live and not draining")
        return sorted(candidates, key=lambda l: (l.joined_s, l.number), reverse=True)[:count]

    def drain(self, learner_ids: list[str], now: float, after_tokens: dict[str, int] | None = None) -> list[Learner]:
        """``after_tokens``: learner -> the token count it trains to before it leaves (not
        listed: it leaves now). A learner already draining to a count takes the new one (a
        token budget moves allotments as learners over- or undershoot theirs), one already
        told to leave now keeps that; its deadline stays. Returns the learners whose drain
        moved."""
        after_tokens = after_tokens or {}
        moved = []
        for learner in map(self.learner, learner_ids):
            after = after_tokens.get(learner.id, 0)
            if not learner.live:
                continue
            if learner.state == DRAINING:
                if learner.drain_after_tokens and after != learner.drain_after_tokens:
                    learner.drain_after_tokens, learner.reason = after, _drain_reason(after)
                    moved.append(learner)
                continue
            learner.state, learner.drain_after_tokens, learner.reason = DRAINING, after, _drain_reason(after)
            learner.drain_deadline_s = now + self.cfg.drain_timeout_s
            self._forget_deadline()
            self._emit("draining", learner, learner.reason)
        return moved

    def remove(self, learner_ids: list[str], reason: str, now: float) -> None:
        for learner in map(self.learner, learner_ids):
            if learner.live:
                self._depart(learner, LEFT, reason, now)

    def reset(self, reason: str, now: float) -> None:
        """Every live learner leaves (the run restarts from a snapshot): learners re-join
        and bootstrap from the restored shards. Left, not failed: their pushes in the
        restored rounds keep their weight."""
        for learner in self.live():
            self._depart(learner, LEFT, reason, now)
        self.launches.clear()

    # --- helpers ---------------------------------------------------------------------

    def _check_pool(self, pool: str) -> None:
        if pool not in self.cfg.pools:
            raise NotFound(f"unknown pool {pool!r}; pools: {', '.join(self.cfg.pools)}")

    def _depart(self, learner: Learner, state: str, reason: str, now: float, gently: bool = False) -> None:
        learner.state, learner.reason, learner.drain_deadline_s, learner.drain_after_tokens = state, reason, None, 0
        self._emit(state, learner, reason, stop_launch=learner.launch_id, gently=gently)
        self._prune()

    def _emit(self, kind: str, learner: Learner, reason: str, stop_launch: str = "", gently: bool = False) -> None:
        self._changes.append(Change(kind, dataclasses.replace(learner), reason, stop_launch, gently))

    def _ordered(self) -> list[Learner]:
        return sorted(self.learners.values(), key=lambda l: l.number)

    def _prune(self) -> None:
        gone = [l for l in self._ordered() if not l.live]
        for learner in gone[: max(0, len(gone) - MAX_GONE_KEPT)]:
            del self.learners[learner.id]

    # --- the state file --------------------------------------------------------------

    def to_state(self) -> dict:
        return {
            "next_learner": self.next_number,
            "tokens_total": self.tokens_total,
            "learners": [dataclasses.asdict(l) for l in self._ordered()],
            "launches": [dataclasses.asdict(x) for x in self.launches.values()],
        }

    @classmethod
    def from_state(cls, cfg: CoordinatorConfig, plan_hash: str, state: dict) -> Membership:
        membership = cls(cfg, plan_hash, int(state.get("next_learner", 0)))
        try:
            known = {f.name for f in dataclasses.fields(Learner)}
            for raw in state.get("learners", []):
                # (a state file from before credentials were recorded: its fields that are gone)
                learner = Learner(**{k: v for k, v in raw.items() if k in known})
                if learner.state not in STATES or not learner.id.startswith("L"):
                    raise ValueError(f"bad learner record {raw}")
                membership.learners[learner.id] = learner
                membership.next_number = max(membership.next_number, learner.number + 1)
            for raw in state.get("launches", []):
                launch = Launch(**raw)
                membership.launches[launch.launch_id] = launch
            # (a state file from before the total was kept: what its learners hold)
            membership.tokens_total = int(state.get("tokens_total", sum(l.tokens for l in membership.learners.values())))
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"corrupt coordinator state: {error}") from None
        return membership
