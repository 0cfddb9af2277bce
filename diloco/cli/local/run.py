"""``diloco local``: the whole system on one machine — a coordinator, S shards and M
learners as separate processes on 127.0.0.1 — with live progress, a run directory and a
summary. It drives the cluster the way a user would: learners are added through the
coordinator's AddLearners RPC, and the final global model is fetched with Bootstrap.

Run directory: ``config.json``, ``endpoints.json`` (role, address, pid of every process,
written as they come up), ``admin-token`` (0600; ``diloco admin --run-dir DIR`` drives
the running cluster), ``logs/``, ``shard<m>/tape-S<m>.jsonl``, ``learners/<id>.json``,
``model.safetensors`` (the final global model under the keys of the task model's
``state_dict()``, fetched with the coordinator's ExportModel), ``curve/`` (the global
model exported at each curve point, and ``evals.jsonl``, the evaluations of the global
model), ``curves.jsonl`` (every loss series against the run's tokens), ``loss.png``,
``timeline.png`` and ``summary.json``; with ``--tensorboard DIR``, the curves as
TensorBoard event files in DIR; with a Hugging Face task (``Task.save_pretrained``),
``hf/``, the final model as ``from_pretrained`` loads it.

This module is the run's driver (launch, watch, stop, summarise); the processes are
``supervisor``'s, the tables ``progress``'s, the curves ``curves``'s, the plot ``plots``'s
and every measure ``diloco.cli.metrics``'s.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from diloco import auth
from diloco.coordinator import sites
from diloco.config import RunConfig
from diloco.errors import AlreadyExists, DilocoError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from diloco.files import PRIVATE_DIR, atomic_write, private_dir
from diloco.coordinator.pin import pin_of
from diloco.snapshots import snapshot_ids
from diloco.telemetry import require_prometheus
from diloco.coordinator.launcher import LINK_OVERRIDE, SITES_FILE
from diloco.learner.config import LearnerConfig
from diloco.cli.chaos import SCAVENGED_POOL, ChaosMonkey, ChaosNetwork
from diloco.cli.check import describe, write_check
from diloco.cli.export import export_model, write_pretrained
from diloco.cli.local.config import LocalConfig
from diloco.cli.local.curves import check_tensorboard, record_global_evals, write_curves, write_tensorboard
from diloco.cli.local.plots import plot_loss
from diloco.cli.local.progress import Failures, closing_lines, final_table, progress_line, progress_table
from diloco.cli.local.supervisor import Cluster, shard_status, take_snapshot
from diloco.cli.metrics import (curve_marks, curve_path, eval_task, expected_period, goodput, learner_events, link_bytes, run_tokens,
                           slot_seconds, start_s, supervisor_task, tape_stats, tokens_per_step, uptime, wire_bytes)

logger = logging.getLogger(__name__)


DRAIN_LEAD_S = LearnerConfig.heartbeat_interval_s
"""How long before the budget is reached (at the current token rate) the drain is sent."""


class CurveExports:
    """The global model's exports at the curve points, one at a time on a thread of their
    own: the supervisor's loop, which sends the budget's drain, never waits on one (an
    export takes 0.04-0.16 s on the default model, seconds on a loaded machine). A mark
    that passes while the previous export still runs is skipped: the curve has a point
    fewer, and the run says so in its log."""

    def __init__(self, admin, run_dir: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.admin, self.run_dir = admin, run_dir
        self.done: list[tuple[float, dict[int, int], Path]] = []
        """(unix time asked, each fragment's version, the file) of each export that landed."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="diloco-curve-export")
        self._pending = None

    def mark(self, tokens: int) -> None:
        if self._pending is not None and not self._pending.done():
            logger.info("the eval curve skips the point at %d tokens: the previous export still runs", tokens)
            return
        self._pending = self._pool.submit(self._export, tokens)

    def _export(self, tokens: int) -> None:
        asked, path = time.time(), curve_path(self.run_dir, tokens)
        try:
            exported = export_model(self.admin, path, timeout_s=60)
        except DilocoError as error:  # a shard restarting: the curve lacks this point
            logger.warning("could not export the model for the eval curve at %d tokens: %s", tokens, error)
            return
        self.done.append((asked, exported.versions, path))

    def close(self) -> None:
        """Wait for the export in flight (before the cluster stops), then let go."""
        self._pool.shutdown(wait=True)
        self.admin.close()


class Pace:
    """Tokens per second over the last few seconds of the learners' (heartbeat) counts."""

    WINDOW_S = 3.0

    def __init__(self) -> None:
        self.points: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, t: float, tokens: int) -> float:
        self.points.append((t, tokens))
        while len(self.points) > 2 and t - self.points[1][0] >= self.WINDOW_S:
            self.points.popleft()
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return max(n1 - n0, 0) / (t1 - t0) if t1 > t0 else 0.0


