"""Each stall run's overshoot from its run directory: python table.py RUN_DIR..."""
import json
import pathlib
import sys

for d in map(pathlib.Path, sys.argv[1:]):
    tokens = json.loads((d / "summary.json").read_text())["tokens"]
    drain = json.loads((d / "drain.json").read_text()) if (d / "drain.json").exists() else {}
    ages = [v.get("count_age_s", v.get("heartbeat_age_s")) for v in drain.get("learners", {}).values()]
    print(f"{d.parent.name:7} {d.name:4} tokens {tokens:>9,} over {tokens - 768_000:>8,}  count ages at the drain {ages}"
          f"  moved {len(drain.get('moved', drain.get('lowered', [])))}")
