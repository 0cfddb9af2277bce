"""The hostile CI test's honest and attacked runs (tiny model, 3 honest learners x 150
steps, seed 0), repeated to see their spread: ``python rep.py N ATTACKS SEED OUT [extra
diloco local flags]``, run from the repository root with PYTHONPATH=. (README.md here)."""
import json
import sys
from pathlib import Path

from diloco.lab.bench.hostile import one_run

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8",
        "--batch-size", "8"]
n, attacks, seed, base, extra = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
for k in range(n):
    for attack in attacks:
        out = Path(f"{base}/{k}")
        out.mkdir(parents=True, exist_ok=True)
        r = one_run(out, seed, attack, 3, 150, 0.1, TINY + extra)
        r.pop("attacker")
        print(json.dumps({"rep": k, **r}), flush=True)
