"""``diloco baseline dp``: synchronous data-parallel on the same workload as ``diloco
local``, with the failure behaviour real DP jobs have.

M workers, each a separate OS process (``diloco.lab.baseline.dp_worker``), train the run's
task (``--task``) in lock step: every step each computes the gradient of its own batch
(worker i builds the task as learner Li does, so it reads Li's share of the data), one
all-reduce averages them (torch.distributed gloo over 127.0.0.1), and every worker applies
the same inner optimizer step (the task's optimizer or the learners' AdamW, under their
schedule: ``diloco.learner.runner.inner_optimizer`` with ``diloco.learner.config.LearnerConfig``
defaults). Rank 0 writes a checkpoint every ``checkpoint_every_steps`` steps and a
timeline of every step. The eval loss (start and final) is the task's, in its unit, as
``diloco local`` reports it.

Failures, like an elastic torchrun job: when any worker dies (``kill_every_s`` SIGKILLs a
random one), the others block in the collective (or fail on the broken connection); the
supervisor notices the exit, kills every worker and starts all M again, which load the
last checkpoint. Steps after that checkpoint are lost. The restart cost is measured, not
assumed: process start, imports, model and data load and the gloo rendezvous are in it.

Run directory: ``config.json``, ``logs/worker<i>.log``, ``events.jsonl`` (the supervisor:
launches, kills, failures), ``timeline/attempt-<a>.jsonl`` (rank 0: ready, steps,
checkpoints), ``checkpoint.pt``, ``model.pt`` (the final model, a plain state dict),
``stats.json`` (the details behind the metrics) and ``summary.json``.
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
    WorkerSites, check_slow_workers, kill, median, ring_allreduce_bytes, spawn, task_error,
)
from diloco.config import RunConfig
from diloco.cli.metrics import bytes_per_1k_tokens, expected_period, goodput, start_s, uptime
from diloco.errors import InvalidArgument, Unavailable
from diloco.task import TaskError

logger = logging.getLogger(__name__)

WORKER_MODULE = "diloco.lab.baseline.dp_worker"


@dataclass(frozen=True)
class DPConfig(WorkloadConfig):
    run: RunConfig = field(default_factory=RunConfig)
    """The task, its options and the seed; fragments and the sync schedule are unused by DP."""
    workers: int = 3
    """M: worker processes, the same count as diloco local's learners."""
    steps: int = 150
    """Optimizer steps of the job; each consumes one task batch per worker, so the token
    budget equals diloco local's learners x steps x tokens per batch."""
    checkpoint_every_steps: int = 25
    """Rank 0 checkpoints after every this many steps (and after the last)."""
    kill_every_s: float = 0.0
    """Mean seconds between SIGKILLs of a random worker (exponential gaps); 0: no faults."""
    slow_workers: tuple[tuple[int, float], ...] = ()
    """(worker id, factor): that worker's compute takes factor x as long (it sleeps)."""
    kill_at_steps: tuple[int, ...] = ()
    """Deterministic faults: SIGKILL a random worker once rank 0 has finished each of these
    steps (the first time it gets there)."""
    fault_seed: int = 0
    """Seed of the kill plan (which worker, and when)."""
    """Seeds the kill times and victims."""
    collective_timeout_s: float = 60.0
    """Gloo timeout of the all-reduce and the rendezvous: the longest a hang can last."""
    startup_timeout_s: float = 180.0
    """A launch whose workers are not all training by then is an error."""
    max_restarts: int = 100
    out: Path | None = None

    def __post_init__(self) -> None:
        self.check_workload("checkpoint_every_steps")
        if self.kill_every_s and self.workers < 2:
            raise InvalidArgument("--kill-every needs at least 2 workers")
        for name in ("collective_timeout_s", "startup_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise InvalidArgument(f"{name} must be a positive number, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise InvalidArgument(f"max restarts must be >= 0, got {self.max_restarts}")
        check_slow_workers(self.slow_workers, self.workers)
        if self.kill_at_steps and (self.workers < 2 or not all(0 < s < self.steps for s in self.kill_at_steps)):
            raise InvalidArgument(f"kill at steps needs >= 2 workers and steps in [1, {self.steps - 1}], got "
                                  f"{list(self.kill_at_steps)}")


# --- metrics (pure: from the recorded timeline) -----------------------------------------


@dataclass
class Attempt:
    """One launch of all M workers, as rank 0 recorded it."""

    number: int
    ready_t: float | None = None
    """All workers loaded and rendezvoused; training starts."""
    start_step: int | None = None
    """Steps already in the loaded checkpoint."""
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    """(steps done after this one, start time, end time) of every step rank 0 finished."""
    checkpoints: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, start time, end time) of every checkpoint written."""

    def add(self, record: dict) -> None:
        kind = record["kind"]
        if kind == "ready":
            self.ready_t, self.start_step = record["t"], record["step"]
        elif kind == "step":
            self.steps.append((record["step"], record["t0"], record["t1"]))
        elif kind == "checkpoint":
            self.checkpoints.append((record["step"], record["t0"], record["t1"]))


def dp_metrics(attempts: list[Attempt], workers: int, buffer_bytes: int, tokens_per_step: int) -> dict:
    """The metrics of a DP run from its timeline.

    - A step **survived** if its update is in the final model: every step of the last
      attempt, and the steps of an earlier attempt up to the checkpoint the next attempt
      resumed from; the others were rolled back (lost).
    - The window is [first ready, last step's end]: the first start-up is excluded (as the
      learners' bootstrap is for Decoupled), every restart is inside it.
    - **goodput** (``diloco.cli.metrics.goodput``): workers x (summed durations of survived
      steps) over workers x window: in lock step every worker is inside the same step.
    - **uptime / global_stall_s**: ``diloco.cli.metrics.uptime`` over every step's end (rolled
      back or not: the job was up; the loss of work is goodput's business) with the
      expected period of one advance per median step (``diloco.cli.metrics.expected_period``).
    - **bytes**: a ring all-reduce of the gradient buffer per finished step
      (``ring_allreduce_bytes``); ``bytes_per_1k_tokens`` = 1000 x bytes sent / tokens
      computed, both counting rolled-back steps, which makes it the protocol's cost
      2(M-1) x buffer / (M x tokens per batch), the same with or without faults.
    """
    ran = [a for a in attempts if a.ready_t is not None]
    if not ran or not ran[-1].steps:
        raise ValueError("the timeline has no finished step")
    survived_s, lost_steps, lost_s = 0.0, 0, 0.0
    for i, attempt in enumerate(ran):
        keep_until = ran[i + 1].start_step if i + 1 < len(ran) else math.inf
        for step, t0, t1 in attempt.steps:
            if step <= keep_until:
                survived_s += t1 - t0
            else:
                lost_steps += 1
                lost_s += t1 - t0
    all_steps = [s for a in ran for s in a.steps]
    durations = [t1 - t0 for _, t0, t1 in all_steps]
    start, end = ran[0].ready_t, ran[-1].steps[-1][2]
    step_s = median(durations)
    period = expected_period(step_s)
    up, stall = uptime([t1 for _, _, t1 in all_steps], start, end, period)
    computed = len(all_steps)
    wire = computed * ring_allreduce_bytes(buffer_bytes, workers)
    return {
        "window_s": end - start,
        "goodput": goodput(workers * survived_s, workers * (end - start)),
        "uptime": up,
        "global_stall_s": stall,
        "step_s_median": step_s,
        "period_s": period,
        "steps_computed": computed,
        "steps_lost": lost_steps,
        "lost_s": lost_s,
        "survived_s": survived_s,
        "checkpoint_s": sum(t1 - t0 for a in ran for _, t0, t1 in a.checkpoints),
        "bytes_total": wire,
        "tokens_computed": computed * tokens_per_step,
        "bytes_per_1k_tokens": bytes_per_1k_tokens(wire, computed * tokens_per_step),
    }


# --- the supervisor -------------------------------------------------------------------


class _Progress(StatusLine):
    def __init__(self, cfg: DPConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def update(self, attempt: int, step: int, loss: float | None, restarts: int, state: str) -> None:
        loss_text = f"{loss:.3f}" if loss is not None else "—"
        self.show(f"dp {self.cfg.workers} workers · {state:<10} · step {step}/{self.cfg.steps} · loss {loss_text} · "
                  f"attempt {attempt} · restarts {restarts}")


class Supervisor:
    """Launches all workers, watches them, injects the planned kills, and restarts every
    worker from the last checkpoint when one dies (an elastic torchrun agent, in short)."""

    def __init__(self, cfg: DPConfig, run_dir: Path, store_port: int, progress: _Progress | None,
                 sites: WorkerSites) -> None:
        self.cfg, self.dir, self.store_port, self.progress, self.sites = cfg, run_dir, store_port, progress, sites
        self.deadline = time.monotonic() + cfg.time_limit_s if cfg.time_limit_s else None
        self.time_limited = False
        self.kills = KillPlan(cfg.kill_every_s, cfg.fault_seed)
        self.kill_steps = sorted(cfg.kill_at_steps)
        self._victims = random.Random(cfg.fault_seed)
        self.events = JsonlWriter(run_dir / "events.jsonl")
        self.attempts: list[Attempt] = []
        self.procs: list = []
        self.restarts = 0
        self.finished = False
        self._step, self._loss = 0, None

    def run(self) -> None:
        while True:
            attempt = Attempt(len(self.attempts))
            self.attempts.append(attempt)
            self._launch(attempt.number)
            outcome = self._watch(attempt)
            self._stop_workers()
            if outcome in ("done", "time limit"):
                self.time_limited = outcome == "time limit"
                return
            self.restarts += 1
            if self.restarts > self.cfg.max_restarts:
                raise Unavailable(f"gave up after {self.cfg.max_restarts} restarts; see {self.dir / 'logs'}")

    def _launch(self, number: int) -> None:
        launched = time.time()
        self.procs = []
        for rank in range(self.cfg.workers):
            where = self.sites.place(rank)
            self.procs.append(spawn(WORKER_MODULE, [
                "--run-dir", str(self.dir), "--rank", str(rank), "--attempt", str(number), "--store-host",
                self.sites.host, "--store-port", str(self.store_port), "--address", where.address,
            ], self.dir / "logs" / f"worker{rank}.log", where))
        self.events.write(kind="launch", attempt=number, pids=[p.pid for p in self.procs], t=launched)

    def _watch(self, attempt: Attempt) -> str:
        tail = JsonlTail(self.dir / "timeline" / f"attempt-{attempt.number}.jsonl")
        launched = time.monotonic()
        killed_here = False
        while True:
            for record in tail.read():
                attempt.add(record)
                if record["kind"] == "ready":
                    self.kills.start(record["t"])
                elif record["kind"] == "step":
                    self._step, self._loss = record["step"], record["loss"]
                    self.finished = record["step"] >= self.cfg.steps
            now = time.time()
            victim = None
            if self.kills.due(now) and not self.finished:
                victim = self.kills.fire(self.cfg.workers)
            elif self.kill_steps and self._step >= self.kill_steps[0]:
                self.kill_steps.pop(0)
                victim = self._victims.randrange(self.cfg.workers)
            if victim is not None and self.procs[victim].poll() is None:
                proc = self.procs[victim]
                proc.kill()
                killed_here = True
                self.events.write(kind="kill", attempt=attempt.number, rank=victim, pid=proc.pid, step=self._step,
                                  t=now)
                logger.info("killed worker %d (pid %d) at step %d", victim, proc.pid, self._step)
            codes = [p.poll() for p in self.procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                broken = [rank for rank, code in failed if code == TASK_ERROR_EXIT]
                if broken:  # the task itself failed: a restart would fail the same way
                    raise TaskError(task_error(self.dir / "logs" / f"worker{broken[0]}.log"))
                rank, code = failed[0]
                self.events.write(kind="failure", attempt=attempt.number, rank=rank, code=code, t=now)
                if not killed_here and not attempt.steps:
                    raise Unavailable(f"worker {rank} exited with code {code} before training; "
                                      f"see {self.dir / 'logs' / f'worker{rank}.log'}")
                return "failed"
            if all(code == 0 for code in codes):
                for record in tail.read():
                    attempt.add(record)
                self.events.write(kind="done", attempt=attempt.number, t=now)
                return "done"
            if self.deadline is not None and time.monotonic() > self.deadline:
                for record in tail.read():
                    attempt.add(record)
                self.events.write(kind="time_limit", attempt=attempt.number, step=self._step, t=now)
                logger.info("time limit of %.0f s reached at step %d: stopping", self.cfg.time_limit_s, self._step)
                return "time limit"
            if attempt.ready_t is None and time.monotonic() - launched > self.cfg.startup_timeout_s:
                raise Unavailable(f"workers not training {self.cfg.startup_timeout_s:.0f} s after launch; "
                                  f"see {self.dir / 'logs'}")
            if self.progress is not None:
                state = "training" if attempt.ready_t is not None else ("restarting" if self.restarts else "starting")
                self.progress.update(attempt.number, self._step, self._loss, self.restarts, state)
            time.sleep(0.05)

    def _stop_workers(self) -> None:
        for proc in self.procs:
            kill(proc)

    def close(self) -> None:
        self._stop_workers()
        self.events.close()


def _restarts_detail(run_dir: Path, attempts: list[Attempt]) -> list[dict]:
    """Each failure: when it happened, when training resumed, what was lost."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for event in (e for e in events if e["kind"] == "failure"):
        number = event["attempt"]
        cause = next((e for e in events if e["kind"] == "kill" and e["attempt"] == number), event)
        nxt = next((a for a in attempts[number + 1:] if a.ready_t is not None), None)
        before = attempts[number].steps[-1][0] if attempts[number].steps else None
        out.append({
            "attempt": number,
            "cause": (f"SIGKILL of worker {cause['rank']}" if cause["kind"] == "kill"
                      else f"worker {event['rank']} exited {event['code']}"),
            "failed_at_step": before,
            "resumed_from_step": nxt.start_step if nxt else None,
            "restart_s": round(nxt.ready_t - cause["t"], 3) if nxt else None,
            "detect_s": round(event["t"] - cause["t"], 3),
        })
    return out


def run_dp(cfg: DPConfig, show_progress: bool = True) -> dict:
    """Run the DP job; returns the summary (``common.SUMMARY_KEYS``), also written to
    ``summary.json`` beside ``stats.json`` in the run directory."""
    import torch
    from torch.distributed import TCPStore

    run = BaselineRun.start(cfg, "dp", holds=("checkpoint.pt", "summary.json"))
    cfg, run_dir = run.cfg, run.dir
    step_tokens = cfg.workers * run.batch_tokens
    params = [p for p in run.task.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    # The gradients plus the loss, one buffer per step (fp32 for the byte GPT).
    buffer_bytes = (numel + 1) * params[0].element_size()

    sites = WorkerSites(cfg.link_mbit, run_dir, logger.info)
    links = None
    try:
        # The rendezvous store lives here, like torchrun's agent's: it outlives every worker.
        store = TCPStore(sites.host, 0, None, True, wait_for_workers=False)
        started, launched = time.monotonic(), time.time()
        progress = _Progress(cfg) if show_progress else None
        supervisor = Supervisor(cfg, run_dir, store.port, progress, sites)
        try:
            with progress or nullcontext():
                supervisor.run()
        finally:
            supervisor.close()
            del store
        wall_s = time.monotonic() - started
    finally:
        links = sites.close()

    metrics = dp_metrics(supervisor.attempts, cfg.workers, buffer_bytes, step_tokens)
    # The workers step together: the job's first step is every worker's.
    metrics["start_s"] = start_s(launched, [a.steps[0][1] for a in supervisor.attempts if a.steps][:1])
    details = {"params": numel, "buffer_bytes": buffer_bytes,
               "restarts_detail": _restarts_detail(run_dir, supervisor.attempts)}
    if supervisor.time_limited:  # the steps it reached, no final model
        steps = max((a.steps[-1][0] for a in supervisor.attempts if a.steps), default=0)
        return run.finish(None, metrics, details, wall_s=wall_s, tokens=steps * step_tokens,
                          goodput=metrics["goodput"], restarts=supervisor.restarts, links=links)
    return run.finish(torch.load(run_dir / "model.pt", weights_only=True), metrics, details, wall_s=wall_s,
                      tokens=cfg.steps * step_tokens, goodput=metrics["goodput"], restarts=supervisor.restarts,
                      links=links)
