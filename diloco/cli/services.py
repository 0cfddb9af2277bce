"""``diloco syncer``, ``diloco learner`` and ``diloco validator``: a shard's, a learner's and
the validator's process, from flags or --config (the coordinator's are in
diloco/cli/coordinator.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.coordinator.config import CoordinatorConfig
from diloco.task import DEFAULT_TASK
from diloco.learner.config import DELTA_CODECS, DEVICES, INNER_OPTIMIZERS, PRECISIONS, LearnerConfig
from diloco.validator.config import ValidatorConfig
from diloco.syncer.config import DOWNLINKS, MERGE_MODES, OUTER_OPTIMIZERS, REPLY_CODECS, SCALE_MODES, MergeConfig, RoundConfig, ShardServerConfig, SyncerConfig
from diloco.cli.common import (GPT_OPTIONS, add_grace_flag, add_run_config, add_telemetry, build_run_config, run_secret,
                              start_telemetry)
from diloco.cli.settings import add_config_flag, add_flag, from_flags


def _syncer(args: argparse.Namespace) -> int:
    import asyncio

    from diloco.syncer.server import run_shard

    run = build_run_config(args)
    grace_mode, grace_s = args.grace
    cfg = from_flags(
        args, SyncerConfig,
        rounds=from_flags(args, RoundConfig, grace_mode=grace_mode, grace_fixed_s=grace_s, overlap_steps=run.overlap_steps),
        merge=from_flags(args, MergeConfig),
    )
    server_cfg = from_flags(
        args, ShardServerConfig,
        secret=run_secret(args),
        health_port=args.health_port,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        static_learners=tuple(x for x in args.learners.split(",") if x) if args.learners else (),
        coordinator=args.coordinator,
        snapshot_dir=args.snapshot_dir or None,
        restore=args.restore,
    )
    telemetry = start_telemetry(args, "syncer", shard_id=args.shard_id)
    try:
        return asyncio.run(run_shard(run, cfg, server_cfg, Path(args.port_file) if args.port_file else None))
    finally:
        telemetry.shutdown()


def add_syncer(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "syncer",
        help="run one syncer shard (CPU parameter server owning fragments p with p mod S == shard id)",
        description="Run one syncer shard. SIGTERM closes open rounds, answers waiting pushes, flushes the tape, exits 0.",
    )
    add_config_flag(p)
    add_flag(p, "--shard-id", SyncerConfig, "shard_id", type=int)
    add_flag(p, "--shards", SyncerConfig, "num_shards", type=int)
    add_flag(p, "--host", ShardServerConfig, "host")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="also answer grpc.health.v1 in plaintext on PORT (for kubelet probes when --tls-dir "
                        "makes the main port mutual TLS)")
    add_flag(p, "--reflection", ShardServerConfig, "reflection",
             action="store_true")
    add_flag(p, "--port", ShardServerConfig, "port", type=int)
    p.add_argument("--port-file", help="write HOST:PORT here once serving")
    p.add_argument("--data-dir", help="directory for the event tape (default: keep no tape)")
    add_flag(p, "--push-log", ShardServerConfig, "push_log",
             action="store_true")
    p.add_argument("--secret-file", help="file holding the run secret (default: $DILOCO_SECRET)")
    p.add_argument("--learners", help="static live learners, e.g. L0,L1 (when there is no coordinator)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="follow this coordinator's membership stream")
    add_flag(p, "--quorum", RoundConfig, "quorum", type=int)
    add_grace_flag(p, RoundConfig, "grace_mode")
    add_flag(p, "--grace-gamma", RoundConfig, "grace_gamma", type=float)
    add_flag(p, "--grace-max-s", RoundConfig, "grace_max_s", type=float)
    add_flag(p, "--merge", MergeConfig, "merge", choices=MERGE_MODES)
    add_flag(p, "--staleness-lambda", MergeConfig, "staleness_lambda", type=float)
    add_flag(p, "--outer-lr", MergeConfig, "outer_lr", type=float)
    add_flag(p, "--outer-momentum", MergeConfig, "outer_momentum", type=float)
    add_flag(p, "--outer-optimizer", MergeConfig, "outer_optimizer", choices=OUTER_OPTIMIZERS)
    add_flag(p, "--scale-by", MergeConfig, "scale_by", choices=SCALE_MODES)
    add_flag(p, "--block-size", MergeConfig, "block_size", type=int)
    add_flag(p, "--scale-dtype", MergeConfig, "scale_dtype", choices=["float16", "float32"])
    add_flag(p, "--chain", MergeConfig, "update_chain_length", type=int)
    add_flag(p, "--downlink", MergeConfig, "downlink", choices=DOWNLINKS)
    add_flag(p, "--reply-codec", MergeConfig, "reply_codec", choices=REPLY_CODECS)
    add_flag(p, "--reply-density", MergeConfig, "reply_density", type=float)
    add_flag(p, "--max-push-mib", SyncerConfig, "max_push_bytes", type=int,
             shown=lambda size: size // 2**20, taken=lambda mib: mib * 2**20)
    add_flag(p, "--anchor-window-s", SyncerConfig, "anchor_window_s",
             type=float, metavar="S")
    add_flag(p, "--max-delta-ratio", SyncerConfig, "max_delta_ratio", type=float)
    add_flag(p, "--robust-multiple", SyncerConfig, "robust_multiple", type=float)
    add_flag(p, "--validator", SyncerConfig, "validator", action="store_true")
    add_flag(p, "--stream-idle-timeout-s", SyncerConfig, "stream_idle_timeout_s", type=float)
    p.add_argument("--snapshot-dir", help="the coordinator's snapshot directory or URL, s3://... (for --restore latest or an id)")
    p.add_argument("--restore", metavar="latest|ID|PATH", help="start from a complete snapshot instead of waiting for a learner to give it one")
    add_telemetry(p)
    add_run_config(p)
    p.set_defaults(func=_syncer)


def _validator(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from diloco.validator.runner import Validator

    validator = Validator(build_run_config(args), from_flags(args, ValidatorConfig), run_secret(args))
    telemetry = start_telemetry(args, "validator")

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await validator.run(stop)

    try:
        asyncio.run(main())
        return 0
    finally:
        telemetry.shutdown()


def add_validator(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "validator",
        help="run the run's validator: score learners' pushes against an outer gradient of its own, lower the "
             "weight of those that do not agree",
        description="Run the validator (diloco.validator): every --interval-s it reads the global model, trains "
                    "--steps inner steps of its own from it, scores each push the shards kept (their --validator) by "
                    "its agreement with that outer gradient and tells the shards what each learner's pushes count "
                    "for. SIGTERM exits 0.",
    )
    add_config_flag(p)
    add_flag(p, "--shards", ValidatorConfig, "shards", metavar="HOST:PORT,...",
             shown=",".join, taken=lambda text: tuple(a for a in text.split(",") if a))
    p.add_argument("--secret-file", help="file holding the run secret (default: $DILOCO_SECRET)")
    add_flag(p, "--interval-s", ValidatorConfig, "interval_s", type=float, metavar="S")
    add_flag(p, "--steps", ValidatorConfig, "steps", type=int)
    add_flag(p, "--agreement", ValidatorConfig, "agreement", type=float)
    add_telemetry(p)
    add_run_config(p)
    p.set_defaults(func=_validator)


def _learner(args: argparse.Namespace) -> int:
    import time

    started = time.time()
    from diloco.errors import InvalidArgument, NotFound

    if args.netns:  # first: every socket and thread after this is the site's
        from diloco.coordinator.sites import enter

        enter(args.netns)

    from diloco.learner.server import joined_membership, preload, run_learner, run_slice_follower, static_membership
    from diloco.learner.slice import SliceLink

    if args.prometheus:
        from diloco.telemetry import require_prometheus

        require_prometheus()  # before joining: fail with the fix, not after taking a slot
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    cfg = from_flags(args, LearnerConfig)
    link = None
    if args.slice_hosts > 1 or args.slice_index:
        if not args.slice_leader:
            raise InvalidArgument("--slice-hosts N > 1 needs --slice-leader HOST:PORT (host 0's address on the slice port)")
        link = SliceLink(args.slice_hosts, args.slice_index, args.slice_leader, cfg.slice_timeout_s)
        if not link.leader:  # never joins: the leader is the learner
            run_slice_follower(cfg, link)
            return 0
    if args.coordinator:
        if not args.join_token_file:
            raise InvalidArgument("--coordinator needs --join-token-file")
        given = [f"--{k.replace('_', '-')}" for k in GPT_OPTIONS if getattr(args, k) is not None]
        given += ["--task"] * (args.task != DEFAULT_TASK) + ["--task-option"] * bool(args.task_option)
        given += ["--init"] * bool(args.init)
        if given or args.run_config:
            raise InvalidArgument(f"{', '.join(given or ['--run-config'])}: a learner that joins a coordinator trains "
                                  "the coordinator's run config; set the task and its options there")
        try:
            token = Path(args.join_token_file).read_text().strip()
        except OSError as error:
            raise NotFound(f"cannot read join token {args.join_token_file}: {error.strerror}") from None
        preload()  # a fork server's learner has it already
        member = joined_membership(args.coordinator, token, args.pool, args.launch_id)
    else:
        if not args.shards or not args.learner_id:
            raise InvalidArgument("without --coordinator, give --shards HOST:PORT,... and --learner-id (static topology)")
        member = static_membership(build_run_config(args), args.learner_id, run_secret(args), args.shards.split(","))
    summary_path = Path(args.summary) if args.summary else None
    if args.summary_dir:
        summary_path = Path(args.summary_dir) / f"{member.learner_id}.json"
    # Started once the learner's id is known (it is a resource attribute): the Join call
    # itself is not traced.
    telemetry = start_telemetry(args, "learner", learner_id=member.learner_id,
                                 pool=args.pool if args.coordinator else None)
    try:
        run_learner(cfg, member, args.coordinator, summary_path,
                    events_dir=Path(args.events_dir) if args.events_dir else None, started_t=started,
                    num_learners=args.num_learners, slice_link=link)
    finally:
        telemetry.shutdown()
    return 0


def add_learner(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "learner",
        allow_abbrev=False,  # launch overrides must not reach a reserved flag through a prefix (--coord)
        help="run one learner: the task's model trained with inner steps, fragments streamed to the shards",
        description="Run one learner. SIGTERM finishes in-flight pushes (bounded), leaves and exits 0. "
                    "With --coordinator the run's task comes from the coordinator's run config.",
    )
    add_config_flag(p)
    join = p.add_argument_group("joining (coordinator) or a static topology")
    join.add_argument("--coordinator", metavar="HOST:PORT", help="join this coordinator (topology, id, credential)")
    join.add_argument("--join-token-file", help="file with the run's join token (with --coordinator)")
    add_flag(join, "--pool", CoordinatorConfig, "pools",
             shown=lambda pools: pools[0])
    join.add_argument("--launch-id", default="", help="set by launchers to match the process they started")
    join.add_argument("--netns", metavar="NAME", help="run in this network namespace: an emulated site (set by the "
                                                      "local launcher with --link-mbit; needs root)")
    join.add_argument("--fork-server", dest="serve_forks", action="store_true",
                      help="a launcher's fork server: load the learner's code once, then fork a learner for each "
                           "launch read from stdin (diloco.coordinator.forks: one JSON request per line); exit when stdin closes")
    join.add_argument("--shards", help="static topology: shard addresses in shard-id order, comma-separated")
    join.add_argument("--learner-id", help="static topology: this learner's id, e.g. L0")
    join.add_argument("--secret-file", help="static topology: the run secret (default: $DILOCO_SECRET)")
    join.add_argument("--num-learners", type=int, default=1, help="learners the run is planned for (TaskContext.num_learners; default 1)")
    t = p.add_argument_group("training")
    add_flag(t, "--device", LearnerConfig, "device", choices=DEVICES)
    add_flag(t, "--precision", LearnerConfig, "precision",
             choices=PRECISIONS)
    add_flag(t, "--steps", LearnerConfig, "steps", type=int)
    add_flag(t, "--lr", LearnerConfig, "lr", type=float)
    add_flag(t, "--inner-optimizer", LearnerConfig, "inner_optimizer", choices=INNER_OPTIMIZERS)
    add_flag(t, "--warmup-steps", LearnerConfig, "warmup_steps", type=int)
    add_flag(t, "--eval-every", LearnerConfig, "eval_every_steps", type=int)
    add_flag(t, "--train-loss-every", LearnerConfig, "train_loss_every_steps", type=int)
    add_flag(t, "--skip-start-eval", LearnerConfig, "skip_start_eval", action="store_true")
    add_flag(t, "--delta-codec", LearnerConfig, "delta_codec", choices=DELTA_CODECS)
    add_flag(t, "--delta-density", LearnerConfig, "delta_density", type=float)
    add_flag(t, "--block-size", LearnerConfig, "block_size", type=int)
    add_flag(t, "--error-feedback", LearnerConfig, "error_feedback", action=argparse.BooleanOptionalAction)
    add_flag(t, "--step-delay-s", LearnerConfig, "step_delay_s", type=float)
    t.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    add_flag(t, "--slow-factor", LearnerConfig, "slow_factor",
             type=float)
    add_flag(t, "--wire-delay-ms", LearnerConfig, "wire_delay_ms",
             type=float)
    add_flag(t, "--push-timeout-s", LearnerConfig, "push_timeout_s", type=float)
    add_flag(t, "--max-inflight", LearnerConfig, "max_inflight_pushes", type=int)
    add_flag(t, "--heartbeat-s", LearnerConfig, "heartbeat_interval_s", type=float)
    add_flag(t, "--coordinator-loss-timeout-s", LearnerConfig, "coordinator_loss_timeout_s", type=float, metavar="S")
    s = p.add_argument_group("a multi-host slice: one learner, one process per host (every host runs the same command)")
    s.add_argument("--slice-hosts", type=int, default=1, metavar="N", help="hosts of this learner's slice (default 1)")
    s.add_argument("--slice-index", type=int, default=0, metavar="I",
                   help="this host's index, 0..N-1; host 0 is the learner toward the coordinator and shards, the "
                        "others repeat its writes (default 0)")
    s.add_argument("--slice-leader", metavar="HOST:PORT", help="host 0's address on the slice port (with N > 1)")
    add_flag(s, "--slice-timeout-s", LearnerConfig, "slice_timeout_s", type=float, metavar="S")
    t.add_argument("--summary", help="write the JSON summary here at exit")
    t.add_argument("--summary-dir", help="write the JSON summary to DIR/<learner id>.json at exit")
    t.add_argument("--events-dir", help="write the event tape (states, evaluations) to DIR/<learner id>.events.jsonl")
    add_telemetry(p)
    add_run_config(p)
    p.set_defaults(func=_learner)


