"""Launchers start and stop learners for AddLearners / RemoveLearners. Two share one
contract: ``LocalProcessLauncher`` (child processes, the embedded default, here) and
``KubernetesLauncher`` (pods, in ``diloco.coordinator.kubernetes``).

A launcher only starts and stops things; the coordinator's core decides how many, and
keeps the books (a launch holds a slot under the cap until its learner joins).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from diloco.coordinator.config import LocalLauncherConfig
from diloco.coordinator import forks
from diloco.errors import DilocoError, InvalidArgument
from diloco.coordinator.sites import Site, Sites, HubSpec, check_mbit
from diloco.files import atomic_write

logger = logging.getLogger(__name__)

# Flags the launcher sets itself; an override may not replace them.
RESERVED_FLAGS = ("coordinator", "join-token-file", "pool", "launch-id", "netns")

SITES_FILE = "sites.jsonl"
"""One line per learner that ran on an emulated site, written when it ended: its site and
the bytes the kernel counted on its link, beside the launcher's logs."""
FORK_SERVER_PID_FILE = "fork-server.pid"
"""The fork server's pid, beside its log in the launcher's log directory."""


def _number(kind: type, minimum: float, above: bool = False) -> Callable[[str], object]:
    def check(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > minimum if above else value >= minimum)):
            raise ValueError(f"must be {'>' if above else '>='} {minimum:g}")
        return value
    return check


def _fraction(text: str) -> object:
    value = _number(float, 0, above=True)(text)
    if value > 1:
        raise ValueError("must be at most 1 (a fraction of each block)")
    return value


def _choice(*choices: str) -> Callable[[str], object]:
    def check(text: str) -> object:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return check


LEARNER_SETTINGS: dict[str, Callable[[str], object]] = {
    "device": _choice("cpu", "cuda", "xla"), "precision": _choice("fp32", "bf16"), "steps": _number(int, 1), "lr": _number(float, 0, above=True),
    "warmup-steps": _number(int, 0), "eval-every": _number(int, 1), "delta-codec": _choice("int4", "sparse", "fp32"),
    "delta-density": _fraction,
    "block-size": _number(int, 1), "step-delay-s": _number(float, 0), "threads": _number(int, 1),
    "slow-factor": _number(float, 0, above=True), "wire-delay-ms": _number(float, 0),
    "push-timeout-s": _number(float, 0, above=True), "max-inflight": _number(int, 0),
    "heartbeat-s": _number(float, 0, above=True), "coordinator-loss-timeout-s": _number(float, 0, above=True),
}
"""The ``diloco learner`` settings an AddLearners caller may override (an allow-list: the
joining flags, where the learner goes and what it presents, are the launcher's), each
with the check its value must pass before anything is launched (tests keep these in step
with the learner's own flags)."""
_OVERRIDE_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")
LINK_OVERRIDE = "link_mbit"
"""The one override that is the launcher's, not a learner flag: the rate of the launch's
emulated site (the local launcher with ``site_hub``; ``diloco.coordinator.sites``)."""


def _link_mbit(value: str) -> float:
    try:
        return check_mbit(float(value), LINK_OVERRIDE)
    except ValueError:
        raise InvalidArgument(f"--set {LINK_OVERRIDE}={value}: not a number") from None


@dataclass(frozen=True)
class LaunchResult:
    launch_id: str
    ok: bool
    detail: str
    """Why the launch failed, or where the learner runs."""


ExitCallback = Callable[[str, str, bool], None]
"""Called when a launched learner's process or pod ends: (launch id, how it ended, whether
cleanly: exit code 0, a pod that Succeeded, a JobSet that Completed)."""


