"""What the baselines share: the summary's keys, the fault plan, the wire-byte count of a
ring all-reduce, the supervisor's process handling and progress line, the run directory's
config, stats and summary, and a worker process's start, steps and exit status.

The metrics' definitions, the same for every system ``diloco compare`` puts side by side, are
``diloco.cli.metrics``'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from diloco.cli.metrics import check_curve_points
from diloco.errors import InvalidArgument
from diloco.files import atomic_write, atomic_write_json
from diloco.learner.config import LearnerConfig

if TYPE_CHECKING:
    import torch

    from diloco.task import Task

logger = logging.getLogger(__name__)

SUMMARY_KEYS = (
    "wall_s", "tokens", "eval_unit", "eval_loss_start", "eval_loss_final", "goodput", "uptime", "global_stall_s",
    "bytes_per_1k_tokens", "start_s", "restarts", "steps", "curve", "time_limited", "links",
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


def check_sites_and_limit(link_mbit: float | None, time_limit_s: float | None) -> None:
    from diloco.coordinator.sites import check_mbit

    if link_mbit is not None:
        check_mbit(link_mbit)
    if time_limit_s is not None and not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise InvalidArgument(f"time limit must be a positive number of seconds, got {time_limit_s}")


def learner_inner(steps: int, lr: float):
    """A worker's inner-loop config: the AdamW weight decay, warmup, cosine schedule and
    clipping of a learner in diloco local (``LearnerConfig`` defaults), for ``steps`` steps
    at peak learning rate ``lr``, with plain AdamW: a DP worker's gradient is already the
    workers' mean, and torchft's replicas are the published algorithm. Data, batch size and
    seed are the task's (``worker_task``)."""
    return LearnerConfig(steps=steps, lr=lr, inner_optimizer="adamw")


def save_torch(path: Path, value: object) -> None:
    """``torch.save`` of ``value`` to ``path``, atomically (a reader never sees half a file)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    atomic_write(path, buffer.getvalue())


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


def run_worker(work: Callable[..., None], *args) -> int:
    """A worker process's exit status from ``work(*args)``: ``TASK_ERROR_EXIT``, with the
    error logged for ``task_error``, when the task is broken."""
    from diloco.task import TaskError

    try:
        work(*args)
    except TaskError as error:  # the task is broken: a restart would fail the same way
        logger.error("%s%s", TASK_ERROR_PREFIX, error)
        return TASK_ERROR_EXIT
    return 0


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


def worker_steps(cfg: WorkloadConfig, who: str, batches, start: int):
    """(step, start time, batch) of each of a worker's steps ``start``..``cfg.steps - 1``.
    The worker stops once its supervisor is gone: nothing would stop it otherwise."""
    supervisor = os.getppid()
    for step in range(start, cfg.steps):
        if os.getppid() != supervisor:
            raise SystemExit(f"{who}: the supervisor is gone; stopping")
        t0 = time.time()
        yield step, t0, next_batch(cfg.run.task, batches, step, cfg.steps)


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
    lr: float = LearnerConfig.lr
    """Peak inner learning rate of every worker (``LearnerConfig.lr``, as diloco local's learners)."""
    curve_points: int = 0
    """Save the global model as the job passes each of this many equal shares of its steps
    (``diloco.cli.metrics.eval_curve``; 0 or 1: only the final model)."""
    link_mbit: float | None = None
    """Emulated sites (``diloco.coordinator.sites``, root): every worker runs in a network namespace
    of its own behind a link shaped to this rate each way, Mbit/s; the supervisor's store
    (and torchft's lighthouse) listen on the hub. None: everything on 127.0.0.1."""
    time_limit_s: float | None = None
    """Stop the job this long after its launch, trained or not: the summary then says
    ``time_limited`` and gives the tokens it reached (no final model, no final eval)."""

    def check_workload(self, *counts: str) -> None:
        """The checks both baselines share: ``workers``, ``steps``, ``threads_per_worker``
        and ``counts`` at least 1, the curve points, sites and time limit, the learners' lr,
        a finite ``kill_every_s``."""
        for name in ("workers", "steps", "threads_per_worker", *counts):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        check_curve_points(self.curve_points)
        check_sites_and_limit(self.link_mbit, self.time_limit_s)
        LearnerConfig(lr=self.lr)  # the learners' own check
        if not (math.isfinite(self.kill_every_s) and self.kill_every_s >= 0):
            raise InvalidArgument(f"kill every must be a finite number of seconds >= 0, got {self.kill_every_s}")

    def inner(self):
        """The workers' inner-loop config (``learner_inner``)."""
        return learner_inner(self.steps, self.lr)

    def task(self, worker: int):
        """Worker ``worker``'s instance of the run's task (``worker_task``)."""
        return worker_task(self.run, worker, self.workers)

    @classmethod
    def read(cls, run_dir: Path):
        """The config ``BaselineRun.start`` wrote to ``run_dir``."""
        return cls.from_json((run_dir / "config.json").read_text())

    @classmethod
    def for_worker(cls, run_dir: Path, worker: int):
        """In worker process ``worker``: the run's config and the worker's task, built with
        ``threads_per_worker`` torch threads."""
        import torch

        cfg = cls.read(run_dir)
        torch.set_num_threads(cfg.threads_per_worker)
        return cfg, cfg.task(worker)

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


@dataclass(frozen=True)
class BaselineRun:
    """A baseline run from its ``config.json`` to its ``summary.json``, with what the
    summary needs from before the training."""

    cfg: WorkloadConfig
    """The run's config, ``out`` set to its directory."""
    task: Task
    """The run's task as the supervisor builds it: for the evaluations and the tokens."""
    batch_tokens: int
    """Tokens of one task batch."""
    eval_start: float
    """The eval loss of the task's initial model."""

    @classmethod
    def start(cls, cfg: WorkloadConfig, name: str, holds: tuple[str, ...]) -> BaselineRun:
        """Make the run directory (``cfg.out`` or ``runs/<name>-<time>``) and write the
        config its workers read. A directory with any of the files ``holds`` already holds
        a run; a broken task fails before the directory is made."""
        from diloco.cli.metrics import eval_task, supervisor_task, tokens_per_step

        run_dir = cfg.out or Path("runs") / time.strftime(f"{name}-%Y%m%d-%H%M%S")
        if any((run_dir / held).exists() for held in holds):
            raise InvalidArgument(f"{run_dir} already holds a run; give a new --out directory")
        task = supervisor_task(cfg.run, cfg.workers)
        batch_tokens = tokens_per_step(cfg.run, task)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cfg = replace(cfg, out=run_dir)
        (run_dir / "config.json").write_text(cfg.to_json())
        return cls(cfg, task, batch_tokens, eval_task(cfg.run, task))

    @property
    def dir(self) -> Path:
        return self.cfg.out

    def finish(self, final_model: dict[str, torch.Tensor] | None, metrics: dict, details: dict, **values) -> dict:
        """Evaluate the final model and write ``stats.json`` (the metrics, rounded, then
        ``details``) and, last, as it marks a finished run, ``summary.json``: ``values``
        (wall_s, tokens, goodput, restarts, links) with the eval losses (and the eval
        curve, ``diloco.cli.metrics.eval_curve``), the metrics' uptime, global stall and bytes,
        and the steps. ``final_model`` None: the run stopped at its time limit, with no
        final model (no final eval, no curve). Returns the summary."""
        from diloco.cli.metrics import eval_curve, eval_task

        final = eval_task(self.cfg.run, self.task, final_model) if final_model is not None else None
        curve = eval_curve(self.cfg.run, self.task, self.dir, self.eval_start, (values["tokens"], final)) \
            if final_model is not None else []
        result = summary(
            eval_unit=self.task.eval_unit, eval_loss_start=self.eval_start,
            eval_loss_final=final, curve=curve, uptime=metrics["uptime"],
            global_stall_s=metrics["global_stall_s"], bytes_per_1k_tokens=metrics["bytes_per_1k_tokens"],
            start_s=metrics["start_s"], steps=self.cfg.steps, time_limited=final_model is None, **values,
        )
        atomic_write_json(self.dir / "stats.json", {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()},
            **details,
            "run_dir": str(self.dir),
        })
        atomic_write_json(self.dir / "summary.json", result)
        return result


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
              "global_stall_s": 3, "bytes_per_1k_tokens": 1, "start_s": 3}
    return {k: (round(values[k], digits[k]) if k in digits and values[k] is not None else values[k]) for k in SUMMARY_KEYS}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass(frozen=True)
