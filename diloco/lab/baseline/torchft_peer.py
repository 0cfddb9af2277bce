"""``diloco baseline torchft``: the same workload under torchft's Streaming DiLoCo, the
closest published peer (torchft 0.2.0, CPU, gloo, its Lighthouse on 127.0.0.1). torchft is
an optional extra (``pip install -c constraints.txt -e ".[peers]"``); without it the command says so.

M replicas (one process each, ``diloco.lab.baseline.torchft_replica``) train the run's task
(replica i builds it as learner Li does; the task must initialise its model from the
seed, as replicas do not sync before their first step) with the learners' inner loop;
torchft syncs one fragment every H/P steps by a fault-tolerant all-reduce of its
pseudo-gradient among the replicas in the current quorum, then applies
the outer optimizer (the defaults are diloco local's: lr 1.0, no momentum, i.e. the
average). Unlike Decoupled DiLoCo every sync is a barrier: a replica blocks until the
quorum forms and the all-reduce completes, so a slow or dead replica delays the others.

Failures: a SIGKILLed replica is restarted alone by the supervisor (like a torchft job's
per-replica-group restarts); it heals from a peer at its first quorum and continues the
dead one's step budget. The others continue without it once the Lighthouse stops hearing
its heartbeats.

Run directory: ``config.json``, ``logs/`` (lighthouse, replica<i>), ``events.jsonl``,
``timeline/replica<i>-attempt<a>.jsonl``, ``global-replica<i>.pt`` (each finished
replica's global model), ``model.pt`` (the newest of them), ``stats.json``, ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from diloco.lab.baseline.common import (
    TASK_ERROR_EXIT, BaselineRun, JsonlTail, JsonlWriter, KillPlan, StatusLine, WorkloadConfig,
    WorkerSites, check_slow_workers, kill, median, spawn, task_error,
)
from diloco.config import RunConfig
from diloco.cli.metrics import bytes_per_1k_tokens, expected_period, goodput, start_s, uptime
from diloco.errors import FailedPrecondition, InvalidArgument, Unavailable
from diloco.task import TaskError
from diloco.syncer.config import MergeConfig

logger = logging.getLogger(__name__)

REPLICA_MODULE = "diloco.lab.baseline.torchft_replica"
PEERS_EXTRA = 'the peers extra: pip install -c constraints.txt -e ".[peers]"'
"""Where torchft comes from."""


def torchft_missing() -> str | None:
    """Why torchft cannot be used here, as its import fails (not installed, or installed
    against another torch), or None: the import itself is the check."""
    try:
        import torchft  # noqa: F401
    except Exception as error:  # ImportError, or what a broken install raises while it loads
        return str(error) or type(error).__name__
    return None


def torchft_available() -> bool:
    return torchft_missing() is None


@dataclass(frozen=True)
class TorchftConfig(WorkloadConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(reply_rule="mix"))
    """Task, seed, fragments P, sync period H, overlap tau and merge alpha, as diloco local."""
    workers: int = 3
    """M: replicas (replica groups of one process)."""
    steps: int = 150
    """Inner steps per replica slot (a replacement continues the dead one's budget)."""
    kill_every_s: float = 0.0
    """Mean seconds between SIGKILLs of a random replica (exponential gaps); 0: none."""
    kill_at_steps: tuple[int, ...] = ()
    """Deterministic faults: SIGKILL a random replica when the slowest live one has done
    each of these steps."""
    slow_workers: tuple[tuple[int, float], ...] = ()
    """(replica id, factor): that replica's compute takes factor x as long."""
    fault_seed: int = 0
    """Seed of the kill plan (which replica, and when)."""
    # The shards' outer step (syncer.config.MergeConfig): both systems step alike.
    outer_lr: float = MergeConfig.outer_lr
    outer_momentum: float = MergeConfig.outer_momentum
    timeout_s: float = 30.0
    """torchft Manager timeout: collectives, should_commit, checkpoint transfer."""
    quorum_timeout_s: float = 120.0
    join_timeout_ms: int = 10_000
    """Lighthouse: how long a quorum waits for heartbeating replicas that have not asked
    (torchft's example value; its default is 60 s)."""
    heartbeat_timeout_ms: int = 5_000
    """Lighthouse: silence after which a replica is dead (torchft's default)."""
    startup_timeout_s: float = 180.0
    max_restarts: int = 100
    out: Path | None = None

    def __post_init__(self) -> None:
        self.check_workload()
        if (self.kill_every_s or self.kill_at_steps) and self.workers < 2:
            raise InvalidArgument("killing replicas needs at least 2 of them")
        if not all(0 < s < self.steps for s in self.kill_at_steps):
            raise InvalidArgument(f"kill at steps must be in [1, {self.steps - 1}], got {list(self.kill_at_steps)}")
        h, p = self.run.sync_every_steps, self.run.fragments
        if h < p or h % p:
            raise InvalidArgument(f"torchft syncs one fragment at a time: sync every (H={h}) must be a multiple of "
                                  f"the fragments (P={p})")
        if getattr(self.run, "reply_rule", "mix") != "mix":
            raise InvalidArgument("torchft applies a synced fragment by mixing with alpha only: use --reply-rule mix")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0 and 0 <= self.outer_momentum < 1):
            raise InvalidArgument("outer lr must be > 0 and outer momentum in [0, 1)")
        check_slow_workers(self.slow_workers, self.workers)

    @property
    def fragments(self) -> int:
        return self.run.fragments