class Launcher(Protocol):
    async def launch(self, launch_ids: Sequence[str], pool: str, overrides: Mapping[str, str]) -> list[LaunchResult]:
        """Start one learner per launch id; failures are results, not exceptions."""

    async def stop(self, launch_ids: Sequence[str], gently: bool = False) -> None:
        """Stop these learners; unknown or already stopped ids are ignored. ``gently``:
        the learner left by itself and is exiting; stop it only if it lingers."""

    def settled(self) -> None:
        """Every launch so far has joined or ended: nothing is starting now (called often;
        cheap, never blocks). A moment to prepare for the next launches."""

    def reaped_on_close(self) -> list[str]:
        """Launch ids that ``close`` will stop (children die with the coordinator)."""

    async def close(self) -> None:
        """The coordinator is shutting down."""


def override_args(overrides: Mapping[str, str]) -> list[str]:
    """``{"device": "cpu", "warmup_steps": "10"}`` -> ``--device cpu --warmup-steps 10``."""
    args = []
    for key, value in sorted(overrides.items()):
        if key == LINK_OVERRIDE:  # the launcher's (checked here, before anything starts)
            _link_mbit(value)
            continue
        flag = key.replace("_", "-")
        if not _OVERRIDE_KEY.match(key):
            raise InvalidArgument(f"override key must be a flag name like 'warmup_steps', got {key!r}")
        if flag in RESERVED_FLAGS:
            raise InvalidArgument(f"--{flag} is set by the launcher and cannot be overridden")
        if flag not in LEARNER_SETTINGS:
            raise InvalidArgument(f"--{flag} is not a learner setting a launch may override "
                                  f"(one of: {', '.join(LEARNER_SETTINGS)})")
        if "\0" in value or "\n" in value:
            raise InvalidArgument(f"override {key!r} has a control character in its value")
        try:
            LEARNER_SETTINGS[flag](value)
        except ValueError as error:
            raise InvalidArgument(f"--set {key}={value}: {error}") from None
        args += [f"--{flag}", value]
    return args


def learner_args(coordinator: str, join_token_file: str, pool: str, launch_id: str, overrides: Mapping[str, str]) -> list[str]:
    return [
        "--coordinator", coordinator, "--join-token-file", join_token_file, "--pool", pool, "--launch-id", launch_id,
        *override_args(overrides),
    ]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def log_tail(path: Path, lines: int = 2, max_chars: int = 400) -> str:
    """The last non-empty lines of a log, joined with " | " (what an operator reads first)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 8192))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    tail = " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])
    return tail if len(tail) <= max_chars else "..." + tail[-max_chars:]


class ForkedLearner:
    """A learner the fork server forked: the launcher's handle on it, like a child
    process's (``pid``, ``returncode``, ``wait``); ``pid`` is known once the server has
    answered, ``failure`` says why it never started."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.returncode: int | None = None
        self.failure = ""
        self._forked = asyncio.Event()
        self._ended = asyncio.Event()

    def forked(self, pid: int) -> None:
        self.pid = pid
        self._forked.set()

    def ended(self, returncode: int | None, failure: str = "") -> None:
        self.returncode, self.failure = returncode, failure
        self._forked.set()
        self._ended.set()

    async def started(self) -> int | None:
        """Its pid once forked; None when it never started."""
        await self._forked.wait()
        return self.pid

    async def wait(self) -> int | None:
        await self._ended.wait()
        return self.returncode


