"""The processes of a local run: a coordinator and S shards started with their settings as
JSON documents (the coordinator launches the learners), watched, restarted by chaos and
stopped together. It starts and stops processes; it draws and measures nothing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from diloco import auth, rpc
from diloco.errors import AlreadyExists, Unavailable
from diloco.files import atomic_write, atomic_write_json, private_dir
from diloco.cli.certs import make_certs
from diloco.coordinator.config import MAX_LEARNERS, CoordinatorConfig
from diloco.coordinator.launcher import FORK_SERVER_PID_FILE
from diloco.coordinator.status import STATUS_URL_FILE
from diloco.coordinator.pin import PIN_FILE, ModelPin
from diloco.coordinator.sites import HubSpec
from diloco.cli.chaos import SCAVENGED_POOL, learner_pid
from diloco.cli.local.config import PROMETHEUS_TARGETS, LocalConfig


LEARNER_EXIT_WAIT_S = 5.0
"""How long a stop waits for learners that left to exit before the shards and the
coordinator are stopped (the coordinator then SIGTERMs any still running)."""


class Cluster:
    """The processes of one local run; every one of them ends when the run does."""

    def __init__(self, cfg: LocalConfig, run_dir: Path, learner_steps: int, pin: ModelPin | None = None,
                 hub: HubSpec | None = None) -> None:
        """``pin``: the run's model, pinned at the coordinator (``run_local`` builds the task
        anyway, for the start evaluation: the coordinator reuses it instead of building it
        again); None: the coordinator builds it. ``hub``: the emulated sites' hub (made by
        the caller): the shards and the coordinator listen on its address, and the
        coordinator's launcher puts each learner on a site of its own."""
        self.cfg, self.dir = cfg, run_dir
        self.learner_steps = learner_steps
        self.pin = pin
        self.hub = hub
        self.host = hub.address if hub is not None else "127.0.0.1"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._plain: rpc.Tls | None = None
        self.endpoints: list[dict] = []
        self._targets = ""
        """What RUN_DIR/prometheus-targets.json holds (``--prometheus``)."""
        coordinator, *shards = rpc.free_ports(self.host, 1 + cfg.shards)
        self.coordinator = f"{self.host}:{coordinator}"
        self.status_url: str | None = None
        """The coordinator's status page, once it serves (``LocalConfig.status_page``)."""
        self.shards = [f"{self.host}:{port}" for port in shards]

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / "logs" / f"{role}.log", "ab")
        tls = ["--tls-dir", str(self.dir / "tls")] if self.cfg.tls else ["--insecure"]
        proc = subprocess.Popen([sys.executable, "-m", "diloco", "--exit-with-parent", "--log-level", "INFO", *tls, *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(self.cfg.child_env) if self.cfg.child_env is not None else None)
        log.close()
        self.procs.append((role, proc))
        return proc

    def _endpoint(self, role: str, address: str, pid: int, **more) -> None:
        entry = {"role": role, "address": address, "pid": pid, **more}
        key = (role, more.get("id"))
        if entry in self.endpoints:
            return
        endpoints = [e for e in self.endpoints if (e["role"], e.get("id")) != key] + [entry]
        atomic_write(self.dir / "endpoints.json", json.dumps(endpoints, indent=1))
        # Kept only once written: a Ctrl-C during the write must not leave a process known
        # here and missing from the file (the stop's listing would then skip it as known).
        self.endpoints = endpoints
        self._list_targets()

    def _list_targets(self) -> None:
        """With ``--prometheus``: RUN_DIR/prometheus-targets.json, the target groups of the
        run's live processes, each as the process wrote it (RUN_DIR/prometheus/<name>.json,
        with the port it got) under its name in endpoints.json; rewritten when that changes.
        (A learner that exits cleanly removes its own; a killed one's is left behind.)"""
        if not self.cfg.prometheus:
            return
        groups = []
        for entry in self.endpoints:
            with contextlib.suppress(FileNotFoundError):
                if _alive(entry["pid"]):
                    groups += json.loads((self.dir / "prometheus" / f"{entry.get('id') or entry['role']}.json").read_text())
        text = json.dumps(groups, indent=1)
        if text != self._targets:
            atomic_write(self.dir / PROMETHEUS_TARGETS, text)
            self._targets = text

    def note_learners(self, members: list[dict]) -> None:
        """List the learners (their ``host:pid`` addresses) and the coordinator's fork server
        in endpoints.json beside the services: every process of the run."""
        pid_file = self.dir / "coordinator" / "learners" / FORK_SERVER_PID_FILE
        with contextlib.suppress(OSError, ValueError):
            self._endpoint("fork-server", "", int(pid_file.read_text()))
        for member in members:
            if (pid := learner_pid(member)) is not None:
                self._endpoint("learner", member["address"], pid, id=member["id"])
        self._list_targets()  # learners that ended, and target files written since

    def _shard_args(self, m: int) -> list[str]:
        """``diloco syncer --config`` with the shard's settings as one JSON document
        (RUN_DIR/shard<m>/syncer.json), not flags turned back into strings."""
        config = self.dir / f"shard{m}" / "syncer.json"
        atomic_write_json(config, {
            "shard_id": m, "shards": self.cfg.shards, "host": self.host, "port": int(self.shards[m].rsplit(":", 1)[1]),
            "data_dir": str(self.dir / f"shard{m}"), "push_log": True, "coordinator": self.coordinator,
            "quorum": self.cfg.quorum, "grace": self.cfg.grace, "outer_lr": self.cfg.outer_lr,
            "outer_momentum": self.cfg.outer_momentum, "outer_optimizer": self.cfg.outer_optimizer, "merge": self.cfg.merge, "scale_by": self.cfg.scale_by,
            "downlink": self.cfg.downlink, "block_size": self.cfg.block_size,
            "reply_codec": self.cfg.reply_codec, "reply_density": self.cfg.reply_density,
            "robust_multiple": self.cfg.robust_multiple, "validator": self.cfg.validator,
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
        # With --prometheus every process serves /metrics at a port of its own and lists it in RUN_DIR/prometheus.
        metrics = {"prometheus": f"{self.host}:0", "prometheus_targets_dir": str(private_dir(self.dir / "prometheus"))} \
            if self.cfg.prometheus else {}
        self.common = {"secret_file": str(self.dir / "secret"), "run_config": str(self.dir / "run.json"), **metrics}
        self.restore = ["--restore", restore] if restore else []
        if self.cfg.tls:
            # A resumed run keeps its certificates; on emulated sites it gets new ones, for its new hub's address.
            if not (self.dir / "tls").exists() or self.hub is not None:
                make_certs(self.dir / "tls", sorted({"localhost", "127.0.0.1", self.host}), overwrite=True)
            self._plain = rpc.use_tls(rpc.Tls.from_dir(self.dir / "tls"))  # this supervisor's own calls, until stop
        tls = f"--tls-dir {self.dir / 'tls'} " if self.cfg.tls else "--insecure "
        # Every process gets its settings as one JSON document (diloco <command> --config);
        # a launch's own overrides (--set, a slow factor) follow it on the command line and win.
        learner_config = self.dir / "learner.json"
        atomic_write_json(learner_config, {
            # (the supervisor evaluates the seed model once for the run: no learner does it again)
            "steps": self.learner_steps, "skip_start_eval": True,
            "eval_every": max(self.learner_steps // self.cfg.learner_evals, 1) if self.cfg.learner_evals
            else self.learner_steps + 1,
            "num_learners": self.cfg.learners,
            "summary_dir": str(self.dir / "learners"), "events_dir": str(self.dir / "learners"),
            "lr": self.cfg.lr, "inner_optimizer": self.cfg.inner_optimizer, "delta_codec": self.cfg.delta_codec,
            "delta_density": self.cfg.delta_density, "error_feedback": self.cfg.error_feedback,
            "block_size": self.cfg.block_size, "threads": self.cfg.threads_per_learner, "wire_delay_ms": self.cfg.delay_ms,
            **metrics,
        })
        learner_cmd = f"{sys.executable} -m diloco --exit-with-parent --log-level INFO {tls}learner --config {shlex.quote(str(learner_config))}"
        coordinator_config = self.dir / "coordinator" / "coordinator.json"
        if self.pin is not None:  # the coordinator pins it (a resumed run's coordinator checks its state against it)
            self.pin.save(self.dir / "coordinator" / PIN_FILE, self.cfg.run)
        atomic_write_json(coordinator_config, {
            "pin_model": True, "host": self.host,
            "port": int(self.coordinator.rsplit(":", 1)[1]), "data_dir": str(self.dir / "coordinator"),
            "shards": ",".join(self.shards), "learner_command": learner_cmd, "pools": f"default,{SCAVENGED_POOL}",
            "snapshot_dir": self.snapshot_dir, "snapshot_every_s": self.cfg.snapshot_every_s,
            "snapshot_keep": self.cfg.snapshot_keep, "fork_server": self.cfg.fork_server,
            "max_learners": min(max(CoordinatorConfig.max_learners, 2 * self.cfg.learners), MAX_LEARNERS), **self.common,
            **({"site_hub": str(self.hub)} if self.hub is not None else {}),
            **({"status_port": 0} if self.cfg.status_page else {}),
            **({"link_mbit": self.cfg.link_mbit} if self.cfg.link_mbit is not None else {}),
        })
        status_file = self.dir / "coordinator" / STATUS_URL_FILE
        status_file.unlink(missing_ok=True)  # a resumed run's: its coordinator writes its own
        if self.cfg.validator:  # first: it builds the task while the others start, and judges the first pushes
            config = self.dir / "validator.json"
            atomic_write_json(config, {"shards": ",".join(self.shards), **self.common})
            self._endpoint("validator", "", self._spawn("validator", ["validator", "--config", str(config)]).pid)
        coord = self._spawn("coordinator", ["coordinator", "--config", str(coordinator_config), *self.restore])
        # Every shard starts at once; then each is waited for.
        self.shard_procs = [self._spawn(f"shard{m}", [*self._shard_args(m), *self.restore]) for m in range(len(self.shards))]
        for m, (address, shard) in enumerate(zip(self.shards, self.shard_procs)):
            self._wait_serving(address, f"shard {m}", shard)
            self._endpoint(f"shard{m}", address, shard.pid)
        self._wait_serving(self.coordinator, "the coordinator", coord)
        self._endpoint("coordinator", self.coordinator, coord.pid)
        token_file = self.dir / "coordinator" / "admin-token"
        wait_until(lambda: token_file.exists(), self.cfg.startup_timeout_s, "the admin token")
        atomic_write(self.dir / "admin-token", token_file.read_text())
        if self.cfg.status_page:
            wait_until(lambda: status_file.exists(), self.cfg.startup_timeout_s, "the status page")
            self.status_url = status_file.read_text().strip()
            self._endpoint("status-page", self.status_url, coord.pid)

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
        status = shard_status([self.shards[m]], self.secret)[0]
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

        wait_until(serving, self.cfg.startup_timeout_s, what)

    def stop(self, say: Callable[[str], None] = lambda line: None) -> None:
        """Stop the shards, then the coordinator (which reaps any learner still running: the
        run stops its learners first, through the coordinator, while the shards serve).
        SIGTERM each group, SIGKILL what lingers after 30 s; ``say`` hears, every 5 s, which
        processes are still being waited for."""
        if self.cfg.tls:
            rpc.use_tls(self._plain)
        self._wait_learners_gone(LEARNER_EXIT_WAIT_S, say)
        self._stop([(r, p) for r, p in self.procs if r != "coordinator"], say)
        self._stop([(r, p) for r, p in self.procs if r == "coordinator"], say)
        self._list_targets()  # none: the run is over

    def _wait_learners_gone(self, timeout_s: float, say: Callable[[str], None]) -> None:
        """Learners that left exit by themselves (a second or so of interpreter teardown
        after their summary): give them that before the coordinator reaps what is left."""
        deadline = time.monotonic() + timeout_s
        while (alive := [e for e in self.endpoints if e["role"] == "learner" and _alive(e["pid"])]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive:
            say(f"{', '.join(e['id'] for e in alive)} still running after {timeout_s:g} s: the coordinator stops them")

    def _stop(self, procs: list[tuple[str, subprocess.Popen]], say: Callable[[str], None]) -> None:
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        deadline, next_say = started + 30, started + 5
        while (waiting := [(role, proc) for role, proc in procs if proc.poll() is None]) and time.monotonic() < deadline:
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by another user's process
        return False


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise Unavailable(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def shard_status(addresses: list[str], secret: str) -> list:
    """Each shard's Status (or the exception), asked as the coordinator: the supervisor
    holds the run secret it made."""
    from diloco.clients.syncer import SyncerClient, open_channel

    async def one(address):
        async with open_channel(address) as channel:
            return await SyncerClient(channel, auth.Credential(auth.COORDINATOR_ID, secret=secret),
                                      timeout_s=2).status()

    async def all_():
        return await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True)

    return rpc.shielded_run(all_)  # (a Ctrl-C must not land inside grpc.aio's code: rpc.shielded)


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

