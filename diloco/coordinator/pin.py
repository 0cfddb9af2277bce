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

A coordinator that cannot build the task (a user's task only in the learner image) may
pin the manifest alone, by the SHA-256 of its JSON (``manifest_sha256``); the initial
values then stay the first learner's.

Importable without torch: ``pin_of`` and ``build_pin`` import it when called.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.manifest import Manifest

if TYPE_CHECKING:
    import torch

PIN_FILE = "model-pin.json"
"""In a coordinator's data directory: the pin it built (or ``diloco local`` built for it),
with the run config it was built for; a restart with the same run config reuses it."""


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

    @property
    def manifest_sha256(self) -> str:
        return manifest_sha256(self.manifest_json)

    def to_json(self, run: RunConfig) -> str:
        return json.dumps({"run_config": run.to_json(), "manifest": self.manifest_json,
                           "initial_values": [d.hex() for d in self.initial_values]})

    @classmethod
    def read(cls, path: Path, run: RunConfig) -> ModelPin | None:
        """The pin kept at ``path`` if it was built for ``run`` (None if absent or built for
        another run config)."""
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
        return pin


def pin_of(model: torch.nn.Module, fragments: int) -> ModelPin:
    """The pin of a model as its task built it: its manifest, and each fragment's values
    as a learner on a CPU encodes them for Initialize (fp32, pieces in plan order)."""
    import torch

    from diloco.codec import encode, values_digest
    from diloco.manifest import manifest_of, synced_tensors

    manifest = manifest_of(model)
    plan = manifest.plan(fragments)
    tensors = synced_tensors(model, manifest)
    digests = []
    for fragment in plan.fragments:
        whole = {p.tensor: tensors[p.tensor].detach().to("cpu", torch.float32) for p in fragment.pieces}
        values = plan.gather(fragment.id, whole)
        digests.append(values_digest([encode(p.name, t, encoding="fp32") for p, t in zip(fragment.pieces, values)]))
    return ModelPin(manifest.to_json(), tuple(digests))


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
