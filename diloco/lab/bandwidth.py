"""``diloco compare --bandwidth-sweep 1000,100,20,5,1``: every system at every link rate on
emulated sites (``diloco.coordinator.sites``: each worker in a network namespace of its own behind a
link the kernel shapes to the rate, each way), the same token budget, ``--seeds`` runs per
cell: the paper's "bandwidth needed" figure on real traffic.

A run that would take too long (DP at 1 Mbit/s moves about 1.4 MB per 1k tokens through
every link) stops at ``--time-limit-s`` and reports the tokens per second it reached,
marked as time-limited (no final eval: it has no final model). Every figure comes from
``diloco.lab.compare``'s per-run metrics (``run_load``: tokens per second, the kernel's byte
counts), the same code for every system.

Writes ``OUT/bandwidth.md`` (the table and the targets), ``OUT/bandwidth.json`` and
``OUT/bandwidth.png`` (tokens per second and final eval against link rate).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from diloco.errors import InvalidArgument
from diloco.coordinator.sites import check_mbit
from diloco.lab.compare import CompareConfig, _baseline, check_systems, _decoupled, _figure, _fmt, over_seeds

logger = logging.getLogger(__name__)

RATES = (1000.0, 100.0, 20.0, 5.0, 1.0)
TIME_LIMIT_S = 150.0
"""A sweep's default limit per run: a little over 3x a run on free links here."""
KEEP = 0.9
"""The share of its tokens per second at the fastest rate a system must keep."""
COLUMNS = ("wall_s", "tokens_per_s", "eval_loss_final", "link_up_per_1k_tokens", "link_down_per_1k_tokens")


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1000,100,20"`` -> (1000.0, 100.0, 20.0), fastest first; each a valid link rate."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(f"--bandwidth-sweep takes link rates in Mbit/s, comma-separated, got {text!r}") from None
    if not rates or len(set(rates)) != len(rates):
        raise InvalidArgument(f"--bandwidth-sweep needs distinct rates, got {text!r}")
    for rate in rates:
        check_mbit(rate, "--bandwidth-sweep")
    return tuple(sorted(rates, reverse=True))


def run_cell(cfg: CompareConfig, system: str, rate: float) -> dict:
    """``cfg.seeds`` runs of ``system`` on ``rate`` Mbit/s sites, nofault."""
    out = cfg.out / f"{rate:g}mbit" / system
    if out.exists() and any(out.iterdir()):
        raise InvalidArgument(f"{out} already holds a run; give a new --out directory")
    runs = []
    for i in range(cfg.seeds):
        seeded = replace(cfg.seeded(i), link_mbit=rate)
        started = time.monotonic()
        if system == "decoupled":
            runs.append(_decoupled(seeded, "nofault", out / f"seed{i}", None))
        else:
            runs.append(_baseline(seeded, system, "nofault", out / f"seed{i}"))
        logger.info("%g Mbit/s / %s / seed %d done in %.0f s", rate, system, i, time.monotonic() - started)
        if "skipped" in runs[-1]:
            break
    return over_seeds(runs)


def lowest_kept_rate(cells: dict[float, dict]) -> float | None:
    """The lowest rate at which the system keeps ``KEEP`` of its tokens per second at the
    fastest rate swept (every rate at or above it too: a dip is not kept)."""
    rates = sorted(cells, reverse=True)
    top = cells[rates[0]].get("tokens_per_s")
    if not top:
        return None
    kept = rates[0]
    for rate in rates[1:]:
        if (cells[rate].get("tokens_per_s") or 0) < KEEP * top:
            break
        kept = rate
    return kept


def targets(results: dict) -> list[tuple[str, bool | None, str]]:
    cells = {float(r): systems for r, systems in results["cells"].items()}
    checks = []
    decoupled = {r: s["decoupled"] for r, s in cells.items() if "decoupled" in s}
    if 1000.0 in decoupled and 5.0 in decoupled:
        fast, slow = decoupled[1000.0], decoupled[5.0]
        wall = slow["wall_s"] / fast["wall_s"]
        checks.append(("Decoupled's wall time at 5 Mbit/s <= 1.15x its time at 1000 Mbit/s", wall <= 1.15,
                       f"{slow['wall_s']:.1f} s vs {fast['wall_s']:.1f} s: {wall:.2f}x"))
        if fast.get("eval_loss_final") and slow.get("eval_loss_final"):
            gap = slow["eval_loss_final"] / fast["eval_loss_final"] - 1
            checks.append(("Decoupled's eval at 5 Mbit/s within 3 % of its 1000 Mbit/s value", abs(gap) <= 0.03,
                           f"{slow['eval_loss_final']:.4f} vs {fast['eval_loss_final']:.4f}: {gap:+.1%}"))
    kept = {system: lowest_kept_rate({r: s[system] for r, s in cells.items() if system in s and "skipped" not in s[system]})
            for system in ("decoupled", "dp", "torchft") if any(system in s and "skipped" not in s[system]
                                                                  for s in cells.values())}
    said = ", ".join(f"{system} {_fmt(rate)} Mbit/s" for system, rate in kept.items())
    if kept.get("decoupled") and kept.get("dp"):
        checks.append((f"the lowest rate keeping {KEEP:.0%} of the fastest rate's tokens/s: Decoupled's >= 20x lower than "
                       "DP's",
                       kept["dp"] / kept["decoupled"] >= 20, f"{said}: {kept['dp'] / kept['decoupled']:.0f}x"))
    if kept.get("decoupled") and kept.get("torchft"):
        checks.append(("... and lower than torchft's", kept["decoupled"] < kept["torchft"], said))
    overheads = [(r, run["links_overhead"]) for r, s in cells.items() if "decoupled" in s
                 for run in s["decoupled"].get("seeds", []) if run.get("links_overhead")]
    if overheads:
        worst = max((abs(v), r, way, v) for r, o in overheads for way, v in o.items() if v is not None)
        checks.append(("kernel byte counters and the project's counts agree within 10 % (Decoupled, every run, "
                       "each direction)", worst[0] <= 0.10,
                       f"worst {worst[3]:+.1%} ({worst[2]}, {_fmt(worst[1])} Mbit/s)"))
    beyond = [(r, run["links_beyond_headers"]) for r, s in cells.items() if "decoupled" in s
              for run in s["decoupled"].get("seeds", []) if run.get("links_beyond_headers")]
    if beyond:
        worst = max((abs(v), r, way, v) for r, o in beyond for way, v in o.items() if v is not None)
        checks.append(("... or, the Ethernet, IP and TCP headers the kernel counted taken out, within 10 % "
                       "(the TCP stream beyond the payloads: TLS, gRPC framing and metadata, control calls)",
                       worst[0] <= 0.10, f"worst {worst[3]:+.1%} ({worst[2]}, {_fmt(worst[1])} Mbit/s)"))
    return checks


