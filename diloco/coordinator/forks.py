"""A fork server: one process that has loaded what every learner loads (Python, torch,
the learner's code: seconds of CPU) and forks a copy of itself for each launch, so no
launch pays that load, and N learners starting at once pay it once instead of N times.

The launcher starts the learner's command with ``--fork-server`` and talks to it over
its stdin and stdout, one JSON object per line:

- launcher -> server: ``{"args": [...], "log": PATH}``: fork a learner that runs the
  command with these arguments added, in its own session, with stdin from /dev/null and
  its output appended to PATH.
- server -> launcher, for each request in order: ``{"pid": N}``, or ``{"error": WHY}``
  when nothing was forked (the log cannot be opened, fork failed, a bad request).
- server -> launcher, when a forked learner ends: ``{"pid": N, "exit": CODE}`` (CODE as
  ``subprocess`` gives it: negative for a signal).

The server exits when its stdin closes (the launcher is gone). Learners started with
``--exit-with-parent`` then stop too. Linux only (``os.pidfd_open``): where it is
missing, ``available()`` is False and launchers start a process per learner.
"""

from __future__ import annotations

import json
import os
import selectors
import sys
from collections.abc import Sequence

FLAG = "--fork-server"


def available() -> bool:
    return hasattr(os, "fork") and hasattr(os, "pidfd_open")


def claim_stdout() -> int:
    """The server's first step, before it loads anything: a new descriptor for the answers
    (stdout's pipe), and stdout pointed at stderr, so that whatever prints while loading
    or serving goes to the server's log instead of into the answers."""
    sys.stdout.flush()
    answers = os.dup(1)
    os.dup2(2, 1)
    return answers


def request(args: Sequence[str], log: str | os.PathLike) -> bytes:
    return json.dumps({"args": list(args), "log": os.fspath(log)}).encode() + b"\n"


def _parse(line: bytes) -> tuple[list[str], str]:
    """(args, log) of a request line; ValueError when it is not one."""
    message = json.loads(line)
    args, log = (message.get("args"), message.get("log")) if isinstance(message, dict) else (None, None)
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args) and isinstance(log, str) and log):
        raise ValueError('a request is {"args": [strings], "log": "path"}')
    return args, log


def serve(answers: int, stdin: int = 0) -> list[str] | None:
    """Fork a learner for each request read from ``stdin`` and answer on ``answers``
    (file descriptors; ``answers`` from ``claim_stdout``), until ``stdin`` closes: then
    None. In a forked child it returns that launch's arguments, the child already in its
    own session with its output in the launch's log: the caller goes on to run them."""
    selector = selectors.PollSelector()  # (epoll refuses a regular file as stdin)
    selector.register(stdin, selectors.EVENT_READ)
    pending = b""

    def answer(message: dict) -> None:
        os.write(answers, json.dumps(message).encode() + b"\n")

    while True:
        for key, _ in selector.select():
            if key.fd != stdin:  # a child ended (its pidfd is readable)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(key.data, 0)
                answer({"pid": key.data, "exit": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:
                selector.close()
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    args, log = _parse(line)
                    log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                except (ValueError, OSError) as error:
                    answer({"error": str(error)})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as error:
                    os.close(log_fd)
                    answer({"error": f"fork: {error}"})
                    continue
                if pid == 0:
                    _become_child(selector, log_fd, answers)
                    return args
                os.close(log_fd)
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                answer({"pid": pid})


def _become_child(selector: selectors.BaseSelector, log_fd: int, answers: int) -> None:
    """In the forked child: drop the server's descriptors, lead a session of its own (the
    launcher signals the group), read nothing, write to the launch's log."""
    for key in list(selector.get_map().values()):
        if key.data is not None:
            os.close(key.fd)
    selector.close()
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(answers)
