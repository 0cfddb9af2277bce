"""A stall of the whole host (every process of a run stopped with SIGSTOP, then SIGCONT:
what a VM pause or a laptop's sleep does) longer than the coordinator's lease fails no
learner: the coordinator sees that it did not run and moves every lease on by that
while, and the run finishes its budget."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.polling import poll

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--batch-size", "8"]
STALL_S = 8.0
"""Longer than the coordinator's lease (5 s, CoordinatorConfig.lease_s): without the stall
rule every learner was failed (docs/results/stall/ has a 15 s one)."""


def run_pids(out: Path, supervisor: subprocess.Popen) -> list[int]:
    """Every process of the run: the supervisor and each process endpoints.json lists."""
    endpoints = json.loads((out / "endpoints.json").read_text())
    return [supervisor.pid, *sorted({int(e["pid"]) for e in endpoints})]


def test_a_stall_of_every_process_longer_than_the_lease_fails_no_learner(tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "diloco", "--insecure", "local", "--learners", "2", "--shards", "2",
                            "--steps", "600", "--out", str(out), *TINY],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        poll(lambda: sum(1 for p in (out / "learners").glob("*.events.jsonl")
                         if '"computing"' in p.read_text()) == 2, "both learners to train", 180, [("run", run)])
        poll(lambda: sum(1 for e in json.loads((out / "endpoints.json").read_text()) if e["role"] == "learner") == 2,
             "endpoints.json to list both learners", 60, [("run", run)])
        pids = run_pids(out, run)
        assert len(pids) >= 6  # supervisor, coordinator, fork server, two shards, two learners
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < STALL_S:  # the stall itself: nothing of the run can run
            time.sleep(STALL_S - (time.monotonic() - stopped))
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            for pid in run_pids(out, run) if (out / "endpoints.json").exists() else []:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learners_failed"] == 0, summary["learners"]
    assert [l["state"] for l in summary["learners"]] == ["left", "left"]
    assert all(l["inner_steps"] == 600 for l in summary["learners"]), summary["learners"]
    log = (out / "logs" / "coordinator.log").read_text()
    stalls = [line for line in log.splitlines() if "the coordinator did not run for" in line]
    assert stalls and float(stalls[0].split("did not run for ")[1].split(" s")[0]) >= STALL_S - 1.5, stalls
