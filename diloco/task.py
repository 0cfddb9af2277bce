"""The task contract: what a user brings (model, data, loss, optional optimizer) and how a
run names it.

A task is a function ``build(ctx: TaskContext) -> Task``, named ``FILE.py:FUNCTION`` or
``package.module:FUNCTION``. Every learner, the baselines and the ``diloco local``
supervisor (which evaluates the start and final global model) call it with their own
context. The built-in byte-level GPT is one such task, ``diloco.tasks.byte_gpt:build``.

Importable without torch (shard processes import the kernel): torch types appear only in
annotations and inside functions.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

DEFAULT_TASK = "diloco.tasks.byte_gpt:build"


class TaskError(FailedPrecondition):
    """The user's task could not be loaded or misbehaved (bad return type, NaN loss, data
    that ran out). The message names the task and the problem in one line."""


@dataclass(frozen=True)
class TaskContext:
    """What a task's ``build`` function is told about the process that calls it."""

    learner_index: int
    """This learner's number (``L3`` is 3): pick its share of the data with it."""
    num_learners: int
    """Learners the run was planned for (scavenged learners may have larger indices)."""
    seed: int
    """The run's seed: initialise the model and order the data from it."""
    device: Any
    """The torch device the model trains on (batches may stay on the CPU if the loss moves them)."""
    options: Mapping[str, str] = field(default_factory=dict)
    """``--task-option KEY=VALUE`` pairs, the same for every process of the run. Read them
    in ``build``: an option it never looks at is refused by name when it returns (a typo
    must not train the defaults silently)."""

    def option(self, key: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
        """``options[key]`` converted with ``kind``, or ``default``; a clear error if it
        does not convert."""
        if key not in self.options:
            return default
        try:
            return kind(self.options[key])
        except (TypeError, ValueError):
            raise InvalidArgument(f"task option {key}={self.options[key]!r} is not a valid {kind.__name__}") from None


class ReadOptions(Mapping[str, str]):
    """The options as a task sees them, noting each key it looks up (``[]``, ``in``,
    ``get``, ``option``; iterating over them looks at every one)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._options = dict(options)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._options[key]

    def __iter__(self) -> Iterator[str]:
        self.read.update(self._options)
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def unread(self) -> list[str]:
        return sorted(self._options.keys() - self.read)


def check_all_read(spec: str, options: ReadOptions) -> None:
    """Refuse, by name, the options the task never looked at (with the read key nearest each)."""
    unread = options.unread()
    if not unread:
        return
    read = sorted(map(str, options.read))
    named = [f"{key} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(key, read, n=1)) else key
             for key in unread]
    raise InvalidArgument(f"task {spec!r} never reads task option{'s' * (len(unread) > 1)} {', '.join(named)}; "
                          f"it reads {', '.join(read) or 'none'}")


@dataclass
class Task:
    """A model, its data and its loss. ``batches`` may be infinite; the runner stops at its
    step or token budget. ``loss(model, batch)`` returns a scalar tensor to minimise;
    ``tokens(batch)`` is what the batch counts toward the token budget and goodput.
    ``eval_batches``: the fixed held-out batches whose mean ``loss`` is the run's eval loss
    (reported times ``eval_scale`` in ``eval_unit``, e.g. bits/byte). ``optimizer``: builds
    the inner optimizer from the parameters (default: the run's AdamW). ``save_pretrained``:
    writes the model, with the values it holds, and what goes with it (a tokenizer) to a
    directory in its own ecosystem's layout (a Hugging Face task: ``from_pretrained`` loads
    it); ``diloco admin export --format hf`` and ``diloco local`` use it."""

    model: torch.nn.Module
    batches: Iterable
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    tokens: Callable[[Any], int]
    eval_batches: Sequence | None = None
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    eval_unit: str = "loss"
    eval_scale: float = 1.0
    save_pretrained: Callable[[Path], None] | None = None


def load_task(spec: str) -> Callable[[TaskContext], Task]:
    """The build function named by ``spec`` (``FILE.py:FUNCTION`` or ``module:FUNCTION``)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise TaskError(f"task {spec!r}: expected FILE.py:FUNCTION or package.module:FUNCTION")
    try:
        if path.endswith(".py") or "/" in path or Path(path).is_file():
            file = Path(path).resolve()
            if not file.is_file():
                raise TaskError(f"task {spec!r}: no such file {path}")
            module_name = f"diloco_task_{abs(hash(str(file)))}"
            module = sys.modules.get(module_name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(module_name, file)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[module_name] = module
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(path)
    except TaskError:
        raise
    except Exception as error:
        raise TaskError(f"task {spec!r} does not import: {type(error).__name__}: {error}") from None
    build = getattr(module, name, None)
    if not callable(build):
        raise TaskError(f"task {spec!r}: {path} has no function {name!r}")
    return build


def build_task(spec: str, ctx: TaskContext, init: str = "") -> Task:
    """Load and call the task, checking what it returns. ``init``: a ``.safetensors`` file
    (an export) whose values the model starts from instead of its own initialisation."""
    import torch

    build = load_task(spec)
    options = ReadOptions(ctx.options)
    try:
        task = build(dataclasses.replace(ctx, options=options))
    except TaskError:
        raise
    except Exception as error:
        raise TaskError(f"task {spec!r} raised {type(error).__name__}: {error}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} returned {type(task).__name__}, not diloco.Task")
    check_all_read(spec, options)
    if not isinstance(task.model, torch.nn.Module):
        raise TaskError(f"task {spec!r}: model is a {type(task.model).__name__}, not a torch.nn.Module")
    for name in ("loss", "tokens"):
        if not callable(getattr(task, name)):
            raise TaskError(f"task {spec!r}: {name} is not callable")
    if task.optimizer is not None and not callable(task.optimizer):
        raise TaskError(f"task {spec!r}: optimizer must be a function of the parameters")
    if task.save_pretrained is not None and not callable(task.save_pretrained):
        raise TaskError(f"task {spec!r}: save_pretrained must be a function of a directory")
    if not any(p.requires_grad for p in task.model.parameters()):
        raise TaskError(f"task {spec!r}: the model has no trainable parameters")
    if not (isinstance(task.eval_scale, (int, float)) and math.isfinite(task.eval_scale) and task.eval_scale > 0):
        raise TaskError(f"task {spec!r}: eval_scale must be a positive number, got {task.eval_scale!r}")
    if init:
        load_init(spec, task.model, init)
    return task


def load_init(spec: str, model, path: str) -> None:
    """Start ``model`` from the tensors of a safetensors file, every key and shape checked;
    or of a checkpoint directory in Hugging Face's layout (``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` lists), where a tied weight is stored once:
    a key the directory lacks is taken only if the model ties it to one it has."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path) if Path(path).is_dir() else None
    try:
        if directory is None:
            files = [Path(path)]
        elif (directory / "model.safetensors").is_file():
            files = [directory / "model.safetensors"]
        elif (directory / "model.safetensors.index.json").is_file():
            index = json.loads((directory / "model.safetensors.index.json").read_text())
            files = [directory / name for name in sorted(set(index["weight_map"].values()))]
        else:
            raise TaskError(f"--init {path}: a directory without model.safetensors or model.safetensors.index.json")
        state = {key: value for file in files for key, value in load_file(file).items()}
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        raise TaskError(f"--init {path}: cannot read it: {error}") from None
    try:
        if directory is None:
            model.load_state_dict(state)
            return
        missing, unexpected = model.load_state_dict(state, strict=False)
        given = {tensor.data_ptr() for key, tensor in model.state_dict().items() if key in state}
        untied = [key for key in missing if model.state_dict()[key].data_ptr() not in given]
        if untied or unexpected:
            raise RuntimeError(f"missing keys {untied[:5]}, unexpected keys {unexpected[:5]}")
    except RuntimeError as error:
        first = str(error).strip().splitlines()
        raise TaskError(f"--init {path} does not fit the model of task {spec!r}: {' '.join(first[:3])[:300]}") from None


def checked_loss(spec: str, value: Any) -> torch.Tensor:
    """The loss as returned by the task, or a TaskError if it is not a finite scalar tensor."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TaskError(f"task {spec!r}: loss returned {type(value).__name__}, not a tensor")
    if value.numel() != 1:
        raise TaskError(f"task {spec!r}: loss returned a tensor of shape {tuple(value.shape)}, not a scalar")
    if not value.requires_grad:
        raise TaskError(f"task {spec!r}: the loss does not depend on any trainable parameter")
    return value


def checked_tokens(spec: str, value: Any) -> int:
    """A batch's token count: a non-negative int (or a one-element integer tensor)."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TaskError(f"task {spec!r}: tokens(batch) returned {value!r}, not a non-negative int")
    return value


def evaluate(spec: str, task: Task) -> float | None:
    """Mean ``loss`` over the task's eval batches, times ``eval_scale``; None without eval
    batches. Runs under ``no_grad`` in eval mode and puts the model back in train mode."""
    import torch

    if not task.eval_batches:
        return None
    model = task.model
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for batch in task.eval_batches:
                value = task.loss(model, batch)
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise TaskError(f"task {spec!r}: loss returned {shape} on an eval batch, not a scalar")
                total += float(value)
    finally:
        model.train(was_training)
    mean = total / len(task.eval_batches)
    if not math.isfinite(mean):
        raise TaskError(f"task {spec!r}: the eval loss is {mean}")
    return mean * task.eval_scale


def parse_options(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--task-option``) as a dict; a clear error for anything else."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"--task-option expects KEY=VALUE, got {pair!r}")
        options[key.strip()] = value
    return options
