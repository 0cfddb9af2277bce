"""`diloco local` with one XLA learner (4 PJRT CPU devices, SPMD) beside two CPU learners:
the XLA learner trains split over its 4 devices, its pushes are merged like the others',
and the global model's eval loss falls."""

import json
import os
import subprocess
import sys

from diloco.tape import read_tape

from tests.xla.conftest import DEVICES

SMALL = ["--width", "64", "--depth", "2", "--heads", "4", "--context", "64", "--batch-size", "8", "--fragments", "4",
         "--sync-every", "8"]


def test_a_run_mixing_an_xla_learner_with_cpu_learners_lowers_the_eval_loss(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "--insecure", "local", "--learners", "3", "--shards", "2", "--steps", "80",
         "--learner-device", "L0:xla", "--out", str(out), *SMALL],
        capture_output=True, text=True, timeout=400, env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    learners = {s["id"]: s for s in summary["learners"]}
    # Ids are given at join: the summary says which learner trained where.
    on_xla = [i for i, s in learners.items() if s.get("device") == "xla"]
    assert len(learners) == 3 and len(on_xla) == 1, learners
    xla = learners[on_xla[0]]
    assert xla["devices"] == 4 and xla["split_share"] == 1.0 and xla["inner_steps"] == 80, xla
    assert all(s["device"] == "cpu" and s["devices"] == 1 and s["inner_steps"] == 80
               for i, s in learners.items() if i != on_xla[0]), learners
    # The XLA learner's own evaluations fall (it starts late, from the global model the CPU
    # learners had trained while it compiled), and its pushes are merged with weight.
    events = [json.loads(line) for line in (out / "learners" / f"{on_xla[0]}.events.jsonl").read_text().splitlines()]
    evals = [e["loss"] for e in events if e["kind"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0] - 0.2, evals
    # A handful of graphs, compiled once: not one per sync (reading a split tensor through
    # .cpu() compiles one per piece per send: scripts/xla_reads.py).
    (compiled,) = [e for e in events if e["kind"] == "compiled"]
    assert 2 <= compiled["graphs"] <= 16, compiled
    merged = {}
    for shard in (0, 1):
        for r in read_tape(out / f"shard{shard}" / f"tape-S{shard}.jsonl"):
            if r["kind"] == "round":
                for p, w in zip(r["participants"], r["weights"]):
                    merged[p] = merged.get(p, 0) + (w > 0)
    assert all(merged.get(i, 0) >= 2 for i in learners), merged
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 1.0, summary
