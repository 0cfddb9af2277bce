"""The chaos checker (diloco/cli/check.py) cannot pass vacuously: a recorded history that keeps
every invariant passes, and the same history with one violation put in fails on exactly
that invariant, with the violation named."""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from diloco.cli.check import INVARIANTS, check, describe, write_check


@dataclass
class FakeReplay:
    shard_id: int
    max_abs_diff: float


def exact(run_dir, snapshot_dir=None):
    return [FakeReplay(0, 0.0)]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def history(versions: int = 10, dt: float = 1.0) -> list[dict]:
    """Shard 0: L0 and L1 push fragment 0 in turn every ``dt`` seconds (each every 2 dt),
    a round per push, both leave at the end."""
    tape = [{"kind": "start", "t": 0.0, "shard": 0},
            {"kind": "membership", "t": 0.1, "event": "snapshot", "live": [], "failed": [], "draining": []},
            {"kind": "membership", "t": 0.2, "learner": "L0", "event": "joined"},
            {"kind": "membership", "t": 0.2, "learner": "L1", "event": "joined"}]
    for v in range(1, versions + 1):
        learner = f"L{(v - 1) % 2}"
        tape.append({"kind": "push", "t": v * dt, "learner": learner, "fragment": 0, "base_version": v - 1,
                     "outcome": "accepted", "target_version": v})
        tape.append({"kind": "round", "t": v * dt + 0.01, "fragment": 0, "version": v, "participants": [learner],
                     "weights": [1.0]})
    end = versions * dt
    tape += [{"kind": "membership", "t": end + 0.5, "learner": "L0", "event": "left"},
             {"kind": "membership", "t": end + 0.6, "learner": "L1", "event": "left"},
             {"kind": "stop", "t": end + 1.0}]
    return tape


def summary() -> dict:
    return {"eval_loss_start": 8.0, "eval_loss_final": 3.0, "missing": {}, "goodput": 0.9, "tokens": 1000,
            "learners": [{"id": "L0", "state": "left", "reason": "finished"},
                         {"id": "L1", "state": "left", "reason": "finished"}]}