class _ForkServer:
    """The launcher's end of a fork server (``diloco.coordinator.forks``): requests are answered in
    order, so each answer goes to the oldest learner waiting for one."""

    def __init__(self, process: asyncio.subprocess.Process, log_path: Path, ended: Callable[[str], None]) -> None:
        self.process = process
        self.log_path = log_path
        self._waiting: collections.deque[ForkedLearner] = collections.deque()
        self._children: dict[int, ForkedLearner] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read(ended))

    @property
    def running(self) -> bool:
        return not self._reader.done()

    async def fork(self, args: list[str], log_path: Path) -> ForkedLearner:
        learner = ForkedLearner()
        self._waiting.append(learner)
        try:
            self.process.stdin.write(forks.request(args, log_path))
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server is gone: its reader ends every learner waiting
        return learner

    async def _read(self, ended: Callable[[str], None]) -> None:
        while line := await self.process.stdout.readline():
            try:
                answer = json.loads(line)
                if "exit" in answer:
                    self._children.pop(answer["pid"]).ended(answer["exit"])
                elif "pid" in answer:
                    learner = self._waiting.popleft()
                    self._children[answer["pid"]] = learner
                    learner.forked(answer["pid"])
                else:
                    self._waiting.popleft().ended(None, f"the fork server could not fork it: {answer['error']}")
            except (ValueError, KeyError, IndexError, TypeError):
                logger.error("fork server (pid %d) answered %r: stopping it", self.process.pid, line[:200])
                self.process.kill()
                break
        returncode = await self.process.wait()
        tail = log_tail(self.log_path)
        why = f"its fork server (pid {self.process.pid}) ended: {describe_exit(returncode)}{f': {tail}' if tail else ''}"
        for learner in self._waiting:
            learner.ended(None, why)
        for pid, learner in self._children.items():  # out of reach now: stopped, not left running unwatched
            _signal_group(pid, signal.SIGKILL)
            learner.ended(-signal.SIGKILL, why)
        self._waiting.clear()
        self._children.clear()
        ended(why)

    async def close(self) -> None:
        """Stop serving (the server exits when its stdin closes) and wait for it."""
        self.process.stdin.close()
        await asyncio.gather(self._reader, return_exceptions=True)


