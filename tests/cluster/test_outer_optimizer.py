"""A run with the delayed Nesterov outer optimizer (``--outer-optimizer delayed-nesterov``):
it trains, every round's momentum step is on the tape, the momentum is applied once per
period of the live learners' pushes, and the run replays bit for bit."""

import json
import subprocess
import sys

from diloco.tape import read_tape
from tests.cluster.test_snapshot_restore import TINY


def test_a_delayed_nesterov_run_trains_records_its_momentum_steps_and_replays_exactly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "--insecure", "local", "--learners", "2", "--shards", "1", "--steps", "200",
         "--batch-size", "8", "--outer-optimizer", "delayed-nesterov", "--outer-lr", "0.5", "--outer-momentum", "0.5",
         "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 1.0
    rounds = [r for r in read_tape(out / "shard0" / "tape-S0.jsonl") if r["kind"] == "round" and r["fragment"] == 0]
    assert len(rounds) > 10
    for r in rounds:
        decay, look, share = r["outer"]
        # A round either completes its period (the momentum step, share back to 0) or adds
        # its participation to it; only a period's first round decays the buffer.
        assert look in (0.0, 0.5) and (look == 0.5) == (share == 0.0), r
        assert decay in (0.5, 1.0)
    steps = [r for r in rounds if r["outer"][1] == 0.5]
    assert 0 < len(steps) < len(rounds)
    replay = subprocess.run([sys.executable, "-m", "diloco", "replay", str(out), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr
