"""Chandy-Lamport snapshots, the coordinator's side: which participants must report,
when a snapshot is complete, failed or still waiting, and what its manifest says.

Pure: the runtime sends the markers (a Marker RPC to every shard, a heartbeat directive
to every learner) and writes the manifest; this module only keeps the books.

A learner that fails or leaves during a snapshot is dropped from it: a restore never
uses learner state (learners re-join and bootstrap from the shards), and the shards
stop waiting for its channel when they hear it left. A shard is never dropped: without
its state the snapshot is useless.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from diloco.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

RUNNING, COMPLETE, FAILED = "running", "complete", "failed"
STATES = (RUNNING, COMPLETE, FAILED)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Finished snapshots kept in the listing (and the state file).
MAX_KEPT = 200


@dataclass(frozen=True)
class SnapshotFile:
    """A file a participant wrote, relative to the snapshot's directory."""

    path: str
    size_bytes: int
    sha256: str

    def __post_init__(self) -> None:
        path = PurePosixPath(self.path)
        if not self.path or path.is_absolute() or ".." in path.parts:
            raise InvalidArgument(f"snapshot file path must be relative to the snapshot directory, got {self.path!r}")
        if not _SHA256.match(self.sha256):
            raise InvalidArgument(f"snapshot file {self.path!r}: sha256 must be 64 lowercase hex digits")
        if self.size_bytes < 0:
            raise InvalidArgument(f"snapshot file {self.path!r}: negative size")


@dataclass(frozen=True)
class Report:
    participant: str
    clock: dict[str, int]
    """The participant's vector clock when it recorded its state: its part of the cut."""
    files: tuple[SnapshotFile, ...]
    reported_s: float


@dataclass
class Snapshot:
    id: int
    state: str
    started_s: float
    directory: str
    shards: list[str]
    learners: list[str]
    """Learners still expected to report (shrinks when one leaves or fails)."""
    reports: dict[str, Report] = field(default_factory=dict)
    marked: dict[str, str] = field(default_factory=dict)
    """Shards whose marker reply arrived: the process (incarnation) that recorded its state."""
    finished_s: float | None = None
    detail: str = ""
    manifest: str = ""
    dropped: list[str] = field(default_factory=list)
    stalled_s: float = 0.0
    """Time the coordinator did not run while it waited (``Snapshots.pause``): its timeout
    runs that much later."""

    @property
    def participants(self) -> list[str]:
        return [*self.shards, *self.learners]

    @property
    def waiting(self) -> list[str]:
        return [p for p in self.participants if p not in self.reports]


@dataclass(frozen=True)
class Complete:
    reason: str


@dataclass(frozen=True)
class Pending:
    reason: str
    deadline_s: float


@dataclass(frozen=True)
class TimedOut:
    reason: str


def decide_snapshot(snapshot: Snapshot, now: float, timeout_s: float) -> Complete | Pending | TimedOut:
    waiting = snapshot.waiting
    if not waiting:
        return Complete(f"all {len(snapshot.participants)} participants reported")
    deadline = snapshot.started_s + snapshot.stalled_s + timeout_s
    names = ", ".join(waiting[:5]) + (" ..." if len(waiting) > 5 else "")
    if now >= deadline:
        return TimedOut(f"timed out after {timeout_s:g} s waiting for {names}")
    return Pending(f"waiting for {names}; times out in {deadline - now:.1f} s", deadline)


