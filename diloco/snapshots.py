"""Snapshot files on disk, shared by the coordinator (writes manifests) and the shards
(write their state, find and verify it on restore).

Layout: ``SNAPSHOT_DIR/<id, six digits>/`` holds every participant's files and, once
the snapshot is complete, ``manifest.json``. The manifest is written last and
atomically, so a directory without one is an unfinished or failed snapshot and is never
restored from.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from diloco import auth
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound

MANIFEST = "manifest.json"


def snapshot_path(snapshot_dir: Path, snapshot_id: int) -> Path:
    return Path(snapshot_dir) / f"{snapshot_id:06d}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: after this the file is either the old
    one or the new one, also across a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, value: object) -> None:
    atomic_write(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def find_manifest(snapshot_dir: Path | None, spec: str) -> Path:
    """``spec``: "latest" (the newest complete snapshot in ``snapshot_dir``), a snapshot
    id, a snapshot directory or a manifest file."""
    if spec == "latest" or spec.isdigit():
        if snapshot_dir is None:
            raise InvalidArgument(f"restoring snapshot {spec!r} needs the snapshot directory")
        root = Path(snapshot_dir)
        if spec == "latest":
            complete = sorted(p for p in root.glob(f"*/{MANIFEST}") if p.parent.name.isdigit())
            if not complete:
                raise NotFound(f"no complete snapshot in {root}")
            return complete[-1]
        path = snapshot_path(root, int(spec)) / MANIFEST
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / MANIFEST
    if not path.is_file():
        raise NotFound(f"no complete snapshot at {path} (a snapshot without a manifest never completed)")
    return path


def read_manifest(path: Path, secret: str | None = None) -> dict:
    """A snapshot manifest; with the run ``secret``, only one the run itself signed."""
    try:
        manifest = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgument(f"cannot read snapshot manifest {path}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != 1 or not isinstance(manifest.get("files"), list):
        raise InvalidArgument(f"{path} is not a snapshot manifest (format 1)")
    if secret is not None:
        presented = manifest.get("mac")
        if not isinstance(presented, str) or not hmac.compare_digest(presented, auth.manifest_mac(secret, manifest)):
            raise FailedPrecondition(
                f"snapshot manifest {path} is not authenticated by this run's secret ("
                + ("it has no mac" if presented is None else "its mac does not match: modified, or another run's")
                + "): refused"
            )
    return manifest


def sign_manifest(secret: str, manifest: dict) -> dict:
    return {**manifest, "mac": auth.manifest_mac(secret, manifest)}


def files_of(manifest_path: Path, manifest: dict, participant: str) -> dict[str, Path]:
    """The verified files ``participant`` recorded, by name: sizes and SHA-256 must match
    the manifest."""
    root = Path(manifest_path).parent.resolve()
    found = {}
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not {"participant", "path", "size_bytes", "sha256"} <= entry.keys():
            raise InvalidArgument(f"snapshot manifest {manifest_path}: a file entry lacks participant, path, size or sha256")
        if entry["participant"] != participant:
            continue
        path = (root / str(entry["path"])).resolve()
        if path.parent != root:  # a name in the snapshot's directory, nothing else (no "..", no absolute path)
            raise FailedPrecondition(f"snapshot file {entry['path']!r} of {participant} is outside {root}: refused")
        try:
            size = path.stat().st_size
        except OSError:
            raise NotFound(f"snapshot file {path} is missing") from None
        if size != entry["size_bytes"] or sha256_of(path) != entry["sha256"]:
            raise FailedPrecondition(f"snapshot file {path} does not match its checksum in {manifest_path}")
        found[Path(entry["path"]).name] = path
    if not found:
        raise NotFound(f"snapshot {manifest.get('snapshot_id')} holds no files of {participant}")
    return found
