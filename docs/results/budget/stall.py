"""One run of tests/cluster/test_local_chaos.py's command with its coordinator SIGSTOPped for
STALL_S seconds at T s after launch; prints the run's overshoot of its 768,000-token budget.

    python stall.py OUT_DIR T [STALL_S]    (run from the repository root whose code is measured)
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

BUDGET = 768_000
out, at_s = pathlib.Path(sys.argv[1]), float(sys.argv[2])
stall_s = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
cmd = [sys.executable, "-m", "diloco", "local", "--learners", "3", "--shards", "2", "--tokens", str(BUDGET),
       "--batch-size", "8", "--kill-learner-every", "20", "--max-kills", "1", "--chaos-seed", "1", "--scavenge", "1@1",
       "--out", str(out), "--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4",
       "--sync-every", "8"]
started = time.time()
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{out}.err", "w"))
time.sleep(max(started + at_s - time.time(), 0))
pid = next(e["pid"] for e in json.loads((out / "endpoints.json").read_text()) if e["role"] == "coordinator")
os.kill(pid, signal.SIGSTOP)
time.sleep(stall_s)
os.kill(pid, signal.SIGCONT)
proc.wait()
tokens = json.loads((out / "summary.json").read_text())["tokens"]
drain = json.loads((out / "drain.json").read_text()) if (out / "drain.json").exists() else {}
ages = [v.get("count_age_s", v.get("heartbeat_age_s")) for v in drain.get("learners", {}).values()]
print(f"T={at_s} stall={stall_s} exit={proc.returncode} tokens={tokens} over={tokens - BUDGET} "
      f"drain_at={drain.get('unix_s', started) - started:.1f}s count_ages={ages} moved={len(drain.get('moved', drain.get('lowered', [])))}",
      flush=True)
