"""The coordinator's side of Chandy-Lamport as a state machine: start, reports, drops,
timeouts, and what the manifest records."""

import pytest

from diloco.coordinator.core.snapshots import (
    COMPLETE,
    FAILED,
    MAX_KEPT,
    RUNNING,
    Complete,
    Pending,
    Report,
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


def test_a_shard_that_restarts_before_it_reports_fails_the_snapshot_at_once():
    books = Snapshots(timeout_s=120, root="/snaps")
    books.start(["S0", "S1"], ["L0"], now=0.0)
    books.marked(1, "S0", "p1", gone=False, now=0.5)
    books.marked(1, "S1", "q1", gone=False, now=0.5)
    books.report(1, "S1", {}, [], now=1.0)
    books.participant_restarted("S1", "q2", now=2.0)  # reported already: its files are on disk
    books.participant_restarted("S9", "x", now=2.0)  # not a participant
    assert books.get(1).state == RUNNING
    books.participant_restarted("S0", "p2", now=3.0)  # p1 recorded the marker, and p1 is gone
    snapshot = books.get(1)
    assert (snapshot.state, snapshot.detail, snapshot.finished_s) == (FAILED, "S0 restarted before it reported", 3.0)
    assert books.take_finished() == [snapshot]
    assert books.start(["S0", "S1"], [], now=4.0).id == 2  # the next one need not wait for the timeout


def test_a_restart_just_before_the_marker_fails_nothing_and_a_stale_answer_fails_the_snapshot():
    books = Snapshots(timeout_s=120, root="/snaps")
    books.start(["S0"], [], now=0.0)
    # S0 restarted as p2, which got the marker; the coordinator hears of p2 afterwards.
    books.marked(1, "S0", "p2", gone=False, now=1.0)
    books.participant_restarted("S0", "p2", now=1.5)
    assert books.get(1).state == RUNNING
    books.report(1, "S0", {}, [], now=2.0)
    assert books.get(1).state == COMPLETE
    # The coordinator follows p3 while the marker is out: the answer decides.
    books.start(["S0"], [], now=3.0)
    books.participant_restarted("S0", "p3", now=3.5)
    assert books.get(2).state == RUNNING
    books.marked(2, "S0", "p2", gone=True, now=4.0)  # p2 answered, and p2 is gone
    assert (books.get(2).state, books.get(2).detail) == (FAILED, "S0 restarted before it reported")
    # A shard that names no process is taken to be a new one on any restart.
    books.start(["S0"], [], now=5.0)
    books.marked(3, "S0", "", gone=False, now=5.5)
    books.participant_restarted("S0", "p4", now=6.0)
    assert books.get(3).state == FAILED


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


def test_the_manifest_records_the_whole_cut():
    books = Snapshots(timeout_s=60, root="/snaps")
    snapshot = books.start(["S0"], ["L0", "L1"], now=100.0)
    books.report(1, "S0", {"S0": 4}, [SnapshotFile("S0-state.pt", 123, "a" * 64)], now=101.0)
    books.drop_learner("L1", "left", now=101.5)
    books.report(1, "L0", {"L0": 9}, [], now=102.0)
    assert manifest_of(snapshot, {"C": 5}, {"plan_hash": "h"}) == {
        "format": 1,
        "snapshot_id": 1,
        "started_s": 100.0,
        "finished_s": 102.0,
        "participants": ["S0", "L0"],
        "dropped": ["L1 (left)"],
        "cut": {"L0": {"L0": 9}, "S0": {"S0": 4}},
        "coordinator_clock": {"C": 5},
        "files": [{"participant": "S0", "path": "S0-state.pt", "size_bytes": 123, "sha256": "a" * 64}],
        "run": {"plan_hash": "h"},
    }


def test_waiting_lists_name_five_participants_at_most():
    books = Snapshots(timeout_s=60, root="/snaps")
    five = books.start(["S0", "S1", "S2", "S3", "S4"], [], now=0.0)
    assert five.detail == "waiting for S0, S1, S2, S3, S4; times out in 60.0 s"
    books.fail(1, "enough", now=1.0)
    six = books.start(["S0", "S1", "S2", "S3", "S4", "S5"], [], now=10.0)
    assert six.detail == "waiting for S0, S1, S2, S3, S4 ...; times out in 60.0 s"
    assert decide_snapshot(six, 70.0, 60) == TimedOut("timed out after 60 s waiting for S0, S1, S2, S3, S4 ...")


def test_file_sizes_may_be_zero_but_not_negative():
    assert SnapshotFile("empty.pt", 0, SHA).size_bytes == 0
    with pytest.raises(InvalidArgument, match=r"^snapshot file 'a.pt': negative size$"):
        SnapshotFile("a.pt", -1, SHA)


def test_finished_snapshots_beyond_the_kept_number_are_forgotten_oldest_first():
    books = Snapshots(timeout_s=60, root="/snaps")
    for t in range(MAX_KEPT + 2):
        books.start([], [], now=float(t))  # no participants: complete at once
    assert [s.id for s in books.listing()][:2] == [3, 4] and len(books.listing()) == MAX_KEPT


def test_reports_are_kept_as_given_and_stamped():
    books = Snapshots(timeout_s=60, root="/snaps")
    snapshot = books.start(["S0", "S1"], [], now=0.0)
    books.report(1, "S0", {"S0": 3}, files("S0.pt"), now=2.5)
    assert snapshot.reports["S0"] == Report("S0", {"S0": 3}, tuple(files("S0.pt")), 2.5)
    assert snapshot.detail == "waiting for S1; times out in 57.5 s"


def test_finishing_stamps_the_time_for_every_outcome():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start(["S0"], ["L0"], now=0.0)
    books.report(1, "S0", {}, [], now=1.0)
    books.drop_learner("L0", "lease expired", now=2.0)  # the last one awaited
    books.start(["S0"], [], now=3.0)
    books.fail(2, "marker to S0 failed", now=4.0)
    books.start(["S0"], [], now=5.0)
    books.expire(35.0)
    assert [(s.id, s.state, s.finished_s) for s in books.listing()] == [
        (1, COMPLETE, 2.0), (2, FAILED, 4.0), (3, FAILED, 35.0),
    ]


def test_dropping_learners_outside_a_running_snapshot_changes_nothing():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.drop_learner("L0", "left", now=0.0)  # no snapshot running
    snapshot = books.start(["S0"], ["L0", "L1", "L2"], now=1.0)
    books.drop_learner("L7", "left", now=2.0)  # not a participant
    books.drop_learner("L2", "left", now=2.0)
    books.drop_learner("L0", "lease expired", now=2.0)
    assert snapshot.learners == ["L1"]
    books.report(1, "S0", {}, [], now=3.0)
    books.report(1, "L1", {}, [], now=3.0)
    assert snapshot.detail == "all 2 participants reported; dropped L2 (left), L0 (lease expired)"


def test_manifest_outcomes_and_forgetting():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start([], [], now=0.0)
    books.start([], [], now=1.0)
    books.completed(1, "/snaps/000001/manifest.json")
    assert books.get(1).manifest == "/snaps/000001/manifest.json"
    books.manifest_failed(2, "disk full")
    assert (books.get(2).state, books.get(2).detail) == (FAILED, "disk full")
    with pytest.raises(NotFound, match="unknown snapshot 9"):
        books.manifest_failed(9, "disk full")
    books.forget(1)
    books.forget(1)  # already forgotten: nothing to do
    assert [s.id for s in books.listing()] == [2]
    with pytest.raises(NotFound, match=r"^no complete snapshot to restore$"):
        books.resolve("latest")


def test_a_report_to_a_finished_snapshot_says_why_it_finished():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start([], [], now=0.0)
    with pytest.raises(FailedPrecondition, match=r"^snapshot 1 is complete: all 0 participants reported$"):
        books.report(1, "S0", {}, [], now=1.0)
    books.start(["S0"], [], now=2.0)
    books.fail(2, "", now=3.0)
    with pytest.raises(FailedPrecondition, match=r"^snapshot 2 is failed$"):
        books.report(2, "S0", {}, [], now=4.0)


def test_only_trailing_slashes_of_the_root_are_dropped():
    books = Snapshots(timeout_s=30, root="/mnt/X/")
    assert books.start(["S0"], [], now=0.0).directory == "/mnt/X/000001"


def test_state_file_keeps_the_snapshot_counter_and_the_timeout():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start([], [], now=0.0)
    books.start([], [], now=1.0)
    books.forget(1)
    books.forget(2)  # retention deleted both: their ids are still never reused
    back = Snapshots.from_state(30, "/snaps", books.to_state(), now=5.0)
    assert back.start(["S0"], [], now=10.0).id == 3
    assert back.next_deadline() == 40.0
    fresh = Snapshots.from_state(30, "/snaps", {}, now=0.0)  # a first start
    assert fresh.start([], [], now=0.0).id == 1
    # Without a counter, the records still keep ids from being reused.
    record = {"id": 3, "state": COMPLETE, "started_s": 0.0, "directory": "/snaps/000003", "shards": [], "learners": []}
    assert Snapshots.from_state(30, "/snaps", {"snapshots": [record]}, now=0.0).start([], [], now=1.0).id == 4


def test_a_snapshot_interrupted_by_a_restart_fails_when_the_coordinator_is_back():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start(["S0"], [], now=0.0)
    back = Snapshots.from_state(30, "/snaps", books.to_state(), now=100.0)
    assert (back.get(1).state, back.get(1).finished_s) == (FAILED, 100.0)


def test_a_snapshot_record_with_a_bad_state_is_refused():
    record = {"id": 3, "state": "paused", "started_s": 0.0, "directory": "/snaps/000003", "shards": [], "learners": []}
    with pytest.raises(InvalidArgument, match=r"^corrupt coordinator state: bad snapshot state 'paused'$"):
        Snapshots.from_state(30, "/snaps", {"snapshots": [record]}, now=0.0)


def test_reports_survive_a_restart_unchanged():
    books = Snapshots(timeout_s=30, root="/snaps")
    books.start(["S0"], ["L0"], now=0.0)
    books.report(1, "S0", {"S0": 4, "C": 1}, files("S0-state.pt"), now=1.5)
    books.report(1, "L0", {"L0": 9}, [], now=2.0)
    back = Snapshots.from_state(30, "/snaps", books.to_state(), now=100.0)
    assert back.get(1).reports == books.get(1).reports
    assert back.get(1).reports["S0"] == Report("S0", {"S0": 4, "C": 1}, tuple(files("S0-state.pt")), 1.5)
