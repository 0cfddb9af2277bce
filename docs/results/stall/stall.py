"""Every process of a default `diloco local --steps 450` run stopped with SIGSTOP for 15 s
once its learners train, then continued with SIGCONT (issue #56's reproduction: before the
stall rule, every learner was failed, "lease expired"). Writes OUT/output.txt (what the
run printed), OUT/summary.json and OUT/stall.txt (when, which processes, the coordinator's
stall line).

    python docs/results/stall/stall.py runs/stall docs/results/stall
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

run_dir, keep = Path(sys.argv[1]), Path(sys.argv[2])
STALL_S = 15.0
run = subprocess.Popen([sys.executable, "-m", "diloco", "local", "--steps", "450", "--out", str(run_dir)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    endpoints = run_dir / "endpoints.json"
    learners = [e for e in json.loads(endpoints.read_text()) if e["role"] == "learner"] if endpoints.exists() else []
    events = list((run_dir / "learners").glob("*.events.jsonl"))
    if len(learners) == 3 and sum('"computing"' in p.read_text() for p in events) == 3:
        break
    time.sleep(0.2)
time.sleep(3.0)  # a few seconds into training
pids = [run.pid, *sorted({int(e["pid"]) for e in json.loads((run_dir / "endpoints.json").read_text())})]
started = time.time()
for pid in pids:
    os.kill(pid, signal.SIGSTOP)
time.sleep(STALL_S)
for pid in pids:
    os.kill(pid, signal.SIGCONT)
output, _ = run.communicate(timeout=600)
keep.mkdir(parents=True, exist_ok=True)
(keep / "output.txt").write_text(f"$ diloco local --steps 450 --out {run_dir}\n{output}\nexit code {run.returncode}\n")
shutil.copy(run_dir / "summary.json", keep / "summary.json")
log = (run_dir / "logs" / "coordinator.log").read_text().splitlines()
stalls = [line for line in log if "did not run for" in line]
(keep / "stall.txt").write_text(
    f"SIGSTOP at {started:.3f} (unix) to {len(pids)} processes (supervisor, then endpoints.json's {len(pids) - 1}) "
    f"for {STALL_S:g} s, then SIGCONT\n" + "\n".join(stalls) + "\n")
summary = json.loads((keep / "summary.json").read_text())
print(f"exit {run.returncode}; learners failed {summary['learners_failed']}; "
      f"{[(l['id'], l['state'], l['inner_steps']) for l in summary['learners']]}; {stalls}")
