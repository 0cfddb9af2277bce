"""The coordinator's runtime: one event loop owns the membership and snapshot books (no
locks). After every call it announces the changes to the shards' membership streams,
stops the processes or pods of departed learners, writes finished snapshots' manifests,
saves the state file and sets one timer for the next deadline (a lease, a drain, a
launch that never joined, a snapshot timeout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.core.membership import (
    DRAINING, STATES, Change, FailedLaunch, HeartbeatStats, Launch, Learner, Membership,
)
from diloco.coordinator.core.progress import LossCurves, RecentEvents
from diloco.coordinator.core.snapshots import COMPLETE, Snapshot, SnapshotFile, Snapshots, manifest_of
from diloco.coordinator.core.stall import STALL_TICK_S, StallWatch
from diloco.coordinator.launcher import Launcher, LaunchResult, override_args
from diloco import auth
from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument
from diloco.files import atomic_write_json
from diloco.fragments import FragmentPlan
from diloco.manifest import Manifest
from diloco.coordinator.pin import ModelPin, manifest_sha256
from diloco.snapshots import (
    MANIFEST, find_manifest, join, pins, prepare, read_manifest, remove_snapshot, sign_manifest, snapshot_ids,
    write_file,
)

logger = logging.getLogger(__name__)

STATE_FILE = "coordinator-state.json"
STATE_FORMAT = 1
# A membership stream that falls this far behind is closed; the shard reconnects and
# starts again from a full list.
WATCH_QUEUE_EVENTS = 1024

RETENTION_GRACE_S = 30.0
"""How long a stopping coordinator waits for deletions of old snapshots in flight."""
MAX_INCARNATION_CHARS = 64
"""Longest process id a shard may give (WatchMembership, a marker's reply)."""
# (shard name, address, snapshot id, directory, learners, coordinator clock) -> sends the Marker RPC.
MarkerSender = Callable[[str, str, int, str, list[str], VectorClock], Awaitable[str]]
"""Sends a shard its marker; returns the incarnation of the process that recorded it."""


@dataclass(frozen=True)
class Directive:
    kind: str
    """drain | snapshot"""
    reason: str = ""
    after_tokens: int = 0
    """drain: leave once the learner's own token count reaches this (0: now)."""
    snapshot_id: int = 0
    directory: str = ""


@dataclass
class RunInfo:
    """What the coordinator knows of the run, for manifests and checks. The model manifest
    (and so the plan) is the operator's when pinned (``pin``, or ``manifest_sha256`` for
    the manifest alone), else fixed by the first learner that registers its model."""

    run: RunConfig
    manifest_json: str = ""
    plan: FragmentPlan | None = None
    pin: ModelPin | None = None
    """The operator's model (``--pin-model``): its manifest is the run's from the start,
    and its initial values the only ones the shards take."""
    manifest_sha256: str = ""
    """The operator's manifest digest (``--model-sha256``): the first registered manifest
    with this digest becomes the run's."""
    manifest: Manifest | None = None

    def __post_init__(self) -> None:
        if self.pin is not None and not self.manifest_json:
            self.adopt(self.pin.manifest_json)

    @property
    def plan_hash(self) -> str:
        return self.plan.plan_hash if self.plan is not None else ""

    @property
    def run_config_json(self) -> str:
        return self.run.to_json()

    @property
    def initial_values(self) -> tuple[bytes, ...]:
        """The pinned initial values' digests, by fragment (empty: not pinned)."""
        return self.pin.initial_values if self.pin is not None else ()

    @property
    def seeds_shards(self) -> bool:
        """The coordinator holds the pinned values and seeds the shards with them."""
        return self.pin is not None and self.pin.values is not None

    def adopt(self, manifest_json: str, manifest: Manifest | None = None, plan: FragmentPlan | None = None) -> None:
        """Make ``manifest_json`` the run's (``manifest`` and ``plan``: already parsed and
        planned off the event loop)."""
        manifest = manifest or self.parse(manifest_json)
        self.plan = plan or manifest.plan(self.run.fragments)
        self.manifest, self.manifest_json = manifest, manifest_json

    def parse(self, manifest_json: str) -> Manifest:
        """A manifest from the wire or a file, parsed and bounded by the run's maximum model size."""
        return Manifest.from_json(manifest_json).check_size(self.run.max_model_bytes)

    def pin_difference(self, manifest: Manifest) -> str | None:
        """How ``manifest`` departs from the pinned model, in one phrase (None: it does not,
        or nothing is pinned)."""
        if self.pin is not None:
            return manifest.first_difference(self.manifest)
        if self.manifest_sha256:
            digest = manifest_sha256(manifest.to_json())
            if digest != self.manifest_sha256.lower():
                return f"its manifest's SHA-256 is {digest[:16]}..., the run's pinned one {self.manifest_sha256[:16]}..."
        return None

    def examine(self, manifest_json: str) -> tuple[Manifest, FragmentPlan | None, str | None]:
        """A learner's manifest parsed and bounded, the plan it would give the run when the
        run has none yet, and how it differs from the run's (pinned or registered) model.
        Reads only immutable values: it runs in a worker thread."""
        manifest, run_manifest = self.parse(manifest_json), self.manifest
        if run_manifest is not None:
            return manifest, None, manifest.first_difference(run_manifest)
        difference = self.pin_difference(manifest)
        return manifest, (manifest.plan(self.run.fragments) if difference is None else None), difference


class CoordinatorRuntime:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        run: RunInfo,
        send_marker: MarkerSender,
        clock: Callable[[], float] = time.time,
        new_launch_id: Callable[[], str] = lambda: secrets.token_hex(4),
        secret: str = "",
    ) -> None:
        """``secret``: the run secret, which signs snapshot manifests (``mac``) and checks
        the one ``--restore`` names."""
        self.cfg = cfg
        self._secret = secret
        self.run = run
        self._send_marker = send_marker
        self._clock = clock
        self.stall = StallWatch(clock())
        """How long this coordinator did not run (``diloco.coordinator.core.stall``)."""
        self._new_launch_id = new_launch_id
        self.launcher: Launcher | None = None
        self._clock_entries: dict[str, int] = {}
        """The coordinator's vector clock, updated in place by every call (``received``)."""
        self._clock_value: VectorClock | None = VectorClock()
        """It as a value, built when read (``vector_clock``) and dropped by the next change."""
        self._shard_ids = frozenset(f"S{m}" for m in range(len(cfg.shards)))
        self.topology_epoch = 1
        self.restored_from: int | None = None
        self.membership = Membership(cfg, run.plan_hash)
        self.curves = LossCurves()
        self.recent = RecentEvents()
        """What the status page shows of the run's history (``diloco.coordinator.core.progress``)."""
        self.snapshots = Snapshots(cfg.snapshot_timeout_s, str(cfg.snapshots_path))
        self._watchers: set[asyncio.Queue] = set()
        self.incarnations: dict[str, str] = {}
        """Each shard's process, as its WatchMembership said (``watcher_connected``)."""
        self._retired: dict[str, set[str]] = {}
        """Each shard's processes that a newer one replaced."""
        self._tasks: set[asyncio.Task] = set()
        self._retentions: set[asyncio.Task] = set()
        """Deletions of old snapshots in flight: a stop lets them finish (they are short)."""
        self._timer: asyncio.TimerHandle | None = None
        self._watch_timer: asyncio.TimerHandle | None = None
        self._next_periodic: float | None = None
        """When the next scheduled snapshot is due (``snapshot_every_s``), once the run has a model."""
        self._closed = False
        self._examining = asyncio.Semaphore(1)
        """Learners' manifests are examined one at a time (each in a worker thread)."""
        self.member_counts: dict[tuple[str, str], int] = {}
        """Learners by (state, pool), every state and pool included (a zero is a series too),
        gone ones as far as they are kept (``MAX_GONE_KEPT``). The metrics thread reads it
        (``CoordinatorTelemetry``): it is replaced whole after a change, never changed in place."""
        self._load()
        self._count_members()

    # --- the state file --------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.cfg.data_dir / STATE_FILE

    def _load(self) -> None:
        """Resume from the state file: learners keep their ids and get a fresh lease; a
        snapshot that was running is failed; ``--restore`` makes every learner re-join."""
        now = self._now()
        state = read_state(self.state_path)
        if state is not None:
            if state.get("manifest"):
                self._adopt_kept(state["manifest"], f"coordinator state {self.state_path}")
            self.membership = Membership.from_state(self.cfg, self.run.plan_hash, state.get("membership", {}))
            self.snapshots = Snapshots.from_state(
                self.cfg.snapshot_timeout_s, str(self.cfg.snapshots_path), state.get("snapshots", {}), now
            )
            self.vector_clock = VectorClock(state.get("clock", {}))
            topology = state.get("topology", {})
            self.topology_epoch = int(topology.get("epoch", 1))
            if list(topology.get("shards", [])) != list(self.cfg.shards):
                self.topology_epoch += 1  # the shard set changed across the restart
            self.restored_from = state.get("restored_from")
            self.membership.renew_all(now)
            logger.info("resumed from %s: %d live learners", self.state_path, len(self.membership.live()))
        stored = snapshot_ids(self.cfg.snapshots_path)
        self.snapshots.next_id = max([self.snapshots.next_id, *(i + 1 for i in stored)])
        if self.cfg.restore is not None:
            manifest_path = find_manifest(self.cfg.snapshots_path, self.cfg.restore)
            manifest = read_manifest(manifest_path, self._secret)
            if manifest.get("run", {}).get("manifest"):
                self._adopt_kept(manifest["run"]["manifest"], f"snapshot {manifest['snapshot_id']}")
                self.membership.plan_hash = self.run.plan_hash
            if manifest.get("run", {}).get("plan_hash") != self.run.plan_hash:
                raise FailedPrecondition(f"snapshot {manifest['snapshot_id']} was taken with another fragment plan")
            self.restored_from = int(manifest["snapshot_id"])
            self.membership.reset(f"the run was restored from snapshot {self.restored_from}; join again", now)
            self.membership.take_changes()
            logger.info("restoring the run from snapshot %d (%s)", self.restored_from, manifest_path)
        self._save()

    def _adopt_kept(self, manifest_json: str, where: str) -> None:
        """The manifest a state file or a snapshot kept: the run's, unless the operator
        pinned a model it does not match (then the coordinator does not start: that state
        belongs to another model's run)."""
        if self.run.pin is not None and manifest_json == self.run.manifest_json:
            return
        manifest = self.run.parse(manifest_json)
        difference = self.run.pin_difference(manifest)
        if difference is not None:
            raise FailedPrecondition(f"{where} holds another model than the pinned one ({difference}): start the "
                                     "pinned model's run in a new data directory, or pin the model of that state")
        if self.run.pin is None and not self.run.manifest_json:
            self.run.adopt(manifest_json, manifest)

    def _save(self) -> None:
        atomic_write_json(
            self.state_path,
            {
                "format": STATE_FORMAT,
                "membership": self.membership.to_state(),
                "snapshots": self.snapshots.to_state(),
                "clock": dict(self.vector_clock.entries),
                "topology": {"shards": list(self.cfg.shards), "epoch": self.topology_epoch},
                "restored_from": self.restored_from,
                "manifest": self.run.manifest_json,
            },
        )

    # --- after every call --------------------------------------------------------------

    @property
    def vector_clock(self) -> VectorClock:
        """The coordinator's clock: the markers, the snapshot manifests, the state file and
        the shards' membership stream carry it whole. Only the run's processes are in it
        (``known_processes``)."""
        if self._clock_value is None:
            known = self.known_processes()
            self._clock_entries = {k: v for k, v in self._clock_entries.items() if k in known}
            self._clock_value = VectorClock(self._clock_entries)
        return self._clock_value

    @vector_clock.setter
    def vector_clock(self, clock: VectorClock) -> None:
        self._clock_entries, self._clock_value = dict(clock.entries), clock

    def received(self, clock: VectorClock) -> VectorClock:
        """Merge a caller's clock and tick the coordinator's entry; returns what a reply to a
        learner carries, that entry alone. A learner's session with the coordinator
        (heartbeats, joins) is apart from its pushes, and nothing of the other learners'
        entries that a reply could carry reaches its pushes: a whole clock each way was
        O(learners) per heartbeat, O(learners²) per interval, for nothing. Entries of ids
        this run did not issue, or issued to learners membership no longer holds, are
        dropped: a caller naming thousands of fresh processes cannot grow the clock."""
        entries = self._clock_entries
        for process, count in clock.entries.items():
            if count > entries.get(process, 0) and self._known(process):
                entries[process] = count
        count = entries[auth.COORDINATOR_ID] = entries.get(auth.COORDINATOR_ID, 0) + 1
        self._clock_value = None
        if len(entries) > 2 * (len(self.membership.learners) + len(self._shard_ids) + 1):
            _ = self.vector_clock  # learners membership forgot: their entries go
        return VectorClock({auth.COORDINATOR_ID: count})

    def _known(self, process: str) -> bool:
        return process == auth.COORDINATOR_ID or process in self._shard_ids or process in self.membership.learners

    def known_processes(self) -> set[str]:
        """The ids a clock of this run may name: the coordinator, each shard ``S<m>`` and
        the learners membership holds (joining, live, draining and the most recent
        ``MAX_GONE_KEPT`` gone)."""
        return {auth.COORDINATOR_ID, *self._shard_ids, *self.membership.learners}

    def check_member(self, caller: str) -> None:
        """A learner's credential stays valid until it expires, but reads the run only
        while its learner is a member: one that left or was marked failed (or was
        forgotten since, under ``MAX_GONE_KEPT``) must join again, under a new id. Ids
        that are not learners (the shards) pass."""
        if not (caller[:1] == "L" and caller[1:].isdigit()):
            return
        learner = self.membership.learners.get(caller)
        if learner is None:
            if int(caller[1:]) < self.membership.next_number:
                raise FailedPrecondition(f"{caller} is no longer a member of the run; join again")
        elif not learner.live:
            raise FailedPrecondition(f"{caller} is no longer a member of the run: it {learner.state} "
                                     f"({learner.reason}); join again")

    def _settle(self, save: bool = False) -> None:
        """Apply what time has done, hand every change on, save if anything changed,
        re-arm the timer. Called after every call and when the timer fires."""
        now = self._now()
        self.membership.expire(now)
        self.snapshots.expire(now)
        changes = self.membership.take_changes()
        for change in changes:
            self._announce(change, now)
        if changes:
            self._count_members()
        finished = self.snapshots.take_finished()
        for snapshot in finished:
            self._finished(snapshot)
        if save or changes or finished:
            self._save()
        if self.launcher is not None and not self.membership.launches:
            self.launcher.settled()
        self._schedule()

    def _count_members(self) -> None:
        counts = {(state, pool): 0 for state in STATES for pool in self.cfg.pools}
        for learner in self.membership.learners.values():
            counts[learner.state, learner.pool] = counts.get((learner.state, learner.pool), 0) + 1
        self.member_counts = counts

    def _announce(self, change: Change, now: float) -> None:
        self.recent.add(now, change.kind, f"{change.learner.id} {change.kind}: {change.reason}"
                        if change.learner is not None else change.reason)
        if change.learner is not None:
            logger.info("learner %s %s: %s", change.learner.id, change.kind, change.reason)
            for queue in list(self._watchers):
                try:
                    queue.put_nowait(change)
                except asyncio.QueueFull:
                    logger.warning("a membership watcher fell %d events behind: closing its stream", WATCH_QUEUE_EVENTS)
                    self._close_watcher(queue)
            if change.kind in ("failed", "left"):
                self.snapshots.drop_learner(change.learner.id, change.reason, now)
        else:
            logger.warning("%s", change.reason)
        if change.stop_launch and self.launcher is not None:
            self._spawn(self.launcher.stop([change.stop_launch], gently=change.gently))

    def _finished(self, snapshot: Snapshot) -> None:
        if snapshot.state != COMPLETE:
            logger.warning("snapshot %d failed: %s", snapshot.id, snapshot.detail)
            self.recent.add(self._now(), "snapshot", f"snapshot {snapshot.id} failed: {snapshot.detail}")
            return
        path = join(snapshot.directory, MANIFEST)
        run = {"plan_hash": self.run.plan_hash, "shards": list(self.cfg.shards), "run_config": self.run.run_config_json,
               "manifest": self.run.manifest_json}
        manifest = sign_manifest(self._secret, manifest_of(snapshot, dict(self.vector_clock.entries), run))
        try:
            write_file(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        except DilocoError as error:
            self.snapshots.manifest_failed(snapshot.id, f"its manifest could not be written: {error}")
            logger.error("snapshot %d failed: its manifest could not be written: %s", snapshot.id, error)
            return
        self.snapshots.completed(snapshot.id, path)
        logger.info("snapshot %d complete: %s", snapshot.id, path)
        self.recent.add(self._now(), "snapshot", f"snapshot {snapshot.id} complete")
        if self.cfg.snapshot_keep:
            task = self._spawn(self._retain(snapshot.id))
            self._retentions.add(task)
            task.add_done_callback(self._retentions.discard)

    async def _retain(self, newest: int) -> None:
        """Keep the newest ``snapshot_keep`` complete snapshots; delete older ones, and
        unfinished ones older than the newest complete. Off the event loop (object stores
        answer slowly); a failure is logged and retried after the next snapshot."""
        root = self.cfg.snapshots_path
        try:
            stored = await asyncio.to_thread(snapshot_ids, root)
            complete = [i for i, done in stored.items() if done and i <= newest]
            keep = set(complete[-self.cfg.snapshot_keep:])
            doomed = []
            for snapshot_id in (i for i in stored if i < newest and i not in keep):
                if await asyncio.to_thread(pins, root, snapshot_id):
                    continue  # a shard restored from it: replaying its tape starts there
                doomed.append(snapshot_id)
            for snapshot_id in doomed:
                await asyncio.to_thread(remove_snapshot, root, snapshot_id)
                self.snapshots.forget(snapshot_id)
        except (DilocoError, OSError) as error:
            logger.warning("deleting old snapshots in %s failed (retried after the next snapshot): %s", root, error)
            return
        if doomed:
            logger.info("deleted snapshots %s (keeping the newest %d complete: %s)", doomed, self.cfg.snapshot_keep, sorted(keep))
            self._settle(save=True)

    def _periodic(self) -> None:
        """Start the scheduled snapshot when it is due (none running, the run has a model)."""
        every = self.cfg.snapshot_every_s
        if not every or not self.run.manifest_json or not self.cfg.shards or self._closed:
            self._next_periodic = None
            return
        now = self._now()
        if self._next_periodic is None:
            self._next_periodic = now + every
        if now < self._next_periodic:
            return
        self._next_periodic = now + every
        if self.snapshots.running() is not None:
            return  # one at a time: the next is due a period later
        logger.info("scheduled snapshot (every %.0f s)", every)
        self.start_snapshot()

    def _tick(self) -> None:
        self._timer = None
        self._periodic()
        self._settle()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closed:
            return
        if self._next_periodic is None and self.cfg.snapshot_every_s and self.run.manifest_json:
            self._next_periodic = self._now() + self.cfg.snapshot_every_s
        deadlines = [self.membership.next_deadline(), self.snapshots.next_deadline(), self._next_periodic]
        deadlines = [d for d in deadlines if d is not None]
        if deadlines:
            delay = max(0.0, min(deadlines) - self._now())
            self._timer = asyncio.get_running_loop().call_later(delay + 0.001, self._tick)

    def start(self) -> None:
        """Arm the timers (called on the event loop once serving)."""
        self._settle()
        self._watch()

    def _now(self) -> float:
        """The time; first, if this coordinator did not run for a while since it last
        looked (a stall of its host or loop), every lease moves on by that while: nobody
        could heartbeat to it. Every look goes through here, the loop's ticks included."""
        now = self._clock()
        stalled = self.stall.stalled(now)
        if stalled:
            self.membership.pause(stalled, now)
            self.snapshots.pause(stalled)
            self.recent.add(now, "stall", f"the coordinator did not run for {stalled:.1f} s: leases extended by it")
            logger.warning("the coordinator did not run for %.1f s (its host or loop stalled): every lease, drain "
                           "and join deadline moves on by that", stalled)
        return now

    def _watch(self) -> None:
        """The loop's tick: a look at the clock every ``STALL_TICK_S`` while it runs."""
        self._now()
        if not self._closed:
            self._watch_timer = asyncio.get_running_loop().call_later(STALL_TICK_S, self._watch)

    def _spawn(self, coroutine: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- learner calls ---------------------------------------------------------------

    def join(self, pool: str, address: str, launch_id: str, plan_hash: str, credential: auth.JoinCredential) -> Learner:
        try:
            return self.membership.join(pool, address, launch_id, plan_hash, self._now(), credential)
        finally:
            self._settle()

    async def register_model(self, learner_id: str, manifest_json: str) -> None:
        """The learner's model manifest. Pinned, the run's model is the operator's; else the
        first manifest registered fixes the run's model and plan. One that differs is
        refused, naming the first tensor that differs, and the learner leaves. A manifest
        equal to the run's is taken as it is; any other is parsed, bounded by the run's
        maximum model size and planned in a worker thread, one at a time: a hostile one
        (100,000 tensors, 2^40 elements) neither stalls the event loop nor allocates."""
        self.membership.learner(learner_id)
        if manifest_json and manifest_json == self.run.manifest_json:
            return
        async with self._examining:
            manifest, plan, difference = await asyncio.to_thread(self.run.examine, manifest_json)
        if difference is None and plan is not None:  # examined while the run had no model
            if not self.run.manifest_json:
                self.run.adopt(manifest_json, manifest, plan)
                self.membership.plan_hash = self.run.plan_hash
                logger.info("the run's model is %s's: %d tensors, %d bytes, manifest sha256 %s, plan %s", learner_id,
                            len(manifest.entries), manifest.total_bytes, manifest_sha256(manifest_json)[:16],
                            self.run.plan_hash[:12])
                self._settle(save=True)
                return
            difference = manifest.first_difference(self.run.manifest)  # another registered meanwhile
        if difference is not None:
            self.leave(learner_id, f"its model differs from the run's: {difference}", failed=True)
            raise FailedPrecondition(f"{learner_id}'s model differs from the run's: {difference}")

    def heartbeat(self, learner_id: str, stats: HeartbeatStats) -> tuple[Learner, list[Directive]]:
        now = self._now()
        try:
            learner = self.membership.heartbeat(learner_id, stats, now)
        finally:
            self._settle()
        if stats.train_loss is not None:
            self.curves.add(learner_id, now, self.membership.tokens_total, stats.train_loss)
        directives = []
        if learner.state == DRAINING:
            directives.append(Directive("drain", learner.reason, after_tokens=learner.drain_after_tokens))
        snapshot = self.snapshots.running()
        if snapshot is not None and learner_id in snapshot.learners and learner_id not in snapshot.reports:
            # Sent on every heartbeat until the learner reports: a lost reply costs nothing.
            directives.append(Directive("snapshot", snapshot_id=snapshot.id, directory=snapshot.directory))
        return learner, directives

    def leave(self, learner_id: str, reason: str, final: tuple[int, int] | None = None, failed: bool = False) -> None:
        """``final``: the learner's last (tokens, inner steps), sent with its Leave;
        ``failed``: it leaves because it failed."""
        try:
            self.membership.leave(learner_id, reason, self._now(), final, failed=failed)
        finally:
            self._settle()

    def launch_ended(self, launch_id: str, detail: str, clean: bool = False) -> None:
        """From a launcher: a process or pod it started has ended (``clean``: exit code 0)."""
        self.membership.launch_ended(launch_id, detail, self._now(), clean)
        self._settle()

    # --- the membership stream -------------------------------------------------------

    def watcher_connected(self, watcher: str, incarnation: str) -> None:
        """A watcher (a shard) opened WatchMembership as process ``incarnation``: a new one
        means it restarted, and a running snapshot it had not reported to is lost (its
        channel state was in the old process's memory): fail it now rather than hold every
        later snapshot until the timeout. Only shards are followed (a learner that restarts
        joins under a new id)."""
        if watcher not in {f"S{m}" for m in range(len(self.cfg.shards))}:
            return
        previous = self.incarnations.get(watcher)
        self.incarnations[watcher] = incarnation
        if previous is None:
            self.recent.add(self._now(), "shard", f"shard {watcher[1:]} follows the membership")
        elif previous != incarnation:
            logger.warning("%s restarted (a new process follows the membership)", watcher)
            self.recent.add(self._now(), "shard", f"shard {watcher[1:]} restarted (a new process follows the membership)")
            self._retired.setdefault(watcher, set()).add(previous)
            self.snapshots.participant_restarted(watcher, incarnation, self._now())
            self._settle(save=True)

    def now(self) -> float:
        return self._now()

    def restarts(self, watcher: str) -> int:
        """How many times the shard ``watcher`` (``S<m>``) was seen restarted."""
        return len(self._retired.get(watcher, ()))

    def watch(self) -> tuple[asyncio.Queue, list[Learner]]:
        """A queue of every change from now on, and the full membership to send first.
        The queue yields None when the stream must end."""
        queue: asyncio.Queue = asyncio.Queue(WATCH_QUEUE_EVENTS)
        self._watchers.add(queue)
        return queue, self.membership.listing(include_gone=True)

    def unwatch(self, queue: asyncio.Queue) -> None:
        self._watchers.discard(queue)

    def _close_watcher(self, queue: asyncio.Queue) -> None:
        self._watchers.discard(queue)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)

    # --- admin calls -----------------------------------------------------------------

    async def add_learners(self, count: int, pool: str, overrides: Mapping[str, str]) -> list[LaunchResult]:
        if self.launcher is None:
            raise FailedPrecondition("this coordinator has no launcher (--launcher none)")
        override_args(overrides)  # bad overrides fail before anything starts
        now = self._now()
        pool = self.membership.check_launch(count, pool)
        launch_ids = [self._new_launch_id() for _ in range(count)]
        for launch_id in launch_ids:  # slots are held while the launcher works
            self.membership.add_launch(launch_id, pool, now)
        results: list[LaunchResult] = []
        try:
            results = await self.launcher.launch(launch_ids, pool, overrides)
        finally:
            started = {r.launch_id for r in results if r.ok}
            for launch_id in launch_ids:
                if launch_id not in started:
                    self.membership.launches.pop(launch_id, None)
            self._settle(save=True)
        for result in results:
            if not result.ok:
                logger.warning("launch %s into pool %s failed: %s", result.launch_id, pool, result.detail)
        return results

    def remove_learners(self, learner_ids: list[str], count: int, drain: bool,
                        after_tokens: dict[str, int] | None = None) -> list[str]:
        """``after_tokens`` (with ``drain``): learner -> the token count it trains to first."""
        now = self._now()
        self.membership.expire(now)
        chosen = [l.id for l in self.membership.select(learner_ids, count)]
        if after_tokens and not drain:
            raise InvalidArgument("after_tokens is for a drain: set drain too")
        if unknown := sorted(set(after_tokens or ()) - set(chosen)):
            raise InvalidArgument(f"after_tokens names learners not drained by this call: {', '.join(unknown)}")
        if drain:
            for learner in self.membership.drain(chosen, now, after_tokens):
                logger.info("learner %s's drain moved: %s", learner.id, learner.reason)
        else:
            self.membership.remove(chosen, "removed by an operator", now)
        self._settle()
        return chosen

    def list_learners(self, include_gone: bool) -> list[Learner]:
        self._settle()
        return self.membership.listing(include_gone)

    def list_launches(self) -> list[Launch | FailedLaunch]:
        """Launches not joined: the pending ones, then the failures the core remembers."""
        return [*self.membership.launches.values(), *self.membership.failed_launches.values()]

    def start_snapshot(self) -> Snapshot:
        """Register snapshot n and send the markers (in the background): the shards by
        Marker RPC now, the learners with their next heartbeat."""
        now = self._now()
        self.membership.expire(now)
        shards = [f"S{m}" for m in range(len(self.cfg.shards))]
        snapshot = self.snapshots.start(shards, [l.id for l in self.membership.live()], now)
        prepare(snapshot.directory)
        clock = self.vector_clock = self.vector_clock.tick(auth.COORDINATOR_ID)
        logger.info("snapshot %d started: %s", snapshot.id, ", ".join(snapshot.participants) or "no participants")
        for name, address in zip(shards, self.cfg.shards):
            self._spawn(self._marker(snapshot.id, name, address, snapshot.directory, list(snapshot.learners), clock))
        self._settle(save=True)
        return snapshot

    async def _marker(self, snapshot_id: int, name: str, address: str, directory: str, learners: list[str], clock: VectorClock) -> None:
        try:
            incarnation = await self._send_marker(name, address, snapshot_id, directory, learners, clock)
            if len(incarnation) > MAX_INCARNATION_CHARS:
                raise InvalidArgument(f"its reply names a process of more than {MAX_INCARNATION_CHARS} characters")
        except DilocoError as error:
            self.snapshots.fail(snapshot_id, f"marker to {name} at {address} failed: {error}", self._now())
            self._settle()
            return
        gone = incarnation in self._retired.get(name, ())
        self.snapshots.marked(snapshot_id, name, incarnation, gone, self._now())
        self._settle(save=gone)

    def report_snapshot(self, snapshot_id: int, participant: str, clock: VectorClock, files: list[SnapshotFile]) -> None:
        try:
            self.snapshots.report(snapshot_id, participant, dict(clock.entries), files, self._now())
        finally:
            self._settle(save=True)

    def list_snapshots(self) -> list[Snapshot]:
        self._settle()
        return self.snapshots.listing()

    # --- shutdown --------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the learners that die with the coordinator (its child processes; pods
        live on) as departed, not failed, so the shards keep their pushes; then end the
        membership streams and save the state."""
        self._closed = True
        if self.launcher is not None:
            reaped = set(self.launcher.reaped_on_close())
            now = self._now()
            self.membership.remove(
                [l.id for l in self.membership.live() if l.launch_id in reaped], "stopped with the coordinator", now
            )
            for launch_id in reaped:
                self.membership.launches.pop(launch_id, None)
            self._settle()
            await self.launcher.close()
        if self._timer is not None:
            self._timer.cancel()
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        for queue in list(self._watchers):
            self._close_watcher(queue)
        if self._retentions:  # a half-applied retention would leave what --snapshot-keep says is gone
            await asyncio.wait(list(self._retentions), timeout=RETENTION_GRACE_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._save()


def read_state(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        state = json.loads(text)
    except ValueError as error:
        raise FailedPrecondition(f"coordinator state {path} is corrupt: {error}") from None
    if state.get("format") != STATE_FORMAT:
        raise FailedPrecondition(f"coordinator state {path} has unknown format {state.get('format')!r}")
    return state
