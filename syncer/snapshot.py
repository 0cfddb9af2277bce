"""A shard's snapshot files: writing what ``syncer.core.snapshot`` recorded, and finding,
verifying and loading them on restore.

Two files per shard in the snapshot's directory: ``S<m>-state.pt`` (the state at the
cut) and ``S<m>-channel.pt`` (the pushes in flight at the cut). Both are ``torch.save``
of plain data, read back with ``weights_only=True``; the manifest holds their SHA-256.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.snapshots import atomic_write, files_of, find_manifest, read_manifest
from syncer.core.shard import PushMeta, PushPayload
from syncer.core.snapshot import FORMAT, push_in, push_out

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WrittenFile:
    path: str
    """Relative to the snapshot's directory."""
    size_bytes: int
    sha256: str


def state_name(shard_id: int) -> str:
    return f"S{shard_id}-state.pt"


def channel_name(shard_id: int) -> str:
    return f"S{shard_id}-channel.pt"


def write(directory: Path, name: str, value: dict) -> WrittenFile:
    """Serialise, write atomically, checksum. Heavy: call it off the event loop."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    try:
        atomic_write(Path(directory) / name, data)
    except OSError as error:
        raise FailedPrecondition(f"cannot write snapshot file {Path(directory) / name}: {error.strerror}") from None
    return WrittenFile(name, len(data), hashlib.sha256(data).hexdigest())


def write_channel(directory: Path, shard_id: int, snapshot_id: int, pushes: list[tuple[PushMeta, PushPayload]]) -> WrittenFile:
    value = {"format": FORMAT, "snapshot_id": snapshot_id, "shard_id": shard_id, "pushes": [push_out(m, p) for m, p in pushes]}
    return write(directory, channel_name(shard_id), value)


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a bad file; all mean the same here
        raise InvalidArgument(f"cannot load snapshot file {path}: {error}") from None


def load_for_restore(spec: str, snapshot_dir: Path | None, shard_id: int) -> tuple[int, dict, list]:
    """(snapshot id, recorded state, channel pushes) of this shard in the complete
    snapshot named by ``spec`` ("latest", an id, a directory or a manifest), checked
    against the manifest's checksums."""
    manifest_path = find_manifest(snapshot_dir, spec)
    manifest = read_manifest(manifest_path)
    files = files_of(manifest_path, manifest, f"S{shard_id}")
    for name in (state_name(shard_id), channel_name(shard_id)):
        if name not in files:
            raise InvalidArgument(f"snapshot {manifest['snapshot_id']} lacks {name}")
    state = _load(files[state_name(shard_id)])
    channel = _load(files[channel_name(shard_id)])
    pushes = [push_in(raw) for raw in channel["pushes"]]
    logger.info(
        "restoring shard %d from snapshot %d (%s): %d in-flight pushes",
        shard_id, manifest["snapshot_id"], manifest_path, len(pushes),
    )
    return int(manifest["snapshot_id"]), state, pushes
