"""Local files written whole: a reader (a launcher polling for a port file, a resume, a
restarted process) sees the old file or the new one, never half of either, also across
a power cut. The one way this project writes such a file.

Modes: what a run writes (state, tapes, secrets, configs) is its owner's alone: files
0600 by default, directories made with ``private_dir`` 0700. A caller widens a mode only
for a file meant to be shared (a certificate)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory, made 0700 when it is new (missing parents as usual). An
    existing directory keeps its mode: the user chose it."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    return path


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first: what
    ``private_dir(path)`` would make."""
    missing = []
    for directory in (Path(path), *Path(path).parents):
        if directory.exists():
            break
        missing.append(directory)
    return missing


def check_makeable(path: str | Path) -> None:
    """Raise the ``OSError`` that making ``path`` a ``private_dir`` (its missing parents
    too) and writing in it would raise: a parent that cannot be made, a file in the way,
    a read-only file system, no permission. Leaves nothing behind: what it makes, it removes."""
    path = Path(path)
    made = []
    try:
        for directory in reversed(missing_dirs(path)):
            directory.mkdir(mode=PRIVATE_DIR)
            made.append(directory)
        os.rmdir(tempfile.mkdtemp(dir=path, prefix=".diloco-probe-"))  # writable, also when it existed
    finally:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()


def private_append(path: str | Path, binary: bool = False) -> IO:
    """``path`` opened to append, created 0600 (in a ``private_dir``) when it is new."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
    return os.fdopen(fd, "ab") if binary else os.fdopen(fd, "a", encoding="utf-8")


@contextlib.contextmanager
def replacing(path: str | Path, mode: int = PRIVATE_FILE) -> Iterator[Path]:
    """A new, empty temporary file beside ``path`` (created with ``mode``, in a
    ``private_dir``), for the block to write; when the block ends without an error it is
    fsynced and renamed onto ``path`` and the directory fsynced; on an error it is removed
    and ``path`` untouched."""
    path = Path(path)
    private_dir(path.parent)
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


def atomic_write(path: str | Path, data: bytes | str, mode: int = PRIVATE_FILE) -> None:
    """``path`` holds ``data`` (text is written UTF-8), or what it held before."""
    with replacing(path, mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path: str | Path, value: object) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
