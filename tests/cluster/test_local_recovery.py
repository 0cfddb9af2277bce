"""A shard SIGKILLed mid-run with no snapshot comes back empty and recovers from the
learners' anchors: never from an initial model, at the anchors' versions, losing only the
rounds since them, and the run's rounds still replay bit for bit."""

import json
import subprocess
import sys

import pytest

from diloco.tape import read_tape

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]


def lives(tape):
    """The tape's records split at each ``start`` (a restarted shard appends a new life)."""
    out = []
    for record in read_tape(tape):
        if record["kind"] == "start":
            out.append([])
        out[-1].append(record)
    return out


def test_a_shard_killed_without_a_snapshot_recovers_from_the_learners_anchors(tmp_path):
    # On a quiet machine the 1500 steps are done about 2 s after the kill at 8 s, before any
    # push of theirs fails: the learners then offer their anchors as they leave (without
    # that, the shard stayed recovering and the run ended with no model to export).
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--learners", "3", "--shards", "2", "--steps", "1500",
         "--batch-size", "8", "--restart-shard-at", "8", "--restart-from", "learners", "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["shard_restarts"] == 1
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5
    (restart,) = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    before = {int(f): v for f, v in restart["versions_before"].items()}  # from Status, just before the kill
    assert before and min(before.values()) >= 1  # it had trained when it was killed
    second = lives(out / "shard0" / "tape-S0.jsonl")[-1]
    assert second[1]["kind"] == "recovering"
    recovered = {r["fragment"]: r for r in second if r["kind"] == "initialize"}
    assert set(recovered) == set(before)
    for fragment, r in recovered.items():
        assert r["source"] == f"anchor at version {r['version']}" and r["version"] >= 1  # never an initial model
    replay = subprocess.run([sys.executable, "-m", "diloco", "replay", str(out), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr
