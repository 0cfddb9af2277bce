"""The run's model as the operator pins it: the manifest and every fragment's initial
values, fixed by the coordinator at start instead of by whichever learner registers or
initialises first.

A pinned coordinator builds the run's task itself, from the run config every learner
gets (task, task options, seed, ``--init``), exactly as a learner does before it offers
its values to the shards: the model's state dict gives the manifest, each fragment's
pieces read as fp32 on the host and encoded raw give its ``values_digest``, the digest a
learner's Initialize must carry (``diloco.learner.api.Learner._bootstrap``). A task that
builds the same model from the seed on every machine (the built-in byte GPT does: its
init draws from a seeded CPU generator), or any task started from ``--init``, gets the
same digests on every learner. The coordinator hands both to the shards
(``Topology.manifest_json`` and ``Topology.initial_values``), which refuse anything else.

The coordinator keeps the values themselves too (``VALUES_FILE``, beside the pin) and
seeds the shards with them before any learner offers its own: on a scarce link a learner
then sends none of the model at start, and downloads none of it while the shards are at
the values it built.

A coordinator that cannot build the task (a user's task only in the learner image) may
pin the manifest alone, by the SHA-256 of its JSON (``manifest_sha256``); the initial
values then stay the first learner's.

Importable without torch: ``pin_of`` and ``build_pin`` import it when called.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.files import atomic_write
from diloco.fragments import FragmentPlan
from diloco.manifest import Manifest

if TYPE_CHECKING:
    import torch

PIN_FILE = "model-pin.json"
"""In a coordinator's data directory: the pin it built (or ``diloco local`` built for it),
with the run config it was built for; a restart with the same run config reuses it."""
VALUES_FILE = "model-pin-values.npz"
"""Beside ``PIN_FILE``: each fragment's initial values (``ModelPin.values``)."""


def manifest_sha256(manifest_json: str) -> str:
    """Hex SHA-256 of a manifest's canonical JSON (``Manifest.to_json``, what a learner
    registers)."""
    return hashlib.sha256(manifest_json.encode()).hexdigest()


