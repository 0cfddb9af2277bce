"""Local files written whole: a reader (a launcher polling for a port file, a resume, a
restarted process) sees the old file or the new one, never half of either, also across
a power cut. The one way this project writes such a file."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path, mode: int = 0o644) -> Iterator[Path]:
    """A new, empty temporary file beside ``path`` (created with ``mode``), for the block
    to write; when the block ends without an error it is fsynced and renamed onto
    ``path`` and the directory fsynced; on an error it is removed and ``path`` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
    os.chmod(tmp, mode)  # an older temporary file keeps its mode through O_CREAT
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """``path`` holds ``data`` (text is written UTF-8), or what it held before."""
    with replacing(path, mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path: str | Path, value: object) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
