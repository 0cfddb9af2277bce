"""Process wiring of one learner: join (or a static topology), build the task, train it
through the ``Learner`` API, and on SIGTERM finish in-flight pushes within a bounded
time, leave and exit 0. A task that fails ends this learner with one line naming the
task and the problem; the shards and the other learners keep running."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path

from diloco.config import RunConfig
from diloco.tape import TapeWriter
from diloco.errors import Cancelled
from diloco.files import atomic_write
from diloco.learner.api import Learner
from diloco.learner.summary import Summary
from diloco.learner.config import LearnerConfig
from diloco.learner.membership import Heartbeats, Membership, join
from diloco.learner.runner import follow_slice, run_task
from diloco.learner.slice import SliceLink

logger = logging.getLogger(__name__)


def run_learner(
    cfg: LearnerConfig,
    member: Membership,
    coordinator: str | None = None,
    summary_path: Path | None = None,
    events_dir: Path | None = None,
    started_t: float | None = None,
    num_learners: int = 1,
    slice_link: SliceLink | None = None,
) -> Summary:
    """``events_dir``: write the learner's event tape (state changes, evaluations) to
    ``<dir>/<id>.events.jsonl``; ``started_t``: when the process started (wall clock).
    ``slice_link``: this learner leads a multi-host slice."""
    # Heartbeats start before the task is built: loading data and bootstrapping can take
    # longer than a lease. Until the learner exists, a drain only stops it from starting.
    stopping = threading.Event()
    heartbeats = None
    if coordinator:
        heartbeats = Heartbeats(coordinator, member, cfg.heartbeat_interval_s, dict, _drain_before_start(stopping),
                                loss_timeout_s=cfg.coordinator_loss_timeout_s)
        heartbeats.start()
    events = None
    if events_dir is not None:
        events = TapeWriter(Path(events_dir) / f"{member.learner_id}.events.jsonl", fsync_every=1)
        events.append("state", started_t or time.time(), state="starting", pid=os.getpid(),
                      slow_factor=cfg.slow_factor, steps=cfg.steps)
    learner = None

    def stop(signum, _frame):
        logger.info("%s: %s, finishing in-flight pushes", member.learner_id, signal.Signals(signum).name)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)

    def attach(created: Learner) -> None:
        nonlocal learner
        learner = created

    try:
        summary = run_task(member, cfg, coordinator=coordinator, num_learners=num_learners, events=events,
                           heartbeats=heartbeats, on_learner=attach, stop=stopping, slice_link=slice_link).summary
    except Cancelled as error:  # asked to leave (a drain, a signal) before training started
        logger.warning("%s: %s: left before training", member.learner_id, error)
        if heartbeats is not None:
            heartbeats.stop_and_leave(f"stopped before training: {error}")
        summary = Summary(member.learner_id)
    except BaseException as error:
        if learner is None and heartbeats is not None:
            heartbeats.stop_and_leave(f"failed to start: {error}", failed=True)
        raise
    finally:
        if events is not None:
            events.append("state", time.time(), state="left", step=learner.summary.inner_steps if learner else 0)
            events.close()
    logger.info("%s done: %d inner steps, %d tokens, eval %s -> %s %s", member.learner_id, summary.inner_steps,
                summary.tokens, _fmt(summary.eval_loss_start), _fmt(summary.eval_loss_final), summary.eval_unit)
    if summary_path is not None:
        write_summary(summary, summary_path)
    return summary


def preload() -> None:
    """Load what a learner's first optimizer loads, torch's compiler front end (dynamo,
    sympy: 1.3 s of CPU here, over 15 s on a loaded host, mostly holding the GIL): called
    before joining, so that it is not paid while a lease runs and heartbeats wait on it."""
    import torch

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def run_slice_follower(cfg: LearnerConfig, link: SliceLink) -> Summary:
    """A follower host of a slice: signals are the leader's to act on (it decides the step
    the whole slice stops at); this host trains until the leader says stop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: logger.info("slice host %d: %s: the leader decides when the slice stops",
                                                              link.index, signal.Signals(signum).name))
    summary = follow_slice(cfg, link).summary
    logger.info("%s done: %d inner steps, %d tokens", summary.learner_id, summary.inner_steps, summary.tokens)
    return summary


def _drain_before_start(stopping: threading.Event):
    """Until the learner exists a drain stops it from starting, unless it comes with tokens
    to train first (a budget's allotment): the learner takes that on from the heartbeat
    after it exists (the directive rides every heartbeat)."""
    def drain(reason: str, after_tokens: int = 0) -> None:
        if not after_tokens:
            stopping.set()
    return drain


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def write_summary(summary: Summary, path: Path) -> None:
    atomic_write(path, json.dumps(asdict(summary), indent=1))


def static_membership(run: RunConfig, learner_id: str, secret: str, shards: list[str]) -> Membership:
    from diloco import auth

    return Membership(learner_id, auth.Credential(learner_id, secret=secret), run, dict(enumerate(shards)), 0.0)


def joined_membership(coordinator: str, join_token: str, pool: str, launch_id: str) -> Membership:
    return join(coordinator, join_token, pool, launch_id, f"{socket.gethostname()}:{os.getpid()}")

