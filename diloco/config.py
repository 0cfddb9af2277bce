"""The run configuration every process of a run shares: which task, how its model is cut
into fragments, and the sync schedule. The coordinator hands it to learners as JSON in the
topology; shards get it on their command line.

The model itself is the task's (``diloco.task``): shards never build it; the fragment plan
comes from the run's model manifest, which a coordinator started with ``--pin-model``
builds from this config (``diloco.coordinator.pin``), else the first learner registers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from diloco.errors import InvalidArgument
from diloco.task import DEFAULT_TASK

REPLY_RULES = ("mix", "rebase")
BLOCK_SIZE = 128
"""Elements per int4 block (one fp16 scale each). The learners' pushes and the shards'
replies use one size; a shard refuses pushes of another. 128 rather than 64: 6 % fewer
bytes on the wire at the same eval loss, with error feedback on pushes and replies
(docs/results/block-size/)."""


def check_density(what: str, density: float) -> None:
    """A sparse codec's density: the fraction of each block it keeps, in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise InvalidArgument(f"{what} must be in (0, 1] (the fraction of each block's values kept), got {density!r}")


@dataclass(frozen=True)
class RunConfig:
    task: str = DEFAULT_TASK
    """What every learner trains: a function (``FILE.py:FUNCTION`` or
    ``package.module:FUNCTION``) taking a ``diloco.TaskContext`` and returning a
    ``diloco.Task`` (the default is the built-in byte-level GPT)."""
    task_options: dict[str, str] = field(default_factory=dict)
    """``--task-option KEY=VALUE`` pairs handed to the task's build function."""
    seed: int = 0
    """The run's seed (TaskContext.seed): model initialisation and data order."""
    init: str = ""
    """A ``.safetensors`` file (e.g. an export), or a checkpoint directory in Hugging Face's
    layout (``diloco admin export --format hf``, ``save_pretrained``), the model starts from
    instead of its own initialisation; every learner reads it, the first to reach a shard
    gives it its values."""
    fragments: int = 4
    """P: fragments the model is cut into."""
    sync_every_steps: int = 4
    """H: inner steps between two sends of the same fragment (with outer Nesterov 0.7 / 0.9
    take H >= 16).

    4 with the sparse codec and pooled AdamW (docs/results/default-h4/: on the long
    workload 4x as close to DP as H = 8 with int4, at fewer bytes); H = 16 fell below 0.9
    goodput under kills (docs/results/compare-condensed/)."""
    overlap_steps: int = 2
    """tau: inner steps between sending a fragment and applying its reply."""
    merge_alpha: float = 0.0
    """alpha of ``reply_rule`` mix: params = alpha*params + (1-alpha)*global when a reply
    is applied (0: overwrite)."""
    reply_rule: str = "rebase"
    """How a learner applies a reply: ``rebase`` (params = global + the progress made
    since the push, which the next push then carries) or ``mix`` (Streaming DiLoCo's
    rule: params = alpha*params + (1-alpha)*global).

    With alpha 0, mix overwrites the tau steps trained since the push: measured, goodput
    0.60 vs 0.97 for rebase at H=4, tau=2, with the same final loss within noise."""
    max_model_bytes: int = 64 << 30
    """Largest model a run may have, bytes: the sum over the manifest's tensors of elements
    x bytes per element. The coordinator and the shards refuse a manifest over it before
    they plan or allocate anything (64 GiB: 16 billion fp32 parameters)."""

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or ":" not in self.task:
            raise InvalidArgument(f"task must be FILE.py:FUNCTION or package.module:FUNCTION, got {self.task!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.task_options).items()):
            raise InvalidArgument("task options must map strings to strings")
        if self.seed < 0:
            raise InvalidArgument(f"seed must be >= 0, got {self.seed}")
        if self.fragments < 1:
            raise InvalidArgument(f"fragments must be >= 1, got {self.fragments}")
        if self.sync_every_steps < 1:
            raise InvalidArgument(f"sync every (H) must be >= 1 inner step, got {self.sync_every_steps}")
        if self.overlap_steps < 1:
            raise InvalidArgument(f"overlap (tau) must be >= 1 inner step, got {self.overlap_steps}")
        if not 0.0 <= self.merge_alpha < 1.0:
            raise InvalidArgument(f"merge alpha must be in [0, 1), got {self.merge_alpha}")
        if isinstance(self.max_model_bytes, bool) or not isinstance(self.max_model_bytes, int) or self.max_model_bytes < 1:
            raise InvalidArgument(f"max model bytes must be a positive integer, got {self.max_model_bytes!r}")
        if self.reply_rule not in REPLY_RULES:
            raise InvalidArgument(f"reply rule must be one of {REPLY_RULES}, got {self.reply_rule!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            return cls(**raw)
        except RecursionError:
            raise InvalidArgument("invalid run config: JSON nested too deeply") from None
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"invalid run config: {error}") from None