# --- metrics (pure: from the replicas' timelines) ---------------------------------------


def ft_metrics(timelines: list[list[dict]], fragments: int, sync_every_steps: int, tokens_per_step: int) -> dict:
    """The metrics of a torchft run; ``timelines`` holds one record list per replica
    process (every attempt of every replica).

    - A step's work on fragment p **reached the global model** if it was done before the
      replica's next prepare of p (where torchft takes the pseudo-gradient) and that sync
      committed. Steps between a prepare and its sync are overwritten by the global
      fragment (alpha 0), a failed commit drops its window, a heal replaces the replica's
      model with a peer's (dropping every open window), a kill drops them too. A
      replacement replica only works on the run's model once it has healed from a peer:
      before that (for instance when the others have already finished and it trains
      alone from the seeded model) its commits count as lost.
    - **goodput**: the fraction of worker time spent in such work = sum over replicas and
      steps of duration x (fragments the step reached) / P, over M x window, the window
      being [first ready, last step's end] (a dead replica's slot counts while it is
      being replaced). ``stats.json`` also has ``goodput_with_overlap``, which counts the
      steps between a prepare and its committed sync as useful (as diloco local's tape
      statistics count a push's steps).
    - **uptime / global_stall_s**: ``diloco.cli.metrics.uptime`` over the commit times (any
      replica's on the run's model) with the expected period of one advance every H/P
      median steps (``diloco.cli.metrics.expected_period``), as diloco local's from round closes.
    - **bytes**: each replica's share of every fragment all-reduce it took part in (ring:
      2(n-1)/n x fragment bytes, fp32, committed or not) plus the state a healing replica
      received; ``bytes_per_1k_tokens`` = 1000 x bytes / tokens computed. Quorum RPCs and
      heartbeats are not counted.
    """
    useful = useful_with_overlap = wire = 0.0
    durations, commits, ready, ends = [], [], [], []
    steps = heals = failed_commits = off_model_commits = 0
    for records in timelines:
        open_window = [0.0] * fragments  # step time since the last prepare of p
        in_flight = [0.0] * fragments  # the window a prepare took, until its sync
        on_the_run_model = True
        for r in records:
            kind = r["kind"]
            if kind == "ready":
                ready.append(r["t"])
                on_the_run_model = r.get("attempt", 0) == 0
            elif kind == "step":
                d = r["t1"] - r["t0"]
                durations.append(d)
                ends.append(r["t1"])
                steps += 1
                open_window = [w + d for w in open_window]
            elif kind == "prepare":
                p = r["fragment"]
                in_flight[p], open_window[p] = open_window[p], 0.0
            elif kind == "sync":
                p = r["fragment"]
                wire += r["bytes"]
                if r["committed"] and on_the_run_model:
                    commits.append(r["t"])
                    useful += in_flight[p] / fragments
                    useful_with_overlap += (in_flight[p] + open_window[p]) / fragments
                elif r["committed"]:
                    off_model_commits += 1
                else:
                    failed_commits += 1
                in_flight[p], open_window[p] = 0.0, 0.0  # the fragment is the global one again
            elif kind == "heal":
                wire += r["bytes"]
                heals += 1
                on_the_run_model = True
                open_window, in_flight = [0.0] * fragments, [0.0] * fragments
    if not ready or not ends:
        raise ValueError("the timelines have no finished step")
    start, end = min(ready), max(ends)
    step_s = median(durations)
    period = expected_period(sync_every_steps / fragments * step_s)
    up, stall = uptime(sorted(set(commits)), start, end, period)
    tokens = steps * tokens_per_step
    return {
        "window_s": end - start,
        "useful_worker_s": useful,
        "useful_worker_s_with_overlap": useful_with_overlap,
        "uptime": up,
        "global_stall_s": stall,
        "step_s_median": step_s,
        "period_s": period,
        "steps_computed": steps,
        "commits": len(commits),
        "failed_commits": failed_commits,
        "off_model_commits": off_model_commits,
        "heals": heals,
        "bytes_total": int(wire),
        "tokens_computed": tokens,
        "bytes_per_1k_tokens": bytes_per_1k_tokens(wire, tokens),
    }


