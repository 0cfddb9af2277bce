"""What a local run shows while it runs and when it ends: a live table on a terminal, one
line every 10 s in a log, and the final table drawn from summary.json's records."""

from __future__ import annotations

import time
from pathlib import Path

REASON_CHARS = 160
"""A failure's reason is cut to this in tables and live lines (summary.json keeps it whole)."""


def shown_state(learner: dict) -> str:
    """A learner's state as tables show it: a failure with its reason."""
    if learner["state"] == "failed" and learner.get("reason"):
        return f"failed: {_cut(learner['reason'])}"
    return learner["state"]


def _cut(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def failure_reason(member: dict, run_dir: Path, cut: bool = False) -> str:
    """A failed learner's reason as the run reports it: the learner's own (what it raised,
    at which inner step, and what that said; or the coordinator's, for one that went
    silent), then, for a learner the run launched, where its log is."""
    reason = member.get("reason") or "no reason given"
    reason = _cut(reason) if cut else reason
    return f"{reason} (log: {run_dir / 'logs' / (member['id'] + '.log')})" if member.get("launch_id") else reason


class Failures:
    """Learners and launches that failed, each reported once, as they happen."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: set[str] = set()

    def new(self, members: list[dict], launches: list[dict]) -> list[str]:
        lines = []
        for m in members:
            if m["state"] == "failed" and m["id"] not in self.seen:
                self.seen.add(m["id"])
                lines.append(f"learner {m['id']} failed: {failure_reason(m, self.run_dir, cut=True)}")
        for x in launches:
            if x["state"] == "failed" and x["launch_id"] not in self.seen:
                self.seen.add(x["launch_id"])
                lines.append(f"launch {x['launch_id']} failed: {_cut(x['detail'])}")
        return lines


def closing_lines(summary: dict, run_dir: Path) -> list[str]:
    """What a run says last, for a person: how the eval moved, where the model and the
    run directory are, and what failed."""
    unit, missing = summary["eval_unit"], summary.get("missing", {})

    def loss(key: str) -> str:
        return f"{summary[key]:.3f}" if summary[key] is not None else f"– ({missing.get(key, 'not measured')})"

    model = run_dir / "model.safetensors"
    lines = [f"eval {loss('eval_loss_start')} → {loss('eval_loss_final')} {unit} · {summary['tokens']:,} tokens in "
             f"{summary['wall_s']:.0f} s · goodput {_number(summary['goodput'], 2)}",
             f"model: {model}" if model.exists() else "model: none exported",
             *([f"hugging face checkpoint: {run_dir / 'hf'} (from_pretrained loads it, tokenizer included)"]
               if (run_dir / "hf").is_dir() else []),
             f"run directory: {run_dir} (summary.json, loss.png, curves.jsonl, logs/; diloco local --json prints the "
             "summary)"]
    if links := summary.get("links"):
        rates = sorted({s["mbit"] for s in links["sites"]})
        lines.append(f"links: {len(links['sites'])} sites at {'/'.join(f'{r:g}' for r in rates)} Mbit/s · the kernel "
                     f"counted {links['kernel_up'] / 1e6:.2f} MB up, {links['kernel_down'] / 1e6:.2f} MB down, the "
                     f"learners' payloads {links['payload_up'] / 1e6:.2f} MB up, {links['payload_down'] / 1e6:.2f} MB "
                     f"down (overhead {_percent(links['overhead_up'])} up, {_percent(links['overhead_down'])} down)"
                     + (f" · not counted (no summary): {', '.join(links['not_counted'])}" if links["not_counted"] else ""))
    if summary["interrupted"] and summary.get("snapshot_at_stop") is not None:
        lines.append(f"resume: diloco local --resume {run_dir}")
    lines += [f"FAILED: {line}" for line in summary.get("failures", [])]
    return lines


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def progress_line(members: list[dict], statuses: list, events: dict[str, list[dict]], started: float, unit: str) -> str:
    """The progress table's essentials on one line (for logs, where a live table is not drawn)."""
    ok = [s for s in statuses if not isinstance(s, BaseException)]
    versions = [f.version for s in ok for f in s.fragments]
    evals = [e["loss"] for m in members for e in events.get(m["id"], [])[-20:] if e["kind"] == "eval"]
    states = {}
    for m in members:
        states[m["state"]] = states.get(m["state"], 0) + 1
    return (f"[{time.monotonic() - started:5.0f} s] tokens {sum(m.get('tokens', 0) for m in members):,} · learners "
            + (", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none joined yet")
            + f" · outer versions {min(versions, default=0)}–{max(versions, default=0)} · rounds "
            f"{sum(s.rounds_closed for s in ok)} · latest eval {f'{evals[-1]:.3f} {unit}' if evals else '–'}"
            + (f" · {len(ok)}/{len(statuses)} shards up" if len(ok) < len(statuses) else ""))


def progress_table(members: list[dict], statuses: list, events: dict[str, list[dict]], goodput: float | None,
                    started: float, unit: str):
    from rich.table import Table

    table = Table(title=f"diloco local — {time.monotonic() - started:5.0f} s", title_justify="left")
    for column in ("learner", "state", "pool", "tokens", "tokens/s", "inner steps", f"eval {unit}"):
        table.add_column(column, justify="left" if column in ("learner", "state", "pool") else "right",
                         min_width=len("interrupted") if column == "state" else None)
    for m in members:
        evals = [e["loss"] for e in events.get(m["id"], []) if e["kind"] == "eval"]
        table.add_row(m["id"], shown_state(m), m.get("pool", ""), f"{m.get('tokens', 0):,}",
                      f"{m.get('tokens_per_s', 0):,.0f}", f"{m.get('inner_steps', 0):,}",
                      f"{evals[-1]:.3f}" if evals else "")
    ok = [s for s in statuses if not isinstance(s, BaseException)]
    versions = [f.version for s in ok for f in s.fragments]
    table.caption = (
        f"global tokens {sum(m.get('tokens', 0) for m in members):,} · outer versions "
        f"{min(versions, default=0)}–{max(versions, default=0)} · rounds {sum(s.rounds_closed for s in ok)} · "
        f"step goodput {'–' if goodput is None else f'{goodput:.2f}'} · "
        f"pushes {sum(s.pushes_received for s in ok)} · wire ↑{sum(s.bytes_received for s in ok) / 1e6:.1f} MB "
        f"↓{sum(s.bytes_sent for s in ok) / 1e6:.1f} MB"
        + (f" · {len(ok)}/{len(statuses)} shards up" if len(ok) < len(statuses) else "")
        + "".join(f" · shard {s.shard_id}: {s.model_state}" for s in ok if not s.model_state.startswith("serving"))
    )
    return table


def final_table(summary: dict, events: dict[str, list[dict]]):
    """The run's last table, drawn from its summary (what summary.json says, row for row)."""
    from rich.table import Table

    unit = summary["eval_unit"]
    state = "interrupted" if summary["interrupted"] else "finished"
    failed = len(summary.get("failures", []))
    table = Table(title=f"diloco local — {state} after {summary['wall_s']:.0f} s"
                  + (f" · {failed} failure{'s' * (failed > 1)} (below)" if failed else ""), title_justify="left")
    for column in ("learner", "state", "pool", "tokens", "tokens/s", "inner steps", f"eval {unit}"):
        table.add_column(column, justify="left" if column in ("learner", "state", "pool") else "right",
                         min_width=len("interrupted") if column == "state" else None)
    for learner in summary["learners"]:
        evals = [e["loss"] for e in events.get(learner["id"], []) if e["kind"] == "eval"]
        table.add_row(learner["id"], shown_state(learner), learner["pool"], f"{learner['tokens']:,}",
                      f"{learner['tokens_per_s']:,.0f}", f"{learner['inner_steps']:,}", f"{evals[-1]:.3f}" if evals else "")
    versions = summary["final_versions"].values()
    table.caption = (
        f"global tokens {summary['tokens']:,} · outer versions {min(versions, default=0)}–{max(versions, default=0)} · "
        f"rounds {summary['rounds']} · step goodput {_number(summary['step_goodput'], 2)} · eval "
        f"{_number(summary['eval_loss_start'], 3)} → {_number(summary['eval_loss_final'], 3)} {unit} · wire ↑{summary['bytes_up'] / 1e6:.1f} MB ↓{summary['bytes_down'] / 1e6:.1f} MB"
    )
    return table



def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"
