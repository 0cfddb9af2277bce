"""The commands that run and read runs: local, replay, check, timeline, tape and certs."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from pathlib import Path

from diloco.cli.chaos import DEFAULT_FAULT_S, FAULT_KINDS, RESTART_SOURCES, ChaosConfig
from diloco.cli.common import add_grace_flag, add_run_config, build_run_config
from diloco.cli.local.config import LocalConfig
from diloco.cli.settings import add_config_flag, add_flag, from_flags
from diloco.errors import InvalidArgument
from diloco.learner.config import DELTA_CODECS, INNER_OPTIMIZERS
from diloco.syncer.config import DOWNLINKS, MERGE_MODES, OUTER_OPTIMIZERS, REPLY_CODECS, SCALE_MODES

logger = logging.getLogger(__name__)


def _local(args: argparse.Namespace) -> int:
    from diloco.cli.local.rundir import resume_config
    from diloco.cli.local.run import run_local

    cfg = _local_config(args)
    if args.resume:  # the stored run, with what was given checked against it
        commands = argparse.ArgumentParser().add_subparsers()
        add_local(commands)  # its defaults (and the top level's transport flag's)
        defaults = argparse.Namespace(**vars(commands.choices["local"].parse_args([])), plaintext=False)
        cfg = resume_config(Path(args.resume), cfg, _local_config(defaults))
    if not cfg.tls:
        logger.warning("--insecure: the run's processes talk plaintext gRPC (tokens and credentials in clear)")
    summary = run_local(cfg)
    # What follows is the process's exit, whose teardown collects every object the run
    # left: torch's alone took 0.4-1.4 s (a loaded machine), past the closing line's
    # "stopped N s after the interrupt". Frozen, they are not walked: the exit takes ~0.3 s.
    gc.freeze()
    if args.json:
        print(json.dumps(summary, indent=1))
    if summary["interrupted"]:
        return 130
    return 1 if summary["failures"] else 0  # closing_lines said what failed


def _local_config(args: argparse.Namespace):
    from diloco.cli.chaos import parse_chaos, parse_learner_device, parse_link, parse_scavenge, parse_slow

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
    _add_cluster_flags(p)
    _add_run_dir_flags(p)
    _add_learner_flags(p)
    _add_sites_and_snapshots_flags(p)
    _add_chaos_flags(p)
    add_run_config(p)
    p.set_defaults(func=_local)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The cluster, the budget and the sync: learners, shards, rounds, outer step, codec."""
    add_flag(p, "--learners", LocalConfig, "learners", type=int)
    add_flag(p, "--shards", LocalConfig, "shards", type=int)
    add_flag(p, "--quorum", LocalConfig, "quorum", type=int)
    add_grace_flag(p, LocalConfig, "grace", taken=lambda grace: grace[0] if grace[0] != "fixed" else str(grace[1]))
    budget = p.add_mutually_exclusive_group()
    add_flag(budget, "--steps", LocalConfig, "steps", type=int)
    budget.add_argument("--tokens", type=int, help="token budget of the whole run instead (learners drain once it is trained)")
    add_flag(p, "--outer-lr", LocalConfig, "outer_lr", type=float)
    add_flag(p, "--outer-momentum", LocalConfig, "outer_momentum", type=float)
    add_flag(p, "--outer-optimizer", LocalConfig, "outer_optimizer", choices=OUTER_OPTIMIZERS)
    add_flag(p, "--merge", LocalConfig, "merge", choices=MERGE_MODES)
    add_flag(p, "--scale-by", LocalConfig, "scale_by", choices=SCALE_MODES)
    add_flag(p, "--downlink", LocalConfig, "downlink", choices=DOWNLINKS)
    add_flag(p, "--reply-codec", LocalConfig, "reply_codec", choices=REPLY_CODECS)
    add_flag(p, "--reply-density", LocalConfig, "reply_density", type=float)
    add_flag(p, "--robust-multiple", LocalConfig, "robust_multiple", type=float)
    add_flag(p, "--validator", LocalConfig, "validator", action="store_true")
    add_flag(p, "--delta-codec", LocalConfig, "delta_codec", choices=DELTA_CODECS)
    add_flag(p, "--delta-density", LocalConfig, "delta_density", type=float)
    add_flag(p, "--error-feedback", LocalConfig, "error_feedback", action=argparse.BooleanOptionalAction)
    add_flag(p, "--block-size", LocalConfig, "block_size", type=int)


def _add_run_dir_flags(p: argparse.ArgumentParser) -> None:
    """Where the run goes (or which stopped run continues) and what it tells."""
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
    add_flag(p, "--prometheus", LocalConfig, "prometheus", action="store_true")


