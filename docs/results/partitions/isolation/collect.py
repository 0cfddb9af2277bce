"""The isolation soaks' table: for each run directory given, the faults, the learners
failed and replaced, tokens against the budget (3 learners x 6,000 steps x 256 tokens),
wall time and eval, from its chaos.jsonl, summary.json, check.json and coordinator log.

    python docs/results/partitions/isolation/collect.py RUN_DIR...   # collect.txt"""
import collections
import json
import sys
from pathlib import Path

BUDGET = 3 * 6000 * 8 * 32

print("| run | faults | learners joined | failed: lease expired · process ended | left cleanly, Leave unheard | replaced (cause) | holds (unheard · heard) | tokens (budget 4,608,000) | wall | eval | check |")
print("|---|---:|---:|---|---:|---|---|---:|---:|---:|---|")
for arg in sys.argv[1:]:
    run = Path(arg)
    chaos = [json.loads(line) for line in (run / "chaos.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    log_file = run / "logs" / "coordinator.log"  # a run directory; its copy here keeps the log beside
    log = (log_file if log_file.exists() else run / "coordinator.log").read_text()
    reasons = collections.Counter(
        "lease" if "lease expired" in l["reason"] else "ended" if "process ended:" in l["reason"] else "other"
        for l in summary["learners"] if l["state"] == "failed")
    replaced = collections.Counter(c.get("cause", "") for c in chaos if c["kind"] == "replace")
    faults = sum(c["kind"] == "fault" for c in chaos)
    cleanly = sum(1 for l in summary["learners"] if l["state"] == "left" and "ended cleanly" in l.get("reason", ""))
    check = json.loads((run / "check.json").read_text())
    print(f"| {run.name} | {faults} | {summary['learners_joined']} | {reasons['lease']} · {reasons['ended']}"
          f"{' · other ' + str(reasons['other']) if reasons['other'] else ''} | {cleanly} | "
          f"{', '.join(f'{n} ({c})' for c, n in replaced.items()) or '0'} | "
          f"{log.count('no learner heard for')} · {log.count('was heard again after')} | "
          f"{summary['tokens']:,} ({summary['tokens'] / BUDGET:.2f}x) | {summary['wall_s']:.0f} s | "
          f"{summary['eval_loss_start']:.3f} → {summary['eval_loss_final']:.3f} | "
          f"{'ok' if check['ok'] else 'VIOLATION'} |")
