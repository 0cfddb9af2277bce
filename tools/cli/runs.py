"""The commands that drive or measure runs: local, compare, baseline, bench, simulate, replay,
timeline, tape and certs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from diloco.errors import InvalidArgument
from learner.config import DELTA_CODECS
from syncer.config import DOWNLINKS, MERGE_MODES, SCALE_MODES
from tools.chaos import DEFAULT_FAULT_S, FAULT_KINDS, RESTART_SOURCES, ChaosConfig
from tools.cli.common import add_grace_flag, add_run_config, build_run_config, parse_count
from tools.cli.settings import add_config_flag, add_flag, from_flags
from tools.local.config import LocalConfig

logger = logging.getLogger(__name__)


def _bench_codec(args: argparse.Namespace) -> int:
    from tools.bench import codec

    result = codec.run(size_mib=args.size_mib, repeats=args.repeats)
    _print_result(result, args.json)
    return 0


def _bench_syncer(args: argparse.Namespace) -> int:
    from tools.bench import syncer

    _print_result(syncer.run(params=args.params, learners=args.learners, rounds=args.rounds), args.json)
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    import itertools

    from tools.bench import load

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
    from tools.bench import learner

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
    from tools.bench.load import LoadConfig

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
    from tools import simulate

    return simulate.run(args)


def add_simulate(commands: argparse._SubParsersAction) -> None:
    from tools.simulate import add_arguments

    parser = commands.add_parser(
        "simulate",
        help="goodput and uptime of DP, elastic DP and Decoupled DiLoCo at scale (discrete-event simulation)",
        description="Simulate chip failures at the paper's scale and report goodput and uptime.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_simulate)


def _local(args: argparse.Namespace) -> int:
    from tools.local.run import resume_config, run_local

    cfg = _local_config(args)
    if args.resume:  # the stored run, with what was given checked against it
        commands = argparse.ArgumentParser().add_subparsers()
        add_local(commands)  # its defaults (and the top level's transport flag's)
        defaults = argparse.Namespace(**vars(commands.choices["local"].parse_args([])), plaintext=False)
        cfg = resume_config(Path(args.resume), cfg, _local_config(defaults))
    if not cfg.tls:
        logger.warning("--insecure: the run's processes talk plaintext gRPC (tokens and credentials in clear)")
    summary = run_local(cfg)
    if args.json:
        print(json.dumps(summary, indent=1))
    if summary["interrupted"]:
        return 130
    return 1 if summary["failures"] else 0  # closing_lines said what failed


def _local_config(args: argparse.Namespace):
    from tools.chaos import parse_chaos, parse_learner_device, parse_link, parse_scavenge, parse_slow

    return from_flags(
        args, LocalConfig,
        run=build_run_config(args), tokens=args.tokens, out=Path(args.out) if args.out else None,
        chaos=from_flags(
            args, ChaosConfig,
            kill_every_s=args.kill_learner_every, max_kills=args.max_kills, restart_shard_at_s=args.restart_shard_at,
            scavenge=parse_scavenge(args.scavenge) if args.scavenge else None,
            faults=parse_chaos(args.chaos) if args.chaos else (),
        ),
        slow_learners=tuple(parse_slow(x) for x in args.slow_learner or ()),
        learner_devices=tuple(parse_learner_device(x) for x in args.learner_device or ()),
        links=tuple(parse_link(x) for x in args.link or ()),
        child_env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": args.otlp_endpoint,
                   "OTEL_EXPORTER_OTLP_INSECURE": "true"} if args.otlp_endpoint else None,
        learner_threads=args.learner_threads, snapshot_dir=args.snapshot_dir,
        tls=not (args.insecure or args.plaintext),
    )


def add_local(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "local",
        help="the main job: a coordinator, S shards and M learners as processes on 127.0.0.1, training the default model",
        description="Run a real multi-process Decoupled DiLoCo training on this machine and write a run directory.",
    )
    add_config_flag(p)
    add_flag(p, "--learners", LocalConfig, "learners", "M: learners", type=int)
    add_flag(p, "--shards", LocalConfig, "shards", "S: syncer shards", type=int)
    add_flag(p, "--quorum", LocalConfig, "quorum", "K: minimum pushes per round", type=int)
    add_grace_flag(p, LocalConfig, "grace", "auto, off, or SECONDS",
                   taken=lambda grace: grace[0] if grace[0] != "fixed" else str(grace[1]))
    budget = p.add_mutually_exclusive_group()
    add_flag(budget, "--steps", LocalConfig, "steps", "inner steps per learner", type=int)
    budget.add_argument("--tokens", type=int, help="token budget of the whole run instead (learners drain once it is trained)")
    add_flag(p, "--outer-lr", LocalConfig, "outer_lr", "shards' outer learning rate (see README)", type=float)
    add_flag(p, "--outer-momentum", LocalConfig, "outer_momentum", "shards' outer Nesterov momentum", type=float)
    add_flag(p, "--merge", LocalConfig, "merge", "shards' merge", choices=MERGE_MODES)
    add_flag(p, "--scale-by", LocalConfig, "scale_by",
             "shards scale the outer lr by the round's share of live learners (live) or not (round)", choices=SCALE_MODES)
    add_flag(p, "--downlink", LocalConfig, "downlink",
             "shards' replies: one int4 update from the learner's anchor (condensed) or every update since it (chain)",
             choices=DOWNLINKS)
    add_flag(p, "--delta-codec", LocalConfig, "delta_codec", "learners' delta encoding", choices=DELTA_CODECS)
    add_flag(p, "--error-feedback", LocalConfig, "error_feedback",
             "learners add what int4 left out of a fragment's last push to its next", action=argparse.BooleanOptionalAction)
    add_flag(p, "--block-size", LocalConfig, "block_size", "int4 block size of pushes and replies", type=int)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", help="run directory, new or empty (default ./runs/<timestamp>)")
    where.add_argument("--resume", metavar="RUN_DIR",
                       help="continue a stopped run from its newest complete snapshot (Ctrl-C and SIGTERM take one; "
                            "--snapshot-every-s for crashes), with its stored config: flags that would change it are "
                            "refused (--learners, --learner-threads, chaos, telemetry and snapshot schedule may differ)")
    p.add_argument("--json", action="store_true",
                   help="print the run's summary (summary.json) on stdout as it ends; exit code 1 if a learner failed "
                        "before training or no token was trained, 130 if interrupted")
    p.add_argument("--otlp-endpoint", metavar="URL", help="send every process's traces and metrics here (OTLP/gRPC)")
    add_flag(p, "--prometheus", LocalConfig, "prometheus",
             "every process serves Prometheus metrics on 127.0.0.1 at a port of its own; RUN_DIR/prometheus-targets.json "
             "lists the live ones (labels role, learner, shard) for a Prometheus file_sd_configs (needs the "
             "diloco[metrics] extra)", action="store_true")
    p.add_argument("--learner-device", action="append", metavar="ID:DEVICE",
                   help="the ID-th learner launched (0-based; L0 reads as 0) trains on DEVICE: cpu, cuda or xla "
                        "(repeatable; default: every learner on the CPU). xla uses every device PJRT_DEVICE gives "
                        "(on the CPU: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4) and needs torch-xla (constraints-xla.txt)")
    p.add_argument("--learner-threads", type=int, help="torch threads per learner (default: cores / learners, at least 1)")
    add_flag(p, "--learner-evals", LocalConfig, "learner_evals",
             "evaluations each learner makes while it trains (0: none; the supervisor evaluates the seed and the "
             "final model either way)", type=int, metavar="N")
    add_flag(p, "--lr", LocalConfig, "lr", "the learners' peak inner learning rate", type=float)
    add_flag(p, "--curve-points", LocalConfig, "curve_points",
             "export the global model as the learners pass each of N equal shares of the budget and evaluate it after "
             "the run: the global model's eval in RUN_DIR/curves.jsonl, loss.png and summary.json's curve (0: only the "
             "seed and the final model)", type=int, metavar="N")
    add_flag(p, "--tensorboard", LocalConfig, "tensorboard",
             "also write the run's loss curves (RUN_DIR/curves.jsonl: training loss, evals, the global model's eval "
             "against the run's tokens) as TensorBoard event files in DIR as the run ends; a resumed run given the same "
             "DIR adds its part (needs the diloco[tensorboard] extra)", type=Path, metavar="DIR")
    add_flag(p, "--status-page", LocalConfig, "status_page",
             "the coordinator serves a live status page (members, shards, snapshots, loss curves, events) on "
             "127.0.0.1; the run prints its URL", action=argparse.BooleanOptionalAction)
    add_flag(p, "--fork-server", LocalConfig, "fork_server",
             "the coordinator forks learners from a process that loaded their code once, so no launch (start, "
             "replacement, scavenged learner) pays the load; --no-fork-server: each launch starts a process",
             action=argparse.BooleanOptionalAction)
    add_flag(p, "--insecure", LocalConfig, "tls",
             "plaintext gRPC between the run's processes instead of mutual TLS with a CA and certificate made for "
             "the run in RUN_DIR/tls", action="store_true", shown=lambda tls: not tls)
    links = p.add_argument_group("emulated sites (root: network namespaces, veth pairs and tc; docs/sites.md)")
    add_flag(links, "--link-mbit", LocalConfig, "link_mbit",
             "every learner (replacements and scavenged ones too) runs in a network namespace of its own, joined to the "
             "shards and the coordinator by a link the kernel shapes to R Mbit/s each way (None: every process on "
             "127.0.0.1)", type=float, metavar="R")
    links.add_argument("--link", action="append", metavar="ID:MBIT",
                       help="the ID-th learner launched (0-based; L1 reads as 1) gets a link of MBIT Mbit/s instead "
                            "(repeatable; turns sites on)")
    snapshots = p.add_argument_group("snapshots")
    snapshots.add_argument("--snapshot-dir", metavar="DIR|URL",
                           help="where snapshots go: a directory or an fsspec URL such as s3://bucket/run "
                                "(default RUN_DIR/coordinator/snapshots)")
    add_flag(snapshots, "--snapshot-every-s", LocalConfig, "snapshot_every_s",
             "the coordinator takes a snapshot every S seconds (0: only on demand)", type=float, metavar="S")
    add_flag(snapshots, "--snapshot-keep", LocalConfig, "snapshot_keep", "keep the newest N complete snapshots (0: all)",
             type=int, metavar="N")
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--kill-learner-every", type=float, metavar="SECONDS",
                       help="SIGKILL a random learner every SECONDS on average (Poisson; times count from the launch of the learners); a replacement is launched")
    chaos.add_argument("--max-kills", type=int, metavar="N", help="stop killing after N kills (default: no limit)")
    chaos.add_argument("--slow-learner", action="append", metavar="ID:FACTOR",
                       help="the ID-th learner launched (0-based; L1 reads as 1) takes FACTOR x as long per "
                       "step (repeatable); ids are given at join, so its events file says slow_factor")
    add_flag(chaos, "--delay-ms", LocalConfig, "delay_ms", "delay added to every push and reply", type=float)
    add_flag(p, "--time-limit-s", LocalConfig, "time_limit_s",
             "stop the learners this long after the start, the budget trained or not (summary.json: time_limited)",
             type=float, metavar="S")
    chaos.add_argument("--restart-shard-at", type=float, metavar="SECONDS",
                       help="snapshot, SIGKILL shard 0 and restart it from the snapshot at SECONDS")
    add_flag(chaos, "--restart-from", ChaosConfig, "restart_from",
             "the restarted shard comes back from a snapshot or, with no state, from the learners' anchors",
             choices=RESTART_SOURCES)
    chaos.add_argument("--scavenge", metavar="N@SECONDS", help="add N learners through AddLearners at SECONDS")
    chaos.add_argument("--chaos", metavar="SPEC",
                       help="one seeded schedule of faults: a comma list of KIND[:SECONDS][@TARGET], kinds "
                            f"{', '.join(FAULT_KINDS)} (network faults last {DEFAULT_FAULT_S:g} s unless given and "
                            "need --link-mbit), e.g. cut:20,flap,starve,cut-shard@S1,kill,restart-shard; each kind "
                            "once per cycle in a seeded order; the run is checked after (check.json)")
    add_flag(chaos, "--chaos-every", ChaosConfig, "fault_every_s", "mean seconds between two --chaos faults (Poisson)",
             type=float, metavar="S")
    add_flag(chaos, "--chaos-seed", ChaosConfig, "seed", "seed of the kill and fault schedules and their victims", type=int)
    add_run_config(p)
    p.set_defaults(func=_local)


def _timeline(args: argparse.Namespace) -> int:
    from tools.timeline import draw_timeline

    print(draw_timeline(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def _check(args: argparse.Namespace) -> int:
    from tools.check import describe, totals, write_check

    reports = [write_check(Path(d), args.snapshot_dir) for d in args.run_dir]
    for run_dir, report in zip(args.run_dir, reports):
        line = json.dumps(report.to_json()) if args.json else describe(report)
        print(f"{run_dir}: {line}" if len(reports) > 1 and not args.json else line)
    if len(reports) > 1:
        print(json.dumps(totals(reports)) if args.json else f"all: {totals(reports)['line']}")
    return 0 if all(r.ok for r in reports) else 1


def _replay(args: argparse.Namespace) -> int:
    from tools.replay import replay

    results = replay(Path(args.run_dir), args.snapshot_dir or None)
    worst = max(r.max_abs_diff for r in results)
    if args.json:
        print(json.dumps({"max_abs_diff": worst, "shards": [r.__dict__ for r in results]}))
    else:
        for r in results:
            origin = f"snapshot {r.restored_from}" if r.restored_from is not None else "its initial values"
            print(f"shard {r.shard_id}: replayed {r.rounds} rounds from {origin}; "
                  f"fragments at versions {r.fragments}; max |diff| {r.max_abs_diff:.3g}")
        print(f"max absolute difference from the run's final global parameters: {worst:.3g}")
    return 0 if worst == 0 or not args.check else 1


def _compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tools import compare

    scenarios = tuple(args.scenario or compare.SCENARIOS)
    cfg = from_flags(args, compare.CompareConfig, run=build_run_config(args))
    if args.workload:
        cfg = replace(cfg, steps=compare.WORKLOADS[args.workload])
    if cfg.link_mbit is not None or args.bandwidth_sweep:
        from diloco.sites import check

        check()  # root, namespaces and tc, before any run starts
    if args.bandwidth_sweep:
        from tools import bandwidth

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
    from tools.bandwidth import TIME_LIMIT_S
    from tools.compare import ABLATIONS, DEFAULT_VARIANT, SCENARIOS, SYSTEMS, WORKLOADS, CompareConfig

    p = commands.add_parser(
        "compare",
        help="Decoupled DiLoCo vs synchronous DP vs torchft, scenario by scenario (real runs); markdown, JSON, plots",
        description="Run the same task (--task) and workload under each system for each scenario and write "
                    "OUT/results.md, OUT/results.json and OUT/compare.png. The first SIGINT or SIGTERM stops the "
                    "running cell and the sweep; the report then holds the cells done (exit 130 or 143).",
    )
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only this scenario (repeatable; default all)")
    add_flag(p, "--systems", CompareConfig, "systems", f"comma-separated subset of {','.join(SYSTEMS)}", shown=",".join,
             taken=lambda systems: tuple(x for x in systems.split(",") if x))
    ablate = p.add_mutually_exclusive_group()
    ablate.add_argument("--ablations", action="store_true",
                        help="also run every Decoupled ablation on nofault, hetero and mtbf30: those of them in "
                             "--scenario, or nofault and hetero when none is")
    ablate.add_argument("--ablation", action="append", metavar="VARIANT",
                        choices=[a for a in ABLATIONS if a != DEFAULT_VARIANT],
                        help="also run this ablation (repeatable), beside the default variant: "
                             + "; ".join(a for a in ABLATIONS if a != DEFAULT_VARIANT))
    add_flag(p, "--workers", CompareConfig, "workers", "M: learners / DP workers / torchft replicas", type=int)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--workload", choices=tuple(WORKLOADS),
                        help="inner steps per worker by name: " + ", ".join(f"{k} {v}" for k, v in WORKLOADS.items())
                             + " (default standard)")
    add_flag(budget, "--steps", CompareConfig, "steps", "inner steps per worker", type=int)
    add_flag(p, "--lr", CompareConfig, "lr", "peak inner learning rate of every system's workers", type=float)
    add_flag(p, "--curve-points", CompareConfig, "curve_points", "points of every run's eval curve (OUT/curves.png): "
             "the global model is saved as the run passes each share of its budget and evaluated after it", type=int)
    add_flag(p, "--seed-faults", CompareConfig, "seed", "seed of the fault schedules", type=int)
    add_flag(p, "--seeds", CompareConfig, "seeds", "runs of every cell, each with its own model, data order and faults "
             "(the report gives their mean and spread)", type=int)
    add_flag(p, "--out", CompareConfig, "out", "output directory", type=Path)
    links = p.add_argument_group("emulated sites (root: network namespaces, veth pairs and tc; docs/sites.md)")
    add_flag(links, "--link-mbit", CompareConfig, "link_mbit",
             "every system's workers each on a site of its own behind a link the kernel shapes to R Mbit/s each way "
             "(None: all on 127.0.0.1)", type=float, metavar="R")
    links.add_argument("--bandwidth-sweep", metavar="R1,R2,...",
                       help="instead of the scenarios: every system, nofault, at each of these link rates (Mbit/s, e.g. "
                            "1000,100,20,5,1); writes OUT/bandwidth.md, .json and .png")
    add_flag(links, "--time-limit-s", CompareConfig, "time_limit_s",
             "stop a run this long after its start, the budget trained or not; it reports the tokens per second it "
             f"reached, marked time-limited (the sweep's default: {TIME_LIMIT_S:g})", type=float, metavar="S")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario as it finishes")
    add_run_config(p)
    p.set_defaults(func=_compare)


def _certs(args: argparse.Namespace) -> int:
    from tools.certs import make_certs

    hosts = [h.strip() for h in (args.hosts or "").split(",") if h.strip()]
    files = make_certs(Path(args.out), hosts, days=args.days, overwrite=args.overwrite)
    print(f"wrote {', '.join(str(f) for f in files)}: give every process of the run --tls-dir {args.out} "
          f"(keep {files[1].name} to yourself; it signs more certificates)")
    return 0


def add_certs(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "certs", help="make a run's CA and certificate for mutual TLS (--tls-dir)",
        description="Write ca.crt, ca.key, tls.crt and tls.key: a CA for one run and one certificate, signed by "
                    "it, that every process of the run presents (as server and client) with --tls-dir DIR.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created; keys are 0600)")
    p.add_argument("--hosts", metavar="H1,H2", help="extra DNS names or IPs the certificate names (channels verify "
                   "the name 'diloco', which it always carries)")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--overwrite", action="store_true", help="replace certificates already in DIR")
    p.set_defaults(func=_certs)


def add_run_tools(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("timeline", help="redraw a diloco local run's busy/idle timeline from its tapes")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", help="PNG to write (default RUN_DIR/timeline.png)")
    p.set_defaults(func=_timeline)
    p = commands.add_parser("check", help="check a diloco local chaos run's recorded history against its invariants",
                            description="Check a finished diloco local run (tools/check.py: replay bit for bit, versions "
                                        "never backwards, no push merged twice or after its learner failed, progress "
                                        "while a learner could reach each shard, every learner accounted for, eval "
                                        "improved); writes RUN_DIR/check.json; exit 1 on a violation.")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="one or more runs (several: a soak; totals at the end)")
    p.add_argument("--json", action="store_true", help="print check.json's object (one per run, then the totals)")
    p.add_argument("--snapshot-dir", help="where the runs' snapshots are, a directory or URL (default: the run's "
                                          "--snapshot-dir, else RUN_DIR/coordinator/snapshots)")
    p.set_defaults(func=_check)
    p = commands.add_parser("replay", help="re-run a diloco local run's rounds from its tapes; compare with its final model")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--snapshot-dir", help="where the run's snapshots are, a directory or URL (default RUN_DIR/coordinator/snapshots)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the replay matches bit for bit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_replay)


def add_baseline(commands: argparse._SubParsersAction) -> None:
    """``diloco baseline dp|torchft``: the systems Decoupled DiLoCo is compared against."""
    from dataclasses import replace

    from tools.baseline.dp import DPConfig
    from tools.baseline.torchft_peer import TorchftConfig

    def baseline(args: argparse.Namespace) -> int:
        from tools.baseline.common import parse_slow_workers

        given = dict(run=build_run_config(args), slow_workers=parse_slow_workers(args.slow_worker),
                     kill_at_steps=tuple(args.kill_at_step or ()), out=Path(args.out) if args.out else None)
        if args.baseline == "dp":
            from tools.baseline.dp import run_dp

            result = run_dp(from_flags(args, DPConfig, **given))
        else:
            from tools.baseline.torchft_peer import run_torchft

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
        "torchft", help="torchft's Streaming DiLoCo (needs the optional extra: pip install 'diloco[peers]')",
        description="The same workload under torchft's Streaming DiLoCo (Lighthouse on 127.0.0.1, gloo, CPU). "
                    "A killed replica is restarted alone and heals from a peer.",
    )
    for p, who, cls in ((dp, "workers", DPConfig), (ft, "replicas", TorchftConfig)):
        add_flag(p, "--workers", cls, "workers", f"M: {who}, one process each", type=int)
        add_flag(p, "--steps", cls, "steps", "steps per worker", type=int)
        add_flag(p, "--lr", cls, "lr", "peak inner learning rate", type=float)
        add_flag(p, "--kill-every", cls, "kill_every_s",
                 f"SIGKILL a random one of the {who} every SECONDS on average (exponential; 0: never)", type=float,
                 metavar="SECONDS")
        p.add_argument("--kill-at-step", type=int, action="append", metavar="STEP",
                       help="deterministic fault: SIGKILL a random one once step STEP is done (repeatable)")
        p.add_argument("--slow-worker", action="append", metavar="ID:FACTOR",
                       help="that worker's steps take FACTOR x as long (repeatable, or comma-separated)")
        add_flag(p, "--fault-seed", cls, "fault_seed", "seed of the kill plan", type=int)
        add_flag(p, "--threads-per-worker", cls, "threads_per_worker", "torch threads of each process (as torchrun sets)",
                 type=int)
        add_flag(p, "--link-mbit", cls, "link_mbit", f"each of the {who} on an emulated site of its own behind a link "
                 "the kernel shapes to R Mbit/s each way (root; None: all on 127.0.0.1)", type=float, metavar="R")
        add_flag(p, "--time-limit-s", cls, "time_limit_s", "stop the job this long after its launch, trained or not "
                 "(no final model; the summary says time_limited)", type=float, metavar="S")
        p.add_argument("--out", help="run directory (default ./runs/<baseline>-<timestamp>)")
        p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
        add_run_config(p)
        p.set_defaults(func=baseline)
    add_flag(dp, "--checkpoint-every", DPConfig, "checkpoint_every_steps", "steps between two checkpoints", type=int,
             metavar="STEPS")
    add_flag(ft, "--outer-lr", TorchftConfig, "outer_lr", "outer SGD learning rate, as the shards'", type=float)
    add_flag(ft, "--outer-momentum", TorchftConfig, "outer_momentum", "outer Nesterov momentum, as the shards'", type=float)

def _tape_show(args: argparse.Namespace) -> int:
    from diloco.tape import read_tape

    records = list(read_tape(args.path))
    if args.kind:
        present = sorted({r["kind"] for r in records})
        unknown = sorted(set(args.kind) - set(present))
        if unknown:
            raise InvalidArgument(f"{args.path} has no records of kind {', '.join(unknown)}; its kinds: {', '.join(present)}")
        records = [r for r in records if r["kind"] in args.kind]
    if args.json:
        print(json.dumps(records))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", title=str(args.path))
    for column in ("t", "kind", "learner", "fragment", "version", "detail"):
        table.add_column(column)
    start = records[0]["t"] if records else 0.0
    for r in records:
        version = r.get("version", r.get("target_version", ""))
        if r["kind"] == "round":
            detail = f"{len(r['participants'])} learners, {r['reason']}, merge {r['merge_s'] * 1e3:.1f} ms"
        elif r["kind"] == "push":
            detail = f"base {r['base_version']}, {r['tokens']} tokens / {r['steps']} steps, {r['bytes']} B, {r['outcome']}"
        else:
            detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("t", "kind", "learner", "fragment"))
        table.add_row(
            f"{r['t'] - start:9.3f}", r["kind"], str(r.get("learner", "")), str(r.get("fragment", "")), str(version), detail
        )
    Console().print(table)
    return 0


def add_tape(commands: argparse._SubParsersAction) -> None:
    tape = commands.add_parser("tape", help="read a shard's event tape")
    verbs = tape.add_subparsers(dest="tape", required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print a tape as a table (or JSON)")
    show.add_argument("path", type=Path, help="tape file (tape-S<m>.jsonl in a shard's data directory)")
    show.add_argument("--kind", action="append", help="only these record kinds (repeatable): push, round, membership, ...")
    show.add_argument("--json", action="store_true", help="print the records as one JSON list")
    show.set_defaults(func=_tape_show)


