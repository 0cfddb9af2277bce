"""What the baselines share: the summary's keys, the fault plan, the wire-byte count of a
ring all-reduce, and the supervisor's process handling.

Definitions (the same for every system ``diloco compare`` puts side by side):

- **advance**: a moment the global model changed (DP: an optimizer step finished on rank
  0; Decoupled and torchft: a fragment's round closed / sync committed).
- **expected period**: the interval between two advances when nothing goes wrong, times
  ``PERIOD_SLACK`` (diloco local uses the same factor of 4).
- **global stall**: time beyond the expected period between two advances, or from the
  start of training to the first advance, or from the last advance to the end
  (``tools.metrics.uptime``); **uptime** = 1 − stall / (end − start).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

PERIOD_SLACK = 4.0
"""An advance may come up to this many times the expected interval late before the gap
counts as a global stall."""

SUMMARY_KEYS = (
    "wall_s", "tokens", "eval_unit", "eval_loss_start", "eval_loss_final", "goodput", "uptime", "global_stall_s",
    "bytes_per_1k_tokens", "restarts", "steps",
)
"""Exactly the keys of every baseline's summary.json, in this order."""


def parse_slow_workers(specs: list[str] | tuple[str, ...] | None) -> tuple[tuple[int, float], ...]:
    """``["1:1.5", "2:2,0:1.2"]`` -> ((0, 1.2), (1, 1.5), (2, 2.0)): worker id and how many
    times as long its steps take."""
    slow: dict[int, float] = {}
    for spec in specs or ():
        for item in filter(None, (s.strip() for s in spec.split(","))):
            worker, sep, factor = item.partition(":")
            try:
                wid, f = int(worker), float(factor)
            except ValueError:
                raise InvalidArgument(f"slow worker must be ID:FACTOR (e.g. 1:1.5), got {item!r}") from None
            if not sep or not math.isfinite(f) or f < 1.0:
                raise InvalidArgument(f"slow worker factor must be a finite number >= 1, got {item!r}")
            slow[wid] = f
    return tuple(sorted(slow.items()))


def check_slow_workers(slow: tuple[tuple[int, float], ...], workers: int) -> None:
    for wid, factor in slow:
        if not 0 <= wid < workers:
            raise InvalidArgument(f"slow worker {wid} does not exist: ids are 0..{workers - 1}")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise InvalidArgument(f"slow worker factor must be a finite number >= 1, got {factor}")


def learner_inner(steps: int):
    """A worker's inner-loop config: the AdamW lr and weight decay, warmup, cosine schedule
    and clipping of a learner in diloco local (``LearnerConfig`` defaults), for ``steps``
    steps. Data, batch size and seed are the task's (``worker_task``)."""
    from learner.config import LearnerConfig

    return LearnerConfig(steps=steps)


def worker_task(run, worker: int, workers: int):
    """Worker ``worker``'s instance of the run's task, built exactly as learner L<worker>
    of diloco local builds it (on the CPU): its model, its share of the data, its loss."""
    import torch

    from diloco.task import TaskContext, build_task

    ctx = TaskContext(learner_index=worker, num_learners=workers, seed=run.seed, device=torch.device("cpu"),
                      options=dict(run.task_options))
    return build_task(run.task, ctx, run.init)


TASK_ERROR_EXIT = 3
"""Exit status of a worker whose task failed (``diloco.task.TaskError``): the supervisor
stops the run with the error instead of restarting a worker that would fail again."""


TASK_ERROR_PREFIX = "task error: "


def task_error(log: Path) -> str:
    """The task error a worker logged (``TASK_ERROR_PREFIX``), for the supervisor's message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    found = [line.split(TASK_ERROR_PREFIX, 1)[1] for line in lines if TASK_ERROR_PREFIX in line]
    return f"{found[-1] if found else 'a worker stopped on a task error'} (see {log})"


def grad_dtype(spec: str, params) -> torch.dtype:
    """The one floating dtype of the trainable parameters (a gradient buffer holds them all)."""
    from diloco.task import TaskError

    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TaskError(f"task {spec!r}: the DP baseline all-reduces one gradient buffer and needs trainable "
                        f"parameters of one floating dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def skip_batches(spec: str, batches, steps: int):
    """``iter(batches)`` advanced past the ``steps`` batches a run restarted at step
    ``steps`` has already trained on."""
    from diloco.task import TaskError

    it = iter(batches)
    for done in range(steps):
        try:
            next(it)
        except StopIteration:
            raise TaskError(f"task {spec!r}: its batches ended after {done} batches; resuming needs {steps}") from None
    return it


def next_batch(spec: str, batches, step: int, steps: int):
    """The batch of step ``step``, or a clear error if the task's batches ran out."""
    from diloco.task import TaskError

    try:
        return next(batches)
    except StopIteration:
        raise TaskError(f"task {spec!r}: its batches ended after {step} batches; this run trains {steps} steps") \
            from None


