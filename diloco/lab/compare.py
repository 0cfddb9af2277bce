"""``diloco compare``: the same workload under Decoupled DiLoCo (``diloco local``),
synchronous data-parallel (``diloco baseline dp``) and torchft's Streaming DiLoCo
(``diloco baseline torchft``, when installed), scenario by scenario, each a real run.

Every system trains the run's task (``--task``; the byte GPT by default), worker i built
as learner Li builds it, with the same workers and token budget (workers x steps x tokens
per batch), and the same fault seed; every system reports the task's eval loss in its
unit (``eval_unit``). The budget is the run's, not a quota per worker: DP trains that many
global steps, a torchft replacement continues the dead replica's steps, and Decoupled's
learners train until together they have trained it (``diloco local --tokens``), so a
fast learner or a replacement keeps going while the others finish. Scenarios:

- ``nofault``: nothing happens.
- ``mtbf30``: a random worker is SIGKILLed every 30 s on average and replaced (Decoupled:
  AddLearners; DP: the whole job restarts from its last checkpoint; torchft: the
  replica is restarted and heals from a peer).
- ``hetero``: half the workers take 1.5 x as long per step.
- ``scavenge``: Decoupled gets +100 % learners half-way through its nofault run time
  (AddLearners into the scavenged pool) under the same token budget; DP and torchft
  cannot grow a running job here and are not run.
- ``shard-restart``: a syncer shard is killed and restored from a snapshot half-way;
  the baselines have no such component and are not run.

Ablations (``--ablations``) rerun Decoupled on ``nofault`` and ``hetero`` with one
setting changed at a time: quorum K = all / K = 1 without grace (the default) / K = 1 +
the adaptive grace window, merge rda / mean, alpha 0 / 0.5 (with the mix rule), int4 / fp32 deltas,
the reply rule rebase (default) / mix, the outer lr and Nesterov momentum, the downlink
and H.

The first SIGINT or SIGTERM stops the sweep: the running cell's processes stop (as on
Ctrl-C), no other cell starts, and the report holds the cells that finished
(``Interrupted`` says how many).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from diloco.cli.chaos import ChaosConfig
from diloco.lab.baseline.common import check_sites_and_limit
from diloco.cli.metrics import bytes_per_1k_tokens, check_curve_points, link_load
from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.learner.config import LearnerConfig

logger = logging.getLogger(__name__)

SCENARIOS = ("nofault", "mtbf30", "hetero", "scavenge", "shard-restart")
SYSTEMS = ("decoupled", "dp", "torchft")
METRICS = ("wall_s", "start_s", "tokens", "eval_loss_final", "goodput", "uptime", "global_stall_s", "bytes_per_1k_tokens")
ABLATIONS = {
    "K=1, no grace (default)": {},
    "K=all": {"quorum": "all"},
    "K=1+grace": {"grace": "auto"},
    "merge mean": {"merge": "mean"},
    "alpha 0.5 (mix)": {"alpha": 0.5, "reply_rule": "mix"},
    "fp32 deltas": {"delta_codec": "fp32"},
    "no error feedback": {"error_feedback": False},
    "block 64": {"block_size": 64},
    "reply rule mix": {"reply_rule": "mix"},
    "outer lr not scaled by participation": {"scale_by": "round"},
    "chain replies": {"downlink": "chain"},
    "outer lr 1.3": {"outer_lr": 1.3},
    "outer lr 0.6, Nesterov 0.5": {"outer_lr": 0.6, "outer_momentum": 0.5},
    "outer lr 0.7, Nesterov 0.9 (paper)": {"outer_lr": 0.7, "outer_momentum": 0.9},
    "H=8": {"sync_every": 8},
    "H=16": {"sync_every": 16},
    "sparse deltas 1/8, 2-bit replies": {"delta_codec": "sparse", "delta_density": 0.125, "reply_codec": "sparse",
                                         "reply_density": 1.0},
    "sparse deltas 1/16, 2-bit replies": {"delta_codec": "sparse", "delta_density": 0.0625, "reply_codec": "sparse",
                                          "reply_density": 1.0},
    "sparse deltas 1/32, 2-bit replies": {"delta_codec": "sparse", "delta_density": 0.03125, "reply_codec": "sparse",
                                          "reply_density": 1.0},
}
WORKLOADS = {"standard": 120, "long": 480, "longer": 960}
"""``--workload``: inner steps per worker. Longer workloads keep the workers, batch and
schedule shape (warmup, then cosine over the whole run) and multiply the tokens, so the
systems meet the late phase of training, where the learning rate has decayed and the
gradient is mostly noise; 4x and 8x the standard run."""
DEFAULT_VARIANT = "K=1, no grace (default)"
ABLATION_SCENARIOS = ("nofault", "hetero", "mtbf30")
"""Where ablations run: those of them in ``--scenario``, or the first two when none is."""


@dataclass(frozen=True)
class CompareConfig:
    run: RunConfig = field(default_factory=RunConfig)
    workers: int = 4
    """M: learners / DP workers / torchft replicas (4, so that half of them can be slow)."""
    steps: int = WORKLOADS["standard"]
    """Inner steps per worker (the workload: ``--workload`` names them)."""
    seed: int = 3
    """Seed of the fault schedules (3: its first kill falls 8 s in, inside a one-minute run)."""
    seeds: int = 3
    """Runs of every cell; run i adds i to the run's seed (model, data order) and to ``seed``."""
    mtbf_s: float = 30.0
    slow_factor: float = 1.5
    systems: tuple[str, ...] = SYSTEMS
    """The systems compared, a subset of decoupled, dp and torchft."""
    lr: float = LearnerConfig.lr
    """Peak inner learning rate of every system's workers (``LearnerConfig.lr``)."""
    curve_points: int = 8
    """Points of every run's eval curve (``diloco.cli.metrics.eval_curve``): the global model is
    saved as the run passes each eighth of its budget and evaluated after it."""
    link_mbit: float | None = None
    """Emulated sites (``diloco.coordinator.sites``, root): every system's workers each on a site of its
    own behind a link shaped to this rate each way, Mbit/s. None: all on 127.0.0.1."""
    time_limit_s: float | None = None
    """Stop a run this long after its start, the budget trained or not (it is marked
    ``time_limited``; its tokens per second still count). None: no limit."""
    out: Path = Path("runs/compare")
    """Where the report (results.md, results.json, the figures) and every run go."""

    def __post_init__(self) -> None:
        if self.workers < 2 or self.steps < 1:
            raise InvalidArgument("compare needs >= 2 workers and >= 1 step")
        if self.seeds < 1:
            raise InvalidArgument(f"--seeds must be >= 1, got {self.seeds}")
        check_curve_points(self.curve_points)
        check_sites_and_limit(self.link_mbit, self.time_limit_s)
        LearnerConfig(lr=self.lr)  # the learners' own check, before any run starts
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise InvalidArgument(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")

    def seeded(self, i: int) -> CompareConfig:
        """Run ``i`` of every cell: its own model initialisation, data order and faults."""
        return replace(self, run=replace(self.run, seed=self.run.seed + i), seed=self.seed + i)

    @property
    def slow(self) -> tuple[tuple[int, float], ...]:
        return tuple((i, self.slow_factor) for i in range(self.workers // 2))

    @cached_property
    def workload(self) -> tuple[int, str]:
        """(tokens of one worker's step, eval unit) of the run's task, built once as the
        supervisors build it (``diloco.cli.metrics.supervisor_task``)."""
        from diloco.cli.metrics import supervisor_task, tokens_per_step

        task = supervisor_task(self.run, self.workers)
        return tokens_per_step(self.run, task), task.eval_unit

    @property
    def tokens_per_step(self) -> int:
        return self.workload[0]

    @property
    def eval_unit(self) -> str:
        return self.workload[1]

    @property
    def tokens(self) -> int:
        return self.workers * self.steps * self.tokens_per_step


def _local_cfg(cfg: CompareConfig, out: Path, **changes):
    from diloco.cli.local.config import LocalConfig

    # The run's token budget, not a quota per learner: a learner that is fast, or replaces
    # a killed one, keeps training until the learners together have trained the budget.
    # No evaluations while training: DP and torchft make none (each system's final model
    # is evaluated once, by the same code).
    local = LocalConfig(run=cfg.run, learners=cfg.workers, tokens=cfg.tokens, out=out, learner_evals=0, lr=cfg.lr,
                        curve_points=cfg.curve_points, link_mbit=cfg.link_mbit, time_limit_s=cfg.time_limit_s)
    return replace(local, **changes)


def _decoupled(cfg: CompareConfig, scenario: str, out: Path, reference_wall_s: float | None, **changes) -> dict:
    """One Decoupled run of ``scenario``; ``changes``: an ablation's ``LocalConfig`` fields."""
    from diloco.cli.local.run import run_local

    half = (reference_wall_s or 60.0) / 2
    faults = {
        "nofault": {},
        "mtbf30": {"chaos": ChaosConfig(kill_every_s=cfg.mtbf_s, seed=cfg.seed)},
        "hetero": {"slow_learners": cfg.slow},
        "scavenge": {"chaos": ChaosConfig(scavenge=(cfg.workers, half), seed=cfg.seed)},
        "shard-restart": {"chaos": ChaosConfig(restart_shard_at_s=half, seed=cfg.seed)},
    }
    if scenario not in faults:
        raise InvalidArgument(f"unknown scenario {scenario!r}")
    summary = run_local(_local_cfg(cfg, out, **faults[scenario], **changes))
    if summary.get("interrupted"):  # it stopped on SIGINT or SIGTERM, as a sweep stops
        raise KeyboardInterrupt
    return _decoupled_metrics(summary)


def _beyond_headers(links: dict | None) -> dict | None:
    """Of the links' overhead, the TCP stream beyond the learners' payloads, each direction
    (the Ethernet, IP and TCP headers the kernel counted taken out: ``link_breakdown``)."""
    shares = {way: b["above_payload_share"] for way in ("up", "down") if links and (b := links.get(f"breakdown_{way}"))}
    return shares or None


def _decoupled_metrics(summary: dict) -> dict:
    wire = summary["bytes_up"] + summary["bytes_down"]
    return {
        **{k: summary[k] for k in METRICS if k in summary},
        "bytes_per_1k_tokens": bytes_per_1k_tokens(wire, summary["tokens"]),
        # Learners to shards (deltas) and shards to learners (replies, bootstraps); DP's and
        # torchft's peers send as much as they receive, so they have no such split.
        "bytes_up_per_1k_tokens": bytes_per_1k_tokens(summary["bytes_up"], summary["tokens"]),
        "bytes_down_per_1k_tokens": bytes_per_1k_tokens(summary["bytes_down"], summary["tokens"]),
        "eval_unit": summary["eval_unit"],
        "eval_loss_start": summary["eval_loss_start"],
        "curve": summary["curve"],
        "step_goodput": summary["step_goodput"],
        "learners_killed": summary["learners_killed"],
        **run_load(summary),
        # (kernel / the learners' own payload counts - 1, each direction: the protocol's overhead)
        "links_overhead": {"up": links["overhead_up"], "down": links["overhead_down"]}
        if (links := summary.get("links")) else None,
        "links_beyond_headers": _beyond_headers(summary.get("links")),
        "run_dir": summary["run_dir"],
    }


def run_load(summary: dict) -> dict:
    """What every system's run reports for the bandwidth sweep, by the same code: tokens per
    second of wall time, whether it stopped at its time limit, and (on emulated sites)
    the bytes the kernel counted on the workers' links per 1k tokens (``link_load``)."""
    return {"tokens_per_s": round(summary["tokens"] / summary["wall_s"], 1) if summary["wall_s"] else None,
            "time_limited": bool(summary.get("time_limited")), **link_load(summary.get("links"), summary["tokens"])}


def _baseline(cfg: CompareConfig, system: str, scenario: str, out: Path) -> dict:
    if scenario in ("scavenge", "shard-restart"):
        return {"skipped": f"{system} has no way to {'grow a running job' if scenario == 'scavenge' else 'restart a shard'} here"}
    faults = {"kill_every_s": cfg.mtbf_s, "fault_seed": cfg.seed} if scenario == "mtbf30" else {}
    slow = {"slow_workers": cfg.slow} if scenario == "hetero" else {}
    common = dict(run=cfg.run, workers=cfg.workers, steps=cfg.steps, out=out, lr=cfg.lr, curve_points=cfg.curve_points,
                  link_mbit=cfg.link_mbit, time_limit_s=cfg.time_limit_s, **faults, **slow)
    if system == "dp":
        from diloco.lab.baseline.dp import DPConfig, run_dp

        result = run_dp(DPConfig(**common), show_progress=True)
    else:
        from diloco.lab.baseline.torchft_peer import PEERS_EXTRA, TorchftConfig, run_torchft, torchft_missing

        if (missing := torchft_missing()) is not None:  # (``run`` refuses first; a scenario run alone skips)
            return {"skipped": f"torchft cannot be imported here ({missing}): install {PEERS_EXTRA}"}
        # torchft's Streaming DiLoCo applies a reply by mixing with alpha (its own algorithm).
        result = run_torchft(TorchftConfig(**{**common, "run": replace(cfg.run, reply_rule="mix")}), show_progress=True)
    return {**{k: result[k] for k in METRICS}, "eval_unit": result["eval_unit"],
            "eval_loss_start": result["eval_loss_start"], "curve": result["curve"], "restarts": result.get("restarts"),
            **run_load(result), "run_dir": str(out)}


def check_systems(cfg: CompareConfig) -> None:
    """Every system asked for can run here, before any runs: torchft is an optional extra,
    and without it a sweep would find out after every other system's runs."""
    from diloco.lab.baseline.torchft_peer import PEERS_EXTRA, torchft_missing

    if "torchft" in cfg.systems and (missing := torchft_missing()) is not None:
        others = ",".join(s for s in cfg.systems if s != "torchft")
        raise FailedPrecondition(f"--systems includes torchft, which cannot be imported here ({missing}): install "
                                 f"{PEERS_EXTRA}" + (f", or leave it out: --systems {others}" if others else ""))


def run_scenario(cfg: CompareConfig, scenario: str, reference_wall_s: float | None = None,
                 systems: dict | None = None) -> dict:
    """One scenario for every system: ``{"scenario": NAME, "systems": {...}}``. ``systems``:
    filled cell by cell (a stopped sweep reports the cells that finished)."""
    if scenario not in SCENARIOS:
        raise InvalidArgument(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    base = cfg.out / scenario
    systems = {} if systems is None else systems
    for system in cfg.systems:
        if (base / system).exists() and any((base / system).iterdir()):
            raise InvalidArgument(f"{base / system} already holds a run; give a new --out directory")
        runs = []
        for i in range(cfg.seeds):
            started, out = time.monotonic(), base / system / f"seed{i}"
            seeded = cfg.seeded(i)
            if system == "decoupled":
                runs.append(_decoupled(seeded, scenario, out, reference_wall_s))
            else:
                runs.append(_baseline(seeded, system, scenario, out))
            logger.info("%s / %s / seed %d done in %.0f s", scenario, system, i, time.monotonic() - started)
            if "skipped" in runs[-1]:
                break
        systems[system] = over_seeds(runs)
    result = {"scenario": scenario, "systems": systems}
    base.mkdir(parents=True, exist_ok=True)
    (base / "result.json").write_text(json.dumps(result, indent=1))
    return result


def run_ablations(cfg: CompareConfig, scenarios: tuple[str, ...] = ABLATION_SCENARIOS[:2],
                  variants: tuple[str, ...] = tuple(ABLATIONS), done: list[dict] = (),
                  results: dict[str, dict] | None = None) -> dict:
    """Decoupled only, one setting changed at a time: ``variants`` and the default one
    (taken from ``done``, the scenarios' results, when they ran Decoupled). ``results``:
    filled cell by cell, as ``run_scenario``'s ``systems``."""
    results = {} if results is None else results
    ran = {r["scenario"]: r["systems"]["decoupled"] for r in done if "decoupled" in r["systems"]}
    for scenario in scenarios:
        for name, change in ABLATIONS.items():
            if name != DEFAULT_VARIANT and name not in variants:
                continue
            if name == DEFAULT_VARIANT and scenario in ran:  # the same runs as the scenario's own
                results.setdefault(scenario, {})[name] = ran[scenario]
                continue
            out = cfg.out / "ablations" / scenario / name.replace(" ", "_").replace(",", "").replace("=", "").replace("/", "-")
            change = dict(change)
            run = cfg.run
            if "alpha" in change:
                run = replace(run, merge_alpha=change.pop("alpha"))
            if "reply_rule" in change:
                run = replace(run, reply_rule=change.pop("reply_rule"))
            if "sync_every" in change:
                run = replace(run, sync_every_steps=change.pop("sync_every"))
            if change.get("quorum") == "all":
                change["quorum"] = cfg.workers
            variant = replace(cfg, run=run)
            runs = [_decoupled(variant.seeded(i), scenario, out / f"seed{i}", None, **change) for i in range(cfg.seeds)]
            results.setdefault(scenario, {})[name] = over_seeds(runs)
    (cfg.out / "ablations").mkdir(parents=True, exist_ok=True)
    (cfg.out / "ablations" / "result.json").write_text(json.dumps(results, indent=1))
    return results


def over_seeds(runs: list[dict]) -> dict:
    """One cell from its runs: each number's mean over the runs, its sample standard
    deviation under ``spread`` (0 for one run), what every run agrees on as it is, and the
    runs themselves under ``seeds``. A cell a system cannot run is its ``skipped``."""
    if any("skipped" in r for r in runs):
        return next(r for r in runs if "skipped" in r)
    cell, spread = {}, {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            if any(math.isnan(v) for v in values):  # a run that failed to measure it: so is the cell
                cell[key] = spread[key] = math.nan
                continue
            cell[key] = round(statistics.fmean(values), 4)
            spread[key] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
        elif all(v == values[0] for v in values):
            cell[key] = values[0]
    return {**cell, "spread": spread, "seeds": runs}


# --- reporting ------------------------------------------------------------------------


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _figure(cell: dict, key: str) -> str:
    """The cell's mean, and its spread when it has more than one run."""
    spread = cell.get("spread", {}).get(key)
    return _fmt(cell.get(key)) + (f" ± {_fmt(spread)}" if spread is not None and len(cell.get("seeds", ())) > 1 else "")


def markdown_table(results: list[dict]) -> str:
    lines = ["| scenario | system | runs | " + " | ".join(METRICS) + " |", "|---|---|---:|" + "---:|" * len(METRICS)]
    for r in results:
        for system, m in r["systems"].items():
            if "skipped" in m:
                lines.append(f"| {r['scenario']} | {system} | 0 | " + f"not run: {m['skipped']} |" + " |" * (len(METRICS) - 1))
            else:
                lines.append(f"| {r['scenario']} | {system} | {len(m['seeds'])} | "
                             + " | ".join(_figure(m, k) for k in METRICS) + " |")
    return "\n".join(lines) + "\n"


def ablation_table(results: dict) -> str:
    keys = ("eval_loss_final", "goodput", "step_goodput", "uptime", "wall_s", "bytes_per_1k_tokens")
    lines = ["| scenario | variant | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
    for scenario, variants in results.items():
        for name, m in variants.items():
            lines.append(f"| {scenario} | {name} | " + " | ".join(_figure(m, k) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def targets(results: list[dict], ablations: dict | None) -> list[tuple[str, bool | None, str]]:
    """(target, met, what was measured) for every target the issue sets that these
    results can judge; met is None when a run it needs is missing."""
    by = {r["scenario"]: r["systems"] for r in results}

    def get(scenario, system, key):
        m = by.get(scenario, {}).get(system, {})
        return m.get(key)

    out = []
    up, good, dp_up = get("mtbf30", "decoupled", "uptime"), get("mtbf30", "decoupled", "goodput"), get("mtbf30", "dp", "uptime")
    ft_good = get("mtbf30", "torchft", "goodput")
    if up is not None:
        out.append(("mtbf30: Decoupled uptime >= 0.99 and goodput >= 0.9, above torchft's; DP uptime below Decoupled's",
                    up >= 0.99 and good >= 0.9 and (ft_good is None or good > ft_good)
                    and (dp_up is not None and dp_up < up),
                    f"Decoupled uptime {up}, goodput {good}; torchft goodput {ft_good}; DP uptime {dp_up}"))
    dec, dp = get("nofault", "decoupled", "eval_loss_final"), get("nofault", "dp", "eval_loss_final")
    if dec is not None and dp is not None:
        unit = get("nofault", "decoupled", "eval_unit") or "loss"
        out.append(("nofault: Decoupled eval loss within 3 % of DP's", dec <= dp * 1.03,
                    f"{dec} vs {dp} {unit} ({100 * (dec / dp - 1):+.1f} %)"))
    dec_b = get("nofault", "decoupled", "bytes_per_1k_tokens")
    for system, factor in (("dp", 50), ("torchft", 5)):
        other = get("nofault", system, "bytes_per_1k_tokens")
        if dec_b and other:
            out.append((f"nofault: bytes on the wire per token >= {factor}x lower than {system}'s", other / dec_b >= factor,
                        f"{dec_b:,.0f} vs {other:,.0f} bytes per 1k tokens ({other / dec_b:.1f}x)"))
    dec_s, ft_s = get("nofault", "decoupled", "start_s"), get("nofault", "torchft", "start_s")
    if dec_s is not None and ft_s is not None:
        out.append(("nofault: launch to every worker's first step no slower than torchft's", dec_s <= ft_s,
                    f"{dec_s} s vs {ft_s} s"))
    het_good, het_eval = get("hetero", "decoupled", "goodput"), get("hetero", "decoupled", "eval_loss_final")
    if het_good is not None:
        out.append(("hetero: Decoupled goodput >= 0.9, eval within 3 % of its nofault value",
                    het_good >= 0.9 and (dec is None or het_eval <= dec * 1.03),
                    f"goodput {het_good}, eval {het_eval} vs {dec} without slow learners"))
    sc, nf = get("scavenge", "decoupled", "wall_s"), get("nofault", "decoupled", "wall_s")
    if sc is not None and nf is not None:
        out.append(("scavenge: wall time to the same tokens shrinks", sc < nf, f"{sc} s vs {nf} s without scavenging"))
    het = (ablations or {}).get("hetero", {})
    if "K=all" in het and DEFAULT_VARIANT in het:
        a, g = het["K=all"], het[DEFAULT_VARIANT]
        out.append(("hetero: K=1 (the default) within 2 % of K=all's loss, with higher goodput",
                    g["eval_loss_final"] <= a["eval_loss_final"] * 1.02 and g["goodput"] > a["goodput"],
                    f"loss {g['eval_loss_final']} vs {a['eval_loss_final']}, goodput {g['goodput']} vs {a['goodput']}"))
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("eval_loss_final", "goodput", "uptime", "wall_s")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6))
    scenarios = [r["scenario"] for r in results]
    systems = [s for s in SYSTEMS if any(s in r["systems"] for r in results)]
    width = 0.8 / max(len(systems), 1)
    for ax, key in zip(axes, keys):
        for i, system in enumerate(systems):
            cells = [r["systems"].get(system, {}) for r in results]
            shown = [(j, c[key], c.get("spread", {}).get(key, 0.0)) for j, c in enumerate(cells) if c.get(key) is not None]
            ax.bar([j + i * width for j, _, _ in shown], [v for _, v, _ in shown], width,
                   yerr=[s for _, _, s in shown], capsize=2, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(scenarios))], scenarios, rotation=30, fontsize=8)
        ax.set_title(key)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_curve(cell: dict) -> list[tuple[float, float, float, float]] | None:
    """(tokens, mean, lowest, highest eval loss) at each point of the cell's runs' eval
    curves, taken point by point (every run saves at the same shares of its budget); None
    when a run has no curve or the runs' points differ in number."""
    curves = [run.get("curve") for run in cell.get("seeds", ())]
    if not curves or not all(curves) or len({len(c) for c in curves}) != 1:
        return None
    points = []
    for at in zip(*curves):
        evals = [e for _, e in at if e is not None]
        if evals:
            points.append((statistics.fmean(t for t, _ in at), statistics.fmean(evals), min(evals), max(evals)))
    return points


def plot_curves(results: list[dict], path: Path, unit: str) -> bool:
    """Eval loss against tokens trained, one panel per scenario, a line per system (the mean
    of its runs, the band their range); log y. False when no cell has curves."""
    panels = [(r["scenario"], {s: c for s, c in ((s, mean_curve(m)) for s, m in r["systems"].items()) if c})
              for r in results]
    panels = [(scenario, curves) for scenario, curves in panels if curves]
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (scenario, curves) in zip(axes[0], panels):
        for system in SYSTEMS:
            if system not in curves:
                continue
            tokens, mean, low, high = zip(*curves[system])
            millions = [t / 1e6 for t in tokens]
            ax.plot(millions, mean, marker=".", label=system)
            ax.fill_between(millions, low, high, alpha=0.2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.set_xlabel("tokens trained (millions)")
        ax.set_ylabel(f"eval loss ({unit})")
        ax.set_title(scenario)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class Interrupted(Exception):
    """A signal stopped the sweep after ``done`` of its ``planned`` cells; the report holds
    the cells done."""

    def __init__(self, signum: int, done: int, planned: int, out: Path) -> None:
        self.signal, self.done, self.planned = signal.Signals(signum), done, planned
        self.exit_code = 128 + signum
        super().__init__(f"{self.signal.name} stopped the sweep after {done} of {planned} cells; the cells done are in "
                         f"{out / 'results.md'} and {out / 'results.json'}")

    def to_json(self) -> dict:
        return {"signal": self.signal.name, "cells_done": self.done, "cells_planned": self.planned}


def write_report(cfg: CompareConfig, results: list[dict], ablations: dict | None,
                 interrupted: Interrupted | None = None) -> Path:
    cfg.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# diloco compare: {cfg.workers} workers x {cfg.steps} steps x {cfg.tokens_per_step:,} tokens = "
             f"{cfg.tokens:,} tokens per system; {cfg.seeds} run(s) per cell (mean ± sample standard deviation)\n",
             f"Task `{cfg.run.task}`; eval loss in {cfg.eval_unit}.\n", markdown_table(results)]
    if interrupted is not None:
        lines.insert(1, f"**Interrupted**: {interrupted.signal.name} stopped the sweep after {interrupted.done} of "
                        f"{interrupted.planned} cells; these are the cells done.\n")
    split = [(r["scenario"], r["systems"]["decoupled"]) for r in results
             if "bytes_up_per_1k_tokens" in r["systems"].get("decoupled", {})]
    if split:
        lines.append("\nDecoupled's bytes per 1k tokens, learners to shards (up) and back (down): "
                     + "; ".join(f"{scenario} {_figure(m, 'bytes_up_per_1k_tokens')} up, "
                                 f"{_figure(m, 'bytes_down_per_1k_tokens')} down" for scenario, m in split) + ".\n")
    if ablations:
        lines += ["\n## Ablations (Decoupled)\n", ablation_table(ablations)]
    checks = targets(results, ablations)
    if checks:
        lines.append("\n## Targets\n")
        lines += [f"- {'MET' if ok else 'MISSED'}: {name} — {measured}" for name, ok, measured in checks]
    report = cfg.out / "results.md"
    report.write_text("\n".join(lines) + "\n")
    (cfg.out / "results.json").write_text(json.dumps({"results": results, "ablations": ablations,
                                                      "targets": [list(c) for c in checks],
                                                      **({"interrupted": interrupted.to_json()} if interrupted else {})},
                                                     indent=1))
    if results:
        plot(results, cfg.out / "compare.png")
        plot_curves(results, cfg.out / "curves.png", cfg.eval_unit)
    return report


@contextlib.contextmanager
def _signals_interrupt():
    """SIGINT and SIGTERM raise KeyboardInterrupt wherever the sweep is (a running ``diloco
    local`` stops as on Ctrl-C; a baseline kills its workers). Yields the signals caught."""
    caught: list[int] = []

    def interrupt(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(cfg: CompareConfig, scenarios: tuple[str, ...], ablations: tuple[str, ...] = (),
        on_result=None) -> tuple[list[dict], dict | None]:
    """The scenarios, then the ``ablations`` (variant names) on those of the scenarios that
    ablations run on (all of them when none of those was asked for). The first SIGINT or
    SIGTERM stops it: the report then holds the cells done, and ``Interrupted`` is raised."""
    check_systems(cfg)
    ablated = tuple(s for s in scenarios if s in ABLATION_SCENARIOS) or ABLATION_SCENARIOS[:2]
    planned = len(scenarios) * len(cfg.systems) + (len(ablated) * len({DEFAULT_VARIANT, *ablations}) if ablations else 0)
    results, found, reference = [], None, None
    with _signals_interrupt() as caught:
        try:
            for scenario in scenarios:
                results.append({"scenario": scenario, "systems": {}})
                result = run_scenario(cfg, scenario, reference, results[-1]["systems"])
                if scenario == "nofault" and "decoupled" in result["systems"]:
                    reference = result["systems"]["decoupled"]["wall_s"]
                if on_result is not None:
                    on_result(result)
                write_report(cfg, results, None)
            if ablations:
                found = {}
                run_ablations(cfg, ablated, ablations, results, found)
        except KeyboardInterrupt:
            for s in (signal.SIGINT, signal.SIGTERM):  # the report is written whole
                signal.signal(s, signal.SIG_IGN)
            # (a signal during a diloco local run reaches this handler through the run's own)
            stop = Interrupted(caught[0] if caught else signal.SIGTERM,
                               sum(len(r["systems"]) for r in results) + sum(map(len, (found or {}).values())),
                               planned, cfg.out)
            write_report(cfg, [r for r in results if r["systems"]], found or None, stop)
            raise stop from None
    write_report(cfg, results, found)
    return results, found
