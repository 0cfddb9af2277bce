"""Launchers start and stop learners for AddLearners / RemoveLearners. Two share one
contract: ``LocalProcessLauncher`` (child processes, the embedded default, here) and
``KubernetesLauncher`` (pods, in ``coordinator.kubernetes``).

A launcher only starts and stops things; the coordinator's core decides how many, and
keeps the books (a launch holds a slot under the cap until its learner joins).
"""

from __future__ import annotations

import asyncio
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

from coordinator.config import LocalLauncherConfig
from diloco.errors import InvalidArgument

logger = logging.getLogger(__name__)

# Flags the launcher sets itself; an override may not replace them.
RESERVED_FLAGS = ("coordinator", "join-token-file", "pool", "launch-id")


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


def _choice(*choices: str) -> Callable[[str], object]:
    def check(text: str) -> object:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return check


LEARNER_SETTINGS: dict[str, Callable[[str], object]] = {
    "device": _choice("cpu", "cuda", "xla"), "precision": _choice("fp32", "bf16"), "steps": _number(int, 1), "lr": _number(float, 0, above=True),
    "warmup-steps": _number(int, 0), "eval-every": _number(int, 1), "delta-codec": _choice("int4", "fp32"),
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


@dataclass(frozen=True)
class LaunchResult:
    launch_id: str
    ok: bool
    detail: str
    """Why the launch failed, or where the learner runs."""


# Called with (launch id, how it ended) when a launched learner's process or pod ends.
ExitCallback = Callable[[str, str], None]


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


class LocalProcessLauncher:
    """Learners as child processes: ``diloco learner`` (or ``cfg.command``), each in its
    own session so a Ctrl-C at the coordinator's terminal reaches only the coordinator,
    which then stops them itself; output to ``<log_dir>/<launch id>.log``.

    Warm spares (``cfg.warm_spares``): processes started ahead with ``--standby``, which
    load Python, torch and the learner's code and then wait on stdin. A launch hands one
    its flags (one JSON list on a line) instead of starting a process; new spares are
    started once no learner is starting (``settled``). A spare whose stdin closes (this
    launcher gone) exits."""

    _MAX_SPARE_FAILURES = 3
    """Spares that die unassigned before spares are given up (a command without --standby)."""

    def __init__(
        self, cfg: LocalLauncherConfig, coordinator: str, join_token_file: Path, log_dir: Path, on_exit: ExitCallback
    ) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self.join_token_file = Path(join_token_file)
        self.log_dir = Path(log_dir)
        self.on_exit = on_exit
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.spares: list[asyncio.subprocess.Process] = []
        self._spare_logs: dict[int, Path] = {}
        self._spares_started = 0
        self._spare_failures = 0
        self._launch_of: dict[int, str] = {}
        self._closing = False
        self._refill: asyncio.Task | None = None
        self._watchers: set[asyncio.Task] = set()

    def prefix(self) -> list[str]:
        return list(self.cfg.command) or [sys.executable, "-m", "tools.cli", "learner"]

    async def launch(self, launch_ids: Sequence[str], pool: str, overrides: Mapping[str, str]) -> list[LaunchResult]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        results = []
        for launch_id in launch_ids:
            args = learner_args(self.coordinator, str(self.join_token_file), pool, launch_id, overrides)
            log_path = self.log_dir / f"{launch_id}.log"
            process = await self._hand_to_spare(launch_id, args, log_path)
            how = "a warm spare" if process else "a new process"
            if process is None:
                argv = [*self.prefix(), *args]
                try:
                    process = await self._start(argv, log_path, stdin=asyncio.subprocess.DEVNULL, launch_id=launch_id)
                except OSError as error:
                    results.append(LaunchResult(launch_id, False, f"cannot start {argv[0]}: {error.strerror or error}"))
                    continue
            self.processes[launch_id] = process
            logger.info("launched learner %s (pid %d, pool %s, %s), log %s", launch_id, process.pid, pool, how, log_path)
            results.append(LaunchResult(launch_id, True, f"pid {process.pid}, log {log_path}"))
        return results

    def settled(self) -> None:
        """Start the missing spares now that no learner is starting (a spare loading beside
        starting learners would slow their start on a machine with few cores)."""
        if (self._refill is None and len(self.spares) < self.cfg.warm_spares and not self._closing
                and self._spare_failures < self._MAX_SPARE_FAILURES):
            self._refill = asyncio.get_running_loop().create_task(self._refill_spares())
            self._refill.add_done_callback(lambda _: setattr(self, "_refill", None))

    async def _start(self, argv: list[str], log_path: Path, stdin: int, launch_id: str | None = None
                     ) -> asyncio.subprocess.Process:
        """``launch_id`` None: a spare."""
        with open(log_path, "ab") as log:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=stdin, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        if launch_id is not None:
            self._launch_of[process.pid] = launch_id
        watcher = asyncio.get_running_loop().create_task(self._watch(process))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return process

    async def _hand_to_spare(self, launch_id: str, args: list[str], log_path: Path) -> asyncio.subprocess.Process | None:
        """The oldest live spare, now ``launch_id`` running as ``args`` (its log renamed to
        the launch's), or None when there is none. A spare that dies while being handed
        the launch ends the launch (its watcher reports it)."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.returncode is not None:
                continue
            self._launch_of[spare.pid] = launch_id
            os.replace(self._spare_logs.pop(spare.pid), log_path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                spare.stdin.write(json.dumps(args).encode() + b"\n")
                await spare.stdin.drain()
                spare.stdin.close()
            return spare
        return None

    async def _refill_spares(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        while (len(self.spares) < self.cfg.warm_spares and self._spare_failures < self._MAX_SPARE_FAILURES
               and not self._closing):
            self._spares_started += 1
            log_path = self.log_dir / f"spare-{self._spares_started}.log"
            try:
                spare = await self._start([*self.prefix(), "--standby"], log_path, stdin=asyncio.subprocess.PIPE)
            except OSError as error:
                logger.warning("cannot start a warm spare learner (%s): launches start their own processes",
                               error.strerror or error)
                self._spare_failures = self._MAX_SPARE_FAILURES
                return
            self._spare_logs[spare.pid] = log_path
            self.spares.append(spare)

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        returncode = await process.wait()
        launch_id = self._launch_of.pop(process.pid, None)
        if launch_id is None:  # a spare that ended unassigned
            if process in self.spares:
                self.spares.remove(process)
            log_path = self._spare_logs.pop(process.pid, None)
            if not self._closing:
                self._spare_failures += 1
                tail = log_tail(log_path) if log_path else ""
                logger.warning("warm spare learner (pid %d) ended unassigned: %s%s%s", process.pid,
                               describe_exit(returncode), f": {tail}" if tail else "",
                               "; no more spares" if self._spare_failures >= self._MAX_SPARE_FAILURES else "")
            return
        self.processes.pop(launch_id, None)
        detail = describe_exit(returncode)
        if returncode != 0:  # say why: the learner's last words
            tail = log_tail(self.log_dir / f"{launch_id}.log")
            detail += f": {tail}" if tail else ""
        logger.info("learner %s (pid %d) ended: %s", launch_id, process.pid, detail)
        self.on_exit(launch_id, detail)

    async def stop(self, launch_ids: Sequence[str], gently: bool = False) -> None:
        await asyncio.gather(*(self._stop_one(self.processes.get(i), i, gently) for i in launch_ids))

    async def _stop_one(self, process: asyncio.subprocess.Process | None, name: str, gently: bool = False) -> None:
        if process is None or process.returncode is not None:
            return
        if gently:  # after Leave it writes its summary and exits: give it the time
            try:
                await asyncio.wait_for(process.wait(), self.cfg.terminate_timeout_s)
                return
            except asyncio.TimeoutError:
                logger.warning("learner %s left but did not exit within %.1f s", name, self.cfg.terminate_timeout_s)
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.cfg.terminate_timeout_s)
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
        """Reap every child: no learner (and no spare) outlives a coordinator that shut
        down cleanly."""
        self._closing = True
        if self._refill is not None:
            await asyncio.gather(self._refill, return_exceptions=True)
        spares, self.spares = self.spares, []
        for spare in spares:  # a spare exits by itself when its stdin closes
            spare.stdin.close()
        await asyncio.gather(self.stop(list(self.processes)),
                             *(self._stop_one(spare, f"spare (pid {spare.pid})", gently=True) for spare in spares))
        if self._watchers:
            await asyncio.gather(*self._watchers, return_exceptions=True)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """The learner leads its own process group (``start_new_session``): signal the group
    so its helpers (data loader workers) go too."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
