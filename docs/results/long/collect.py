"""Collect the single-run experiments of docs/results/long/ (one diloco local or compare run
each, on the long workload's budget) into experiments.md: final eval, bytes, the eval curve.
Usage: python docs/results/long/collect.py RUNS_DIR NAME... (DP runs first: "vs DP" is
against the first of them; writes experiments.md beside this file)."""

import json
import sys
from pathlib import Path

here = Path(__file__).parent
runs = Path(sys.argv[1])
rows = ["| run | command | eval (bits/byte) | vs DP | up B/1k tok | down B/1k tok | eval at 1/8 … 8/8 of the budget |",
        "|---|---|---:|---:|---:|---:|---|"]
dp = None
for name in sys.argv[2:]:
    run = runs / name
    if not (run / "results.json").exists():  # diloco local
        s = json.loads((run / "summary.json").read_text())
        up, down = 1000 * s["bytes_up"] / s["tokens"], 1000 * s["bytes_down"] / s["tokens"]
    else:  # a compare of one baseline
        r = json.loads((run / "results.json").read_text())["results"][0]["systems"]
        system, cell = next(iter(r.items()))
        s = cell["seeds"][0]
        up = down = s["bytes_per_1k_tokens"] / 2
        if system == "dp" and dp is None:
            dp = s["eval_loss_final"]
    curve, final = s["curve"], s["eval_loss_final"]
    command = (run / "command.txt").read_text().strip() if (run / "command.txt").exists() else ""
    vs = f"{100 * (final / dp - 1):+.1f} %" if dp else "–"
    points = " ".join(f"{e:.3f}" for _, e in curve[1:])
    rows.append(f"| {name} | `{command}` | {final:.3f} | {vs} | {up:,.0f} | {down:,.0f} | {points} |")
(here / "experiments.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