@dataclass(frozen=True)
class ModelPin:
    manifest_json: str
    """The run's manifest, canonical (``Manifest.to_json``)."""
    initial_values: tuple[bytes, ...]
    """``values_digest`` of each fragment's initial values, by fragment id."""
    values: tuple[tuple[np.ndarray, ...], ...] | None = field(default=None, compare=False, repr=False)
    """Each fragment's initial values, its pieces in plan order (fp32), when the pin was
    built from the model or kept with them; what the coordinator seeds the shards with."""

    @property
    def manifest_sha256(self) -> str:
        return manifest_sha256(self.manifest_json)

    def to_json(self, run: RunConfig) -> str:
        return json.dumps({"run_config": run.to_json(), "manifest": self.manifest_json,
                           "initial_values": [d.hex() for d in self.initial_values]})

    def save(self, path: Path, run: RunConfig) -> None:
        """Keep the pin at ``path`` and its values (if it has them) beside it."""
        if self.values is not None:
            buffer = io.BytesIO()
            np.savez(buffer, **{f"f{f}p{i}": piece for f, pieces in enumerate(self.values) for i, piece in enumerate(pieces)})
            atomic_write(path.parent / VALUES_FILE, buffer.getvalue())
        atomic_write(path, self.to_json(run))

    @classmethod
    def read(cls, path: Path, run: RunConfig) -> ModelPin | None:
        """The pin kept at ``path`` if it was built for ``run`` (None if absent or built for
        another run config), with the values kept beside it when they are there and are
        the pinned ones."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise FailedPrecondition(f"model pin {path} is corrupt: {error}") from None
        if not isinstance(raw, dict) or raw.get("run_config") != run.to_json():
            return None
        try:
            pin = cls(str(raw["manifest"]), tuple(bytes.fromhex(d) for d in raw["initial_values"]))
        except (KeyError, TypeError, ValueError) as error:
            raise FailedPrecondition(f"model pin {path} is corrupt: {error}") from None
        manifest = Manifest.from_json(pin.manifest_json).check_size(run.max_model_bytes)
        if len(pin.initial_values) != run.fragments or manifest.to_json() != pin.manifest_json:
            raise FailedPrecondition(f"model pin {path} does not describe this run's {run.fragments} fragments")
        plan = manifest.plan(run.fragments)
        values = _read_values(path.parent / VALUES_FILE, plan)
        if values is None:
            return pin
        kept = cls(pin.manifest_json, pin.initial_values, values)
        from diloco.codec import values_digest

        if tuple(values_digest(kept.encoded(plan, f.id)) for f in plan.fragments) != pin.initial_values:
            raise FailedPrecondition(f"{path.parent / VALUES_FILE} does not hold the values pinned in {path}")
        return kept

    def encoded(self, plan: FragmentPlan, fragment_id: int):
        """A fragment's values as a learner encodes them for Initialize (fp32 pieces);
        ``plan``: the run's, cut from this pin's manifest."""
        from diloco.codec import encode

        pieces = plan.fragments[fragment_id].pieces
        return [encode(p.name, values, encoding="fp32") for p, values in zip(pieces, self.values[fragment_id])]


def _read_values(path: Path, plan: FragmentPlan) -> tuple[tuple[np.ndarray, ...], ...] | None:
    """The values file at ``path``, each piece shaped as the plan cuts it (None if absent;
    FailedPrecondition if it does not fit the plan)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            values = tuple(tuple(archive[f"f{f.id}p{i}"] for i in range(len(f.pieces))) for f in plan.fragments)
    except FileNotFoundError:
        return None
    except (KeyError, ValueError, OSError) as error:
        raise FailedPrecondition(f"{path} is corrupt: {error}") from None
    for fragment, pieces in zip(plan.fragments, values):
        for piece, array in zip(fragment.pieces, pieces):
            if array.dtype != np.float32 or tuple(array.shape) != tuple(piece.shape):
                raise FailedPrecondition(f"{path}: piece {piece.name} of fragment {fragment.id} is {array.dtype} "
                                         f"{tuple(array.shape)}, the plan cuts it {tuple(piece.shape)}")
    return values


def pin_of(model: torch.nn.Module, fragments: int) -> ModelPin:
    """The pin of a model as its task built it: its manifest, and each fragment's values
    as a learner on a CPU encodes them for Initialize (fp32, pieces in plan order)."""
    import torch

    from diloco.codec import encode, values_digest
    from diloco.manifest import manifest_of, synced_tensors

    manifest = manifest_of(model)
    plan = manifest.plan(fragments)
    tensors = synced_tensors(model, manifest)
    digests, kept = [], []
    for fragment in plan.fragments:
        whole = {p.tensor: tensors[p.tensor].detach().to("cpu", torch.float32) for p in fragment.pieces}
        values = plan.gather(fragment.id, whole)
        encoded = [encode(p.name, t, encoding="fp32") for p, t in zip(fragment.pieces, values)]
        digests.append(values_digest(encoded))
        kept.append(tuple(np.frombuffer(e.payload, dtype="<f4").reshape(e.spec.shape) for e in encoded))
    return ModelPin(manifest.to_json(), tuple(digests), tuple(kept))


def build_pin(run: RunConfig) -> ModelPin:
    """Build the run's task on the CPU (as learner 0 of 1 would) and pin its model. Slow
    (imports torch, builds the model): call it off the event loop."""
    import torch

    from diloco.task import TaskContext, build_task

    task = build_task(run.task, TaskContext(0, 1, run.seed, torch.device("cpu"), dict(run.task_options)), run.init)
    pin = pin_of(task.model, run.fragments)
    Manifest.from_json(pin.manifest_json).check_size(run.max_model_bytes)
    return pin


def check_sha256(value: str) -> str:
    """A manifest digest as ``--model-sha256`` takes it: 64 hex digits, lowercased."""
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value.lower()):
        raise InvalidArgument(f"a model manifest SHA-256 is 64 hex digits, got {value[:80]!r}")
    return value.lower()
