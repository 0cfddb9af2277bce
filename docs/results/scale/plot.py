"""Draw scale.png from the sweeps beside this file (load-sweep.sh): each panel shows a cost
per unit of work, so a flat line is linear scaling. Run from the repository root:

    python docs/results/scale/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def main() -> None:
    learners, params, shards, memory = (rows(f"{n}.jsonl") for n in ("learners", "params", "shards", "memory"))
    params += rows("params-64Mi.jsonl")
    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))

    def panel(a, xs, ys, title, xlabel, ylabel, log_x=True, labels=None):
        a.plot(xs, ys, "o-")
        for x, y, text in zip(xs, ys, labels or [None] * len(xs)):
            if text:
                a.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if log_x:
            a.set_xscale("log", base=2)
        a.set_ylim(bottom=0)
        a.set(title=title, xlabel=xlabel, ylabel=ylabel)
        a.grid(alpha=0.3)

    n = [r["learners"] for r in learners]
    panel(ax[0, 0], n, [r["cpu_s_per_push"] * 1e3 for r in learners],
          "shard CPU per push, 1 Mi params, 16 pushes/s", "learners", "ms")
    panel(ax[0, 1], n, [r["coordinator_cpu_s_per_s"] / r["learners"] * 1e3 for r in learners],
          "coordinator CPU per heartbeat (1/s per learner)", "learners", "ms")
    panel(ax[0, 2], n, [r["p99_reply_ms"] for r in learners], "push to reply, p99 (p50 dashed)", "learners", "ms")
    ax[0, 2].plot(n, [r["p50_reply_ms"] for r in learners], "o--")
    p = [r["params"] / 2**20 for r in params]
    panel(ax[1, 0], p, [r["cpu_s_per_push"] / r["params"] * 1e9 for r in params],
          "shard CPU per parameter pushed, 8 learners", "parameters (Mi)", "ns")
    s = [r["shards"] for r in shards]
    panel(ax[1, 1], s, [r["cpu_s_per_push"] / (r["params"] / r["shards"]) * 1e9 for r in shards],
          "shard CPU per parameter pushed, 4 Mi model, 16 learners", "shards", "ns", log_x=False)
    panel(ax[1, 2], [r["learners"] for r in learners], [r["rss_now_bytes"] / r["params"] for r in learners],
          "shard RSS at the window's end per parameter (1 Mi; 16 Mi: squares)", "learners", "bytes")
    ax[1, 2].plot([r["learners"] for r in memory], [r["rss_now_bytes"] / r["params"] for r in memory], "s-")
    fig.tight_layout()
    fig.savefig(HERE / "scale.png", dpi=110)


if __name__ == "__main__":
    main()
