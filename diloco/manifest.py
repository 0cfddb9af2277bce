"""The model manifest: which tensors a run synchronises, by name, shape and dtype.

Built by a learner from its ``model.state_dict()``; the coordinator fixes the run's
manifest from the first learner that registers one and refuses a learner whose manifest
differs; shards build their fragment plan from it. No process but a learner (or a tool)
ever imports the model.

Policy, per state-dict entry:
- floating-point parameters and buffers are synchronised; each storage once: a tensor
  reachable under several keys (tied weights) is synced under its first key and the
  other keys are recorded as aliases;
- floating-point buffers (BatchNorm running statistics; the "buffer" tag of their pieces)
  travel as values, not deltas, and the shards set them to the learners' weighted mean:
  a convex combination, so a running variance can never turn negative (deltas against
  stale anchors, outer momentum or int4 rounding could);
- non-floating-point tensors (``num_batches_tracked``, integer masks) are not synced:
  each learner keeps its own; the manifest carries the registering learner's value of
  the small ones so that an export is complete.
Deltas are taken and merged in fp32 whatever the parameter dtype (bf16 included).

Importable without torch; ``manifest_of`` imports it when called.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import InvalidArgument, ResourceExhausted
from diloco.fragments import FragmentPlan, is_embedding_name, max_fragments, plan_fragments

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
OTHER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "bool")
MAX_ENTRIES = 100_000
MAX_NAME_CHARS = 512
MAX_DIMS = 8
MAX_NUMEL = 1 << 40
MAX_VALUE_NUMEL = 4096
"""Non-synced tensors up to this size travel in the manifest (their value for export)."""
MAX_JSON_BYTES = 16 << 20
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
               "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    """"parameter" or "buffer"."""
    value: tuple | None = None
    """Flat value of a small non-synced tensor (None for synced ones and large ones)."""

    @property
    def synced(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]
    """Every state-dict key but the aliases, in state-dict order."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(alias key, the key it shares storage with)."""

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            raise InvalidArgument("model manifest: duplicate tensor names")
        known = set(names)
        for alias, target in self.aliases:
            if alias in known or target not in known:
                raise InvalidArgument(f"model manifest: alias {alias!r} -> {target!r} is not a shared tensor of the model")
        if not any(e.synced and e.numel for e in self.entries):
            raise InvalidArgument("model manifest: no floating-point tensor to synchronise")

    @property
    def total_bytes(self) -> int:
        """The model's size: elements x bytes per element, over every tensor."""
        return sum(e.numel * DTYPE_BYTES[e.dtype] for e in self.entries)

    def check_size(self, max_bytes: int) -> Manifest:
        """This manifest, if the model it describes fits in ``max_bytes`` (the run's
        ``max_model_bytes``); else ResourceExhausted, before anyone plans or allocates it."""
        total = self.total_bytes
        if total > max_bytes:
            raise ResourceExhausted(f"model manifest describes {total:,} bytes of tensors, over the run's maximum model "
                                    f"size of {max_bytes:,} bytes (--max-model-bytes)")
        return self

    @property
    def synced(self) -> list[Entry]:
        return [e for e in self.entries if e.synced and e.numel]

    def max_fragments(self) -> int:
        """The most fragments the synced tensors can be cut into (``fragments.max_fragments``)."""
        return max_fragments([(e.name, e.shape) for e in self.synced])

    def plan(self, num_fragments: int) -> FragmentPlan:
        buffers = {e.name for e in self.synced if e.kind == "buffer"}
        return plan_fragments(
            [(e.name, e.shape) for e in self.synced], num_fragments,
            is_embedding=lambda name: name not in buffers and is_embedding_name(name),
            is_buffer=lambda name: name in buffers,
        )

    def first_difference(self, run: Manifest) -> str | None:
        """Where this manifest departs from the run's, in one phrase (None: equal)."""
        mine = {e.name: e for e in self.entries}
        theirs = {e.name: e for e in run.entries}
        for e in run.entries:
            other = mine.get(e.name)
            if other is None:
                return f"the run's {e.describe()} is missing from this model"
            if (other.shape, other.dtype, other.kind) != (e.shape, e.dtype, e.kind):
                return f"{e.kind} {e.name!r}: {list(other.shape)} {other.dtype} here, {list(e.shape)} {e.dtype} in the run"
        for e in self.entries:
            if e.name not in theirs:
                return f"this model's {e.describe()} is not in the run"
        if dict(self.aliases) != dict(run.aliases):
            return f"tied tensors differ: {dict(self.aliases)} here, {dict(run.aliases)} in the run"
        return None

    def to_json(self) -> str:
        return json.dumps({
            "entries": [
                {"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "kind": e.kind,
                 **({"value": list(e.value)} if e.value is not None else {})}
                for e in self.entries
            ],
            "aliases": [list(a) for a in self.aliases],
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and bound a manifest from the wire or a file: hostile input gets an
        InvalidArgument, never an exception of another kind."""
        if len(text) > MAX_JSON_BYTES:
            raise InvalidArgument(f"model manifest of {len(text)} bytes exceeds {MAX_JSON_BYTES}")
        try:
            raw = json.loads(text)
            entries_raw, aliases_raw = raw["entries"], raw.get("aliases", [])
            if not isinstance(entries_raw, list) or not isinstance(aliases_raw, list):
                raise TypeError("entries and aliases must be lists")
            if len(entries_raw) > MAX_ENTRIES or len(aliases_raw) > MAX_ENTRIES:
                raise ValueError(f"more than {MAX_ENTRIES} tensors")
            entries = tuple(_entry(e) for e in entries_raw)
            aliases = tuple((_name(a), _name(b)) for a, b in aliases_raw)
        except RecursionError:
            raise InvalidArgument("invalid model manifest: JSON nested too deeply") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InvalidArgument(f"invalid model manifest: {error}") from None
        return cls(entries, aliases)


def _name(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS or not value.isprintable():
        raise ValueError(f"bad tensor name {str(value)[:40]!r}")
    return value


def _entry(raw: dict) -> Entry:
    name = _name(raw["name"])
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ValueError(f"{name}: shape must be a list of at most {MAX_DIMS} dims")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"{name}: dims must be non-negative ints")
    if math.prod(shape) > MAX_NUMEL:
        raise ValueError(f"{name}: more than {MAX_NUMEL} elements")
    dtype, kind = raw["dtype"], raw["kind"]
    if dtype not in FLOAT_DTYPES + OTHER_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {str(dtype)[:20]!r}")
    if kind not in ("parameter", "buffer"):
        raise ValueError(f"{name}: kind must be parameter or buffer")
    value = raw.get("value")
    if value is not None:
        if dtype in FLOAT_DTYPES or not isinstance(value, list) or len(value) != math.prod(shape):
            raise ValueError(f"{name}: value does not match its shape and dtype")
        if any(isinstance(v, bool) != (dtype == "bool") or not isinstance(v, (int, bool)) for v in value):
            raise ValueError(f"{name}: value must hold {dtype}s")
        value = tuple(value)
    return Entry(name, tuple(shape), dtype, kind, value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage_keys(tensor: torch.Tensor) -> list[tuple]:
    """What makes two state-dict entries one tensor: the same object (tied parameters), or
    the same storage, offset, shape and strides where the device exposes its memory
    (XLA tensors and meta tensors do not: there, object identity alone)."""
    keys: list[tuple] = [("object", id(tensor))]
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        pointer = 0
    if pointer:
        keys.append(("storage", tensor.device.type, pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())))
    return keys


def manifest_of(model: torch.nn.Module) -> Manifest:
    """The manifest of ``model.state_dict()``: tied tensors once, with their aliases."""
    state = model.state_dict(keep_vars=True)
    parameters = {id(p) for p in model.parameters()}
    entries, aliases, seen = [], [], {}
    for name, tensor in state.items():
        keys = _storage_keys(tensor)
        target = next((seen[k] for k in keys if k in seen), None)
        if target is not None and tensor.numel():
            aliases.append((name, target))
            continue
        if tensor.is_complex():
            raise InvalidArgument(f"model tensor {name!r} is complex ({tensor.dtype}): not supported")
        dtype = dtype_name(tensor.dtype)
        if dtype not in FLOAT_DTYPES + OTHER_DTYPES:
            raise InvalidArgument(f"model tensor {name!r} has dtype {dtype}: not supported")
        seen.update({k: name for k in keys})
        value = None
        if dtype not in FLOAT_DTYPES and tensor.numel() <= MAX_VALUE_NUMEL and not tensor.is_meta:
            value = tuple(tensor.detach().cpu().reshape(-1).tolist())
        entries.append(Entry(name, tuple(tensor.shape), dtype, "parameter" if id(tensor) in parameters else "buffer", value))
    return Manifest(tuple(entries), tuple(aliases))


def synced_tensors(model: torch.nn.Module, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The model's own tensors (not copies) for each synced entry, by name: writes to a
    piece view go straight into the model."""
    state = model.state_dict(keep_vars=True)
    return {e.name: state[e.name].data for e in manifest.synced}
