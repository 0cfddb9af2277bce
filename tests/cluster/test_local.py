"""`diloco local` end to end, as a user runs it: real processes, a run directory, a summary."""

import collections
import json
import math
import os
import stat
import subprocess
import sys

import pytest

from diloco.tape import read_tape
from tests.cluster.tables import assert_final_table_agrees

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]


def test_local_run_trains_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps", "48",
         "--batch-size", "8", "--out", str(out), "--json", *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # stderr is not a terminal: progress comes as plain lines, then the final table, each on its own line.
    lines = proc.stderr.splitlines()
    progress = [line for line in lines if line.startswith("[") and "] tokens " in line]
    assert progress and " · learners " in progress[0], proc.stderr[-2000:]
    assert "exporting the trained model from the shards" in lines  # a line of its own, not glued to the table
    assert json.loads(proc.stdout)["run_dir"] == str(out)  # with --json, stdout is the summary alone
    # It ends with a few lines for a person: the eval, the model, the run directory.
    assert f"model: {out / 'model.safetensors'}" in lines and lines[-1].startswith(f"run directory: {out} ")
    assert lines[-3].startswith("eval 8.") and " → " in lines[-3]
    summary = json.loads((out / "summary.json").read_text())
    # The final table is the summary's records, and the counts are the learners' own.
    assert_final_table_agrees(proc.stderr, summary)
    assert [l["inner_steps"] for l in summary["learners"]] == [48, 48]
    for key in ("tokens", "wall_s", "eval_loss_start", "eval_loss_final", "goodput", "uptime", "global_stall_s",
                "bytes_up", "bytes_down", "rounds", "mean_participants", "mean_grace_s", "learners_joined",
                "learners_failed"):
        assert key in summary, key
    assert summary["tokens"] == 2 * 48 * 8 * 32
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5
    assert summary["learners_joined"] == 2 and summary["learners_failed"] == 0
    assert 0 < summary["goodput"] <= 1 and summary["rounds"] > 0
    assert (out / "model.safetensors").exists() and (out / "loss.png").exists() and (out / "curves.jsonl").exists()
    # The run's state and secrets are its owner's alone. Readable: what a person reads (logs,
    # plots, the summary), certificates, and the lock (a pid).
    for directory in (out, out / "coordinator", out / "shard0", out / "shard1"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for path in out.rglob("*"):
        public = path.suffix in (".log", ".png", ".crt") or path.name in ("summary.json", "supervisor.lock")
        if path.is_file() and not public:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    endpoints = json.loads((out / "endpoints.json").read_text())
    # Every process of the run: the services, the coordinator's fork server, each learner;
    # and the coordinator's status page, which the run printed.
    assert sorted(e["role"] for e in endpoints) == ["coordinator", "fork-server", "learner", "learner", "shard0", "shard1",
                                                     "status-page"]
    (page,) = [e for e in endpoints if e["role"] == "status-page"]
    assert f"status page: {page['address']}" in lines and page["address"].startswith("http://127.0.0.1:")
    assert page["pid"] == next(e["pid"] for e in endpoints if e["role"] == "coordinator")
    assert sorted(e["id"] for e in endpoints if e["role"] == "learner") == ["L0", "L1"]
    for learner in summary["learners"]:  # logs by learner id, each saying which launch it is
        log = (out / "logs" / f"{learner['id']}.log").read_text()
        assert f"as {learner['id']} (pool default, launch " in log, log[-2000:]
    # Tapes are consistent: versions contiguous per fragment, and every participant of the
    # round that made version v pushed exactly one delta accepted for v (not some earlier one).
    rounds = 0
    for m in range(2):
        records = list(read_tape(out / f"shard{m}" / f"tape-S{m}.jsonl"))
        pushed = collections.Counter((r["learner"], r["fragment"], r["target_version"]) for r in records
                                     if r["kind"] == "push" and r["outcome"].startswith("accepted"))
        versions = {}
        for r in (r for r in records if r["kind"] == "round"):
            assert r["version"] == versions.get(r["fragment"], 0) + 1
            versions[r["fragment"]] = r["version"]
            assert r["participants"] and len(set(r["participants"])) == len(r["participants"]), r
            for p in r["participants"]:
                assert pushed[(p, r["fragment"], r["version"])] == 1, (p, r)
            assert math.isclose(sum(r["weights"]), 1.0, rel_tol=1e-6), r
            rounds += 1
    assert rounds == summary["rounds"] > 0
    # No child process is left running.
    for e in endpoints:
        with pytest.raises(ProcessLookupError):
            os.kill(e["pid"], 0)


def test_a_task_option_the_task_never_reads_stops_the_run_before_anything_starts(tmp_path):
    (tmp_path / "secret").write_text("s")
    commands = {
        "local": ["local", "--task-option", "d_modle=64", "--out", str(tmp_path / "run")],
        "learner": ["--insecure", "learner", "--task-option", "d_modle=64", "--shards", "127.0.0.1:1", "--learner-id", "L0",
                    "--secret-file", str(tmp_path / "secret")],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "diloco", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, argv in commands.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            errors = [line for line in err.splitlines() if line.startswith("diloco: error:")]
            assert proc.returncode == 2 and out == "", (name, err)
            assert len(errors) == 1 and "never reads task option d_modle; it reads batch_size," in errors[0], (name, err)
            assert "Traceback" not in err, (name, err)
    finally:
        for proc in procs.values():
            proc.kill()
    assert not (tmp_path / "run").exists()  # nothing written, nothing started
