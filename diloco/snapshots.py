"""Snapshot storage, shared by the coordinator (writes manifests, keeps the newest), the
shards and the learners (write their state; the shards find and verify it on restore).

A snapshot root is a local directory or an fsspec URL (``s3://bucket/run/snapshots``,
``gs://...``, ``memory://...``); every process of a run must reach the same root (object
store credentials come from the usual environment: ``AWS_*`` for s3fs, for example).
Layout: ``ROOT/<id, six digits>/`` holds every participant's files and, once the
snapshot is complete, ``manifest.json``. The manifest is written last (atomically: a
rename on a local disk, one PUT on an object store), so a snapshot without one is
unfinished or failed and is never restored from.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import posixpath
import re
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from diloco import auth
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound
from diloco.files import atomic_write, private_dir

MANIFEST = "manifest.json"
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


def _fs(url: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as error:  # an unknown scheme, or its package (s3fs, gcsfs) missing
        raise InvalidArgument(f"cannot open snapshot storage {url}: {error}") from None


def join(root: str | Path, *names: str) -> str:
    """``root/name/...`` for a directory or a URL."""
    return "/".join([str(root).rstrip("/"), *names])


def snapshot_path(root: str | Path, snapshot_id: int) -> str:
    return join(root, f"{snapshot_id:06d}")


def prepare(directory: str | Path) -> None:
    """Make a snapshot's directory where directories exist (object stores have none)."""
    fs, path = _fs(directory)
    if isinstance(fs, LocalFileSystem):
        private_dir(path)  # 0700: it holds the model and the optimizers' state


def write_file(url: str | Path, data: bytes) -> None:
    """Write a whole file: an atomic rename on a local disk, one PUT on an object store;
    either way a reader sees the old file or the new one, never half of one."""
    fs, path = _fs(url)
    try:
        if isinstance(fs, LocalFileSystem):
            atomic_write(Path(path), data)
        else:
            fs.pipe_file(path, data)
    except OSError as error:
        raise FailedPrecondition(f"cannot write {url}: {error}") from None