def advance_schedule(schedule, steps: int) -> None:
    """Put the inner lr schedule at step ``steps`` (a restarted or replacement worker)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": on purpose here
        for _ in range(steps):
            schedule.step()


@dataclass(frozen=True)
class WorkloadConfig:
    """What both baselines' config dataclasses share: ``threads_per_worker``, and, for
    their own fields ``run``, ``workers``, ``steps``, ``slow_workers``, ``kill_at_steps``
    and ``out``, a worker's inner-loop config, task and slow factor, and the JSON round
    trip the supervisor hands its workers."""

    threads_per_worker: int = 1
    """torch intra-op threads of each worker process. 1, as torchrun sets OMP_NUM_THREADS
    for its workers: on a machine with fewer cores than workers, more threads make every
    lock-step collective wait for descheduled spinning threads (measured here, 3 workers
    on 2 cores: 0.7 s per step with 1 thread, 5 s with torch's default of 2)."""

    def inner(self):
        """The workers' inner-loop config (``learner_inner``)."""
        return learner_inner(self.steps)

    def task(self, worker: int):
        """Worker ``worker``'s instance of the run's task (``worker_task``)."""
        return worker_task(self.run, worker, self.workers)

    def slow_factor(self, worker: int) -> float:
        return dict(self.slow_workers).get(worker, 1.0)

    def to_json(self) -> str:
        from dataclasses import asdict

        raw = asdict(self)
        raw["run"] = json.loads(self.run.to_json())
        raw["out"] = str(self.out) if self.out is not None else None
        return json.dumps(raw, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        from diloco.config import RunConfig

        raw = json.loads(text)
        raw["run"] = RunConfig.from_json(json.dumps(raw["run"]))
        raw["slow_workers"] = tuple((int(w), float(f)) for w, f in raw.get("slow_workers", ()))
        raw["kill_at_steps"] = tuple(raw.get("kill_at_steps", ()))
        raw["out"] = Path(raw["out"]) if raw.get("out") else None
        return cls(**raw)


def ring_allreduce_bytes(buffer_bytes: int, members: int) -> int:
    """Bytes all members together send for one ring all-reduce of ``buffer_bytes``: each
    sends 2(n-1)/n of the buffer (reduce-scatter then all-gather), 2(n-1) buffers in all."""
    return 2 * (members - 1) * buffer_bytes if members > 1 else 0


@dataclass
class KillPlan:
    """Failures as a Poisson process in wall time: gaps drawn from an exponential with mean
    ``mean_s`` and the victim drawn uniformly, both from one seeded generator, so a run's
    fault plan is fixed by its seed. Time is passed in, never read here."""

    mean_s: float
    seed: int
    next_at: float | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def enabled(self) -> bool:
        return self.mean_s > 0

    def start(self, now: float) -> None:
        if self.enabled and self.next_at is None:
            self.next_at = now + self._rng.expovariate(1.0 / self.mean_s)

    def due(self, now: float) -> bool:
        return self.next_at is not None and now >= self.next_at

    def fire(self, members: int) -> int:
        """The victim among ``members``; schedules the next failure."""
        victim = self._rng.randrange(members)
        self.next_at = (self.next_at or 0.0) + self._rng.expovariate(1.0 / self.mean_s)
        return victim


def summary(**values) -> dict:
    """A summary with exactly ``SUMMARY_KEYS``, rounded for reading."""
    missing = set(SUMMARY_KEYS) - set(values)
    extra = set(values) - set(SUMMARY_KEYS)
    if missing or extra:
        raise ValueError(f"summary keys: missing {sorted(missing)}, unexpected {sorted(extra)}")
    digits = {"wall_s": 2, "eval_loss_start": 4, "eval_loss_final": 4, "goodput": 4, "uptime": 4,
              "global_stall_s": 3, "bytes_per_1k_tokens": 1}
    return {k: (round(values[k], digits[k]) if k in digits else values[k]) for k in SUMMARY_KEYS}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def spawn(module: str, args: list[str], log: Path) -> subprocess.Popen:
    """``python -m module args`` in its own session (so it can be killed with everything
    it started), stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its session, then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self._partial = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


class JsonlWriter:
    """Appends one JSON object per line, flushed, so a supervisor can tail it and a
    SIGKILL loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()

