"""The lab's commands: compare, baseline, bench and simulate, the measurements of the
product against the systems it is compared with and against its own targets."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from diloco.cli.common import add_run_config, build_run_config, parse_count
from diloco.cli.settings import add_flag, from_flags
from diloco.errors import InvalidArgument

logger = logging.getLogger(__name__)


def _bench_codec(args: argparse.Namespace) -> int:
    from diloco.lab.bench import codec

    result = codec.run(size_mib=args.size_mib, repeats=args.repeats)
    _print_result(result, args.json)
    return 0


def _bench_syncer(args: argparse.Namespace) -> int:
    from diloco.lab.bench import syncer

    _print_result(syncer.run(params=args.params, learners=args.learners, rounds=args.rounds), args.json)
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    import itertools

    from diloco.lab.bench import load

    configs = [load.LoadConfig(learners=n, params=p, shards=s, seconds=args.seconds, warmup_s=args.warmup,
                               step_s=args.step_s, sync_every=args.sync_every, pushes_per_s=args.pushes_per_s,
                               clients=args.clients, seed=args.seed)
               for n, p, s in itertools.product(args.learners, args.params, args.shards)]
    for result in load.run(configs):
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print_result({k: v for k, v in result.items() if k != "config"}, False)
    return 0


def _counts(value: str) -> list[int]:
    """A comma-separated list of counts (``1,4,16``; ``1Mi,4Mi``)."""
    return [parse_count(item) for item in value.split(",")]


def _bench_learner(args: argparse.Namespace) -> int:
    from diloco.lab.bench import learner

    result = learner.run(steps=args.steps, overlap_steps=args.overlap, threads=args.threads, tracing=args.tracing,
                         runs=args.runs)
    _print_result(result, args.json)
    return 0


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    codec = kinds.add_parser("codec", help="int4 quantize/dequantize and zstd framing vs memcpy")
    codec.add_argument("--size-mib", type=int, default=64, help="fp32 data per measurement (default 64 MiB)")
    codec.add_argument("--repeats", type=int, default=5, help="timed repetitions; the best is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object")
    codec.set_defaults(func=_bench_codec)
    sync = kinds.add_parser("syncer", help="one shard's ingress vs raw loopback TCP, merge time vs memcpy, memory")
    sync.add_argument("--params", type=parse_count, default="4Mi",
                      help="parameters of the shard's fragment, a multiple of 1024 (1048576, 1Mi, 64Mi; default 4Mi)")
    sync.add_argument("--learners", type=int, default=8, help="client processes pushing (default 8)")
    sync.add_argument("--rounds", type=int, default=30, help="rounds to measure, after one warm-up round (default 30)")
    sync.add_argument("--json", action="store_true", help="print one JSON object")
    sync.set_defaults(func=_bench_syncer)
    load = kinds.add_parser(
        "load", help="synthetic learners (no training) against a real coordinator and shards over mutual TLS: "
                     "shard CPU per push, reply latency, memory; one configuration per combination of the lists")
    from diloco.lab.bench.load import LoadConfig

    d = LoadConfig()
    load.add_argument("--learners", type=_counts, default=[d.learners],
                      help=f"synthetic learners, a list (1,4,16; default {d.learners})")
    load.add_argument("--params", type=_counts, default=[d.params],
                      help=f"the model's parameters, one fragment per shard, a list (1Mi,4Mi; default {d.params})")
    load.add_argument("--shards", type=_counts, default=[d.shards], help=f"shard processes, a list (1,2,4; default {d.shards})")
    load.add_argument("--seconds", type=float, default=d.seconds, help=f"measured window per configuration (default {d.seconds:g})")
    load.add_argument("--warmup", type=float, default=d.warmup_s,
                      help="seconds of pushing before the window (default: a push period and 5 s)")
    load.add_argument("--step-s", type=float, default=d.step_s,
                      help=f"a learner's inner step time; it pushes each fragment every --sync-every steps (default {d.step_s:g})")
    load.add_argument("--sync-every", type=int, default=d.sync_every,
                      help=f"H, inner steps between a fragment's pushes (default {d.sync_every}, the run's)")
    load.add_argument("--pushes-per-s", type=float, default=d.pushes_per_s,
                      help="offer this many pushes per second in all, whatever the learner count (overrides --step-s)")
    load.add_argument("--clients", type=int, default=d.clients,
                      help=f"client processes the learners are spread over (default {d.clients})")
    load.add_argument("--seed", type=int, default=d.seed, help="seed of the deltas and the learners' start offsets")
    load.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    load.set_defaults(func=_bench_load)
    lrn = kinds.add_parser("learner", help="a learner's tokens/s with syncing on vs off, side by side")
    lrn.add_argument("--steps", type=int, default=120, help="inner steps per run (default 120)")
    lrn.add_argument("--overlap", type=int, default=2, help="tau, inner steps of overlap (default 2)")
    lrn.add_argument("--threads", type=int, help="torch threads of the learner (default: all cores but one)")
    lrn.add_argument("--tracing", action="store_true",
                     help="compare OpenTelemetry on (SDK + OTLP exporters) vs off instead, syncing on in both")
    lrn.add_argument("--runs", type=int, default=2, help="with --tracing: runs per configuration, interleaved (default 2)")
    lrn.add_argument("--json", action="store_true", help="print one JSON object")
    lrn.set_defaults(func=_bench_learner)


def _simulate(args: argparse.Namespace) -> int:
    from diloco.lab import simulate

    return simulate.run(args)


def add_simulate(commands: argparse._SubParsersAction) -> None:
    from diloco.lab.simulate import add_arguments

    parser = commands.add_parser(
        "simulate",
        help="goodput and uptime of DP, elastic DP and Decoupled DiLoCo at scale (discrete-event simulation)",
        description="Simulate chip failures at the paper's scale and report goodput and uptime.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_simulate)


def _compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from diloco.lab import compare

    scenarios = tuple(args.scenario or compare.SCENARIOS)
    cfg = from_flags(args, compare.CompareConfig, run=build_run_config(args))
    if args.workload:
        cfg = replace(cfg, steps=compare.WORKLOADS[args.workload])
    compare.check_systems(cfg)  # torchft importable, if asked for, before any run
    if cfg.link_mbit is not None or args.bandwidth_sweep:
        from diloco.coordinator.sites import check

        check()  # root, namespaces and tc, before any run starts
    if args.bandwidth_sweep:
        from diloco.lab import bandwidth

        if args.scenario or args.ablations or args.ablation or cfg.link_mbit is not None:
            raise InvalidArgument("--bandwidth-sweep runs nofault at each of its rates: without --scenario, "
                                  "--ablation(s) or --link-mbit")
        rates = bandwidth.parse_rates(args.bandwidth_sweep)
        results = bandwidth.run(cfg, rates)
        print(json.dumps(results) if args.json else (cfg.out / "bandwidth.md").read_text())
        return 0
    emit = (lambda r: print(json.dumps(r), flush=True)) if args.json else None
    ablations = tuple(compare.ABLATIONS) if args.ablations else tuple(args.ablation or ())
    try:
        compare.run(cfg, scenarios, ablations, on_result=emit)
    except compare.Interrupted as stop:
        print(f"diloco compare: {stop}", file=sys.stderr)
        return stop.exit_code
    if not args.json:
        print((cfg.out / "results.md").read_text())
    return 0


def add_compare(commands: argparse._SubParsersAction) -> None:
    from diloco.lab.compare import ABLATIONS, DEFAULT_VARIANT, SCENARIOS, WORKLOADS, CompareConfig

    p = commands.add_parser(
        "compare",
        help="Decoupled DiLoCo vs synchronous DP vs torchft, scenario by scenario (real runs); markdown, JSON, plots",
        description="Run the same task (--task) and workload under each system for each scenario and write "
                    "OUT/results.md, OUT/results.json and OUT/compare.png. The first SIGINT or SIGTERM stops the "
                    "running cell and the sweep; the report then holds the cells done (exit 130 or 143).",
    )
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only this scenario (repeatable; default all)")
    add_flag(p, "--systems", CompareConfig, "systems", shown=",".join,
             taken=lambda systems: tuple(x for x in systems.split(",") if x))
    ablate = p.add_mutually_exclusive_group()
    ablate.add_argument("--ablations", action="store_true",
                        help="also run every Decoupled ablation on nofault, hetero and mtbf30: those of them in "
                             "--scenario, or nofault and hetero when none is")
    ablate.add_argument("--ablation", action="append", metavar="VARIANT",
                        choices=[a for a in ABLATIONS if a != DEFAULT_VARIANT],
                        help="also run this ablation (repeatable), beside the default variant: "
                             + "; ".join(a for a in ABLATIONS if a != DEFAULT_VARIANT))
    add_flag(p, "--workers", CompareConfig, "workers", type=int)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--workload", choices=tuple(WORKLOADS),
                        help="inner steps per worker by name: " + ", ".join(f"{k} {v}" for k, v in WORKLOADS.items())
                             + " (default standard)")
    add_flag(budget, "--steps", CompareConfig, "steps", type=int)
    add_flag(p, "--lr", CompareConfig, "lr", type=float)
    add_flag(p, "--curve-points", CompareConfig, "curve_points", type=int)
    add_flag(p, "--seed-faults", CompareConfig, "seed", type=int)
    add_flag(p, "--seeds", CompareConfig, "seeds", type=int)
    add_flag(p, "--out", CompareConfig, "out", type=Path)
    links = p.add_argument_group("emulated sites (root: network namespaces, veth pairs and tc; docs/sites.md)")
    add_flag(links, "--link-mbit", CompareConfig, "link_mbit", type=float, metavar="R")
    links.add_argument("--bandwidth-sweep", metavar="R1,R2,...",
                       help="instead of the scenarios: every system, nofault, at each of these link rates (Mbit/s, e.g. "
                            "1000,100,20,5,1); writes OUT/bandwidth.md, .json and .png")
    add_flag(links, "--time-limit-s", CompareConfig, "time_limit_s", type=float, metavar="S")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario as it finishes")
    add_run_config(p)
    p.set_defaults(func=_compare)


def add_baseline(commands: argparse._SubParsersAction) -> None:
    """``diloco baseline dp|torchft``: the systems Decoupled DiLoCo is compared against."""
    from dataclasses import replace

    from diloco.lab.baseline.dp import DPConfig
    from diloco.lab.baseline.torchft_peer import TorchftConfig

    def baseline(args: argparse.Namespace) -> int:
        from diloco.lab.baseline.common import parse_slow_workers

        given = dict(run=build_run_config(args), slow_workers=parse_slow_workers(args.slow_worker),
                     kill_at_steps=tuple(args.kill_at_step or ()), out=Path(args.out) if args.out else None)
        if args.baseline == "dp":
            from diloco.lab.baseline.dp import run_dp

            result = run_dp(from_flags(args, DPConfig, **given))
        else:
            from diloco.lab.baseline.torchft_peer import run_torchft

            # torchft's Streaming DiLoCo mixes a synced fragment in with alpha: its own rule.
            given["run"] = replace(given["run"], reply_rule="mix")
            result = run_torchft(from_flags(args, TorchftConfig, **given))
        _print_result(result, args.json)
        return 0

    parser = commands.add_parser(
        "baseline",
        help="the baselines on the same workload as diloco local: synchronous data-parallel, torchft",
        description="Run a baseline on diloco local's task (--task: model, data, loss, eval), token budget and "
                    "worker count; write a run directory with summary.json (wall_s, tokens, eval_unit, eval_loss_*, "
                    "goodput, uptime, global_stall_s, bytes_per_1k_tokens, restarts, steps).",
    )
    kinds = parser.add_subparsers(dest="baseline", required=True, metavar="BASELINE")
    dp = kinds.add_parser(
        "dp", help="synchronous data-parallel: one gradient all-reduce per step (gloo), elastic restart from checkpoints",
        description="Synchronous data-parallel over gloo on 127.0.0.1. A dead worker stalls every worker until the "
                    "supervisor restarts all of them from the last checkpoint.",
    )
    ft = kinds.add_parser(
        "torchft", help="torchft's Streaming DiLoCo (needs the peers extra: pip install -c constraints.txt -e '.[peers]')",
        description="The same workload under torchft's Streaming DiLoCo (Lighthouse on 127.0.0.1, gloo, CPU). "
                    "A killed replica is restarted alone and heals from a peer.",
    )
    for p, who, cls in ((dp, "workers", DPConfig), (ft, "replicas", TorchftConfig)):
        add_flag(p, "--workers", cls, "workers", type=int)
        add_flag(p, "--steps", cls, "steps", type=int)
        add_flag(p, "--lr", cls, "lr", type=float)
        add_flag(p, "--kill-every", cls, "kill_every_s", type=float,
                 metavar="SECONDS")
        p.add_argument("--kill-at-step", type=int, action="append", metavar="STEP",
                       help="deterministic fault: SIGKILL a random one once step STEP is done (repeatable)")
        p.add_argument("--slow-worker", action="append", metavar="ID:FACTOR",
                       help="that worker's steps take FACTOR x as long (repeatable, or comma-separated)")
        add_flag(p, "--fault-seed", cls, "fault_seed", type=int)
        add_flag(p, "--threads-per-worker", cls, "threads_per_worker",
                 type=int)
        add_flag(p, "--link-mbit", cls, "link_mbit", type=float, metavar="R")
        add_flag(p, "--time-limit-s", cls, "time_limit_s", type=float, metavar="S")
        p.add_argument("--out", help="run directory (default ./runs/<baseline>-<timestamp>)")
        p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
        add_run_config(p)
        p.set_defaults(func=baseline)
    add_flag(dp, "--checkpoint-every", DPConfig, "checkpoint_every_steps", type=int,
             metavar="STEPS")
    add_flag(ft, "--outer-lr", TorchftConfig, "outer_lr", type=float)
    add_flag(ft, "--outer-momentum", TorchftConfig, "outer_momentum", type=float)



COMMANDS = (add_compare, add_baseline, add_bench, add_simulate)
"""The lab's commands, after the product's in ``diloco --help``."""