# --- the supervisor -------------------------------------------------------------------


@dataclass
class _Slot:
    """One replica id: its current process and every attempt's timeline."""

    index: int
    proc: object = None
    attempt: int = 0
    tails: list[JsonlTail] = field(default_factory=list)
    records: list[list[dict]] = field(default_factory=list)
    step: int = 0
    done: bool = False
    killed: bool = False


class Supervisor:
    def __init__(self, cfg: TorchftConfig, run_dir: Path, store, lighthouse: str, progress, sites: WorkerSites) -> None:
        self.cfg, self.dir, self.store, self.lighthouse, self.progress = cfg, run_dir, store, lighthouse, progress
        self.sites = sites
        self.deadline = time.monotonic() + cfg.time_limit_s if cfg.time_limit_s else None
        self.time_limited = False
        self.kills = KillPlan(cfg.kill_every_s, cfg.fault_seed)
        self.kill_steps = sorted(cfg.kill_at_steps)
        self._victims = random.Random(cfg.fault_seed)
        self.events = JsonlWriter(run_dir / "events.jsonl")
        self.slots = [_Slot(i) for i in range(cfg.workers)]
        self.restarts = 0
        self.started = False

    def run(self) -> None:
        for slot in self.slots:
            self._launch(slot)
        launched = time.monotonic()
        while not all(s.done for s in self.slots):
            self._read()
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.time_limited = True
                self.events.write(kind="time_limit", steps=[s.step for s in self.slots], t=time.time())
                logger.info("time limit of %.0f s reached at steps %s: stopping", self.cfg.time_limit_s,
                            [s.step for s in self.slots])
                return
            now = time.time()
            if not self.started:
                if int(self.store.add("ready", 0)) >= self.cfg.workers:
                    self.store.set("go", "1")
                    self.started = True
                    self.kills.start(now)
                elif time.monotonic() - launched > self.cfg.startup_timeout_s:
                    raise Unavailable(f"replicas not ready {self.cfg.startup_timeout_s:.0f} s after launch; "
                                      f"see {self.dir / 'logs'}")
            self._inject(now)
            for slot in self.slots:
                code = slot.proc.poll() if slot.proc is not None else None
                if code is None or slot.done:
                    continue
                if code == 0:
                    self._read()
                    slot.done = True
                    continue
                self.events.write(kind="failure", replica=slot.index, attempt=slot.attempt, code=code, t=now)
                if code == TASK_ERROR_EXIT:  # the task itself failed: a restart would fail the same way
                    raise TaskError(task_error(self.dir / "logs" / f"replica{slot.index}.log"))
                if not slot.killed and not any(r["kind"] == "step" for r in slot.records[-1]):
                    raise Unavailable(f"replica {slot.index} exited with code {code} before training; "
                                      f"see {self.dir / 'logs' / f'replica{slot.index}.log'}")
                self.restarts += 1
                if self.restarts > self.cfg.max_restarts:
                    raise Unavailable(f"gave up after {self.cfg.max_restarts} restarts; see {self.dir / 'logs'}")
                slot.attempt += 1
                self._launch(slot)
            if self.progress is not None:
                self.progress.update(self.slots, self.restarts, "training" if self.started else "starting")
            time.sleep(0.05)
        self._read()

    def _launch(self, slot: _Slot) -> None:
        slot.killed = False
        launched = time.time()
        where = self.sites.place(slot.index)
        slot.proc = spawn(REPLICA_MODULE, [
            "replica", "--run-dir", str(self.dir), "--replica", str(slot.index), "--attempt", str(slot.attempt),
            "--lighthouse", self.lighthouse, "--store-host", self.sites.host, "--store-port", str(self.store.port),
            "--address", where.address, "--start-step", str(slot.step),
        ], self.dir / "logs" / f"replica{slot.index}.log", where)
        self.events.write(kind="launch", replica=slot.index, attempt=slot.attempt, step=slot.step, pid=slot.proc.pid,
                          t=launched)
        slot.tails.append(JsonlTail(self.dir / "timeline" / f"replica{slot.index}-attempt{slot.attempt}.jsonl"))
        slot.records.append([])

    def _read(self) -> None:
        for slot in self.slots:
            for record in slot.tails[-1].read():
                slot.records[-1].append(record)
                if record["kind"] == "step":
                    slot.step = record["step"]

    def _inject(self, now: float) -> None:
        if not self.started or any(s.done or s.step >= self.cfg.steps for s in self.slots):
            return  # no faults before the start or once the first replica is finishing
        victim = None
        if self.kills.due(now):
            victim = self.kills.fire(self.cfg.workers)
        elif self.kill_steps and min(s.step for s in self.slots) >= self.kill_steps[0]:
            self.kill_steps.pop(0)
            victim = self._victims.randrange(self.cfg.workers)
        if victim is None:
            return
        slot = self.slots[victim]
        if slot.proc.poll() is None:
            slot.proc.kill()
            slot.killed = True
            self.events.write(kind="kill", replica=victim, attempt=slot.attempt, step=slot.step, t=now)
            logger.info("killed replica %d at step %d", victim, slot.step)

    def close(self) -> None:
        for slot in self.slots:
            if slot.proc is not None:
                kill(slot.proc)
        self.events.close()


