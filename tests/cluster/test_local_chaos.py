"""`diloco local` under chaos, as a user runs it: a learner SIGKILLed mid-run and
replaced, a scavenged learner added through AddLearners; then the run's tapes are
checked, the timeline redrawn and the rounds replayed bit for bit."""

import json
import os
import subprocess
import sys

import pytest

from diloco.tape import read_tape

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(480)]

STEP_TOKENS = 8 * 32
BUDGET = 3 * 1000 * STEP_TOKENS
TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]


def diloco(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chaos") / "run"
    # Seed 1: the kill falls 2.9 s after the launch (or as soon as a learner is active),
    # the scavenged learner is asked for at 1 s. On a token budget the survivors keep
    # training while the replacement starts, and everyone is drained at the budget.
    proc = diloco("local", "--learners", "3", "--shards", "2", "--tokens", str(BUDGET), "--batch-size", "8",
                  "--kill-learner-every", "20", "--max-kills", "1", "--chaos-seed", "1", "--scavenge", "1@1",
                  "--out", str(out), *TINY, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


def test_killed_learner_is_replaced_and_scavenged_learner_contributes(chaos_run):
    out, summary = chaos_run
    chaos = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    kills = [c for c in chaos if c["kind"] == "kill"]
    assert len(kills) == 1 and summary["learners_killed"] == 1
    assert len([c for c in chaos if c["kind"] == "replace" and c["launched"]]) == len(kills)
    # The kill may hit the scavenged learner: its replacement joins the same pool.
    pools = {m["id"]: m["pool"] for m in summary["learners"]}
    assert summary["learners_scavenged"] == 1 + sum(pools[k["learner"]] == "scavenged" for k in kills)
    assert summary["learners_joined"] == 3 + len(kills) + 1
    assert summary["learners_failed"] >= len(kills)
    scavenged = [m["id"] for m in summary["learners"] if m["pool"] == "scavenged" and m["inner_steps"] > 0]
    assert scavenged
    merged = set()
    for m in range(2):
        for r in read_tape(out / f"shard{m}" / f"tape-S{m}.jsonl"):
            if r["kind"] == "round":
                merged |= {p for p, w in zip(r["participants"], r["weights"]) if w > 0}
    assert set(scavenged) <= merged, f"scavenged {scavenged} never merged"
    # The survivors kept training for the killed learner, and the run met its budget to
    # within a step per learner: what was left of it shortly before was allotted to the
    # learners training then, each drained once its own count reached its allotment.
    drained = [m for m in summary["learners"] if m["state"] == "left"]
    assert BUDGET <= summary["tokens"] <= BUDGET + len(drained) * STEP_TOKENS, (summary["tokens"], BUDGET, drained)
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5
    assert summary["global_stall_s"] == 0 and summary["uptime"] == 1.0, summary


def test_tapes_are_consistent(chaos_run):
    out, _ = chaos_run
    for m in range(2):
        records = list(read_tape(out / f"shard{m}" / f"tape-S{m}.jsonl"))
        pushed = {(r["learner"], r["fragment"], r["target_version"]) for r in records if r["kind"] == "push"}
        versions, own_clock, learner_clock = {}, 0, {}
        for r in records:
            if r["kind"] == "push" and r["outcome"] != "duplicate":
                seq = r["clock"][r["learner"]]
                assert seq > learner_clock.get((r["learner"], r["fragment"]), 0), "a learner's clock went back"
                learner_clock[(r["learner"], r["fragment"])] = seq
            if r["kind"] != "round":
                continue
            assert r["version"] == versions.get(r["fragment"], 0) + 1, "versions are not contiguous"
            versions[r["fragment"]] = r["version"]
            assert r["clock"][f"S{m}"] > own_clock, "the shard's clock did not advance"
            own_clock = r["clock"][f"S{m}"]
            for p in r["participants"]:
                assert (p, r["fragment"], r["version"]) in pushed, f"{p} merged into {r['fragment']}@{r['version']} without a push"


def test_no_process_is_left_running(chaos_run):
    out, _ = chaos_run
    pids = [e["pid"] for e in json.loads((out / "endpoints.json").read_text())]
    for path in (out / "learners").glob("*.events.jsonl"):
        pids += [r["pid"] for r in read_tape(path) if r.get("state") == "starting"]
    assert len(pids) >= 3 + 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_timeline_and_replay(chaos_run):
    out, _ = chaos_run
    assert (out / "timeline.png").stat().st_size > 10_000
    redrawn = out / "again.png"
    proc = diloco("timeline", str(out), "--out", str(redrawn))
    assert proc.returncode == 0, proc.stderr
    assert redrawn.stat().st_size > 10_000
    proc = diloco("replay", str(out), "--json", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["max_abs_diff"] == 0.0
    assert sum(s["rounds"] for s in result["shards"]) > 0


def test_replay_and_timeline_reject_a_directory_that_is_not_a_run(tmp_path):
    for command in ("replay", "timeline"):
        proc = diloco(command, str(tmp_path))
        assert proc.returncode == 2
        assert proc.stderr.startswith("diloco: error:") and "Traceback" not in proc.stderr