class Placement:
    """Where a worker process runs: its command's prefix (its namespace), and the address it
    listens on and gives its peers."""

    prefix: tuple[str, ...] = ()
    address: str = "127.0.0.1"


class WorkerSites:
    """Where a baseline's workers run: this namespace, or (``link_mbit``) each worker on an
    emulated site of its own (``diloco.coordinator.sites``) for the whole run; a restarted worker comes
    back on its site, as on its machine. ``host``: where the supervisor's side listens."""

    def __init__(self, link_mbit: float | None, run_dir: Path, say: Callable[[str], None]) -> None:
        from diloco.coordinator import sites

        self.mbit, self.dir = link_mbit, run_dir
        self.hub = sites.new_hub(say) if link_mbit is not None else None
        self.sites = sites.Sites(self.hub) if self.hub is not None else None
        self.of: dict[int, sites.Site] = {}

    @property
    def host(self) -> str:
        return self.hub.address if self.hub is not None else "127.0.0.1"

    def place(self, worker: int) -> Placement:
        from diloco.coordinator.sites import SITE_IFACE

        if self.sites is None:
            return Placement()
        if worker not in self.of:
            self.of[worker] = self.sites.add(self.mbit)
        site = self.of[worker]
        # gloo binds and advertises the site's interface (its default resolves the host name).
        return Placement(("ip", "netns", "exec", site.netns, "env", f"GLOO_SOCKET_IFNAME={SITE_IFACE}"), site.address)

    def close(self) -> dict | None:
        """Record what the kernel counted on every worker's link (``sites.jsonl``), remove
        the sites and the hub; the counts, or None without sites."""
        if self.hub is None:
            return None
        from diloco.coordinator import sites

        try:
            records = [{"worker": w, "netns": s.netns, "address": s.address, "mbit": s.mbit, **self.sites.counters(s)}
                       for w, s in sorted(self.of.items())]
            with open(self.dir / "sites.jsonl", "w") as out:
                out.writelines(json.dumps(r) + "\n" for r in records)
        finally:
            sites.remove_hub(self.hub)
        return {"sites": records, "kernel_up": sum(r["up"] for r in records),
                "kernel_down": sum(r["down"] for r in records)}


def spawn(module: str, args: list[str], log: Path, where: Placement = Placement()) -> subprocess.Popen:
    """``python -m module args`` in its own session (so it can be killed with everything
    it started), ``where`` says (its namespace), stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen([*where.prefix, sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
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


class StatusLine:
    """A supervisor's one-line progress on stderr, redrawn in place while it is entered;
    it ends in the seconds since it was made."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(console=Console(stderr=True), refresh_per_second=4)
        self.started = time.monotonic()

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def show(self, text: str) -> None:
        from rich.text import Text

        self.live.update(Text(f"{text} · {time.monotonic() - self.started:5.0f} s"))


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

