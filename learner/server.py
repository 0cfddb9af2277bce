"""Process wiring of one learner: join (or a static topology), train, and on SIGTERM
finish in-flight pushes within a bounded time, Leave and exit 0."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from diloco.config import RunConfig
from diloco.tape import TapeWriter
from learner.config import LearnerConfig
from learner.membership import Heartbeats, Membership, join
from learner.worker import Learner, Summary, write_summary

logger = logging.getLogger(__name__)


def learner_number(learner_id: str) -> int:
    digits = "".join(ch for ch in learner_id if ch.isdigit())
    return int(digits) if digits else 0


def run_learner(
    cfg: LearnerConfig,
    member: Membership,
    data: str | None,
    coordinator: str | None = None,
    summary_path: Path | None = None,
    assign_data_shard: bool = False,
    events_dir: Path | None = None,
    started_t: float | None = None,
) -> Summary:
    """``events_dir``: write the learner's event tape (state changes, evaluations) to
    ``<dir>/<id>.events.jsonl``; ``started_t``: when the process started (wall clock)."""
    if assign_data_shard:
        cfg = replace(cfg, data_shard=learner_number(member.learner_id) % cfg.data_shards)
    # Heartbeats start before the learner is built: loading data and bootstrapping can take
    # longer than a lease.
    holder: dict[str, Learner] = {}
    early_stop = threading.Event()
    heartbeats = None
    if coordinator:
        def stats() -> dict:
            if "learner" not in holder:
                return {}
            s = holder["learner"].summary
            return {"tokens": s.tokens, "inner_steps": s.inner_steps,
                    "tokens_per_s": s.tokens / s.wall_s if s.wall_s else 0.0,
                    "version_lag": holder["learner"].version_lag()}

        def stop_learner(reason: str) -> None:
            logger.warning("%s: leaving: %s", member.learner_id, reason)
            early_stop.set()
            if "learner" in holder:
                holder["learner"].stop.set()

        def on_snapshot(snapshot_id: int, directory: str) -> None:
            if "learner" in holder:
                holder["learner"].markers.put((snapshot_id, directory))

        heartbeats = Heartbeats(coordinator, member, cfg.heartbeat_interval_s, stats, stop_learner, on_snapshot)
        heartbeats.start()
    events = None
    if events_dir is not None:
        events = TapeWriter(Path(events_dir) / f"{member.learner_id}.events.jsonl", fsync_every=1)
        events.append("state", started_t or time.time(), state="starting", pid=os.getpid(),
                      slow_factor=cfg.slow_factor, steps=cfg.steps)
        events.append("state", time.time(), state="bootstrapping")
    learner = Learner(member.run, cfg, member.learner_id, member.credential, member.shards, data=data)
    learner.events = events
    holder["learner"] = learner
    if early_stop.is_set():
        learner.stop.set()
    if heartbeats is not None:
        learner.on_recorded = heartbeats.report

    def stop(signum, _frame):
        logger.info("%s: %s, finishing in-flight pushes", member.learner_id, signal.Signals(signum).name)
        learner.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        summary = learner.train()
    finally:
        if heartbeats is not None:
            heartbeats.stop_and_leave("finished" if not learner.stop.is_set() else "stopped")
        learner.event("state", state="left", step=learner.summary.inner_steps)
        if events is not None:
            events.close()
    logger.info("%s done: %d inner steps, %d tokens, eval %.3f -> %.3f bits/byte", member.learner_id,
                summary.inner_steps, summary.tokens, summary.eval_bpb_start or 0, summary.eval_bpb_final or 0)
    if summary_path is not None:
        write_summary(summary, summary_path)
    return summary


def static_membership(run: RunConfig, learner_id: str, secret: str, shards: list[str]) -> Membership:
    from diloco import auth

    return Membership(learner_id, auth.sign(secret, learner_id), run, dict(enumerate(shards)), 0.0)


def joined_membership(coordinator: str, join_token: str, pool: str, launch_id: str) -> Membership:
    return join(coordinator, join_token, pool, launch_id, f"{socket.gethostname()}:{os.getpid()}")
