"""Export the global model of a live run as ``model.safetensors``, under the keys of the
user's ``model.state_dict()`` (``load_state_dict`` on a fresh instance takes it as is).

The coordinator relays every shard's Bootstrap (``ExportModel``) with the run's model
manifest; this module assembles the fragments into whole tensors, casts each to the
dtype the model declared (bf16 parameters included; the shards hold fp32), restores
tied keys as copies (safetensors stores no shared storage) and the small non-synced
tensors (``num_batches_tracked``) from the manifest. Nothing here imports the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.files import replacing
from diloco.manifest import Manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exported:
    state: dict[str, torch.Tensor]
    versions: dict[int, int]
    """Each fragment's global version in the export."""
    skipped: tuple[str, ...]
    """Non-synced tensors too large to travel in the manifest: not in the file."""
    manifest: Manifest


def assemble(replies) -> Exported:
    """The model from an ``ExportModel`` reply stream (header, then updates and chunks)."""
    from diloco.clients.syncer import decode_update

    replies = list(replies)
    if not replies or replies[0].WhichOneof("kind") != "header":
        raise InvalidArgument("export stream does not start with its header")
    header = replies[0].header
    manifest = Manifest.from_json(header.manifest_json)
    plan = manifest.plan(header.fragments)
    if plan.plan_hash != header.plan_hash:
        raise FailedPrecondition("the exported manifest does not give the run's fragment plan")
    synced = {e.name: torch.empty(e.shape, dtype=torch.float32) for e in manifest.synced}
    versions: dict[int, int] = {}
    update, chunks = None, []
    for reply in [*replies[1:], None]:
        kind = reply.WhichOneof("kind") if reply is not None else None
        if kind == "chunk":
            if update is None:
                raise InvalidArgument("export stream: a chunk before its update")
            chunks.append(reply.chunk.data)
            continue
        if update is not None:
            decoded = decode_update(update, chunks)
            if decoded.fragment >= plan.num_fragments or not decoded.segments or decoded.segments[-1].kind != "full":
                raise InvalidArgument(f"export stream: unexpected update of fragment {decoded.fragment}")
            for view, value in zip(plan.gather(decoded.fragment, synced), decoded.segments[-1].tensors):
                view.copy_(value.reshape(view.shape))
            versions[decoded.fragment] = decoded.version
        if kind == "update":
            update, chunks = reply.update, []
        elif reply is not None:
            raise InvalidArgument(f"export stream: unexpected {kind}")
    missing = sorted(set(range(plan.num_fragments)) - set(versions))
    if missing:
        raise FailedPrecondition(f"the shards returned no values for fragments {missing}")
    state, skipped = {}, []
    for entry in manifest.entries:
        dtype = getattr(torch, entry.dtype)
        if entry.name in synced:
            state[entry.name] = synced[entry.name].to(dtype)
        elif entry.value is not None:
            state[entry.name] = torch.tensor(entry.value, dtype=dtype).reshape(entry.shape)
        elif entry.numel == 0:
            state[entry.name] = torch.empty(entry.shape, dtype=dtype)
        else:
            skipped.append(entry.name)
    for alias, target in manifest.aliases:
        if target in state:
            state[alias] = state[target].clone()
    if skipped:
        logger.warning("not exported (large non-floating-point tensors, never synced): %s", ", ".join(skipped))
    return Exported(state, versions, tuple(skipped), manifest)


def save(exported: Exported, path: Path) -> None:
    """Write ``model.safetensors`` atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    versions = ",".join(f"{f}:{v}" for f, v in sorted(exported.versions.items()))
    with replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in exported.state.items()}, str(tmp),
                  metadata={"format": "pt", "diloco_versions": versions})


def export_model(admin, path: Path, timeout_s: float = 600.0) -> Exported:
    """Fetch the global model through the coordinator's ``ExportModel`` and save it."""
    exported = assemble(admin.export_model(timeout_s))
    save(exported, path)
    return exported


def check_new_dir(out: Path) -> None:
    """An export directory is new (or empty): never written over."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FailedPrecondition(f"{out} exists: give a new directory for the export")


def save_pretrained(run, state: dict[str, torch.Tensor], out: Path) -> None:
    """Write ``state`` into directory ``out`` as the run's task saves its model
    (``write_pretrained``), the task built here, on the CPU, to hold the values."""
    from diloco.task import TaskContext, build_task

    check_new_dir(out)
    task = build_task(run.task, TaskContext(0, 1, run.seed, torch.device("cpu"), dict(run.task_options)))
    write_pretrained(run.task, task, state, out)


def write_pretrained(spec: str, task, state: dict[str, torch.Tensor], out: Path) -> None:
    """``task``'s model holding ``state``, written to directory ``out`` by the task
    (``Task.save_pretrained``: a Hugging Face task writes what ``from_pretrained`` loads,
    with its tokenizer). ``out`` appears whole or not at all; an existing one is refused."""
    import shutil
    import tempfile

    check_new_dir(out)
    if task.save_pretrained is None:
        raise FailedPrecondition(f"task {spec!r} writes no checkpoint directory (no save_pretrained): the hf format "
                                 "is for Hugging Face tasks such as diloco.tasks.hf_causal_lm:build")
    task.model.load_state_dict(state)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        task.save_pretrained(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