def table(results: dict) -> str:
    lines = ["| Mbit/s | system | runs | time-limited | " + " | ".join(COLUMNS) + " |",
             "|---:|---|---:|---:|" + "---:|" * len(COLUMNS)]
    for rate, systems in results["cells"].items():
        for system, cell in systems.items():
            if "skipped" in cell:
                lines.append(f"| {rate} | {system} | 0 | | not run: {cell['skipped']} |" + " |" * (len(COLUMNS) - 1))
                continue
            limited = sum(1 for run in cell["seeds"] if run.get("time_limited"))
            lines.append(f"| {rate} | {system} | {len(cell['seeds'])} | {limited} | "
                         + " | ".join(_figure(cell, k) for k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, quality) = plt.subplots(1, 2, figsize=(11, 4.2))
    systems = sorted({s for cells in results["cells"].values() for s in cells})
    for system in systems:
        points = sorted((float(r), c) for r, cells in results["cells"].items()
                        if (c := cells.get(system)) and "skipped" not in c)
        if not points:
            continue
        rates = [r for r, _ in points]
        line = speed.errorbar(rates, [c.get("tokens_per_s") or 0 for _, c in points],
                              yerr=[c["spread"].get("tokens_per_s") or 0 for _, c in points], marker="o",
                              capsize=3, label=system)
        limited = [(r, c["tokens_per_s"]) for r, c in points if any(x.get("time_limited") for x in c["seeds"])]
        if limited:
            speed.scatter(*zip(*limited), s=120, facecolors="none", edgecolors=line[0].get_color())
        done = [(r, c) for r, c in points if c.get("eval_loss_final") is not None]
        if done:
            quality.errorbar([r for r, _ in done], [c["eval_loss_final"] for _, c in done],
                             yerr=[c["spread"].get("eval_loss_final") or 0 for _, c in done], marker="o", capsize=3,
                             label=system, color=line[0].get_color())
    for ax in (speed, quality):
        ax.set_xscale("log")
        ax.set_xlabel("link rate per site, Mbit/s (each way)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    speed.set_ylabel("tokens per second (circled: a run stopped at the time limit)")
    quality.set_ylabel(f"final eval ({unit}), runs that finished")
    fig.suptitle("The same budget over kernel-shaped links: what each system needs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(cfg: CompareConfig, results: dict) -> Path:
    cfg.out.mkdir(parents=True, exist_ok=True)
    checks = targets(results)
    lines = [f"# diloco compare --bandwidth-sweep: {cfg.workers} workers x {cfg.steps} steps x {cfg.tokens_per_step:,} "
             f"tokens = {cfg.tokens:,} tokens per run; {cfg.seeds} run(s) per cell (mean ± sample standard deviation); "
             f"a run stops at {cfg.time_limit_s:g} s\n",
             f"Task `{cfg.run.task}`; eval in {cfg.eval_unit}. Each worker on an emulated site: a network namespace "
             "behind a veth pair tc shapes to the rate in both directions; link bytes are the kernel's counts on "
             "those links. Latency is not emulated (the kernel here has no netem).\n", table(results)]
    if checks:
        lines += ["\n## Targets\n"] + [f"- {'MET' if ok else 'MISSED'}: {name} — {measured}" for name, ok, measured in checks]
    report = cfg.out / "bandwidth.md"
    report.write_text("\n".join(lines) + "\n")
    (cfg.out / "bandwidth.json").write_text(json.dumps({**results, "targets": [list(c) for c in checks]}, indent=1))
    plot(results, cfg.out / "bandwidth.png", cfg.eval_unit)
    return report


def run(cfg: CompareConfig, rates: tuple[float, ...]) -> dict:
    """Every rate, fastest first, every system of ``cfg`` at each; the report is rewritten
    after every cell (a stopped sweep keeps the cells done)."""
    check_systems(cfg)
    cfg = replace(cfg, time_limit_s=cfg.time_limit_s or TIME_LIMIT_S, curve_points=0)
    results = {"rates": list(rates), "time_limit_s": cfg.time_limit_s, "cells": {}}
    for rate in rates:
        for system in cfg.systems:
            results["cells"].setdefault(f"{rate:g}", {})[system] = run_cell(cfg, system, rate)
            write_report(cfg, results)
    return results
