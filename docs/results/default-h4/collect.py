"""The tables of README.md from runs/*/summary.json and DP's three runs of the same workload
(../long/compare/results.json): python docs/results/default-h4/collect.py."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
DP = [s for s in json.loads((HERE.parent / "long/compare/results.json").read_text())["results"][0]["systems"]["dp"]["seeds"]]
DP_BYTES = DP[0]["bytes_per_1k_tokens"]


def load(name):
    s = json.loads((HERE / "runs" / name / "summary.json").read_text())
    return s["eval_loss_final"], (s["bytes_up"] + s["bytes_down"]) / s["tokens"] * 1000, [p[1] for p in s["curve"]][1:]


def row(label, names):
    runs = [load(n) for n in names]
    evals = [r[0] for r in runs]
    mean, dp = statistics.mean(evals), statistics.mean(s["eval_loss_final"] for s in DP)
    spread = f" ± {statistics.stdev(evals):.3f}" if len(evals) > 1 else ""
    nbytes = statistics.mean(r[1] for r in runs)
    return (f"| {label} | {mean:.3f}{spread} | {', '.join(f'{e:.3f}' for e in evals)} | {100 * (mean / dp - 1):+.1f} % "
            f"| {nbytes:,.0f} | {DP_BYTES / nbytes:.1f}x |")


def gaps(names):
    """The mean curve against DP's mean curve at each eighth of the budget."""
    curves = [load(n)[2] for n in names]
    dp = [[p[1] for p in s["curve"]][1:] for s in DP]
    mean = [statistics.mean(c[k] for c in curves) for k in range(8)]
    dp_mean = [statistics.mean(c[k] for c in dp) for k in range(8)]
    return " ".join(f"{100 * (m / d - 1):+.1f}" for m, d in zip(mean, dp_mean))


print("| Decoupled (long workload) | eval | per seed | vs DP | B / 1k tokens | fewer than DP |")
print("|---|---:|---|---:|---:|---:|")
dp_evals = [s["eval_loss_final"] for s in DP]
print(f"| DP (`../long/`) | {statistics.mean(dp_evals):.3f} ± {statistics.stdev(dp_evals):.3f} | "
      f"{', '.join(f'{e:.3f}' for e in dp_evals)} | | {DP_BYTES:,.0f} | |")
print(row("int4, H = 8, AdamW (the defaults until now)", ["base-h8-s0"]))
print(row("sparse 1/8, 2-bit replies, H = 4, AdamW", ["sp8h4-s0", "sp8h4-s1", "sp8h4-s2"]))
print(row("**sparse 1/8, 2-bit replies, H = 4, adamw-pooled (the new defaults)**", ["sp8h4p-s0", "sp8h4p-s1", "sp8h4p-s2"]))
print(row("sparse 1/16, 2-bit replies, H = 2, AdamW", ["sp16h2-s0"]))
print()
print("gap to DP's mean curve at each eighth (%):")
print("- new defaults:", gaps(["sp8h4p-s0", "sp8h4p-s1", "sp8h4p-s2"]))
print("- sparse, H = 4, AdamW:", gaps(["sp8h4-s0", "sp8h4-s1", "sp8h4-s2"]))
