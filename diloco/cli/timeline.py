"""The learners' busy/idle timeline of a ``diloco local`` run, drawn from its tapes: one
lane per learner coloured by state (starting, bootstrapping, computing, waiting,
draining, dead), the shards' round closes as ticks, chaos actions as dashed lines and
network faults as hatched boxes over their victims' lanes.

Sources: each learner's event tape (``learners/<id>.events.jsonl``: its state changes),
the shards' tapes (round closes; the coordinator's failure notices as membership
events) and ``chaos.jsonl`` (kills, scavenges, shard restarts). A learner whose tape
ends without ``left`` is dead from its kill (or, without one, its failure notice or
its last record) to the end of the run.
"""

from __future__ import annotations

import json
from pathlib import Path

from diloco.errors import NotFound
from diloco.tape import read_tape
from diloco.cli.chaos import fault_spans

COLORS = {
    "starting": "#f2c14e",
    "bootstrapping": "#f78154",
    "computing": "#4d9078",
    "waiting": "#b4b4b4",
    "draining": "#5fa8d3",
    "dead": "#c0392b",
}
FAULT_COLOR = "#c0392b"
"""Network faults (chaos on emulated sites), hatched over their victims' lanes."""


def learner_intervals(events: list[dict], end: float, death: float | None) -> list[tuple[float, float, str]]:
    """(start, stop, state) spans of one learner from its event tape."""
    states = [(e["t"], e["state"]) for e in events if e["kind"] == "state"]
    spans = []
    for (t0, state), (t1, _) in zip(states, states[1:]):
        if state != "left":
            spans.append((t0, t1, state))
    if states and states[-1][1] != "left":
        last_t, last_state = states[-1]
        died = max(death if death is not None else last_t, last_t)
        spans.append((last_t, min(died, end), last_state))
        spans.append((died, end, "dead"))
    return [s for s in spans if s[1] > s[0]]


def draw_timeline(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run_dir = Path(run_dir)
    paths = sorted((run_dir / "learners").glob("*.events.jsonl"))
    if not paths:
        raise NotFound(f"no learner event tapes under {run_dir / 'learners'}: is it a diloco local run directory?")
    events = {p.name.removesuffix(".events.jsonl"): list(read_tape(p)) for p in paths}
    chaos_path = run_dir / "chaos.jsonl"
    chaos = [json.loads(line) for line in chaos_path.read_text().splitlines() if line.strip()] if chaos_path.exists() else []
    rounds: dict[str, list[float]] = {}
    failed: dict[str, float] = {}
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        shard = tape.stem.removeprefix("tape-")
        for r in read_tape(tape):
            if r["kind"] == "round":
                rounds.setdefault(shard, []).append(r["t"])
            elif r["kind"] == "membership" and r.get("event") == "failed":
                failed.setdefault(r["learner"], r["t"])
    every_t = [e["t"] for es in events.values() for e in es] + [t for ts in rounds.values() for t in ts]
    t0, end = min(every_t), max(every_t)
    killed = {c["learner"]: c["t"] for c in chaos if c["kind"] == "kill"}

    order = sorted(events, key=lambda i: (int(i.lstrip("L")) if i.lstrip("L").isdigit() else 1 << 30, i))
    lanes = [*rounds, *order]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * len(lanes)))
    seen = set()
    for y, learner in enumerate(order, start=len(rounds)):
        first = next((e for e in events[learner] if e["kind"] == "state"), {})
        for a, b, state in learner_intervals(events[learner], end, killed.get(learner, failed.get(learner))):
            ax.broken_barh([(a - t0, b - a)], (y - 0.35, 0.7), color=COLORS.get(state, "#777777"))
            seen.add(state)
        label = learner + (f" ({first['slow_factor']:g}x slower)" if first.get("slow_factor", 1) > 1 else "")
        lanes[y] = label
    lane_of = {learner: y for y, learner in enumerate(order, start=len(rounds))}
    for fault, learner, start, healed in fault_spans(chaos, end):  # a hatched box over each victim's lane
        if learner in lane_of:
            y = lane_of[learner]
            ax.broken_barh([(start - t0, healed - start)], (y - 0.45, 0.9), facecolor="none",
                           edgecolor=FAULT_COLOR, hatch="///", linewidth=0.8)
            ax.text(start - t0, y - 0.47, fault["fault"], fontsize=6, color=FAULT_COLOR, va="bottom")
            seen.add("network fault")
    for y, (shard, times) in enumerate(rounds.items()):
        ax.vlines([t - t0 for t in times], y - 0.35, y + 0.35, color="#333333", linewidth=0.6)
        lanes[y] = f"{shard} round closes"
    marks = [c for c in chaos if c["kind"] in ("kill", "scavenge", "restart_shard")]
    for c in marks:
        ax.axvline(c["t"] - t0, color="#888888", linestyle="--", linewidth=0.8)
        text = {"kill": f"kill {c.get('learner', '')}", "scavenge": f"+{c.get('count', '')} scavenged",
                "restart_shard": f"restart S{c.get('shard', '')}"}[c["kind"]]
        ax.text(c["t"] - t0, 1.01, text, rotation=90, fontsize=7, va="bottom", ha="center",
                transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, end - t0)
    ax.set_xlabel("seconds since the first learner started")
    ax.set_title("diloco local: learners' states and the shards' round closes", pad=60 if marks else 6)
    handles = [Patch(color=COLORS[s], label=s) for s in COLORS if s in seen]
    if "network fault" in seen:
        handles.append(Patch(facecolor="none", edgecolor=FAULT_COLOR, hatch="///", label="network fault"))
    ax.legend(handles=handles,
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.0 / (2 + len(lanes))), ncol=6, fontsize="small", frameon=False)
    fig.tight_layout()
    out = out or run_dir / "timeline.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
