"""The loss plot of a local run (RUN_DIR/loss.png), drawn from its curves
(``diloco.cli.local.curves``); its timeline is diloco/cli/timeline.py."""

from __future__ import annotations

from pathlib import Path

LOSS_PLOT = "loss.png"
NAMED_LEARNERS = 8
"""Up to this many learners the legend names each one; beyond, one entry stands for all."""


def plot_loss(run_dir: Path, records: list[dict], unit: str) -> Path:
    """Each learner's training loss (a line) and evaluations (dots in its colour), the
    global model's evaluations (black: the seed at 0, the curve points, each part's final
    model) and where the run was resumed, against the whole run's tokens, log-scale loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, LogFormatter

    learners = sorted({r["learner"] for r in records if "learner" in r}, key=lambda i: (len(i), i))
    palette = plt.get_cmap("tab10" if len(learners) <= 10 else "viridis")
    named = len(learners) <= NAMED_LEARNERS
    fig, ax = plt.subplots(figsize=(9, 5))
    for n, learner in enumerate(learners):
        color = palette(n if len(learners) <= 10 else n / (len(learners) - 1))
        train = [r for r in records if r["series"] == "train" and r["learner"] == learner]
        evals = [r for r in records if r["series"] == "eval" and r["learner"] == learner]
        ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], color=color, lw=1.2 if named else 0.7,
                alpha=0.85 if named else 0.6, label=f"{learner} training loss" if named else None)
        ax.plot([r["tokens"] for r in evals], [r["loss"] for r in evals], color=color, ls="none", marker="o", ms=3,
                label=f"{learner} eval" if named else None)
    if learners and not named:
        ax.plot([], [], color="gray", lw=0.7, marker="o", ms=3,
                label=f"{len(learners)} learners: training loss (lines), eval (dots)")
    evals = sorted((r for r in records if r["series"] == "global_eval"), key=lambda r: (r["tokens"], r["t"]))
    ax.plot([r["tokens"] for r in evals], [r["loss"] for r in evals], color="black", lw=2, marker="s", ms=5, zorder=5,
            label="global model eval (seed, curve points, final)")
    for n, resume in enumerate(r for r in records if r["series"] == "resume"):
        ax.axvline(resume["tokens"], color="gray", ls="--", lw=1, label="resumed" if n == 0 else None)
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 4, 5, 6 rather than 4 x 10^0
        axis(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
    ax.xaxis.set_major_formatter(EngFormatter())  # 200 k, 1.5 M
    ax.set_xlabel("tokens trained by the whole run (all learners)")
    ax.set_ylabel(f"loss ({unit}, log scale)")
    ax.set_title("diloco local: training and eval loss against the run's tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", ncol=2 if named and len(learners) > 2 else 1, loc="upper right")
    fig.tight_layout()
    path = run_dir / LOSS_PLOT
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