def read_file(url: str | Path) -> bytes:
    fs, path = _fs(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise NotFound(f"{url} does not exist") from None
    except OSError as error:
        raise FailedPrecondition(f"cannot read {url}: {error}") from None


def snapshot_ids(root: str | Path) -> dict[int, bool]:
    """The snapshots under ``root``: id -> complete (has a manifest)."""
    fs, path = _fs(root)
    fs.invalidate_cache()  # other processes write here: never answer from a cached listing
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return {}
    ids = sorted(int(n) for n in names if n.isdigit())
    complete = {posixpath.basename(posixpath.dirname(p)) for p in fs.glob(f"{path.rstrip('/')}/*/{MANIFEST}")}
    return {i: f"{i:06d}" in complete for i in ids}


PIN_PREFIX = "pinned-by-"


def pin(directory: str | Path, who: str) -> None:
    """Mark a snapshot as one that ``who`` restored from: retention keeps it (replaying
    ``who``'s tape starts from it)."""
    write_file(join(directory, PIN_PREFIX + who), b"")


def pins(root: str | Path, snapshot_id: int) -> list[str]:
    """Who restored from the snapshot (see ``pin``)."""
    fs, path = _fs(snapshot_path(root, snapshot_id))
    fs.invalidate_cache()
    return sorted(posixpath.basename(p)[len(PIN_PREFIX):] for p in fs.glob(f"{path}/{PIN_PREFIX}*"))


def remove_snapshot(root: str | Path, snapshot_id: int) -> None:
    """Delete a snapshot's files, its manifest first (so it never looks complete half-deleted)."""
    fs, path = _fs(snapshot_path(root, snapshot_id))
    manifest = f"{path}/{MANIFEST}"
    if fs.exists(manifest):
        fs.rm_file(manifest)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def find_manifest(root: str | Path | None, spec: str) -> str:
    """``spec``: "latest" (the newest complete snapshot under ``root``), a snapshot id, a
    snapshot directory or a manifest file (paths or URLs). Returns the manifest's URL."""
    if spec == "latest" or spec.isdigit():
        if root is None:
            raise InvalidArgument(f"restoring snapshot {spec!r} needs the snapshot directory")
        found = snapshot_ids(root)
        complete = [i for i, done in found.items() if done]
        if spec == "latest":
            if not complete:
                raise NotFound(f"no complete snapshot in {root}" + (f" (unfinished: {sorted(found)})" if found else ""))
            return join(snapshot_path(root, complete[-1]), MANIFEST)
        if int(spec) not in complete:
            state = "never completed (it has no manifest)" if int(spec) in found else "does not exist"
            raise NotFound(f"snapshot {int(spec)} in {root} {state}; complete snapshots: {complete or 'none'}")
        return join(snapshot_path(root, int(spec)), MANIFEST)
    url = str(spec)
    if not url.endswith(MANIFEST):
        url = join(url, MANIFEST)
    fs, path = _fs(url)
    if not fs.exists(path):
        raise NotFound(f"no complete snapshot at {url} (a snapshot without a manifest never completed)")
    return url


def read_manifest(url: str | Path, secret: str | None = None) -> dict:
    """A snapshot manifest; with the run ``secret``, only one the run itself signed."""
    try:
        manifest = json.loads(read_file(url))
    except RecursionError:
        raise InvalidArgument(f"cannot read snapshot manifest {url}: JSON nested too deeply") from None
    except ValueError as error:
        raise InvalidArgument(f"cannot read snapshot manifest {url}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != 1 or not isinstance(manifest.get("files"), list):
        raise InvalidArgument(f"{url} is not a snapshot manifest (format 1)")
    if secret is not None:
        presented = manifest.get("mac")
        if not isinstance(presented, str) or not hmac.compare_digest(presented, auth.manifest_mac(secret, manifest)):
            raise FailedPrecondition(
                f"snapshot manifest {url} is not authenticated by this run's secret ("
                + ("it has no mac" if presented is None else "its mac does not match: modified, or another run's")
                + "): refused"
            )
    _check_id(url, manifest)
    return manifest


def _check_id(url: str | Path, manifest: dict) -> None:
    """A manifest in a directory named for a snapshot id must record that id: the mac
    covers the id, not the directory's name, so an older snapshot copied under a higher
    id would otherwise be restored as "latest"."""
    directory = posixpath.basename(posixpath.dirname(str(url).rstrip("/")))
    recorded = manifest.get("snapshot_id")
    if directory.isdigit() and (isinstance(recorded, bool) or not isinstance(recorded, int) or recorded != int(directory)):
        raise FailedPrecondition(
            f"snapshot directory {directory} holds the signed manifest of snapshot {recorded!r} ({url}): "
            f"a snapshot copied under another id, refused; remove {directory} or restore a snapshot by its own id"
        )


def sign_manifest(secret: str, manifest: dict) -> dict:
    return {**manifest, "mac": auth.manifest_mac(secret, manifest)}


def files_of(manifest_url: str | Path, manifest: dict, participant: str) -> dict[str, bytes]:
    """The files ``participant`` recorded, by name, read whole and verified: sizes and
    SHA-256 must match the manifest (what is checked is what is used: nothing is read
    twice). Names are plain file names in the snapshot's directory."""
    root = posixpath.dirname(str(manifest_url).rstrip("/"))
    found = {}
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not {"participant", "path", "size_bytes", "sha256"} <= entry.keys():
            raise InvalidArgument(f"snapshot manifest {manifest_url}: a file entry lacks participant, path, size or sha256")
        if entry["participant"] != participant:
            continue
        name = str(entry["path"])
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            # a plain name in the snapshot's directory, nothing else (no "..", no path, no control character)
            raise FailedPrecondition(f"snapshot file {name!r} of {participant} is outside {root}: refused")
        url = join(root, name)
        data = read_file(url)
        if len(data) != entry["size_bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FailedPrecondition(f"snapshot file {url} does not match its checksum in {manifest_url}: refused")
        found[name] = data
    if not found:
        raise NotFound(f"snapshot {manifest.get('snapshot_id')} holds no files of {participant}")
    return found