class _Progress(StatusLine):
    def __init__(self, cfg: TorchftConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def update(self, slots: list[_Slot], restarts: int, state: str) -> None:
        steps = " ".join(f"{s.step}" for s in slots)
        self.show(f"torchft {len(slots)} replicas · {state:<8} · steps {steps} (of {self.cfg.steps}) · "
                  f"restarts {restarts}")


def _wait_for_file(path: Path, proc, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise Unavailable(f"the torchft lighthouse exited with code {proc.returncode}; see {path.parent / 'logs'}")
        if time.monotonic() > deadline:
            raise Unavailable(f"the torchft lighthouse did not come up in {timeout_s:.0f} s")
        time.sleep(0.05)
    return path.read_text().strip()


def run_torchft(cfg: TorchftConfig, show_progress: bool = True) -> dict:
    """Run the torchft peer; returns the summary (``common.SUMMARY_KEYS``), also written
    to ``summary.json`` beside ``stats.json``."""
    if (missing := torchft_missing()) is not None:
        raise FailedPrecondition(f"torchft cannot be imported here ({missing}): install {PEERS_EXTRA}")
    import torch
    from torch.distributed import TCPStore

    run = BaselineRun.start(cfg, "torchft", holds=("summary.json", "events.jsonl"))
    cfg, run_dir = run.cfg, run.dir
    sites = WorkerSites(cfg.link_mbit, run_dir, logger.info)
    try:
        started, launched = time.monotonic(), time.time()
        lighthouse = spawn(REPLICA_MODULE, ["lighthouse", "--run-dir", str(run_dir), "--host", sites.host],
                           run_dir / "logs" / "lighthouse.log")
        store = TCPStore(sites.host, 0, None, True, wait_for_workers=False)
        progress = _Progress(cfg) if show_progress else None
        supervisor = None
        try:
            address = _wait_for_file(run_dir / "lighthouse", lighthouse, cfg.startup_timeout_s)
            supervisor = Supervisor(cfg, run_dir, store, address, progress, sites)
            with progress or nullcontext():
                supervisor.run()
        finally:
            if supervisor is not None:
                supervisor.close()
            kill(lighthouse)
            del store
        wall_s = time.monotonic() - started
    finally:
        links = sites.close()

    state, newest = None, None
    if not supervisor.time_limited:
        finals = [(json.loads(path.read_text())["manager_step"], path.with_suffix(".pt"))
                  for path in run_dir.glob("global-replica*.json")]
        newest = max(finals)[1]
        state = torch.load(newest, weights_only=True)
        torch.save(state, run_dir / "model.pt")
    timelines = [records for slot in supervisor.slots for records in slot.records]
    metrics = ft_metrics(timelines, cfg.fragments, cfg.run.sync_every_steps, run.batch_tokens)
    first_steps = [min((r["t0"] for records in slot.records for r in records if r["kind"] == "step"), default=None)
                   for slot in supervisor.slots]
    metrics["start_s"] = start_s(launched, [t for t in first_steps if t is not None])
    window = metrics["window_s"]
    good = goodput(metrics["useful_worker_s"], cfg.workers * window)
    details = {
        "goodput": good,
        "goodput_with_overlap": goodput(metrics["useful_worker_s_with_overlap"], cfg.workers * window),
        "final_model_from": newest.name if newest is not None else None,
    }
    return run.finish(state, metrics, details, wall_s=wall_s, tokens=metrics["tokens_computed"], goodput=good,
                      restarts=supervisor.restarts, links=links)
