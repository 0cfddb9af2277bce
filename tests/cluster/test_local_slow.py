"""`diloco local --slow-learner` and `--delay-ms` end to end: the slow learner really steps
slower, every push really waits the wire delay each way, and both learners' pushes are
still merged into the global model."""

import json
import subprocess
import sys

import pytest

from diloco.tape import read_tape

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "8"]
DELAY_MS = 200


def test_a_slow_learner_on_a_slow_wire_still_contributes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "--insecure", "local", "--learners", "2", "--shards", "1", "--steps", "120",
         "--batch-size", "8", "--slow-learner", "1:3", "--delay-ms", str(DELAY_MS), "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    learners = {s["learner_id"]: s for s in (json.loads(p.read_text()) for p in (out / "learners").glob("*.json"))}
    assert set(learners) == {"L0", "L1"} and all(s["inner_steps"] == 120 for s in learners.values()), learners
    # Ids are given in the order the learners join, not launch: the events say which one
    # was launched slow. It sleeps twice its step time after each step: a third of the
    # speed (half is the bound, the machine is shared).
    factors = {}
    for learner in learners:
        events = [json.loads(line) for line in (out / "learners" / f"{learner}.events.jsonl").read_text().splitlines()]
        factors[learner] = next(e["slow_factor"] for e in events if e.get("state") == "starting")
    assert sorted(factors.values()) == [1.0, 3.0], factors
    slow = next(learner for learner, factor in factors.items() if factor == 3.0)
    fast = next(learner for learner in learners if learner != slow)
    assert learners[slow]["tokens_per_s"] < 0.5 * learners[fast]["tokens_per_s"], learners
    # Each push waits the delay before it is sent and again before its reply is used.
    for s in learners.values():
        assert s["pushes_acked"] >= 1 and s["sync_latency_s_p50"] >= 2 * DELAY_MS / 1000, s
    merged = {}
    for r in read_tape(out / "shard0" / "tape-S0.jsonl"):
        if r["kind"] == "round":
            for p, w in zip(r["participants"], r["weights"]):
                merged[p] = merged.get(p, 0) + (w > 0)
    assert merged.get(slow, 0) >= 1 and merged.get(fast, 0) >= 1, merged
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5, summary
