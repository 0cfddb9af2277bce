"""No process of a `diloco local` run outlives it: SIGKILL or SIGTERM the supervisor alone
(not its process group) mid-run, and its coordinator, shards and learners all stop;
after SIGTERM the run directory still gets its summary and final model."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.tables import assert_final_table_agrees
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's reaping is left



def learner_pids(out: Path) -> list[int]:
    pids = []
    for path in (out / "learners").glob("*.events.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any(r.get("state") == "computing" for r in records):
            pids += [r["pid"] for r in records if "pid" in r]
    return pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_every_process_stops_with_the_supervisor(tmp_path, sig):
    out = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "diloco", "local", "--insecure", "--learners", "2", "--shards", "2", "--steps", "100000",
         "--batch-size", "4", "--out", str(out), *TINY],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        learners = poll(lambda: len(pids := learner_pids(out)) == 2 and pids, "2 learners computing", 120)
        endpoints = json.loads((out / "endpoints.json").read_text())  # every process, the fork server's too
        services = [e["pid"] for e in endpoints if e["role"] in ("coordinator", "shard0", "shard1")]
        pids = sorted({*(e["pid"] for e in endpoints), *learners})
        assert len(services) == 3 and any(e["role"] == "fork-server" for e in endpoints)
        assert all(alive(p) for p in pids)
        supervisor.send_signal(sig)  # the supervisor alone, as `kill` or `timeout` would
        _, stderr = supervisor.communicate(timeout=120)
        poll(lambda: not any(alive(p) for p in pids), f"every process to stop after {sig.name}", 60)
        if sig == signal.SIGTERM:
            assert supervisor.returncode == 130
            summary = json.loads((out / "summary.json").read_text())
            assert summary["interrupted"] is True and summary["final_versions"]
            # Interrupted runs list their learners too (it was "learners": []).
            assert sorted(l["id"] for l in summary["learners"]) == ["L0", "L1"]
            assert all(l["inner_steps"] > 0 for l in summary["learners"])
            assert_final_table_agrees(stderr, summary)  # after SIGTERM too
            assert (out / "model.safetensors").exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
