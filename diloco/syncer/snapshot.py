"""A shard's snapshot files: writing what ``diloco.syncer.core.snapshot`` recorded, and finding,
verifying and loading them on restore.

Two files per shard in the snapshot's directory: ``S<m>-state.npz`` (the state at the
cut) and ``S<m>-channel.npz`` (the pushes in flight at the cut). Each is a numpy ``.npz``
archive: the recorded tree as JSON (entry ``tree``), every array in it replaced by
``{"__array__": i}`` and stored as entry ``a<i>``. Loading never unpickles (numpy's
``allow_pickle=False``) and needs no torch; the manifest holds the files' SHA-256.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diloco.errors import InvalidArgument
from diloco import snapshots
from diloco.snapshots import files_of, find_manifest, join, read_manifest, write_file
from diloco.wire import PushMeta
from diloco.syncer.core.shard import PushPayload
from diloco.syncer.core.snapshot import FORMAT, push_in, push_out

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WrittenFile:
    path: str
    """Relative to the snapshot's directory."""
    size_bytes: int
    sha256: str


def state_name(shard_id: int) -> str:
    return f"S{shard_id}-state.npz"


def channel_name(shard_id: int) -> str:
    return f"S{shard_id}-channel.npz"


_ARRAY = "__array__"


def dumps(value: dict) -> bytes:
    """The ``.npz`` bytes of a tree of dicts, lists, JSON scalars and numpy arrays."""
    arrays: list[np.ndarray] = []

    def strip(node):
        if isinstance(node, np.ndarray):
            arrays.append(node)
            return {_ARRAY: len(arrays) - 1}
        if isinstance(node, dict):
            return {key: strip(item) for key, item in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(item) for item in node]
        return node

    tree = json.dumps(strip(value)).encode()
    buffer = io.BytesIO()
    np.savez(buffer, tree=np.frombuffer(tree, dtype=np.uint8), **{f"a{i}": a for i, a in enumerate(arrays)})
    return buffer.getvalue()


def loads(source) -> dict:
    """The tree ``dumps`` wrote, from a path or a binary file object."""
    with np.load(source, allow_pickle=False) as archive:
        tree = json.loads(archive["tree"].tobytes())

        def fill(node):
            if isinstance(node, dict):
                if set(node) == {_ARRAY}:
                    return archive[f"a{node[_ARRAY]}"]
                return {key: fill(item) for key, item in node.items()}
            if isinstance(node, list):
                return [fill(item) for item in node]
            return node

        return fill(tree)


def write(directory: str, name: str, value: dict) -> WrittenFile:
    """Serialise, write atomically (a directory or an fsspec URL), checksum. Heavy: call
    it off the event loop."""
    data = dumps(value)
    write_file(join(directory, name), data)
    return WrittenFile(name, len(data), hashlib.sha256(data).hexdigest())


def write_channel(directory: str, shard_id: int, snapshot_id: int, pushes: list[tuple[PushMeta, PushPayload]]) -> WrittenFile:
    value = {"format": FORMAT, "snapshot_id": snapshot_id, "shard_id": shard_id, "pushes": [push_out(m, p) for m, p in pushes]}
    return write(directory, channel_name(shard_id), value)


def _load(name: str, data: bytes) -> dict:
    try:
        return loads(io.BytesIO(data))
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise InvalidArgument(f"cannot load snapshot file {name}: {error}") from None


def load_for_restore(spec: str, snapshot_dir: str | Path | None, shard_id: int, secret: str,
                     pin: bool = False) -> tuple[int, dict, list]:
    """(snapshot id, recorded state, channel pushes) of this shard in the complete
    snapshot named by ``spec`` ("latest", an id, a directory or a manifest), checked
    against the manifest's checksums, the manifest against the run ``secret``'s mac.
    ``pin``: mark the snapshot as restored from, so retention keeps it."""
    manifest_path = find_manifest(snapshot_dir, spec)
    manifest = read_manifest(manifest_path, secret)
    files = files_of(manifest_path, manifest, f"S{shard_id}")
    for name in (state_name(shard_id), channel_name(shard_id)):
        if name not in files:
            raise InvalidArgument(f"snapshot {manifest['snapshot_id']} lacks {name}")
    state = _load(state_name(shard_id), files[state_name(shard_id)])
    channel = _load(channel_name(shard_id), files[channel_name(shard_id)])
    pushes = [push_in(raw) for raw in channel["pushes"]]
    if pin:
        snapshots.pin(posixpath.dirname(manifest_path), f"S{shard_id}")
    logger.info(
        "restoring shard %d from snapshot %d (%s): %d in-flight pushes",
        shard_id, manifest["snapshot_id"], manifest_path, len(pushes),
    )
    return int(manifest["snapshot_id"]), state, pushes
