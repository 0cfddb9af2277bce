"""The tables of README.md from the compares copied here (long/, longer/, size-2m/, size-7m/:
each `diloco compare`'s results.json) and the DP cells of the larger models
(../outer/size/): python docs/results/quality-final/collect.py."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def systems(name: str) -> dict:
    return json.loads((HERE / name / "results.json").read_text())["results"][0]["systems"]


def curve(seed: dict) -> list[float]:
    return [p[1] for p in seed["curve"]][1:]


def mean_curve(cell: dict) -> list[float]:
    curves = [curve(s) for s in cell["seeds"]]
    return [statistics.mean(c[k] for c in curves) for k in range(len(curves[0]))]


def gaps(cell: dict, dp: dict) -> list[float]:
    return [100 * (a / b - 1) for a, b in zip(mean_curve(cell), mean_curve(dp))]


def evals(cell: dict) -> str:
    values = [s["eval_loss_final"] for s in cell["seeds"]]
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread} | {', '.join(f'{v:.3f}' for v in values)}"


print("| workload | system | eval (bits/byte) | per seed | vs DP | B / 1k tokens | fewer than DP | gap at 1/4 | gap at the end |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|")
for workload in ("long", "longer"):
    cells = systems(workload)
    dp = cells["dp"]
    for system in ("decoupled", "dp"):
        cell = cells[system]
        g = gaps(cell, dp)
        vs = f"{100 * (statistics.mean(s['eval_loss_final'] for s in cell['seeds']) / statistics.mean(s['eval_loss_final'] for s in dp['seeds']) - 1):+.1f} %"
        print(f"| {workload} | {system} | {evals(cell)} | {vs if system != 'dp' else ''} | "
              f"{cell['bytes_per_1k_tokens']:,.0f} | {dp['bytes_per_1k_tokens'] / cell['bytes_per_1k_tokens']:.1f}x | "
              f"{g[1]:+.1f} % | {g[-1]:+.1f} % |" if system != "dp" else
              f"| {workload} | dp | {evals(cell)} | | {cell['bytes_per_1k_tokens']:,.0f} | | | |")
    print(f"\n{workload}: Decoupled's gap to DP's mean curve at each eighth (%): "
          + " ".join(f"{x:+.1f}" for x in gaps(cells['decoupled'], dp)) + "\n")

print("| parameters | Decoupled | DP (../outer/size/ for 1.7M and 7.3M) | gap | gap at each eighth (%) |")
print("|---|---:|---:|---:|---|")
rows = [("0.5M", systems("long")["decoupled"], systems("long")["dp"])]
for label, name in (("1.7M", "size-2m"), ("7.3M", "size-7m")):
    if (HERE / name / "results.json").exists():
        dp = json.loads((HERE.parent / "outer/size" / name / "results.json").read_text())["results"][0]["systems"]["dp"]
        rows.append((label, systems(name)["decoupled"], dp))
for label, dec, dp in rows:
    d, p = (statistics.mean(s["eval_loss_final"] for s in c["seeds"]) for c in (dec, dp))
    print(f"| {label} | {d:.3f} | {p:.3f} | {100 * (d / p - 1):+.1f} % | {' '.join(f'{x:+.1f}' for x in gaps(dec, dp))} |")

print()
print("Standard workload (Decoupled here, 3 seeds; DP's and torchft's cells: ../std-long-fix/):")
print()
print("| scenario | Decoupled eval | per seed | DP | torchft | vs DP | goodput | uptime | B / 1k tokens |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
if (HERE / "standard" / "results.json").exists():
    ours = {r["scenario"]: r["systems"]["decoupled"] for r in json.loads((HERE / "standard/results.json").read_text())["results"]}
    theirs = {r["scenario"]: r["systems"] for r in json.loads((HERE.parent / "std-long-fix/results.json").read_text())["results"]}
    for scenario, cell in ours.items():
        dp, tf = theirs[scenario]["dp"]["eval_loss_final"], theirs[scenario]["torchft"]["eval_loss_final"]
        goodputs = ", ".join(f"{s['goodput']:.3f}" for s in cell["seeds"])
        print(f"| {scenario} | {evals(cell)} | {dp:.3f} | {tf:.3f} | {100 * (cell['eval_loss_final'] / dp - 1):+.1f} % | "
              f"{cell['goodput']:.3f} ({goodputs}) | {cell['uptime']:.3f} | {cell['bytes_per_1k_tokens']:,.0f} |")