class Snapshots:
    def __init__(self, timeout_s: float, root: str, next_id: int = 1) -> None:
        self.timeout_s = timeout_s
        self.root = root
        self.next_id = next_id
        self.snapshots: dict[int, Snapshot] = {}
        self._finished: list[Snapshot] = []

    def get(self, snapshot_id: int) -> Snapshot:
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            raise NotFound(f"unknown snapshot {snapshot_id}")
        return snapshot

    def running(self) -> Snapshot | None:
        return next((s for s in self.snapshots.values() if s.state == RUNNING), None)

    def listing(self) -> list[Snapshot]:
        return [self.snapshots[i] for i in sorted(self.snapshots)]

    def take_finished(self) -> list[Snapshot]:
        """Snapshots that completed or failed since the last call (the runtime writes
        manifests and logs them)."""
        finished, self._finished = self._finished, []
        return finished

    def next_deadline(self) -> float | None:
        running = self.running()
        return None if running is None else running.started_s + running.stalled_s + self.timeout_s

    def pause(self, stalled_s: float) -> None:
        """The coordinator did not run for ``stalled_s``: the running snapshot's timeout
        moves on by that much (its participants could not report to it)."""
        running = self.running()
        if running is not None:
            running.stalled_s += stalled_s

    def start(self, shards: list[str], learners: list[str], now: float) -> Snapshot:
        running = self.running()
        if running is not None:
            decision = decide_snapshot(running, now, self.timeout_s)
            raise AlreadyExists(f"snapshot {running.id} is already running ({decision.reason})")
        snapshot_id = self.next_id
        self.next_id += 1
        snapshot = Snapshot(
            snapshot_id, RUNNING, now, f"{self.root.rstrip('/')}/{snapshot_id:06d}", list(shards), sorted(learners)
        )
        self.snapshots[snapshot_id] = snapshot
        self._settle(snapshot, now)
        self._prune()
        return snapshot

    def report(self, snapshot_id: int, participant: str, clock: dict[str, int], files: list[SnapshotFile], now: float) -> Snapshot:
        """Record a participant's report; reporting twice replaces the first (a retried RPC)."""
        snapshot = self.get(snapshot_id)
        if snapshot.state != RUNNING:
            raise FailedPrecondition(f"snapshot {snapshot_id} is {snapshot.state}" + (f": {snapshot.detail}" if snapshot.detail else ""))
        if participant not in snapshot.participants:
            raise PermissionDenied(f"{participant} is not a participant of snapshot {snapshot_id}")
        paths = [f.path for f in files]
        if len(set(paths)) != len(paths):
            raise InvalidArgument(f"{participant} reported the same file twice")
        snapshot.reports[participant] = Report(participant, dict(clock), tuple(files), now)
        self._settle(snapshot, now)
        return snapshot

    def drop_learner(self, learner_id: str, reason: str, now: float) -> None:
        snapshot = self.running()
        if snapshot is None or learner_id not in snapshot.learners or learner_id in snapshot.reports:
            return
        snapshot.learners.remove(learner_id)
        snapshot.dropped.append(f"{learner_id} ({reason})")
        self._settle(snapshot, now)

    def participant_restarted(self, participant: str, incarnation: str, now: float) -> None:
        """A participant that had not reported now runs as process ``incarnation``. If an
        older process recorded the marker, what it kept in memory (a shard's channel state)
        is gone and it will never report: the snapshot fails. If the new process recorded
        it, the snapshot goes on; if the marker has not answered yet, its answer decides
        (``marked``)."""
        snapshot = self.running()
        if snapshot is None or participant not in snapshot.participants or participant in snapshot.reports:
            return
        recorded_by = snapshot.marked.get(participant)
        if recorded_by is not None and recorded_by != incarnation:
            self._finish(snapshot, FAILED, f"{participant} restarted before it reported", now)

    def marked(self, snapshot_id: int, shard: str, incarnation: str, gone: bool, now: float) -> None:
        """Shard ``shard`` answered its marker: process ``incarnation`` recorded its state.
        ``gone``: the coordinator already follows a newer process of that shard, so the
        recording died with this one (the snapshot fails)."""
        snapshot = self.get(snapshot_id)
        if snapshot.state != RUNNING or shard not in snapshot.shards:
            return
        snapshot.marked[shard] = incarnation
        if gone and shard not in snapshot.reports:
            self._finish(snapshot, FAILED, f"{shard} restarted before it reported", now)

    def fail(self, snapshot_id: int, reason: str, now: float) -> None:
        snapshot = self.get(snapshot_id)
        if snapshot.state == RUNNING:
            self._finish(snapshot, FAILED, reason, now)

    def expire(self, now: float) -> None:
        snapshot = self.running()
        if snapshot is not None:
            self._settle(snapshot, now)

    def completed(self, snapshot_id: int, manifest_path: str) -> None:
        self.get(snapshot_id).manifest = manifest_path

    def manifest_failed(self, snapshot_id: int, reason: str) -> None:
        """Every participant recorded, but the manifest could not be written: never complete."""
        snapshot = self.get(snapshot_id)
        snapshot.state, snapshot.detail = FAILED, reason

    def forget(self, snapshot_id: int) -> None:
        """A snapshot whose files were deleted (retention)."""
        self.snapshots.pop(snapshot_id, None)

    def resolve(self, spec: str) -> Snapshot:
        """The complete snapshot named by ``spec``: "latest" or an id."""
        if spec == "latest":
            complete = [s for s in self.listing() if s.state == COMPLETE]
            if not complete:
                raise NotFound("no complete snapshot to restore")
            return complete[-1]
        snapshot = self.get(int(spec))
        if snapshot.state != COMPLETE:
            raise FailedPrecondition(f"snapshot {snapshot.id} is {snapshot.state}, only a complete one can be restored")
        return snapshot

    def _settle(self, snapshot: Snapshot, now: float) -> None:
        decision = decide_snapshot(snapshot, now, self.timeout_s)
        if isinstance(decision, Complete):
            detail = decision.reason + (f"; dropped {', '.join(snapshot.dropped)}" if snapshot.dropped else "")
            self._finish(snapshot, COMPLETE, detail, now)
        elif isinstance(decision, TimedOut):
            self._finish(snapshot, FAILED, decision.reason, now)
        else:
            snapshot.detail = decision.reason

    def _finish(self, snapshot: Snapshot, state: str, detail: str, now: float) -> None:
        snapshot.state, snapshot.detail, snapshot.finished_s = state, detail, now
        self._finished.append(snapshot)

    def _prune(self) -> None:
        done = [i for i in sorted(self.snapshots) if self.snapshots[i].state != RUNNING]
        for snapshot_id in done[: max(0, len(done) - MAX_KEPT)]:
            del self.snapshots[snapshot_id]

    # --- the state file --------------------------------------------------------------

    def to_state(self) -> dict:
        return {"next_snapshot": self.next_id, "snapshots": [dataclasses.asdict(s) for s in self.listing()]}

    @classmethod
    def from_state(cls, timeout_s: float, root: str, state: dict, now: float) -> Snapshots:
        """A snapshot that was running when the coordinator stopped is marked failed: the
        markers' context (who still has to report) is gone with the process."""
        snapshots = cls(timeout_s, root, int(state.get("next_snapshot", 1)))
        try:
            for raw in state.get("snapshots", []):
                raw = dict(raw)
                reports = {
                    p: Report(r["participant"], dict(r["clock"]), tuple(SnapshotFile(**f) for f in r["files"]), r["reported_s"])
                    for p, r in raw.pop("reports", {}).items()
                }
                snapshot = Snapshot(**raw, reports=reports)
                if snapshot.state not in STATES:
                    raise ValueError(f"bad snapshot state {snapshot.state!r}")
                snapshots.snapshots[snapshot.id] = snapshot
                snapshots.next_id = max(snapshots.next_id, snapshot.id + 1)
        except (TypeError, ValueError, KeyError) as error:
            raise InvalidArgument(f"corrupt coordinator state: {error}") from None
        running = snapshots.running()
        if running is not None:
            snapshots.fail(running.id, "the coordinator restarted during the snapshot", now)
            snapshots.take_finished()
        return snapshots


def manifest_of(snapshot: Snapshot, coordinator_clock: dict[str, int], run: dict) -> dict:
    """What a restore needs: the cut (each participant's clock when it recorded), the
    files with their checksums and the run it belongs to."""
    return {
        "format": 1,
        "snapshot_id": snapshot.id,
        "started_s": snapshot.started_s,
        "finished_s": snapshot.finished_s,
        "participants": snapshot.participants,
        "dropped": snapshot.dropped,
        "cut": {p: r.clock for p, r in sorted(snapshot.reports.items())},
        "coordinator_clock": coordinator_clock,
        "files": [
            {"participant": p, "path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256}
            for p, r in sorted(snapshot.reports.items())
            for f in r.files
        ],
        "run": run,
    }
