"""Output formats of the simulator: JSON, rich and markdown tables, the PNG plot.

Nothing here simulates; everything takes an ``engine.Table``.
"""

from __future__ import annotations

from pathlib import Path

from diloco.lab.simulate.engine import JobResult, Table

# Paper, Table 1 (goodput %, MTBI 1 year per chip): the cells the defaults are calibrated to.
PUBLISHED_GOODPUT_PCT: dict[str, dict] = {
    "dp": {1_200_000: 27, 2_400_000: 18},
    "elastic_dp": {1_200_000: 58, 2_400_000: 40},
    "decoupled": {
        2: {1_200_000: 70, 2_400_000: 54},
        8: {1_200_000: 88, 2_400_000: 80},
        16: {1_200_000: 93, 2_400_000: 86},
    },
}

_LABELS = {"dp": "DP, no elasticity", "elastic_dp": "DP, elastic"}
_TITLES = {
    "goodput": "goodput % (useful chip-time / allocated chip-time)",
    "uptime": "uptime % (wall time in which the global model advances)",
}


def _pct(x: float) -> float:
    return round(100.0 * x, 2)


def _metric(table: Table, metric: str) -> dict:
    def row(cells: dict[int, JobResult]) -> dict[str, float]:
        return {str(n): _pct(getattr(cells[n], metric)) for n in table.chips}

    return {
        "dp": row(table.dp),
        "elastic_dp": row(table.elastic_dp),
        "decoupled": {str(m): row(table.decoupled[m]) for m in table.learners},
    }


def to_json(table: Table) -> dict:
    """``{"goodput": {...}, "uptime": {...}}`` in percent, keyed by strings (chips, learners)."""
    return {"goodput": _metric(table, "goodput"), "uptime": _metric(table, "uptime")}


def published_errors(table: Table) -> list[dict]:
    """Simulated minus published goodput (points) for every published cell the table holds."""
    out = []
    for system in ("dp", "elastic_dp"):
        for n, pub in PUBLISHED_GOODPUT_PCT[system].items():
            if n in getattr(table, system):
                sim = _pct(getattr(table, system)[n].goodput)
                out.append({"system": system, "learners": None, "chips": n, "published": pub, "simulated": sim})
    for m, cells in PUBLISHED_GOODPUT_PCT["decoupled"].items():
        for n, pub in cells.items():
            if m in table.decoupled and n in table.decoupled[m]:
                sim = _pct(table.decoupled[m][n].goodput)
                out.append({"system": "decoupled", "learners": m, "chips": n, "published": pub, "simulated": sim})
    for row in out:
        row["error"] = round(row["simulated"] - row["published"], 2)
    return out


def _series(table: Table) -> list[tuple[str, dict[int, JobResult], dict[int, int]]]:
    """(label, cells by chip count, published goodput % by chip count) per system, in table order."""
    out = [
        (_LABELS["dp"], table.dp, PUBLISHED_GOODPUT_PCT["dp"]),
        (_LABELS["elastic_dp"], table.elastic_dp, PUBLISHED_GOODPUT_PCT["elastic_dp"]),
    ]
    out += [
        (f"Decoupled M={m}", table.decoupled[m], PUBLISHED_GOODPUT_PCT["decoupled"].get(m, {}))
        for m in table.learners
    ]
    return out


def _rows(table: Table, metric: str) -> list[tuple[str, list[float]]]:
    return [(label, [getattr(cells[n], metric) for n in table.chips]) for label, cells, _ in _series(table)]


def chips_label(n: int) -> str:
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1e6:g}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1000}k"
    return str(n)


def rich_tables(table: Table):
    """Two ``rich.table.Table`` objects: goodput and uptime, percent."""
    from rich.table import Table as RichTable

    out = []
    for metric in ("goodput", "uptime"):
        t = RichTable(title=_TITLES[metric])
        t.add_column("system")
        for n in table.chips:
            t.add_column(chips_label(n), justify="right")
        for label, values in _rows(table, metric):
            t.add_row(label, *(f"{100 * v:.1f}" for v in values))
        out.append(t)
    return out


