"""The event tape: an append-only JSONL log of what a shard saw and decided.

One JSON object per line with at least ``kind`` and ``t`` (wall-clock seconds). Writes
are buffered and fsynced in batches (every ``fsync_every`` records or on ``flush``); the
shard hands a round's records to the operating system (``write_through``) before any
learner can read its reply, so a killed shard process (SIGKILL, the OOM killer) loses no
record of a round a learner saw, and only the host's own crash loses up to a batch. The
reader skips a final partial line and reports it, never trusting a torn one.

Kinds written by the shard: ``start``, ``push``, ``round``, ``membership``, ``marker``,
``stop``. The tape drives ``diloco replay`` and ``diloco timeline``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from diloco.errors import InvalidArgument, NotFound
from diloco.files import private_append

logger = logging.getLogger(__name__)


class TapeWriter:
    def __init__(self, path: str | Path, fsync_every: int = 64) -> None:
        if fsync_every <= 0:
            raise InvalidArgument(f"fsync_every must be positive, got {fsync_every}")
        self.path = Path(path)
        self._file: IO[str] | None = private_append(self.path)
        self._fsync_every = fsync_every
        self._pending = 0
        self.records = 0

    def append(self, kind: str, t: float, **fields: Any) -> None:
        if self._file is None:
            raise InvalidArgument(f"tape {self.path} is closed")
        self._file.write(json.dumps({"kind": kind, "t": round(t, 6), **fields}, separators=(",", ":")) + "\n")
        self._pending += 1
        self.records += 1
        if self._pending >= self._fsync_every:
            self.flush()

    def write_through(self) -> None:
        """Hand buffered records to the operating system (no fsync): after this they
        survive the process's death, SIGKILL included, though not the host's."""
        if self._file is not None and self._pending:
            self._file.flush()

    def flush(self) -> None:
        """Write buffered records and fsync them: after this they survive a crash."""
        if self._file is None or self._pending == 0:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._pending = 0

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


def read_tape(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records in order. A truncated last line (a crash mid-write) is skipped with a warning;
    a malformed line elsewhere is corruption and raises."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no tape at {path}")
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                logger.warning("tape %s: skipping a partial last line (crash mid-write)", path)
                return
            raise InvalidArgument(f"tape {path}: line {number} is not valid JSON") from None
        if not isinstance(record, dict) or "kind" not in record or "t" not in record:
            raise InvalidArgument(f"tape {path}: line {number} lacks 'kind' or 't'")
        yield record
