"""Ctrl-C on the default `diloco local`: SIGINT 25 s after the start, then the time from the
signal to the supervisor's exit, the learners' states and exit codes, from the run directory.
Run from the repository root: python docs/results/stop/measure.py RUNS_DIR [N]"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

root, runs = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
for i in range(runs):
    out = root / f"run{i}"
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "local", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(25)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    took = time.monotonic() - sent
    summary = json.loads((out / "summary.json").read_text())
    log = (out / "logs" / "coordinator.log").read_text()
    stopped = re.search(r"stopped ([\d.]+) s after the interrupt", stderr)
    print(json.dumps({"run": i, "exit_code": proc.returncode, "signal_to_exit_s": round(took, 2),
                      "signal_to_processes_stopped_s": float(stopped.group(1)) if stopped else None,
                      "learners": [(l["id"], l["state"], l["inner_steps"]) for l in summary["learners"]],
                      "learner_exits": re.findall(r"ended: (exit code \d+|killed by \w+)", log),
                      "snapshot_at_stop": summary["snapshot_at_stop"], "sigkill_in_logs": "SIGKILL" in log}),
          flush=True)