def write_run(path, tape=None, summ=None, chaos=(), endpoints=None):
    (path / "shard0").mkdir(parents=True, exist_ok=True)
    (path / "shard0" / "tape-S0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (tape or history())))
    (path / "summary.json").write_text(json.dumps(summ or summary()))
    (path / "chaos.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chaos))
    (path / "endpoints.json").write_text(json.dumps(endpoints if endpoints is not None else
                                                    [{"role": "learner", "id": "L0", "pid": _dead_pid()}]))
    return path


def failing(report) -> dict:
    return {name: detail for name, detail in report.results.items() if detail is not None}


def test_a_history_that_keeps_every_invariant_passes_and_says_so(tmp_path):
    run = write_run(tmp_path)
    report = check(run, replay_fn=exact)
    assert failing(report) == {} and list(report.results) == list(INVARIANTS)
    shard = report.stats["shards"]["0"]
    assert (shard["push_interval_s"], shard["period_s"], shard["uptime"]) == (2.0, 8.0, 1.0)
    assert describe(report).startswith("check: all 7 invariants hold after 0 faults")


def test_a_replay_that_differs_fails(tmp_path):
    run = write_run(tmp_path)
    report = check(run, replay_fn=lambda d, snapshots: [FakeReplay(0, 1e-3)])
    assert failing(report) == {"replay": "shard 0 differs by 0.001"}
    assert report.first == "replay: shard 0 differs by 0.001" and not report.ok


def test_the_replay_looks_for_snapshots_where_the_run_put_them(tmp_path):
    run = write_run(tmp_path)
    seen = []
    check(run, replay_fn=lambda d, snapshots: seen.append(snapshots) or [FakeReplay(0, 0.0)])
    (run / "config.json").write_text(json.dumps({"snapshot_dir": "s3://bucket/run1/snapshots"}))
    check(run, replay_fn=lambda d, snapshots: seen.append(snapshots) or [FakeReplay(0, 0.0)])
    check(run, replay_fn=lambda d, snapshots: seen.append(snapshots) or [FakeReplay(0, 0.0)], snapshot_dir="/elsewhere")
    assert seen == [None, "s3://bucket/run1/snapshots", "/elsewhere"]


def test_a_version_going_backwards_fails(tmp_path):
    tape = history()
    rounds = [r for r in tape if r["kind"] == "round"]
    rounds[4]["version"], rounds[5]["version"] = 6, 5
    assert failing(check(write_run(tmp_path, tape), replay_fn=exact)) == {
        "versions": "shard 0 fragment 0: version 5 (epoch 0) after 6 (epoch 0) at t=6.010"}


def test_a_restore_is_a_new_epoch_but_only_to_its_markers_cut(tmp_path):
    tape = history()[:-3]  # killed after version 10
    tape.insert(8, {"kind": "marker", "t": 2.5, "snapshot": 1, "versions": {"0": 2}})
    tape += [{"kind": "start", "t": 12.0, "shard": 0},
             {"kind": "restore", "t": 12.1, "snapshot": 1, "versions": {"0": 2}, "channel": []},
             {"kind": "membership", "t": 12.2, "event": "snapshot", "live": ["L0"], "failed": [], "draining": []},
             {"kind": "push", "t": 13.0, "learner": "L0", "fragment": 0, "outcome": "accepted", "target_version": 3},
             {"kind": "round", "t": 13.01, "fragment": 0, "version": 3, "participants": ["L0"], "weights": [1.0]},
             {"kind": "stop", "t": 14.0}]
    summ = summary()
    assert failing(check(write_run(tmp_path / "ok", tape, summ), replay_fn=exact)) == {}
    tape[-5]["versions"] = {"0": 1}  # restored to something other than the cut
    assert failing(check(write_run(tmp_path / "bad", tape, summ), replay_fn=exact)) == {
        "versions": "shard 0 restored snapshot 1 at versions {0: 1}, not its marker's {0: 2}"}


def test_a_shard_back_without_state_goes_on_from_the_anchor_it_took(tmp_path):
    """Killed after version 10 with no snapshot: the new life takes a learner's anchor at
    version 9 and issues 10 again (the dead life's last round is lost), or one at 12 (the
    kill lost the tape's last records), which is no violation; going back without an
    anchor is one."""
    tape = history()[:-3]
    tape += [{"kind": "start", "t": 12.0, "shard": 0},
             {"kind": "membership", "t": 12.1, "event": "snapshot", "live": ["L0"], "failed": [], "draining": []},
             {"kind": "initialize", "t": 12.2, "fragment": 0, "learner": "L0", "version": 9,
              "source": "anchor at version 9"},
             {"kind": "push", "t": 13.0, "learner": "L0", "fragment": 0, "outcome": "accepted", "target_version": 10},
             {"kind": "round", "t": 13.01, "fragment": 0, "version": 10, "participants": ["L0"], "weights": [1.0]},
             {"kind": "stop", "t": 14.0}]
    summ = summary()
    assert failing(check(write_run(tmp_path / "ok", tape, summ), replay_fn=exact)) == {}
    ahead = [dict(r, version=12, source="anchor at version 12") if r["kind"] == "initialize"
             else dict(r, version=13) if r["kind"] == "round" and r["t"] > 12 else r for r in tape]
    assert failing(check(write_run(tmp_path / "ahead", ahead, summ), replay_fn=exact)) == {}
    behind = [dict(r, version=12) if r["kind"] == "round" and r["t"] > 12 else r for r in ahead]
    assert failing(check(write_run(tmp_path / "behind", behind, summ), replay_fn=exact)) == {
        "versions": "shard 0 fragment 0: version 12 (epoch 0) after 12 (epoch 0) at t=13.010"}
    without = [r for r in tape if r["kind"] != "initialize"]
    assert failing(check(write_run(tmp_path / "without", without, summ), replay_fn=exact)) == {
        "versions": "shard 0 fragment 0: version 10 (epoch 0) after 10 (epoch 0) at t=13.010"}


def test_a_push_merged_twice_fails(tmp_path):
    tape = history()
    again = dict(next(r for r in tape if r["kind"] == "round" and r["version"] == 3))
    tape.insert(tape.index(next(r for r in tape if r["kind"] == "round" and r["version"] == 3)) + 1,
                {**again, "version": 4, "t": 3.5})
    for r in tape:  # keep the versions in order, so only the double merge is wrong
        if r["kind"] == "round" and r["t"] > 3.5:
            r["version"] += 1
    assert failing(check(write_run(tmp_path, tape), replay_fn=exact)) == {
        "merged_once": "shard 0 fragment 0 version 4 merged a push of L0 that no push record left unmerged "
                       "(merged twice?)"}


def test_channel_pushes_of_a_restore_count_as_pushes(tmp_path):
    tape = history()[:6]  # start, membership, L0's first push and round
    tape += [{"kind": "start", "t": 3.0, "shard": 0},
             {"kind": "restore", "t": 3.1, "snapshot": 1, "versions": {"0": 1},
              "channel": [{"learner": "L1", "fragment": 0, "outcome": "accepted", "target_version": 2}]},
             {"kind": "round", "t": 3.2, "fragment": 0, "version": 2, "participants": ["L1"], "weights": [1.0]},
             {"kind": "stop", "t": 3.5}]
    assert "merged_once" not in failing(check(write_run(tmp_path / "ok", tape), replay_fn=exact))
    tape[7]["channel"] = []
    assert "merged_once" in failing(check(write_run(tmp_path / "bad", tape), replay_fn=exact))


def test_pushes_a_snapshot_held_in_open_rounds_count_as_pushes_after_its_restore(tmp_path):
    """The recorded state held L0's push in an open round (accepted before the marker, its
    round closed after): the restored life merges it, with no push record of its own. Seen
    in a fresh-clone CI run (shard restart with S3 snapshots) before restores listed them."""
    tape = history()[:6]
    tape += [{"kind": "start", "t": 3.0, "shard": 0},
             {"kind": "restore", "t": 3.1, "snapshot": 1, "versions": {"0": 1},
              "pending": [{"learner": "L0", "fragment": 0}],
              "channel": [{"learner": "L1", "fragment": 0, "outcome": "accepted", "target_version": 2}]},
             {"kind": "round", "t": 3.2, "fragment": 0, "version": 2, "participants": ["L0", "L1"], "weights": [1.0, 1.0]},
             {"kind": "stop", "t": 3.5}]
    assert "merged_once" not in failing(check(write_run(tmp_path / "ok", tape), replay_fn=exact))
    tape[7]["pending"] = []
    assert "merged_once" in failing(check(write_run(tmp_path / "bad", tape), replay_fn=exact))


def test_a_push_accepted_after_its_learners_failure_fails(tmp_path):
    tape = history()
    tape.insert(tape.index(next(r for r in tape if r["kind"] == "push" and r["t"] == 6.0)),
                {"kind": "membership", "t": 5.5, "learner": "L1", "event": "failed"})
    summ = summary()
    summ["learners"][1] = {"id": "L1", "state": "failed", "reason": "lease expired"}
    result = failing(check(write_run(tmp_path, tape, summ), replay_fn=exact))
    assert result == {"no_merge_after_failure": "shard 0 accepted a push of L1 (fragment 0) at t=6.000, after hearing "
                                                "at t=5.500 that it was gone"}


def test_weight_given_to_a_failed_learner_fails_and_weight_zero_passes(tmp_path):
    tape = history()
    last = next(r for r in tape if r["kind"] == "round" and r["version"] == 10)
    last["participants"], last["weights"] = ["L1", "L0"], [0.0, 1.0]
    tape.insert(tape.index(last), {"kind": "push", "t": 9.5, "learner": "L0", "fragment": 0, "outcome": "accepted"})
    tape.insert(tape.index(last), {"kind": "membership", "t": 10.0, "learner": "L1", "event": "failed"})
    tape.remove(next(r for r in tape if r["kind"] == "push" and r["t"] == 10.0))
    tape.insert(3, {"kind": "push", "t": 0.5, "learner": "L1", "fragment": 0, "outcome": "accepted"})
    summ = summary()
    summ["learners"][1] = {"id": "L1", "state": "failed", "reason": "lease expired"}
    assert "no_merge_after_failure" not in failing(check(write_run(tmp_path / "ok", tape, summ), replay_fn=exact))
    last["weights"] = [0.5, 1.0]
    assert failing(check(write_run(tmp_path / "bad", tape, summ), replay_fn=exact)) == {
        "no_merge_after_failure": "shard 0 fragment 0 version 10 gave L1 weight 0.5 after hearing it failed"}
    last["closed_t"] = 9.99  # decided before the failure was heard, recorded after: fine
    assert "no_merge_after_failure" not in failing(check(write_run(tmp_path / "early", tape, summ), replay_fn=exact))


def test_a_failure_a_shard_never_heard_of_fails(tmp_path):
    summ = summary()
    summ["learners"][1] = {"id": "L1", "state": "failed", "reason": "lease expired"}
    assert failing(check(write_run(tmp_path, summ=summ), replay_fn=exact)) == {
        "no_merge_after_failure": "shard 0 never heard that L1 failed"}


def _without_rounds(tape, start, end, pushes=False):
    return [r for r in tape if not (r["kind"] in (("round", "push") if pushes else ("round",)) and start < r["t"] < end)]


def test_a_stall_while_learners_could_reach_the_shard_fails(tmp_path):
    """Pushes every 0.25 s (each learner every 0.5 s: an expected period of 2 s), and no
    round from t=1.01 to t=7.26 while they keep arriving."""
    report = check(write_run(tmp_path, _without_rounds(history(60, 0.25), 1.1, 7.1)), replay_fn=exact)
    assert failing(report) == {"progress": "shard 0: no round for 6.2 s from t=1.010 while a learner could reach it "
                                           "(expected period 2.00 s)"}
    assert report.stats["shards"]["0"]["longest_gap_s"] == 6.25 and report.stats["shards"]["0"]["uptime"] < 1
    # Up to twice the period is no stall.
    assert failing(check(write_run(tmp_path / "short", _without_rounds(history(60, 0.25), 1.1, 4.9)),
                         replay_fn=exact)) == {}


def test_a_gap_after_every_learner_stopped_training_is_no_stall_though_the_shard_was_not_told(tmp_path):
    """The learners stop pushing at t=1.1 (drained, by their own events) and the shard hears
    they left only at the end (the coordinator did not answer): no learner could make the
    shard progress. Without the learners' events the same tape is a stall."""
    tape = _without_rounds(history(60, 0.25), 1.1, 14.0, pushes=True)
    path = write_run(tmp_path / "stopped", tape)
    (path / "learners").mkdir()
    for learner, t in (("L0", 1.05), ("L1", 1.15)):
        events = [{"kind": "state", "t": 0.1, "state": "computing", "step": 0},
                  {"kind": "state", "t": t, "state": "draining", "step": 9}]
        (path / "learners" / f"{learner}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"kind": "st')
    assert failing(check(path, replay_fn=exact)) == {}
    assert "progress" in failing(check(write_run(tmp_path / "untold", tape), replay_fn=exact))


def test_a_gap_while_every_learner_is_cut_off_is_no_stall(tmp_path):
    tape = _without_rounds(history(60, 0.25), 1.1, 7.1, pushes=True)
    cut = [{"kind": "fault", "t": 1.2, "fault": "cut", "learners": ["L0"]},
           {"kind": "fault", "t": 1.3, "fault": "cut-shard", "shard": 0, "learners": ["L1"]},
           {"kind": "heal", "t": 6.9, "fault": "cut", "learners": ["L0"]},
           {"kind": "heal", "t": 7.0, "fault": "cut-shard", "learners": ["L1"]}]
    report = check(write_run(tmp_path / "cut", tape, chaos=cut), replay_fn=exact)
    assert failing(report) == {} and report.stats["faults"] == {"cut": 1, "cut-shard": 1}
    # From each heal to the victim's next push (L0 at 7.25, L1 at 7.5).
    assert report.stats["recovery_s"] == {"cut": {"median": 0.35, "max": 0.35, "n": 1},
                                          "cut-shard": {"median": 0.5, "max": 0.5, "n": 1}}
    # The same gap with one learner cut off another shard only: a stall.
    cut[1]["shard"] = 1
    assert "progress" in failing(check(write_run(tmp_path / "other", tape, chaos=cut), replay_fn=exact))


def test_a_restarted_shard_is_down_until_it_serves_a_model_again(tmp_path):
    """Killed at t=5, started at 5.5, restored (from object storage) at 10.5: no stall;
    the same gap after it serves again is one."""
    full = history(60, 0.25)
    old = [r for r in full if r["t"] <= 5.01 and r["kind"] not in ("stop",)]
    old.insert(5, {"kind": "marker", "t": 1.0, "snapshot": 1, "versions": {"0": 20}})
    new = [{"kind": "start", "t": 5.5, "shard": 0},
           {"kind": "restore", "t": 10.5, "snapshot": 1, "versions": {"0": 20}, "channel": []},
           {"kind": "membership", "t": 10.55, "event": "snapshot", "live": ["L0", "L1"], "failed": [], "draining": []}]
    for r in full:
        if r["kind"] in ("push", "round") and r["t"] >= 10.5:
            new.append(r)
    new += [r for r in full if r["kind"] in ("membership", "stop") and r["t"] > 15]
    summ = summary()
    assert failing(check(write_run(tmp_path / "ok", old + new, summ), replay_fn=exact)) == {}
    late = [dict(r, t=r["t"] + 5.0) if r["kind"] in ("restore", "membership") and 10 < r["t"] < 11 else r for r in new]
    late[1]["t"] = 6.0  # restored at once, pushes arrive again, and no round until 10.51
    late += [{"kind": "push", "t": t, "learner": "L0", "fragment": 0, "outcome": "accepted"} for t in (6.2, 6.4)]
    late = sorted(late, key=lambda r: r["t"])
    assert list(failing(check(write_run(tmp_path / "stall", old + late, summ), replay_fn=exact))) == ["progress"]


def test_a_learner_missing_from_a_shards_membership_list_no_longer_counts_as_reaching_it(tmp_path):
    """L1 leaves while shard 0's membership stream is down: the full list the shard gets on
    reconnecting lacks it. Then L0, the only learner left, is cut off from 6.1 to 11 s: no
    round is due."""
    old = [r for r in history(40, 0.25) if r["t"] <= 5.01 and r["kind"] != "stop"]
    new = [{"kind": "membership", "t": 5.7, "event": "snapshot", "live": ["L0"], "failed": [], "draining": []}]
    version = 20
    for t in (5.75, 6.0, 11.25, 11.5, 11.75, 12.0):
        version += 1
        new += [{"kind": "push", "t": t, "learner": "L0", "fragment": 0, "outcome": "accepted"},
                {"kind": "round", "t": t + 0.01, "fragment": 0, "version": version, "participants": ["L0"],
                 "weights": [1.0]}]
    new += [{"kind": "membership", "t": 12.2, "learner": "L0", "event": "left"}, {"kind": "stop", "t": 12.5}]
    cut = [{"kind": "fault", "t": 6.1, "fault": "cut", "learners": ["L0"]},
           {"kind": "heal", "t": 11.0, "fault": "cut", "learners": ["L0"]}]
    assert failing(check(write_run(tmp_path, old + new, chaos=cut), replay_fn=exact)) == {}
    new[0]["live"] = ["L0", "L1"]  # still listed: L1 could have pushed, and no round came
    assert list(failing(check(write_run(tmp_path / "listed", old + new, chaos=cut), replay_fn=exact))) == ["progress"]


@pytest.mark.parametrize("change, violation", [
    (lambda s, e: s["learners"][0].update(state="active"), "L0 is still active at the end"),
    (lambda s, e: s["learners"][1].update(reason=""), "L1 left with no recorded reason"),
    (lambda s, e: s.update(missing={"L2": "never joined"}), "launches that never joined: {'L2': 'never joined'}"),
    (lambda s, e: e.append({"role": "shard0", "pid": __import__("os").getpid()}), "still running after the run"),
])
def test_a_learner_unaccounted_for_or_a_process_left_running_fails(tmp_path, change, violation):
    summ, endpoints = summary(), [{"role": "learner", "id": "L0", "pid": _dead_pid()}]
    change(summ, endpoints)
    result = failing(check(write_run(tmp_path, summ=summ, endpoints=endpoints), replay_fn=exact))
    assert list(result) == ["learners"] and violation in result["learners"]


def test_an_eval_that_did_not_improve_fails(tmp_path):
    summ = summary()
    summ["eval_loss_final"] = 8.0
    assert failing(check(write_run(tmp_path, summ=summ), replay_fn=exact)) == {
        "eval": "the final eval 8.0 is not below the initial 8.0"}


def test_write_check_stores_the_verdict_and_the_cli_exits_1_on_a_violation(tmp_path):
    summ = summary()
    summ["eval_loss_final"] = 9.0
    run = write_run(tmp_path, summ=summ)
    proc = subprocess.run([sys.executable, "-m", "diloco", "check", str(run)], capture_output=True, text=True)
    # No run.json or model: the replay cannot run, which is a violation too, named.
    assert proc.returncode == 1 and proc.stdout.startswith("check: VIOLATION replay: cannot check:")
    stored = json.loads((run / "check.json").read_text())
    assert not stored["ok"] and {i["name"]: i["ok"] for i in stored["invariants"]}["eval"] is False
    with pytest.raises(Exception, match="no summary.json"):
        write_check(tmp_path / "nothing")