class LocalProcessLauncher:
    """Learners as child processes: ``diloco learner`` (or ``cfg.command``), each in its
    own session so a Ctrl-C at the coordinator's terminal reaches only the coordinator,
    which then stops them itself; output to ``<log_dir>/<launch id>.log``.

    With ``cfg.fork_server``, learners are forked from a fork server (``diloco.coordinator.forks``:
    the command with ``--fork-server``, started with the coordinator, loaded once). A
    launch it cannot serve (the server failed to start or died first) starts a process of
    its own; after ``_MAX_FORK_SERVER_FAILURES`` servers ended, every launch does."""

    _MAX_FORK_SERVER_FAILURES = 3

    def __init__(
        self, cfg: LocalLauncherConfig, coordinator: str, mint: Callable[[str], str], log_dir: Path, on_exit: ExitCallback
    ) -> None:
        """``mint``: the join credential of a launch id (``CoordinatorServer.launch_credential``:
        one learner's), written beside its log for it alone."""
        self.cfg = cfg
        self.coordinator = coordinator
        self.mint = mint
        self.log_dir = Path(log_dir)
        self.on_exit = on_exit
        self.processes: dict[str, asyncio.subprocess.Process | ForkedLearner] = {}
        self.fork_server: _ForkServer | None = None
        self._fork_server_failures = 0
        self._starting_server: asyncio.Task | None = None
        self._closing = False
        self._watchers: set[asyncio.Task] = set()
        self.sites = Sites(HubSpec.parse(cfg.site_hub)) if cfg.site_hub else None
        self.site_of: dict[str, Site] = {}

    def prefix(self) -> list[str]:
        return list(self.cfg.command) or [sys.executable, "-m", "diloco", "learner"]

    async def launch(self, launch_ids: Sequence[str], pool: str, overrides: Mapping[str, str]) -> list[LaunchResult]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        server = await self._server()
        results = []
        for launch_id in launch_ids:
            credential = self.log_dir / f"{launch_id}.join"
            atomic_write(credential, self.mint(launch_id) + "\n", mode=0o600)
            args = learner_args(self.coordinator, str(credential), pool, launch_id, overrides)
            log_path = self.log_dir / f"{launch_id}.log"
            try:
                args += self._site(launch_id, overrides)
            except DilocoError as error:
                results.append(LaunchResult(launch_id, False, str(error)))
                continue
            if server is not None and server.running:
                process = await server.fork(args, log_path)
                self.processes[launch_id] = process
                self._watch(launch_id, process, args)
                logger.info("launched learner %s (pool %s, forked by the fork server), log %s", launch_id, pool, log_path)
                results.append(LaunchResult(launch_id, True, f"forked by pid {server.process.pid}, log {log_path}"))
                continue
            try:
                process = await self._start(launch_id, args, log_path)
            except OSError as error:
                self._remove_site(launch_id)
                results.append(LaunchResult(launch_id, False, f"cannot start {self.prefix()[0]}: {error.strerror or error}"))
                continue
            logger.info("launched learner %s (pid %d, pool %s), log %s", launch_id, process.pid, pool, log_path)
            results.append(LaunchResult(launch_id, True, f"pid {process.pid}, log {log_path}"))
        return results

    def _site(self, launch_id: str, overrides: Mapping[str, str]) -> list[str]:
        """The learner's own emulated site (with ``site_hub``): its flags."""
        if self.sites is None:
            if LINK_OVERRIDE in overrides:
                raise InvalidArgument(f"{LINK_OVERRIDE}: this launcher has no emulated sites "
                                      "(a local run with --link-mbit makes them)")
            return []
        mbit = _link_mbit(overrides[LINK_OVERRIDE]) if LINK_OVERRIDE in overrides else self.cfg.link_mbit
        site = self.sites.add(mbit)
        self.site_of[launch_id] = site
        return ["--netns", site.netns]

    def _remove_site(self, launch_id: str) -> None:
        """Record what the kernel counted on the learner's link (``SITES_FILE``), then
        remove its site."""
        site = self.site_of.pop(launch_id, None)
        if site is None:
            return
        try:
            counted = self.sites.counters(site)
        except OSError as error:
            counted = {"error": str(error)}
        with open(self.log_dir / SITES_FILE, "a") as out:
            out.write(json.dumps({"launch_id": launch_id, "netns": site.netns, "address": site.address,
                                  "mbit": site.mbit, **counted}) + "\n")
        self.sites.remove(site)

    def settled(self) -> None:
        """Start the fork server when none runs (at the coordinator's start, and again after
        one ended), so that it has loaded when the launches come."""
        if self._wants_server():
            self._start_server()

    def _wants_server(self) -> bool:
        return (self.cfg.fork_server and forks.available() and not self._closing
                and self._fork_server_failures < self._MAX_FORK_SERVER_FAILURES
                and (self.fork_server is None or not self.fork_server.running))

    def _start_server(self) -> asyncio.Task:
        if self._starting_server is None:
            self._starting_server = asyncio.get_running_loop().create_task(self._spawn_server())
            self._starting_server.add_done_callback(lambda _: setattr(self, "_starting_server", None))
        return self._starting_server

    async def _server(self) -> _ForkServer | None:
        """The running fork server, started if need be; None when launches start processes."""
        if self._wants_server():
            await asyncio.shield(self._start_server())
        return self.fork_server if self.fork_server is not None and self.fork_server.running else None

    async def _spawn_server(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / "fork-server.log"
        try:
            with open(log_path, "ab") as log:
                process = await asyncio.create_subprocess_exec(
                    *self.prefix(), forks.FLAG, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=log, start_new_session=True)
        except OSError as error:
            logger.warning("cannot start a fork server (%s): each launch starts a process", error.strerror or error)
            self._fork_server_failures = self._MAX_FORK_SERVER_FAILURES
            return
        logger.info("fork server started (pid %d), log %s", process.pid, log_path)
        atomic_write(self.log_dir / FORK_SERVER_PID_FILE, str(process.pid))  # a local run lists it in endpoints.json
        self.fork_server = _ForkServer(process, log_path, self._fork_server_ended)

    def _fork_server_ended(self, why: str) -> None:
        if not self._closing:
            self._fork_server_failures += 1
            logger.warning("%s%s", why, "; launches start processes from now on"
                           if self._fork_server_failures >= self._MAX_FORK_SERVER_FAILURES else "")

    async def _start(self, launch_id: str, args: list[str], log_path: Path) -> asyncio.subprocess.Process:
        with open(log_path, "ab") as log:
            process = await asyncio.create_subprocess_exec(
                *self.prefix(), *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[launch_id] = process
        self._watch(launch_id, process, args)
        return process

    def _watch(self, launch_id: str, process: asyncio.subprocess.Process | ForkedLearner, args: list[str]) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_one(launch_id, process, args))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch_one(self, launch_id: str, process: asyncio.subprocess.Process | ForkedLearner,
                         args: list[str]) -> None:
        if isinstance(process, ForkedLearner) and await process.started() is not None:
            logger.info("learner %s forked: pid %d", launch_id, process.pid)
        returncode = await process.wait()
        failure = process.failure if isinstance(process, ForkedLearner) else ""
        if returncode is None and not self._closing:  # never forked: a process of its own instead
            logger.warning("learner %s: %s; starting a process for it", launch_id, failure)
            try:
                restarted = await self._start(launch_id, args, self.log_dir / f"{launch_id}.log")
                logger.info("launched learner %s (pid %d)", launch_id, restarted.pid)
                return
            except OSError as error:
                failure = f"cannot start {self.prefix()[0]}: {error.strerror or error}"
        self.processes.pop(launch_id, None)
        self._remove_site(launch_id)
        detail = failure or describe_exit(returncode)
        if returncode != 0 and not failure:  # say why: the learner's last words
            tail = log_tail(self.log_dir / f"{launch_id}.log")
            detail += f": {tail}" if tail else ""
        logger.info("learner %s (pid %s) ended: %s", launch_id, process.pid, detail)
        self.on_exit(launch_id, detail, returncode == 0 and not failure)

    async def stop(self, launch_ids: Sequence[str], gently: bool = False) -> None:
        await asyncio.gather(*(self._stop_one(self.processes.get(i), i, gently) for i in launch_ids))

    async def _stop_one(self, process: asyncio.subprocess.Process | ForkedLearner | None, name: str,
                        gently: bool = False) -> None:
        if isinstance(process, ForkedLearner):
            try:
                if await asyncio.wait_for(asyncio.shield(process.started()), self.cfg.terminate_timeout_s) is None:
                    return
            except asyncio.TimeoutError:  # the fork server is stuck: stopping it ends the launch
                logger.warning("learner %s: the fork server has not forked it in %.1f s: stopping the server",
                               name, self.cfg.terminate_timeout_s)
                self.fork_server.process.kill()
                await process.wait()
                return
        if process is None or process.returncode is not None:
            return
        if gently:  # after Leave it writes its summary and exits: give it the time
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), self.cfg.terminate_timeout_s)
                return
            except asyncio.TimeoutError:
                logger.warning("learner %s left but did not exit within %.1f s", name, self.cfg.terminate_timeout_s)
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), self.cfg.terminate_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("learner %s ignored SIGTERM for %.1f s: its threads' stacks go to its log, then SIGKILL",
                           name, self.cfg.terminate_timeout_s)
            _signal_group(process.pid, signal.SIGUSR1)  # diloco processes dump their stacks (faulthandler)
            await asyncio.sleep(0.5)
            _signal_group(process.pid, signal.SIGKILL)
            await process.wait()

    def reaped_on_close(self) -> list[str]:
        return list(self.processes)

    async def close(self) -> None:
        """Reap every child: no learner (and no fork server) outlives a coordinator that
        shut down cleanly."""
        self._closing = True
        if self._starting_server is not None:
            await asyncio.gather(self._starting_server, return_exceptions=True)
        await self.stop(list(self.processes))
        if self._watchers:
            await asyncio.gather(*self._watchers, return_exceptions=True)
        if self.fork_server is not None:
            await self.fork_server.close()
        for launch_id in list(self.site_of):  # launches that never started a process
            self._remove_site(launch_id)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """The learner leads its own process group (``start_new_session``): signal the group
    so its helpers (data loader workers) go too."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # not leading its group yet (a learner just forked)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
