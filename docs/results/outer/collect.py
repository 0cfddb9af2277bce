"""Collect the one-run experiments of docs/results/outer/ (runs/<name>/: command.txt, the
diloco local summary.json and output.txt) into experiments.md: final eval, bytes per 1k
tokens and the global model's eval at each eighth of the budget, against DP on the same
budget: long 2.267 bits/byte (3 runs, docs/results/long/), longer 1.852 (the mean of its two
runs, docs/results/long/longer/ and longer-dp-s1/).

    python docs/results/outer/collect.py
"""

import json
from pathlib import Path

DP = {3932160: 2.267, 7864320: 1.852}
here = Path(__file__).parent
rows = ["| run | command | eval (bits/byte) | vs DP | B/1k tokens | eval at 1/8 … 8/8 of the budget |",
        "|---|---|---:|---:|---:|---|"]
for run in sorted((here / "runs").iterdir()):
    s = json.loads((run / "summary.json").read_text())
    command = (run / "command.txt").read_text().strip()
    final = s["eval_loss_final"]
    dp = DP[7864320 if "--tokens 7864320" in command else 3932160]
    points = " ".join(f"{e:.3f}" for _, e in s["curve"][1:])
    total = 1000 * (s["bytes_up"] + s["bytes_down"]) / s["tokens"]
    rows.append(f"| {run.name} | `{command}` | {final:.3f} | {100 * (final / dp - 1):+.1f} % | {total:,.0f} | {points} |")
(here / "experiments.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