def markdown(table: Table, options_text: str = "", show_paper: bool = True) -> str:
    """Goodput and uptime tables, and (``show_paper``) the published cells with their errors."""
    lines = []
    header = "| system | " + " | ".join(chips_label(n) for n in table.chips) + " |"
    rule = "|---|" + "---:|" * len(table.chips)
    for metric in ("goodput", "uptime"):
        lines += [f"### {metric} (%)", "", header, rule]
        for label, values in _rows(table, metric):
            lines.append(f"| {label} | " + " | ".join(f"{100 * v:.1f}" for v in values) + " |")
        lines.append("")
    errors = published_errors(table) if show_paper else []
    if errors:
        lines += ["### published cells (goodput %)", "", "| system | chips | paper | simulated | error |",
                  "|---|---:|---:|---:|---:|"]
        for e in errors:
            label = _LABELS.get(e["system"]) or f"Decoupled M={e['learners']}"
            row = [label, chips_label(e["chips"]), str(e["published"]), f"{e['simulated']:.1f}", f"{e['error']:+.1f}"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if options_text:
        lines += ["### options", "", "```", options_text, "```", ""]
    return "\n".join(lines)


def plot(table: Table, path: Path, show_paper: bool = True) -> None:
    """Goodput and uptime against chip count; ``show_paper`` marks the published cells."""
    # Figure + Agg canvas directly: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_g, ax_u = fig.subplots(1, 2)
    palette = ["tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
    x = list(table.chips)
    for i, (label, cells, published) in enumerate(_series(table)):
        color = palette[i % len(palette)]
        ax_g.plot(x, [100 * cells[n].goodput for n in x], "o-", color=color, label=label)
        ax_u.plot(x, [100 * cells[n].uptime for n in x], "o-", color=color, label=label)
        pub = [(n, pct) for n, pct in published.items() if n in cells] if show_paper else []
        if pub:
            ax_g.plot([n for n, _ in pub], [pct for _, pct in pub], "s", mfc="none", ms=10, color=color)
    for ax, name in ((ax_g, "goodput (%)"), (ax_u, "uptime (%)")):
        ax.set_xscale("log")
        ax.set_xticks(x, [chips_label(n) for n in x])
        ax.minorticks_off()
        ax.set_xlabel("chips")
        ax.set_ylabel(name)
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    ax_g.set_title("goodput (open squares: paper, Table 1)" if show_paper else "goodput")
    ax_u.set_title("uptime")
    ax_u.legend(loc="lower left", fontsize=8)
    fig.savefig(path, dpi=120)


def _si(value: float) -> str:
    """1234567 -> 1.23M (a column that fits a terminal)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:g}"


def capacity_table(rows: list[dict]):
    """``diloco simulate --capacity``'s rows as a rich table, one per learner count."""
    from rich.table import Table

    first = rows[0]
    table = Table(title=f"shards for {_si(first['params'])} parameters, a push every {first['sync_every']} x "
                        f"{first['step_s']:g} s, {first['link_mbit']:g} Mbit/s links, each shard at "
                        f"{first['utilization']:.0%} of a core and a link", header_style="bold")
    for name in ("learners", "shards", "params /shard", "RAM /shard", "cores /shard", "Mbit/s /shard", "learner Mbit/s up",
                 "coordinator cores"):
        table.add_column(name, justify="right")
    for r in rows:
        up = f"{r['learner_mbit_up']:g}" + ("" if r["learner_link_ok"] else " (> link)")
        table.add_row(str(r["learners"]), str(r["shards"]), _si(r["params_per_shard"]), f"{r['shard_rss_gb']:g} GB",
                      f"{r['shard_cores']:g}", f"{r['shard_mbit_in']:g}", up, f"{r['coordinator_cores']:g}")
    return table