EXPORT_ATTEMPTS = 3
"""Tries of the final export (a shard that stops sending fails one in 30 s)."""


def _launch(admin, cfg: LocalConfig) -> None:
    slow, devices, links = dict(cfg.slow_learners), dict(cfg.learner_devices), dict(cfg.links)
    for index in range(cfg.learners):
        overrides = {"slow_factor": str(slow[index])} if index in slow else {}
        if index in devices:
            overrides["device"] = devices[index]
        if index in links:
            overrides[LINK_OVERRIDE] = str(links[index])
        failed = [r for r in admin.add_learners(1, overrides=overrides) if not r["ok"]]
        if failed:
            raise Unavailable(f"could not launch learners: {failed}")


LEARNERS_STOP_S = 8.0
"""How long a stop waits for drained learners' summaries (their final pushes take at
most ``FINAL_PUSH_WAIT_S``) before the shards and the coordinator go regardless."""


def _stop_learners(admin, run_dir: Path, say: Callable[[str], None]) -> list[str]:
    """Drain every live learner while the shards still serve, so its final pushes land and
    it writes its summary; wait for those summaries (at most ``LEARNERS_STOP_S``; a second
    Ctrl-C stops waiting). Returns the ids drained."""
    try:
        live = [m["id"] for m in admin.members()]  # joining, active or draining
        if live:
            admin.remove_learners(live, drain=True)
    except DilocoError as error:
        say(f"could not stop the learners through the coordinator: {error}")
        return []
    if not live:
        return []
    say(f"stopping {len(live)} learners: {', '.join(live)}")
    deadline = time.monotonic() + LEARNERS_STOP_S
    try:
        while (waiting := [i for i in live if not (run_dir / "learners" / f"{i}.json").exists()]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        say("stopped waiting for the learners (interrupted again)")
        return live
    if waiting:
        say(f"{', '.join(waiting)} did not stop within {LEARNERS_STOP_S:g} s: the coordinator stops them")
    return live


def _figure(value: float, digits: int) -> float | None:
    """A measured figure for summary.json: None where it does not exist (NaN)."""
    return round(value, digits) if math.isfinite(value) else None


def strict(summary: dict, missing: dict[str, str]) -> dict:
    """``summary`` as strict JSON can hold it: every non-finite number becomes null, and
    ``missing`` says why for each such figure (its own reason, or "not measured")."""
    reasons = dict(missing)

    def clean(value, key: str):
        if isinstance(value, float) and not math.isfinite(value):
            reasons.setdefault(key, f"not measured ({value})")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        return value

    cleaned = clean(summary, "")
    cleaned["missing"] = reasons
    return cleaned


def run_failures(summary: dict, killed: set[str]) -> list[str]:
    """What makes ``diloco local`` exit non-zero, one line each: a learner that failed before
    training (a chaos kill is no failure), a launch that ended before joining, no token trained."""
    lines = [f"learner {l['id']} failed before training: {l['reason']}" for l in summary["learners"]
             if l["state"] == "failed" and not l["inner_steps"] and l["id"] not in killed]
    lines += [f"launch {x['launch_id']} ended before joining: {x['detail']}" for x in summary["launches_failed"]]
    if not summary["tokens"]:
        lines.append("no token was trained")
    return lines


def _finished(cfg: LocalConfig, members: list[dict], monkey: ChaosMonkey | None) -> bool:
    """Every learner launched has joined and is gone. A chaos action in progress (a kill
    whose replacement is being launched, a network fault, a victim of one that may yet
    be failed and replaced) means not yet."""
    if monkey is not None and not (monkey.settled() and monkey.acting.acquire(blocking=False)):
        return False
    try:
        expected = cfg.learners + (monkey.launched if monkey is not None else 0)
        return len(members) >= expected and all(m["state"] in ("left", "failed") for m in members)
    finally:
        if monkey is not None:
            monkey.acting.release()


def _missing(cfg: LocalConfig, members: list[dict], monkey: ChaosMonkey | None) -> int:
    return cfg.learners + (monkey.launched if monkey is not None else 0) - len(members)


def _sigterm_interrupts():
    """SIGTERM (``timeout``, ``kill``) stops a run as Ctrl-C does: the final model is
    exported and every process stopped. Returns the handler it replaced (None off the
    main thread, where Python cannot install one). Every process of the run also watches
    this one (``--exit-with-parent``), so a SIGKILL here leaves nothing running either."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _link_learner_logs(run_dir: Path, members: list[dict]) -> None:
    """logs/<learner id>.log for each learner that joined: a link to the log its launcher
    writes by launch id (the id is known only once it joins)."""
    for member in members:
        link = run_dir / "logs" / f"{member['id']}.log"
        if member["launch_id"] and not link.is_symlink():
            with contextlib.suppress(FileExistsError):
                link.symlink_to(Path("..") / "coordinator" / "learners" / f"{member['launch_id']}.log")


def _check_new_run_dir(run_dir: Path) -> None:
    """A run directory is new or empty: never another run's (live or finished), whose
    secret, tapes and coordinator state a second run would mix with its own."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise InvalidArgument(f"--out {run_dir} is a file, not a directory")
    if not any(run_dir.iterdir()):
        return
    live = []
    with contextlib.suppress(OSError, ValueError):
        for entry in json.loads((run_dir / "endpoints.json").read_text()):
            with contextlib.suppress(ProcessLookupError, PermissionError, KeyError, TypeError):
                os.kill(int(entry["pid"]), 0)
                live.append(f"{entry['role']} pid {entry['pid']}")
    if live:
        what = f"a live run ({', '.join(live)})"
    elif (run_dir / "summary.json").exists():
        what = "a finished run (summary.json)"
    elif (run_dir / "config.json").exists():
        what = "a run that stopped before it finished (config.json, no summary.json)"
    else:
        what = "files"
    raise AlreadyExists(f"--out {run_dir} already holds {what}; a run never reuses another's directory: "
                          "give a new or empty --out (or remove that one)")


# What defines a run, kept from its config.json when it is resumed (the rest, such as the
# number of learners, the chaos and the snapshot schedule, may differ from one part to the next).
RUN_DEFINING = ("shards", "quorum", "grace", "steps", "tokens", "lr", "outer_lr", "outer_momentum", "merge", "scale_by",
                "downlink", "delta_codec", "error_feedback", "block_size", "tls", "snapshot_dir")
# Kept from it unless given again.
RUN_ADJUSTABLE = ("learners", "learner_threads", "snapshot_every_s", "snapshot_keep", "fork_server")


def resume_config(run_dir: Path, given: LocalConfig, default: LocalConfig) -> LocalConfig:
    """The configuration that continues the stopped run in ``run_dir``: its stored run
    config and run-defining settings; whatever ``given`` sets away from ``default`` must
    agree with them (FailedPrecondition naming every key that does not)."""
    try:
        stored = json.loads((run_dir / "config.json").read_text())
        stored_run = RunConfig.from_json((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise NotFound(f"--resume {run_dir}: no run there (no config.json and run.json)") from None
    except (OSError, ValueError, DilocoError) as error:
        raise InvalidArgument(f"--resume {run_dir}: its config cannot be read: {error}") from None
    conflicts = []
    given_run, default_run, kept_run = (json.loads(r.to_json()) for r in (given.run, default.run, stored_run))
    for key, value in given_run.items():
        if value != default_run.get(key) and value != kept_run.get(key):
            conflicts.append(f"{key} {value!r} (the run has {kept_run.get(key)!r})")
    kept = {}
    for key in RUN_DEFINING:
        value, kept[key] = getattr(given, key), stored.get(key, getattr(default, key))
        if value != getattr(default, key) and value != kept[key]:
            conflicts.append(f"{key} {value!r} (the run has {kept[key]!r})")
    if conflicts:
        raise FailedPrecondition(f"--resume {run_dir} continues the run with its own config; these differ: "
                                 f"{'; '.join(conflicts)}. Start a new run (--out) to change them")
    for key in RUN_ADJUSTABLE:
        if getattr(given, key) == getattr(default, key) and key in stored:
            kept[key] = stored[key]
    return replace(given, run=stored_run, out=run_dir, resume=True, **kept)


def _resumable(run_dir: Path, snapshot_dir: str) -> int:
    """The snapshot a stopped run resumes from (its newest complete one)."""
    summary = run_dir / "summary.json"
    if summary.exists() and not json.loads(summary.read_text()).get("interrupted", True):
        raise FailedPrecondition(f"--resume {run_dir}: that run finished (summary.json); nothing to continue")
    complete = [i for i, done in snapshot_ids(snapshot_dir).items() if done]
    if not complete:
        raise FailedPrecondition(f"--resume {run_dir}: no complete snapshot in {snapshot_dir} to resume from (a run "
                                 "takes one when stopped with Ctrl-C or SIGTERM; --snapshot-every-s S also covers crashes)")
    return max(complete)


def _lock(run_dir: Path):
    """Hold RUN_DIR/supervisor.lock for this run: a second supervisor (a resume while this
    one lives) is refused. The lock goes with the process, however it ends."""
    import fcntl

    handle = open(run_dir / "supervisor.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise AlreadyExists(f"{run_dir} is in use by a live diloco local (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _snapshot_for_resume(admin, run_dir: Path, say: Callable[[str], None]) -> int | None:
    """A snapshot of the interrupted run, taken once its learners stopped and before the
    shards do (within 60 s; a second Ctrl-C gives up on it): ``diloco local --resume
    RUN_DIR`` continues from it, with every step the learners trained."""
    say("taking a snapshot to resume from")
    try:
        snapshot_id, state = take_snapshot(admin)
        if state == "complete":
            say(f"snapshot {snapshot_id} taken: `diloco local --resume {run_dir}` continues the run")
            return snapshot_id
        say(f"snapshot {snapshot_id} {state}; --resume would start from an earlier one, if any")
    except KeyboardInterrupt:
        say("snapshot abandoned (interrupted again)")
    except DilocoError as error:
        say(f"no snapshot to resume from: {error}")
    return None


def _steps_done(run_dir: Path) -> int:
    """Inner steps the stopped run's learners got to: the most any one reached, from the
    run's summary (written on Ctrl-C/SIGTERM) or else from the learners' own summaries."""
    learners = []
    with contextlib.suppress(OSError, ValueError):
        learners = json.loads((run_dir / "summary.json").read_text()).get("learners", [])
    if not learners:
        for path in (run_dir / "learners").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                learners.append(json.loads(path.read_text()))
    return max((int(l.get("inner_steps", 0)) for l in learners), default=0)


def _check_devices(cfg: LocalConfig) -> None:
    """A learner device this machine cannot give fails the run before anything starts."""
    devices = {device for _, device in cfg.learner_devices}
    if "xla" in devices and importlib.util.find_spec("torch_xla") is None:
        raise FailedPrecondition(
            "--learner-device ...:xla: torch-xla is not installed here. It pins its own torch, so it goes in a venv of "
            "its own: pip install -c constraints-xla.txt -e '.[xla]' (on a CPU also set PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)"
        )
    if "cuda" in devices and not torch.cuda.is_available():
        raise FailedPrecondition("--learner-device ...:cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")


def run_local(cfg: LocalConfig) -> dict:
    from rich.console import Console
    from rich.live import Live

    from diloco.clients.coordinator import AdminClient
    from diloco.cli.timeline import draw_timeline

    # The directory and the task first: a bad one fails before anything is written or started.
    part_started = time.time()  # this part of the run (a resumed run has several)
    run_dir = cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    snapshot_dir = cfg.snapshot_dir or str(run_dir / "coordinator" / "snapshots")
    lock = _lock(run_dir) if cfg.resume else None
    resumed_from = _resumable(run_dir, snapshot_dir) if cfg.resume else None
    if not cfg.resume:
        _check_new_run_dir(run_dir)
    _check_devices(cfg)
    if cfg.tensorboard is not None:
        check_tensorboard(cfg.tensorboard)
    if cfg.sites:
        sites.check()  # root, namespaces and tc: before anything is written
    if cfg.prometheus:
        require_prometheus()  # the optional extra, likewise
    task = supervisor_task(cfg.run, cfg.learners)
    pin = pin_of(task.model, cfg.run.fragments)  # the run's model, pinned at the coordinator (before any evaluation)
    unit = task.eval_unit
    eval_start = eval_task(cfg.run, task)  # a task whose evaluation fails stops here, with nothing written
    batch_tokens = tokens_per_step(cfg.run, task)
    learner_steps = cfg.learner_steps(batch_tokens)
    if cfg.resume and cfg.tokens is None:  # the steps each learner has left
        learner_steps = max(learner_steps - _steps_done(run_dir), 1)
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)  # logs: no table cut at 80
    if cfg.resume:
        console.print(f"[bold]diloco local[/]: resuming {run_dir} from snapshot {resumed_from}")
        with open(run_dir / "resumes.jsonl", "a") as resumes:
            resumes.write(json.dumps({"t": time.time(), "snapshot": resumed_from, "learners": cfg.learners,
                                      "learner_steps": learner_steps}) + "\n")
    else:
        os.chmod(private_dir(run_dir), PRIVATE_DIR)  # also an empty directory given as --out: it will hold the secret
        lock = _lock(run_dir)
        private_dir(run_dir / "learners")
        atomic_write(run_dir / "secret", auth.new_secret())
        atomic_write(run_dir / "run.json", cfg.run.to_json())
        resolved = {**asdict(cfg), "out": str(run_dir), "run": json.loads(cfg.run.to_json()), "learner_steps": learner_steps}
        atomic_write(run_dir / "config.json", json.dumps(resolved, indent=1, default=str))
        if math.isfinite(eval_start):  # the seed is every fragment's version 0
            record_global_evals(run_dir, [("seed", time.time(), dict.fromkeys(range(cfg.run.fragments), 0), eval_start)],
                                unit)
    budget = f"{cfg.tokens:,} tokens" if cfg.tokens else f"{learner_steps} inner steps each"
    console.print(f"[bold]diloco local[/]: task {cfg.run.task}, {cfg.learners} learners, {cfg.shards} shards, {budget}, "
                  f"run directory {run_dir}")
    hub = sites.new_hub(lambda line: console.print(line, soft_wrap=True, markup=False)) if cfg.sites else None
    try:
        cluster = Cluster(cfg, run_dir, learner_steps, pin, hub)
    except BaseException:
        if hub is not None:
            sites.remove_hub(hub)
        raise
    started_wall, started = time.time(), time.monotonic()
    admin = monkey = curve_exports = None
    before: set[str] = set()
    interrupted = time_limited = False
    draining: set[str] = set()
    drained_at = None
    previous_sigterm = _sigterm_interrupts()
    try:
        cluster.start(restore=None if resumed_from is None else str(resumed_from))
        if cluster.status_url:
            console.print(f"status page: {cluster.status_url}", soft_wrap=True, markup=False)
        token = (run_dir / "admin-token").read_text().strip()
        admin = AdminClient(cluster.coordinator, token, timeout_s=10)
        before = {m["id"] for m in admin.members(include_gone=True)}  # a resumed run's earlier learners
        _launch(admin, cfg)
        curve_exports = CurveExports(AdminClient(cluster.coordinator, token, timeout_s=60), run_dir)
        if cfg.chaos.active:  # its clock starts now that the learners are launched
            chaos_admin = AdminClient(cluster.coordinator, token, timeout_s=10)
            network = ChaosNetwork(hub, cluster.coordinator, tuple(cluster.shards)) if hub is not None else None
            monkey = ChaosMonkey(cfg.chaos, chaos_admin, lambda m: cluster.restart_shard(m, chaos_admin, monkey.record),
                                 learner_steps, run_dir / "chaos.jsonl", time.monotonic(), network, cfg.shards)
            monkey.start()
        last_stats, step_goodput, idle_since, last_line = 0.0, None, None, 0.0
        marks = curve_marks(cfg.tokens or cfg.learners * learner_steps * batch_tokens, cfg.curve_points)
        failures = Failures()
        pace = Pace()
        # On a terminal a live table; in a log (CI, nohup, kubectl logs) one line every 10 s.
        # (transient: at the end the final table, from the summary's records, takes its place)
        with Live(console=console, refresh_per_second=2, transient=True) if console.is_terminal \
                else contextlib.nullcontext() as live:
            while True:
                members, launches = admin.listing(include_gone=True)
                _link_learner_logs(run_dir, members)
                cluster.note_learners(members)
                for line in failures.new(members, launches):
                    console.print(line, soft_wrap=True, markup=False)
                events = learner_events(run_dir)
                if time.monotonic() - last_stats > 5:
                    steps = {m["id"]: m["inner_steps"] for m in members}
                    step_goodput, last_stats = tape_stats(run_dir, cfg.run.fragments, steps)["step_goodput"], time.monotonic()
                statuses = shard_status(cluster.shards, cluster.secret)
                if live is not None:
                    live.update(progress_table(members, statuses, events, step_goodput, started, unit))
                elif time.monotonic() - last_line >= 10:
                    console.print(progress_line(members, statuses, events, started, unit), soft_wrap=True)
                    last_line = time.monotonic()
                trained = sum(m["tokens"] for m in members)
                rate = pace.add(time.monotonic(), trained)
                if marks and trained >= marks[0]:  # a point of the eval curve: the global model now
                    marks = [m for m in marks if m > trained]
                    curve_exports.mark(trained)
                # A drain takes effect about a heartbeat interval after it is sent (the counts
                # are half an interval old, the directive rides the next heartbeat): sent that
                # early, the learners stop at the budget on average instead of past it.
                if cfg.tokens is not None and trained + rate * DRAIN_LEAD_S >= cfg.tokens:
                    # The budget is spent: drain everyone (and anyone who joins late).
                    if monkey is not None:
                        monkey.halt()
                    todo = [m["id"] for m in members if m["state"] in ("active", "joining") and m["id"] not in draining]
                    if todo:
                        admin.remove_learners(todo, drain=True)
                        draining |= set(todo)
                        drained_at = drained_at or time.time()
                current = [m for m in members if m["id"] not in before]
                # The run's learners are those it launched; one that joined by itself with the
                # run's credential (an own-loop script, a hostile one) does not hold the end:
                # the stop below drains it with the rest.
                if _finished(cfg, [m for m in current if m["launch_id"]], monkey):
                    break
                if cfg.time_limit_s is not None and time.monotonic() - started > cfg.time_limit_s:
                    console.print(f"time limit of {cfg.time_limit_s:g} s reached at {trained:,} tokens: stopping")
                    time_limited = True
                    break
                # A launch that never joins (the learner died while starting) must not hang
                # the run: once every member is gone, wait for late joiners only so long.
                if current and all(m["state"] in ("left", "failed") for m in current):
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > cfg.startup_timeout_s:
                        logger.warning("%d launched learners never joined; see %s", _missing(cfg, current, monkey),
                                       run_dir / "coordinator" / "learners")
                        break
                else:
                    idle_since = None
                # Near the budget, look again just in time for the drain; once drained, often
                # enough to see the end soon.
                if draining:
                    pause = 0.25
                elif cfg.tokens is not None and rate > 0:
                    pause = min(1.0, max((cfg.tokens - trained) / rate - DRAIN_LEAD_S, 0.05))
                else:
                    pause = 1.0
                time.sleep(pause)
    except KeyboardInterrupt:
        interrupted = True
        stop_started = time.monotonic()
        console.print("interrupted: the learners stop (final pushes, summaries), a snapshot is taken, then the "
                      "shards and the coordinator stop")
    finally:
        say = lambda line: console.print(line, soft_wrap=True, markup=False)  # noqa: E731
        if curve_exports is not None:
            curve_exports.close()
        if monkey is not None:
            monkey.halt()
            monkey.join(timeout=60)
        stopped: list[str] = []
        if admin is not None:  # while the shards serve: their final pushes land, they write their summaries
            stopped = _stop_learners(admin, run_dir, say)
        stop_snapshot = None
        if interrupted and admin is not None:  # what --resume continues from: every step trained is in it
            stop_snapshot = _snapshot_for_resume(admin, run_dir, say)
        state, versions = None, {}
        export_error = None
        exported_at = time.time()
        if admin is not None:
            console.print("exporting the trained model from the shards")
            for attempt in range(1, EXPORT_ATTEMPTS + 1):
                try:
                    exported = export_model(AdminClient(cluster.coordinator, token, timeout_s=60),
                                            run_dir / "model.safetensors", timeout_s=120)
                    state, versions = exported.state, exported.versions
                    break
                except DilocoError as error:  # the cluster may already be gone after Ctrl-C
                    export_error = str(error)
                    logger.warning("could not export the final model (attempt %d of %d): %s", attempt, EXPORT_ATTEMPTS,
                                   error)
        members, launches = [], []
        if admin is not None:  # after Ctrl-C too: the processes run in their own sessions
            try:
                members, launches = admin.listing(include_gone=True)
                cluster.note_learners(members)
            except DilocoError as error:
                logger.warning("could not list the learners: %s", error)
        if admin is not None:
            admin.close()
        try:
            cluster.stop(say=say)
        finally:
            if hub is not None:
                sites.remove_hub(hub)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if interrupted:
            say(f"stopped {time.monotonic() - stop_started:.1f} s after the interrupt")
    wall_s = time.monotonic() - started
    stopped_by_interrupt = set(stopped) if interrupted else set()
    failed_launches = [{"launch_id": x["launch_id"], "detail": x["detail"]} for x in launches if x["state"] == "failed"]
    summaries = {s["learner_id"]: s for s in (json.loads(p.read_text()) for p in sorted((run_dir / "learners").glob("*.json")))}
    events = learner_events(run_dir)
    eval_final = eval_task(cfg.run, task, state) if state is not None else float("nan")
    if state is not None and task.save_pretrained is not None:  # a Hugging Face task: RUN_DIR/hf, from_pretrained's
        pretrained = run_dir / "hf"
        if cfg.resume and pretrained.exists():  # a resumed run's final model replaces its earlier part's
            shutil.rmtree(pretrained)
        write_pretrained(cfg.run.task, task, state, pretrained)
    missing = {}  # figures that do not exist, and why
    if not task.eval_batches:
        missing["eval_loss_start"] = missing["eval_loss_final"] = "the task has no eval batches"
    elif state is None:
        missing["eval_loss_final"] = (f"the final model could not be exported: {export_error}" if export_error
                                      else "no final model: the cluster did not start")
    # Inner steps per learner: its summary, or for a killed one its last heartbeat.
    steps = {m["id"]: m["inner_steps"] for m in members}
    steps.update({i: s["inner_steps"] for i, s in summaries.items()})
    tokens = sum(s["tokens"] for s in summaries.values()) + sum(
        m["tokens"] for m in members if m["id"] not in summaries)
    if task.eval_batches:  # the global model's eval at each curve point and at the end (diloco.cli.local.curves)
        from safetensors.torch import load_file

        exports = curve_exports.done if curve_exports is not None else []
        if state is not None:  # a mark the supervisor saw pass once training was over: the final model is that point
            tokens_at = run_tokens(events)
            exports = [e for e in exports if tokens_at(e[0]) < tokens_at(exported_at)]
        evals = [("curve", t, v, eval_task(cfg.run, task, load_file(str(path)))) for t, v, path in exports]
        record_global_evals(run_dir, evals + ([("final", exported_at, versions, eval_final)] if state is not None else []),
                            unit)
    curves = write_curves(run_dir, events)
    curve = [[r["tokens"], round(r["loss"], 4)] for r in curves if r["series"] == "global_eval"] if state is not None else []
    # Goodput and uptime are this part's (a resumed run's earlier parts had theirs); tokens,
    # rounds and bytes are the whole run's.
    part = {i: r for i, r in events.items() if i not in before}
    stats = tape_stats(run_dir, cfg.run.fragments, {i: n for i, n in steps.items() if i not in before})
    # Uptime over the training window: from the first learner computing to the last one done.
    computing = [e["t"] for r in part.values() for e in r if e["kind"] == "state" and e["state"] == "computing"]
    # When each learner stopped training: drained, or gone.
    done = [min(stops) for r in part.values()
            if (stops := [e["t"] for e in r if e["kind"] == "state" and e["state"] in ("draining", "left")])]
    # A fragment's round closes every H/P inner steps.
    period = expected_period(cfg.run.sync_every_steps / cfg.run.fragments * stats["step_s"])
    # Training ends with the last learner's last step, or when the budget drained them all
    # (a learner still starting then leaves later without having trained: no stall).
    end = max(done, default=started_wall + wall_s)
    window = (min(computing, default=started_wall), min(end, drained_at) if drained_at else end)
    up, stall = uptime(stats.pop("round_closes"), *window, period)
    chaos = [json.loads(line) for line in (run_dir / "chaos.jsonl").read_text().splitlines()] if (run_dir / "chaos.jsonl").exists() else []
    pools = {m["id"]: m["pool"] for m in members}
    # Where each learner trained: device, devices, precision (and on XLA the split share).
    devices = {i: {k: v for k, v in e.items() if k not in ("kind", "t")}
               for i, r in events.items() for e in r if e["kind"] == "device"}
    first_steps = sorted(min(e["t"] for e in r if e["kind"] == "state" and e["state"] == "computing")
                         for i, r in part.items()
                         if pools.get(i) != SCAVENGED_POOL and any(e.get("state") == "computing" for e in r))
    # Slots are held until the last learner stopped training (its last step), as DP's and
    # torchft's until their last step: steps a drain lets finish count, so goodput <= 1.
    slots = slot_seconds(first_steps[: cfg.learners], end,
                         [(c["t"], len(c["launched"])) for c in chaos if c["kind"] == "scavenge"])
    summary = {
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "task": cfg.run.task,
        "eval_unit": unit,
        "eval_loss_start": _figure(eval_start, 4),
        "eval_loss_final": _figure(eval_final, 4),
        "curve": curve,
        "start_s": start_s(started_wall, first_steps[: cfg.learners]),
        "goodput": goodput(stats.pop("useful_s"), slots),
        "step_goodput": stats.pop("step_goodput"),
        "uptime": up,
        "global_stall_s": stall,
        **wire_bytes(run_dir),
        "links": link_bytes(run_dir / "coordinator" / "learners" / SITES_FILE, summaries,
                            {m["launch_id"]: m["id"] for m in members if m["launch_id"]}),
        **{k: v for k, v in stats.items() if k != "step_s"},
        "learners_joined": len(members) if members else len(summaries),
        "learners_failed": sum(1 for m in members if m["state"] == "failed") + len(failed_launches),
        "learners_killed": sum(1 for c in chaos if c["kind"] == "kill"),
        "learners_scavenged": (sum(1 for m in members if m["pool"] == SCAVENGED_POOL) if members
                               else sum(len(c["launched"]) for c in chaos if c["kind"] == "scavenge")),
        "shard_restarts": sum(1 for c in chaos if c["kind"] == "restart_shard"),
        "learners": [{"id": m["id"], "pool": m["pool"], "state": "interrupted" if m["id"] in stopped_by_interrupt
                      else m["state"], "reason": m["reason"], "inner_steps": steps.get(m["id"], 0),
                      "tokens": summaries[m["id"]]["tokens"] if m["id"] in summaries else m["tokens"],
                      "tokens_per_s": round(summaries.get(m["id"], m).get("tokens_per_s", 0.0), 1),
                      **devices.get(m["id"], {})} for m in members],
        "final_versions": {str(f): v for f, v in sorted(versions.items())},
        "started_unix": round(started_wall, 3),
        "interrupted": interrupted,
        "time_limited": time_limited,
        "resumed_from_snapshot": resumed_from,
        "snapshot_at_stop": stop_snapshot,
        "launches_failed": failed_launches,
        "run_dir": str(run_dir),
    }
    killed = {c["learner"] for c in chaos if c["kind"] in ("kill", "replace")}  # chaos' victims, replaced
    summary["failures"] = run_failures(summary, killed)
    summary = strict(summary, missing)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    console.print(final_table(summary, events))  # the same records as summary.json, however the run ended
    if curves:
        plot_loss(run_dir, curves, unit)
    if cfg.tensorboard is not None:
        write_tensorboard(curves, cfg.tensorboard, part_started)
    if events:
        draw_timeline(run_dir)
    if cfg.chaos.active and not interrupted:  # the checker over what the run recorded: check.json
        report = write_check(run_dir)
        console.print(describe(report), soft_wrap=True, markup=False)
        if not report.ok:
            summary["failures"].append(f"the chaos checker found a violation ({run_dir / 'check.json'}): {report.first}")
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    for line in closing_lines(summary, run_dir):
        console.print(line, soft_wrap=True, markup=False)
    lock.close()
    return summary