def _add_learner_flags(p: argparse.ArgumentParser) -> None:
    """The learners' devices, threads, evaluations and learning rate; the curves, the
    status page, the fork server and the transport."""
    p.add_argument("--learner-device", action="append", metavar="ID:DEVICE",
                   help="the ID-th learner launched (0-based; L0 reads as 0) trains on DEVICE: cpu, cuda or xla "
                        "(repeatable; default: every learner on the CPU). xla uses every device PJRT_DEVICE gives "
                        "(on the CPU: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4) and needs torch-xla (constraints-xla.txt)")
    p.add_argument("--learner-threads", type=int, help="torch threads per learner (default: cores / learners, at least 1)")
    add_flag(p, "--learner-evals", LocalConfig, "learner_evals", type=int, metavar="N")
    add_flag(p, "--lr", LocalConfig, "lr", type=float)
    add_flag(p, "--inner-optimizer", LocalConfig, "inner_optimizer", choices=INNER_OPTIMIZERS)
    add_flag(p, "--curve-points", LocalConfig, "curve_points", type=int, metavar="N")
    add_flag(p, "--tensorboard", LocalConfig, "tensorboard", type=Path, metavar="DIR")
    add_flag(p, "--status-page", LocalConfig, "status_page", action=argparse.BooleanOptionalAction)
    add_flag(p, "--fork-server", LocalConfig, "fork_server", action=argparse.BooleanOptionalAction)
    add_flag(p, "--insecure", LocalConfig, "tls", action="store_true", shown=lambda tls: not tls)


def _add_sites_and_snapshots_flags(p: argparse.ArgumentParser) -> None:
    links = p.add_argument_group("emulated sites (root: network namespaces, veth pairs and tc; docs/sites.md)")
    add_flag(links, "--link-mbit", LocalConfig, "link_mbit", type=float, metavar="R")
    links.add_argument("--link", action="append", metavar="ID:MBIT",
                       help="the ID-th learner launched (0-based; L1 reads as 1) gets a link of MBIT Mbit/s instead "
                            "(repeatable; turns sites on)")
    snapshots = p.add_argument_group("snapshots")
    snapshots.add_argument("--snapshot-dir", metavar="DIR|URL",
                           help="where snapshots go: a directory or an fsspec URL such as s3://bucket/run "
                                "(default RUN_DIR/coordinator/snapshots)")
    add_flag(snapshots, "--snapshot-every-s", LocalConfig, "snapshot_every_s", type=float, metavar="S")
    add_flag(snapshots, "--snapshot-keep", LocalConfig, "snapshot_keep", type=int, metavar="N")


def _add_chaos_flags(p: argparse.ArgumentParser) -> None:
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--kill-learner-every", type=float, metavar="SECONDS",
                       help="SIGKILL a random learner every SECONDS on average (Poisson; times count from the launch "
                            "of the learners); a replacement is launched")
    chaos.add_argument("--max-kills", type=int, metavar="N", help="stop killing after N kills (default: no limit)")
    chaos.add_argument("--slow-learner", action="append", metavar="ID:FACTOR",
                       help="the ID-th learner launched (0-based; L1 reads as 1) takes FACTOR x as long per "
                       "step (repeatable); ids are given at join, so its events file says slow_factor")
    add_flag(chaos, "--delay-ms", LocalConfig, "delay_ms", type=float)
    add_flag(p, "--time-limit-s", LocalConfig, "time_limit_s", type=float, metavar="S")
    chaos.add_argument("--restart-shard-at", type=float, metavar="SECONDS",
                       help="snapshot, SIGKILL shard 0 and restart it from the snapshot at SECONDS")
    add_flag(chaos, "--restart-from", ChaosConfig, "restart_from", choices=RESTART_SOURCES)
    chaos.add_argument("--scavenge", metavar="N@SECONDS", help="add N learners through AddLearners at SECONDS")
    chaos.add_argument("--chaos", metavar="SPEC",
                       help="one seeded schedule of faults: a comma list of KIND[:SECONDS][@TARGET], kinds "
                            f"{', '.join(FAULT_KINDS)} (network faults last {DEFAULT_FAULT_S:g} s unless given and "
                            "need --link-mbit), e.g. cut:20,flap,starve,cut-shard@S1,kill,restart-shard; each kind "
                            "once per cycle in a seeded order; the run is checked after (check.json)")
    add_flag(chaos, "--chaos-every", ChaosConfig, "fault_every_s", type=float, metavar="S")
    add_flag(chaos, "--chaos-seed", ChaosConfig, "seed", type=int)


def _timeline(args: argparse.Namespace) -> int:
    from diloco.cli.timeline import draw_timeline

    print(draw_timeline(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def _check(args: argparse.Namespace) -> int:
    from diloco.cli.check import describe, totals, write_check

    reports = [write_check(Path(d), args.snapshot_dir) for d in args.run_dir]
    for run_dir, report in zip(args.run_dir, reports):
        line = json.dumps(report.to_json()) if args.json else describe(report)
        print(f"{run_dir}: {line}" if len(reports) > 1 and not args.json else line)
    if len(reports) > 1:
        print(json.dumps(totals(reports)) if args.json else f"all: {totals(reports)['line']}")
    return 0 if all(r.ok for r in reports) else 1


def _replay(args: argparse.Namespace) -> int:
    from diloco.cli.replay import replay

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


def _certs(args: argparse.Namespace) -> int:
    from diloco.cli.certs import make_certs

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
                            description="Check a finished diloco local run (diloco/cli/check.py: replay bit for bit, versions "
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


