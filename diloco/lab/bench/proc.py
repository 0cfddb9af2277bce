"""What a benchmark reads of another process from /proc: its CPU time and its memory."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process's live threads, in nanoseconds of resolution (the clock
    ticks of /proc/PID/stat are 10 ms: a short measurement could read 0); the ticks where
    the kernel keeps no schedstat."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes(pid: int) -> int:
    """The most memory the process has held resident (VmHWM)."""
    return _status_bytes(pid, "VmHWM")


def rss_bytes(pid: int) -> int:
    """What the process holds resident now (VmRSS)."""
    return _status_bytes(pid, "VmRSS")
