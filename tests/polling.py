"""The one poll of the process tests: wait for a truthy value, with a deadline, failing
early when a process the wait depends on has exited."""

import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], what: str, timeout_s: float = 60.0,
         procs: Iterable[tuple[str, subprocess.Popen]] = (), interval_s: float = 0.1) -> T:
    """``predicate()``'s first truthy value. Fails with ``what`` at the deadline, or at
    once when one of ``procs`` (name, process) has exited."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        for name, proc in procs:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr is not None else ""
                raise AssertionError(f"{name} exited with {proc.returncode} while waiting for {what}: {err}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)
    return value
