"""The eval-loss plot of a local run (RUN_DIR/eval_loss.png); its timeline is tools/timeline.py."""

from __future__ import annotations

from pathlib import Path


def plot_eval(run_dir: Path, events: dict[str, list[dict]], start: float, final: float, tokens: int, unit: str) -> None:
    """Each learner's evaluations by the tokens it has seen, the seed model's (``start``,
    the supervisor's: learners skip theirs) at 0 and the final global model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    end = 0
    for learner, records in sorted(events.items(), key=lambda kv: int(kv[0].lstrip("L") or 0)):
        evals = [r for r in records if r["kind"] == "eval"]
        if evals:
            ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], marker="o", ms=3, label=learner)
            end = max(end, evals[-1]["tokens"])
    ax.scatter([0], [start], color="gray", marker="s", zorder=3, label="seed model")
    ax.scatter([end], [final], color="black", zorder=3,
               label=f"final global model ({tokens:,} tokens from all learners)")
    ax.set_xlabel("tokens seen by each learner")
    ax.set_ylabel(f"eval loss ({unit})")
    ax.set_title("diloco local: eval loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(run_dir / "eval_loss.png", dpi=120)
    plt.close(fig)

