"""The coordinator's side of Chandy-Lamport as a state machine: start, reports, drops,
timeouts, and what the manifest records."""

import pytest

from coordinator.core.snapshots import (
    COMPLETE,
    FAILED,
    RUNNING,
    Complete,
    Pending,
    SnapshotFile,
    Snapshots,
    TimedOut,
    decide_snapshot,
    manifest_of,
)
from diloco.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

SHA = "0" * 64


def files(*names):
    return [SnapshotFile(n, 10, SHA) for n in names]


def test_complete_once_every_participant_reported():
    books = Snapshots(timeout_s=60, root="/snaps")
    snapshot = books.start(["S0", "S1"], ["L1", "L0"], now=100.0)
    assert (snapshot.id, snapshot.state, snapshot.directory) == (1, RUNNING, "/snaps/000001")
    assert snapshot.participants == ["S0", "S1", "L0", "L1"]
    assert decide_snapshot(snapshot, 110.0, 60) == Pending("waiting for S0, S1, L0, L1; times out in 50.0 s", 160.0)
    books.report(1, "S0", {"S0": 4, "C": 1}, files("S0-state.pt", "S0-channel.pt"), now=101.0)
    books.report(1, "L0", {"L0": 9}, files("L0.pt"), now=102.0)
    books.report(1, "L0", {"L0": 9}, files("L0.pt"), now=102.5)  # a retried report replaces the first
    books.report(1, "S1", {"S1": 2}, files("S1-state.pt"), now=103.0)
    assert books.take_finished() == []
    books.report(1, "L1", {"L1": 3}, [], now=104.0)
    assert snapshot.state == COMPLETE and snapshot.finished_s == 104.0
    assert snapshot.detail == "all 4 participants reported"
    assert books.take_finished() == [snapshot]
    manifest = manifest_of(snapshot, {"C": 5}, {"plan_hash": "h"})
    assert manifest["cut"] == {"L0": {"L0": 9}, "L1": {"L1": 3}, "S0": {"C": 1, "S0": 4}, "S1": {"S1": 2}}
    assert [(f["participant"], f["path"]) for f in manifest["files"]] == [
        ("L0", "L0.pt"), ("S0", "S0-state.pt"), ("S0", "S0-channel.pt"), ("S1", "S1-state.pt"),
    ]
    assert manifest["run"] == {"plan_hash": "h"} and manifest["snapshot_id"] == 1


def test_only_one_snapshot_at_a_time():
    books = Snapshots(timeout_s=60, root="/snaps")
    books.start(["S0"], [], now=0.0)
    with pytest.raises(AlreadyExists, match=r"snapshot 1 is already running \(waiting for S0; times out in 50.0 s\)"):
        books.start(["S0"], [], now=10.0)
    books.report(1, "S0", {}, [], now=11.0)
    assert books.start(["S0"], [], now=12.0).id == 2


def test_reports_that_do_not_fit():
    books = Snapshots(timeout_s=60, root="/snaps")
    books.start(["S0"], ["L0"], now=0.0)
    with pytest.raises(NotFound, match="unknown snapshot 7"):
        books.report(7, "S0", {}, [], now=1.0)
    with pytest.raises(PermissionDenied, match="L5 is not a participant of snapshot 1"):
        books.report(1, "L5", {}, [], now=1.0)
    with pytest.raises(InvalidArgument, match="same file twice"):
        books.report(1, "S0", {}, files("a", "a"), now=1.0)
    books.fail(1, "marker to S0 failed", now=2.0)
    with pytest.raises(FailedPrecondition, match="snapshot 1 is failed: marker to S0 failed"):
        books.report(1, "S0", {}, [], now=3.0)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../b", ""])
def test_file_paths_stay_inside_the_snapshot(path):
    with pytest.raises(InvalidArgument, match="relative"):
        SnapshotFile(path, 1, SHA)


def test_file_checksum_must_be_sha256_hex():
    with pytest.raises(InvalidArgument, match="sha256"):
        SnapshotFile("a", 1, "xyz")


def test_timeout_names_who_is_missing():
    books = Snapshots(timeout_s=30, root="/snaps")
    snapshot = books.start(["S0"], ["L0"], now=0.0)
    books.report(1, "S0", {}, [], now=1.0)
    assert books.next_deadline() == 30.0
    assert decide_snapshot(snapshot, 30.0, 30) == TimedOut("timed out after 30 s waiting for L0")
    books.expire(29.9)
    assert snapshot.state == RUNNING
    books.expire(30.0)
    assert snapshot.state == FAILED and snapshot.detail == "timed out after 30 s waiting for L0"
    assert books.next_deadline() is None


def test_a_learner_that_leaves_is_dropped_and_no_longer_awaited():
    books = Snapshots(timeout_s=30, root="/snaps")
    snapshot = books.start(["S0"], ["L0", "L1"], now=0.0)
    books.report(1, "S0", {}, [], now=1.0)
    books.report(1, "L0", {}, [], now=1.0)
    books.drop_learner("L0", "left", now=1.5)  # already reported: kept
    books.drop_learner("L1", "lease expired", now=2.0)
    assert snapshot.state == COMPLETE
    assert snapshot.detail == "all 2 participants reported; dropped L1 (lease expired)"
    assert decide_snapshot(snapshot, 2.0, 30) == Complete("all 2 participants reported")


def test_without_participants_a_snapshot_completes_at_once():
    books = Snapshots(timeout_s=30, root="/snaps")
    assert books.start([], [], now=0.0).state == COMPLETE


def test_restore_resolution_and_state_round_trip():
    books = Snapshots(timeout_s=30, root="/snaps")
    with pytest.raises(NotFound, match="no complete snapshot"):
        books.resolve("latest")
    books.start(["S0"], [], now=0.0)
    books.report(1, "S0", {"S0": 1}, files("S0-state.pt"), now=1.0)
    books.start(["S0"], [], now=2.0)
    books.fail(2, "marker failed", now=3.0)
    books.start(["S0"], [], now=4.0)  # running when the coordinator stops
    assert books.resolve("latest").id == 1
    with pytest.raises(FailedPrecondition, match="snapshot 2 is failed"):
        books.resolve("2")
    back = Snapshots.from_state(30, "/snaps", books.to_state(), now=100.0)
    assert [(s.id, s.state) for s in back.listing()] == [(1, COMPLETE), (2, FAILED), (3, FAILED)]
    assert back.get(3).detail == "the coordinator restarted during the snapshot"
    assert back.get(1).reports["S0"].files == tuple(files("S0-state.pt"))
    assert back.start([], [], now=101.0).id == 4
