"""``diloco local``: the whole system on one machine — a coordinator, S shards and M
learners as separate processes on 127.0.0.1 — with live progress, a run directory and a
summary. It drives the cluster the way a user would: learners are added through the
coordinator's AddLearners RPC, and the final global model is fetched with Bootstrap.

Run directory: ``config.json``, ``endpoints.json`` (role, address, pid of every process,
written as they come up), ``admin-token`` (0600; ``diloco admin --run-dir DIR`` drives
the running cluster), ``logs/``, ``shard<m>/tape-S<m>.jsonl``, ``learners/<id>.json``,
``model.safetensors`` (the final global model under the keys of the task model's
``state_dict()``, fetched with the coordinator's ExportModel), ``summary.json`` and
``eval_loss.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path

import torch

from diloco import auth, rpc
from diloco.certs import make_certs
from diloco.chaos import SCAVENGED_POOL, ChaosMonkey
from diloco.config import RunConfig
from diloco.errors import AlreadyExists, DilocoError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from diloco.export import export_model
from diloco.files import atomic_write, atomic_write_json
from diloco.snapshots import snapshot_ids
from diloco.tape import read_tape
from diloco.task import Task, TaskContext, TaskError, build_task, checked_tokens, evaluate
from diloco.local_config import LocalConfig

logger = logging.getLogger(__name__)

MIN_UPTIME_PERIOD_S = 1.0
"""Floor of uptime's expected period between two advances of the global model."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The processes of one local run; every one of them ends when the run does."""

    def __init__(self, cfg: LocalConfig, run_dir: Path, learner_steps: int) -> None:
        self.cfg, self.dir = cfg, run_dir
        self.learner_steps = learner_steps
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._plain: rpc.Tls | None = None
        self.endpoints: list[dict] = []
        self.coordinator = f"127.0.0.1:{_free_port()}"
        self.shards = [f"127.0.0.1:{_free_port()}" for _ in range(cfg.shards)]

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / "logs" / f"{role}.log", "ab")
        tls = ["--tls-dir", str(self.dir / "tls")] if self.cfg.tls else ["--insecure"]
        proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "--exit-with-parent", "--log-level", "INFO", *tls, *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(self.cfg.child_env) if self.cfg.child_env is not None else None)
        log.close()
        self.procs.append((role, proc))
        return proc

    def _endpoint(self, role: str, address: str, pid: int) -> None:
        self.endpoints = [e for e in self.endpoints if e["role"] != role] + [{"role": role, "address": address, "pid": pid}]
        atomic_write(self.dir / "endpoints.json", json.dumps(self.endpoints, indent=1))

    def _shard_args(self, m: int) -> list[str]:
        """``diloco syncer --config`` with the shard's settings as one JSON document
        (RUN_DIR/shard<m>/syncer.json), not flags turned back into strings."""
        config = self.dir / f"shard{m}" / "syncer.json"
        atomic_write_json(config, {
            "shard_id": m, "shards": self.cfg.shards, "port": int(self.shards[m].rsplit(":", 1)[1]),
            "data_dir": str(self.dir / f"shard{m}"), "push_log": True, "coordinator": self.coordinator,
            "quorum": self.cfg.quorum, "grace": self.cfg.grace, "outer_lr": self.cfg.outer_lr,
            "outer_momentum": self.cfg.outer_momentum, "merge": self.cfg.merge, "scale_by": self.cfg.scale_by,
            "snapshot_dir": self.snapshot_dir, **self.common,
        })
        return ["syncer", "--config", str(config)]

    @functools.cached_property
    def secret(self) -> str:
        """The run secret (written before the cluster starts; read once, not every poll)."""
        return (self.dir / "secret").read_text().strip()

    @property
    def snapshot_dir(self) -> str:
        return self.cfg.snapshot_dir or str(self.dir / "coordinator" / "snapshots")

    def start(self, restore: str | None = None) -> None:
        """Start the coordinator and the shards (``restore``: from that snapshot, as
        ``--restore`` takes it), wait until they serve."""
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.common = {"secret_file": str(self.dir / "secret"), "run_config": str(self.dir / "run.json")}
        self.restore = ["--restore", restore] if restore else []
        if self.cfg.tls:
            if not (self.dir / "tls").exists():  # a resumed run keeps its certificates
                make_certs(self.dir / "tls", ["localhost", "127.0.0.1"])
            self._plain = rpc.use_tls(rpc.Tls.from_dir(self.dir / "tls"))  # this supervisor's own calls, until stop
        tls = f"--tls-dir {self.dir / 'tls'} " if self.cfg.tls else "--insecure "
        # Every process gets its settings as one JSON document (diloco <command> --config);
        # a launch's own overrides (--set, a slow factor) follow it on the command line and win.
        learner_config = self.dir / "learner.json"
        atomic_write_json(learner_config, {
            "steps": self.learner_steps, "eval_every": max(self.learner_steps // 6, 1), "num_learners": self.cfg.learners,
            "summary_dir": str(self.dir / "learners"), "events_dir": str(self.dir / "learners"),
            "delta_codec": self.cfg.delta_codec, "threads": self.cfg.threads_per_learner, "wire_delay_ms": self.cfg.delay_ms,
        })
        learner_cmd = f"{sys.executable} -m diloco.cli --exit-with-parent --log-level INFO {tls}learner --config {shlex.quote(str(learner_config))}"
        coordinator_config = self.dir / "coordinator" / "coordinator.json"
        atomic_write_json(coordinator_config, {
            "port": int(self.coordinator.rsplit(":", 1)[1]), "data_dir": str(self.dir / "coordinator"),
            "shards": ",".join(self.shards), "learner_command": learner_cmd, "pools": f"default,{SCAVENGED_POOL}",
            "snapshot_dir": self.snapshot_dir, "snapshot_every_s": self.cfg.snapshot_every_s,
            "snapshot_keep": self.cfg.snapshot_keep, **self.common,
        })
        coord = self._spawn("coordinator", ["coordinator", "--config", str(coordinator_config), *self.restore])
        self.shard_procs = []
        for m, address in enumerate(self.shards):
            shard = self._spawn(f"shard{m}", [*self._shard_args(m), *self.restore])
            self.shard_procs.append(shard)
            self._wait_serving(address, f"shard {m}", shard)
            self._endpoint(f"shard{m}", address, shard.pid)
        self._wait_serving(self.coordinator, "the coordinator", coord)
        self._endpoint("coordinator", self.coordinator, coord.pid)
        token_file = self.dir / "coordinator" / "admin-token"
        _wait(lambda: token_file.exists(), self.cfg.startup_timeout_s, "the admin token")
        (self.dir / "admin-token").write_text(token_file.read_text())
        os.chmod(self.dir / "admin-token", 0o600)

    def restart_shard(self, m: int, admin, log) -> None:
        """SIGKILL shard ``m`` and start it again: from a snapshot taken just before
        (``restart_from`` snapshot), or with no state at all, to recover from the learners'
        anchors (``learners``)."""
        restore, snapshot_id = [], None
        if self.cfg.chaos.restart_from == "snapshot":
            snapshot_id, state = take_snapshot(admin)
            if state != "complete":
                raise Unavailable(f"snapshot {snapshot_id} {state}: not restarting shard {m}")
            restore = ["--restore", str(snapshot_id)]
        old = self.shard_procs[m]
        # Its versions just before the kill: what a recovery from the learners is measured
        # against (its tape's last records may die unflushed with it).
        status = _shard_status([self.shards[m]], self.secret)[0]
        versions = {} if isinstance(status, BaseException) else {f.fragment: f.version for f in status.fragments}
        killed = time.time()
        os.killpg(old.pid, signal.SIGKILL)
        old.wait(timeout=10)
        new = self._spawn(f"shard{m}", [*self._shard_args(m), *restore])
        self.shard_procs[m] = new
        self._wait_serving(self.shards[m], f"shard {m}", new)
        self._endpoint(f"shard{m}", self.shards[m], new.pid)
        log("restart_shard", t=killed, shard=m, snapshot=snapshot_id, source=self.cfg.chaos.restart_from,
            versions_before={str(f): v for f, v in sorted(versions.items())},
            old_pid=old.pid, pid=new.pid, down_s=round(time.time() - killed, 3))

    def _wait_serving(self, address: str, what: str, proc: subprocess.Popen) -> None:
        def serving() -> bool:
            if proc.poll() is not None:
                raise Unavailable(f"{what} exited with code {proc.returncode}; see {self.dir / 'logs'}")
            host, port = address.rsplit(":", 1)
            with socket.socket() as s:
                return s.connect_ex((host, int(port))) == 0

        _wait(serving, self.cfg.startup_timeout_s, what)

    def stop(self, say: Callable[[str], None] = lambda line: None) -> None:
        """SIGTERM everything (the coordinator reaps its learners), SIGKILL what lingers
        after 30 s; ``say`` hears, every 5 s, which processes are still being waited for."""
        if self.cfg.tls:
            rpc.use_tls(self._plain)
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        deadline, next_say = started + 30, started + 5
        while (waiting := [(role, proc) for role, proc in self.procs if proc.poll() is None]) and time.monotonic() < deadline:
            if time.monotonic() >= next_say:
                say(f"stopping: waiting {time.monotonic() - started:.0f} s for "
                    + ", ".join(f"{role} (pid {proc.pid})" for role, proc in waiting)
                    + f"; SIGKILL at {deadline - started:.0f} s")
                next_say += 5
            time.sleep(0.1)
        for role, proc in waiting:
            say(f"stopping: {role} (pid {proc.pid}) ignored SIGTERM for 30 s: its stacks go to its log, then SIGKILL")
            proc.send_signal(signal.SIGUSR1)  # its threads' stacks go to its log (faulthandler)
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise Unavailable(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


# --- progress ------------------------------------------------------------------------


def _shard_status(addresses: list[str], secret: str) -> list:
    """Each shard's Status (or the exception), asked as the coordinator: the supervisor
    holds the run secret it made."""
    from diloco.clients.syncer import SyncerClient, open_channel

    async def one(address):
        async with open_channel(address) as channel:
            return await SyncerClient(channel, auth.Credential(auth.COORDINATOR_ID, secret=secret),
                                      timeout_s=2).status()

    async def all_():
        return await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True)

    return asyncio.run(all_())


def learner_events(run_dir: Path) -> dict[str, list[dict]]:
    """Each learner's event tape (``learners/<id>.events.jsonl``)."""
    events = {}
    for path in sorted((run_dir / "learners").glob("*.events.jsonl")):
        events[path.name.removesuffix(".events.jsonl")] = list(read_tape(path))
    return events


def _progress_line(members: list[dict], statuses: list, events: dict[str, list[dict]], started: float, unit: str) -> str:
    """The progress table's essentials on one line (for logs, where a live table is not drawn)."""
    ok = [s for s in statuses if not isinstance(s, BaseException)]
    versions = [f.version for s in ok for f in s.fragments]
    evals = [e["loss"] for m in members for e in events.get(m["id"], [])[-20:] if e["kind"] == "eval"]
    states = {}
    for m in members:
        states[m["state"]] = states.get(m["state"], 0) + 1
    return (f"[{time.monotonic() - started:5.0f} s] tokens {sum(m.get('tokens', 0) for m in members):,} · learners "
            + (", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none joined yet")
            + f" · outer versions {min(versions, default=0)}–{max(versions, default=0)} · rounds "
            f"{sum(s.rounds_closed for s in ok)} · latest eval {f'{evals[-1]:.3f} {unit}' if evals else '–'}"
            + (f" · {len(ok)}/{len(statuses)} shards up" if len(ok) < len(statuses) else ""))


def _progress_table(members: list[dict], statuses: list, events: dict[str, list[dict]], goodput: float | None,
                    started: float, unit: str):
    from rich.table import Table

    table = Table(title=f"diloco local — {time.monotonic() - started:5.0f} s", title_justify="left")
    for column in ("learner", "state", "pool", "tokens", "tokens/s", "inner steps", f"eval {unit}"):
        table.add_column(column, justify="left" if column in ("learner", "state", "pool") else "right")
    for m in members:
        evals = [e["loss"] for e in events.get(m["id"], []) if e["kind"] == "eval"]
        table.add_row(m["id"], m["state"], m.get("pool", ""), f"{m.get('tokens', 0):,}",
                      f"{m.get('tokens_per_s', 0):,.0f}", f"{m.get('inner_steps', 0):,}",
                      f"{evals[-1]:.3f}" if evals else "")
    ok = [s for s in statuses if not isinstance(s, BaseException)]
    versions = [f.version for s in ok for f in s.fragments]
    table.caption = (
        f"global tokens {sum(m.get('tokens', 0) for m in members):,} · outer versions "
        f"{min(versions, default=0)}–{max(versions, default=0)} · rounds {sum(s.rounds_closed for s in ok)} · "
        f"step goodput {'–' if goodput is None else f'{goodput:.2f}'} · "
        f"pushes {sum(s.pushes_received for s in ok)} · wire ↑{sum(s.bytes_received for s in ok) / 1e6:.1f} MB "
        f"↓{sum(s.bytes_sent for s in ok) / 1e6:.1f} MB"
        + (f" · {len(ok)}/{len(statuses)} shards up" if len(ok) < len(statuses) else "")
        + "".join(f" · shard {s.shard_id}: {s.model_state}" for s in ok if not s.model_state.startswith("serving"))
    )
    return table


def _final_table(summary: dict, events: dict[str, list[dict]]):
    """The run's last table, drawn from its summary (what summary.json says, row for row)."""
    from rich.table import Table

    unit = summary["eval_unit"]
    state = "interrupted" if summary["interrupted"] else "finished"
    table = Table(title=f"diloco local — {state} after {summary['wall_s']:.0f} s", title_justify="left")
    for column in ("learner", "state", "pool", "tokens", "tokens/s", "inner steps", f"eval {unit}"):
        table.add_column(column, justify="left" if column in ("learner", "state", "pool") else "right")
    for learner in summary["learners"]:
        evals = [e["loss"] for e in events.get(learner["id"], []) if e["kind"] == "eval"]
        table.add_row(learner["id"], learner["state"], learner["pool"], f"{learner['tokens']:,}",
                      f"{learner['tokens_per_s']:,.0f}", f"{learner['inner_steps']:,}", f"{evals[-1]:.3f}" if evals else "")
    versions = summary["final_versions"].values()
    table.caption = (
        f"global tokens {summary['tokens']:,} · outer versions {min(versions, default=0)}–{max(versions, default=0)} · "
        f"rounds {summary['rounds']} · step goodput {summary['step_goodput']:.2f} · eval {summary['eval_loss_start']:.3f} → "
        f"{summary['eval_loss_final']:.3f} {unit} · wire ↑{summary['bytes_up'] / 1e6:.1f} MB ↓{summary['bytes_down'] / 1e6:.1f} MB"
    )
    return table


# --- results -------------------------------------------------------------------------


def supervisor_task(run: RunConfig, learners: int) -> Task:
    """The run's task as the supervisor builds it: for the start and final evaluation
    (with the learners' eval batches) and the tokens of one batch."""
    return build_task(run.task, TaskContext(0, learners, run.seed, torch.device("cpu"), dict(run.task_options)), run.init)


def eval_task(run: RunConfig, task: Task, state: Mapping[str, torch.Tensor] | None = None) -> float:
    """The task's eval loss of ``state`` (None: the task's own initial model)."""
    if state is not None:
        task.model.load_state_dict(state)
    value = evaluate(run.task, task)
    return float("nan") if value is None else value


def tokens_per_step(run: RunConfig, task: Task) -> int:
    """Tokens one inner step trains on: the task's count of its first batch."""
    try:
        batch = next(iter(task.batches))
    except StopIteration:
        raise TaskError(f"task {run.task!r} yields no batches") from None
    return checked_tokens(run.task, task.tokens(batch))


def tape_stats(run_dir: Path, fragments: int, steps: dict[str, int]) -> dict:
    """Rounds, participants and grace from the shards' tapes, and goodput (README): the
    share of the learners' inner-step time whose deltas reached the global model, i.e.
    per learner the fragment-steps of its pushes merged with weight > 0 over its inner
    steps x P, weighted by its step time. ``steps``: inner steps each learner trained."""
    rounds, merged, pushes = [], set(), []
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        life = 0  # a restarted shard starts a new life; versions repeat after a restore
        for r in read_tape(tape):
            if r["kind"] == "start":
                life += 1
            elif r["kind"] == "round":
                rounds.append(r)
                merged |= {(tape, life, p, r["fragment"], r["version"])
                           for p, w in zip(r["participants"], r["weights"]) if w > 0}
            elif r["kind"] == "push" and r["outcome"] != "duplicate":
                pushes.append((tape, life, r))
    merged_steps: dict[str, int] = {}
    step_s: dict[str, float] = {}
    for tape, life, p in pushes:
        step_s[p["learner"]] = p["step_time_s"]
        if (tape, life, p["learner"], p["fragment"], p["target_version"]) in merged:
            merged_steps[p["learner"]] = merged_steps.get(p["learner"], 0) + p["steps"]
    typical = sorted(step_s.values())[len(step_s) // 2] if step_s else 1.0
    useful = total = 0.0
    for learner, n in steps.items():
        t = step_s.get(learner) or typical
        total += n * fragments * t
        useful += min(merged_steps.get(learner, 0), n * fragments) * t
    return {
        "rounds": len(rounds),
        "mean_participants": round(sum(len(r["participants"]) for r in rounds) / len(rounds), 3) if rounds else 0.0,
        "mean_grace_s": round(sum(r["grace_s"] for r in rounds) / len(rounds), 4) if rounds else 0.0,
        "step_goodput": round(useful / total, 4) if total else 0.0,
        "useful_s": useful / fragments,
        "round_closes": sorted(r["t"] for r in rounds),
        "step_s": typical,
    }


def slot_seconds(slot_starts: list[float], end: float, scavenged: list[tuple[float, int]]) -> float:
    """Learner-slot time of the training window, the denominator of goodput. Each of the
    learners launched at the start holds a slot from its first inner step (the first
    start-up is excluded, as DP's is) to the end of training; a killed learner's slot
    keeps counting through its replacement's start-up; an early finisher's slot idles
    until the end. Each scavenged learner holds a slot from the moment it was asked for."""
    return sum(max(end - t, 0.0) for t in slot_starts) + sum(count * max(end - t, 0.0) for t, count in scavenged)


def uptime(closes: list[float], start: float, end: float, period_s: float) -> tuple[float, float]:
    """(uptime, global stall seconds): the global model is up in every window of length
    ``period_s`` that saw a round close; a stall is time beyond ``period_s`` between two
    closes (or from the start to the first, or the last to the end)."""
    if end <= start or period_s <= 0:
        return 0.0, 0.0
    points = [start, *[c for c in closes if start <= c <= end], end]
    stall = sum(max(b - a - period_s, 0.0) for a, b in zip(points, points[1:]))
    return round(1.0 - stall / (end - start), 4), round(stall, 3)


def plot_eval(run_dir: Path, events: dict[str, list[dict]], final: float, tokens: int, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    end = 0
    for learner, records in sorted(events.items(), key=lambda kv: int(kv[0].lstrip("L") or 0)):
        evals = [r for r in records if r["kind"] == "eval"]
        if evals:
            ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], marker="o", ms=3, label=learner)
            end = max(end, evals[-1]["tokens"])
    ax.scatter([end], [final], color="black", zorder=3,
               label=f"final global model ({tokens:,} tokens from all learners)")
    ax.set_xlabel("tokens seen by each learner")
    ax.set_ylabel(f"eval loss ({unit})")
    ax.set_title("diloco local: eval loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(run_dir / "eval_loss.png", dpi=120)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------


def _launch(admin, cfg: LocalConfig) -> None:
    slow, devices = dict(cfg.slow_learners), dict(cfg.learner_devices)
    for index in range(cfg.learners):
        overrides = {"slow_factor": str(slow[index])} if index in slow else {}
        if index in devices:
            overrides["device"] = devices[index]
        failed = [r for r in admin.add_learners(1, overrides=overrides) if not r["ok"]]
        if failed:
            raise Unavailable(f"could not launch learners: {failed}")


def _finished(cfg: LocalConfig, members: list[dict], monkey: ChaosMonkey | None) -> bool:
    """Every learner launched has joined and is gone. A chaos action in progress (a kill
    whose replacement is being launched) means not yet."""
    if monkey is not None and not monkey.acting.acquire(blocking=False):
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
RUN_DEFINING = ("shards", "quorum", "grace", "steps", "tokens", "outer_lr", "outer_momentum", "merge", "scale_by",
                "delta_codec", "tls", "snapshot_dir")
# Kept from it unless given again.
RUN_ADJUSTABLE = ("learners", "learner_threads", "snapshot_every_s", "snapshot_keep")


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


def take_snapshot(admin, timeout_s: float = 60.0) -> tuple[int, str]:
    """Start a snapshot (after a scheduled one that is running) and wait for it: its id and
    how it ended, "complete", "failed" or "did not complete within N s"."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            snapshot_id = admin.start_snapshot()
            break
        except AlreadyExists:  # a scheduled snapshot is running: ours starts after it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    while time.monotonic() < deadline:
        state = next((x["state"] for x in admin.snapshots() if x["id"] == snapshot_id), "running")
        if state in ("complete", "failed"):
            return snapshot_id, state
        time.sleep(0.2)
    return snapshot_id, f"did not complete within {timeout_s:g} s"


def _snapshot_for_resume(admin, run_dir: Path, say: Callable[[str], None]) -> int | None:
    """A snapshot of the interrupted run, taken before anything stops (within 60 s; a
    second Ctrl-C gives up on it): ``diloco local --resume RUN_DIR`` continues from it."""
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
    from diloco.timeline import draw_timeline

    # The directory and the task first: a bad one fails before anything is written or started.
    run_dir = cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    snapshot_dir = cfg.snapshot_dir or str(run_dir / "coordinator" / "snapshots")
    lock = _lock(run_dir) if cfg.resume else None
    resumed_from = _resumable(run_dir, snapshot_dir) if cfg.resume else None
    if not cfg.resume:
        _check_new_run_dir(run_dir)
    _check_devices(cfg)
    task = supervisor_task(cfg.run, cfg.learners)
    unit = task.eval_unit
    learner_steps = cfg.learner_steps(tokens_per_step(cfg.run, task))
    if cfg.resume and cfg.tokens is None:  # the steps each learner has left
        learner_steps = max(learner_steps - _steps_done(run_dir), 1)
    console = Console(stderr=True)
    if cfg.resume:
        console.print(f"[bold]diloco local[/]: resuming {run_dir} from snapshot {resumed_from}")
        with open(run_dir / "resumes.jsonl", "a") as resumes:
            resumes.write(json.dumps({"t": time.time(), "snapshot": resumed_from, "learners": cfg.learners,
                                      "learner_steps": learner_steps}) + "\n")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock(run_dir)
        (run_dir / "learners").mkdir(exist_ok=True)
        (run_dir / "secret").write_text(auth.new_secret())
        os.chmod(run_dir / "secret", 0o600)
        (run_dir / "run.json").write_text(cfg.run.to_json())
        resolved = {**asdict(cfg), "out": str(run_dir), "run": json.loads(cfg.run.to_json()), "learner_steps": learner_steps}
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=1, default=str))
    budget = f"{cfg.tokens:,} tokens" if cfg.tokens else f"{learner_steps} inner steps each"
    console.print(f"[bold]diloco local[/]: task {cfg.run.task}, {cfg.learners} learners, {cfg.shards} shards, {budget}, "
                  f"run directory {run_dir}")
    eval_start = eval_task(cfg.run, task)
    cluster = Cluster(cfg, run_dir, learner_steps)
    started_wall, started = time.time(), time.monotonic()
    admin = monkey = None
    before: set[str] = set()
    interrupted = False
    draining: set[str] = set()
    drained_at = None
    previous_sigterm = _sigterm_interrupts()
    try:
        cluster.start(restore=None if resumed_from is None else str(resumed_from))
        token = (run_dir / "admin-token").read_text().strip()
        admin = AdminClient(cluster.coordinator, token, timeout_s=10)
        before = {m["id"] for m in admin.members(include_gone=True)}  # a resumed run's earlier learners
        _launch(admin, cfg)
        if cfg.chaos.active:  # its clock starts now that the learners are launched
            chaos_admin = AdminClient(cluster.coordinator, token, timeout_s=10)
            monkey = ChaosMonkey(cfg.chaos, chaos_admin, lambda m: cluster.restart_shard(m, chaos_admin, monkey.record),
                                 learner_steps, run_dir / "chaos.jsonl", time.monotonic())
            monkey.start()
        last_stats, goodput, idle_since, last_line = 0.0, None, None, 0.0
        # On a terminal a live table; in a log (CI, nohup, kubectl logs) one line every 10 s.
        # (transient: at the end the final table, from the summary's records, takes its place)
        with Live(console=console, refresh_per_second=2, transient=True) if console.is_terminal \
                else contextlib.nullcontext() as live:
            while True:
                members = admin.members(include_gone=True)
                _link_learner_logs(run_dir, members)
                events = learner_events(run_dir)
                if time.monotonic() - last_stats > 5:
                    steps = {m["id"]: m["inner_steps"] for m in members}
                    goodput, last_stats = tape_stats(run_dir, cfg.run.fragments, steps)["step_goodput"], time.monotonic()
                statuses = _shard_status(cluster.shards, cluster.secret)
                if live is not None:
                    live.update(_progress_table(members, statuses, events, goodput, started, unit))
                elif time.monotonic() - last_line >= 10:
                    console.print(_progress_line(members, statuses, events, started, unit), soft_wrap=True)
                    last_line = time.monotonic()
                if cfg.tokens is not None and sum(m["tokens"] for m in members) >= cfg.tokens:
                    # The budget is spent: drain everyone (and anyone who joins late).
                    if monkey is not None:
                        monkey.halt()
                    todo = [m["id"] for m in members if m["state"] in ("active", "joining") and m["id"] not in draining]
                    if todo:
                        admin.remove_learners(todo, drain=True)
                        draining |= set(todo)
                        drained_at = drained_at or time.time()
                current = [m for m in members if m["id"] not in before]
                if _finished(cfg, current, monkey):
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
                time.sleep(1.0)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: stopping every process")
    finally:
        if monkey is not None:
            monkey.halt()
            monkey.join(timeout=60)
        stop_snapshot = None
        if interrupted and admin is not None:  # what --resume continues from
            stop_snapshot = _snapshot_for_resume(admin, run_dir, lambda line: console.print(line, soft_wrap=True))
        state, versions = None, {}
        try:
            if admin is not None:
                console.print("exporting the trained model from the shards")
                exported = export_model(AdminClient(cluster.coordinator, token, timeout_s=60), run_dir / "model.safetensors",
                                        timeout_s=120)
                state, versions = exported.state, exported.versions
        except DilocoError as error:  # the cluster may already be gone after Ctrl-C
            logger.warning("could not export the final model: %s", error)
        members = []
        if admin is not None:  # after Ctrl-C too: the processes run in their own sessions
            try:
                members = admin.members(include_gone=True)
            except DilocoError as error:
                logger.warning("could not list the learners: %s", error)
        if admin is not None:
            admin.close()
        cluster.stop(say=console.print)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    wall_s = time.monotonic() - started
    summaries = {s["learner_id"]: s for s in (json.loads(p.read_text()) for p in sorted((run_dir / "learners").glob("*.json")))}
    events = learner_events(run_dir)
    eval_final = eval_task(cfg.run, task, state) if state is not None else float("nan")
    # Inner steps per learner: its summary, or for a killed one its last heartbeat.
    steps = {m["id"]: m["inner_steps"] for m in members}
    steps.update({i: s["inner_steps"] for i, s in summaries.items()})
    tokens = sum(s["tokens"] for s in summaries.values()) + sum(
        m["tokens"] for m in members if m["id"] not in summaries)
    # Goodput and uptime are this part's (a resumed run's earlier parts had theirs); tokens,
    # rounds and bytes are the whole run's.
    part = {i: r for i, r in events.items() if i not in before}
    stats = tape_stats(run_dir, cfg.run.fragments, {i: n for i, n in steps.items() if i not in before})
    # Uptime over the training window: from the first learner computing to the last one done.
    computing = [e["t"] for r in part.values() for e in r if e["kind"] == "state" and e["state"] == "computing"]
    done = [e["t"] for r in part.values() for e in r if e["kind"] == "state" and e["state"] in ("draining", "left")]
    # At least a second: below that, OS scheduling jitter of a loaded machine (not the
    # system) decides (a tiny test model steps in ~15 ms, a 0.12 s period).
    period = max(cfg.run.sync_every_steps / cfg.run.fragments * stats["step_s"] * 4, MIN_UPTIME_PERIOD_S)
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
    slots = slot_seconds(first_steps[: cfg.learners], window[1],
                         [(c["t"], len(c["launched"])) for c in chaos if c["kind"] == "scavenge"])
    summary = {
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "task": cfg.run.task,
        "eval_unit": unit,
        "eval_loss_start": round(eval_start, 4),
        "eval_loss_final": round(eval_final, 4),
        "goodput": round(min(stats.pop("useful_s") / slots, 1.0), 4) if slots else 0.0,
        "step_goodput": stats.pop("step_goodput"),
        "uptime": up,
        "global_stall_s": stall,
        "bytes_up": sum(s["bytes_up"] for s in summaries.values()),
        "bytes_down": sum(s["bytes_down"] for s in summaries.values()),
        **{k: v for k, v in stats.items() if k != "step_s"},
        "learners_joined": len(members) if members else len(summaries),
        "learners_failed": sum(1 for m in members if m["state"] == "failed"),
        "learners_killed": sum(1 for c in chaos if c["kind"] == "kill"),
        "learners_scavenged": (sum(1 for m in members if m["pool"] == SCAVENGED_POOL) if members
                               else sum(len(c["launched"]) for c in chaos if c["kind"] == "scavenge")),
        "shard_restarts": sum(1 for c in chaos if c["kind"] == "restart_shard"),
        "learners": [{"id": m["id"], "pool": m["pool"], "state": m["state"], "inner_steps": steps.get(m["id"], 0),
                      "tokens": summaries[m["id"]]["tokens"] if m["id"] in summaries else m["tokens"],
                      "tokens_per_s": round(summaries.get(m["id"], m).get("tokens_per_s", 0.0), 1),
                      **devices.get(m["id"], {})} for m in members],
        "final_versions": {str(f): v for f, v in sorted(versions.items())},
        "started_unix": round(started_wall, 3),
        "interrupted": interrupted,
        "resumed_from_snapshot": resumed_from,
        "snapshot_at_stop": stop_snapshot,
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(_final_table(summary, events))  # the same records as summary.json, however the run ended
    if events and state is not None:
        plot_eval(run_dir, events, eval_final, tokens, unit)
    if events:
        draw_timeline(run_dir)
    lock.close()
    return summary
