"""Interrupt `diloco local` N times at a random moment after both learners train; print
each run's exit code (130: a clean stop). A run that exits otherwise keeps its stderr in
WORKDIR/TAG-I.stderr (faulthandler on: an abort prints every thread's Python stack).

    python docs/results/ctrl-c/stress.py N TAG WORKDIR > TAG.txt

Run two at once on two cores to load the machine as CI does."""
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--batch-size", "8", "--fragments", "4",
        "--sync-every", "8"]
n, tag, work = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
work.mkdir(parents=True, exist_ok=True)
rng = random.Random(tag)
env = dict(os.environ, PYTHONFAULTHANDLER="1")
for i in range(n):
    out = work / f"{tag}-{i}"
    run = subprocess.Popen([sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps",
                            "100000", "--out", str(out), *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=work, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline:
        if sum(1 for p in (out / "learners").glob("*.events.jsonl") if '"computing"' in p.read_text()) == 2:
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.0))
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    print(i, run.returncode, flush=True)
    if run.returncode != 130:
        (work / f"{tag}-{i}.stderr").write_text(err)
    else:
        shutil.rmtree(out, ignore_errors=True)
