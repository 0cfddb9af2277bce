"""The byte GPT's options and their defaults, without torch: the command line shows them
(``--width`` and the other shorthands) while building its parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import InvalidArgument

if TYPE_CHECKING:
    from diloco.task import TaskContext


@dataclass(frozen=True)
class ModelConfig:
    width: int = 128
    """Residual stream width (d_model)."""
    depth: int = 2
    """Transformer blocks."""
    heads: int = 4
    context: int = 128
    """Tokens (bytes) per training sequence."""
    seed: int = 0
    """Initialisation seed (the run's seed)."""

    def __post_init__(self) -> None:
        for name in ("width", "depth", "heads", "context"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise InvalidArgument(f"model width {self.width} must be divisible by heads {self.heads}")


@dataclass(frozen=True)
class Options:
    """The task's options, parsed and checked once."""

    model: ModelConfig
    batch_size: int = 16
    """Sequences per inner step."""
    data: str | None = None
    data_shards: int = 8
    """Disjoint training shards; learner i reads shard i mod data_shards."""
    eval_batches: int = 8

    @classmethod
    def parse(cls, ctx: TaskContext) -> Options:
        model = ModelConfig(**{name: ctx.option(name, getattr(ModelConfig, name), int)
                                for name in ("width", "depth", "heads", "context")}, seed=ctx.seed)
        opts = cls(model, **{name: ctx.option(name, getattr(cls, name), int)
                             for name in ("batch_size", "data_shards", "eval_batches")}, data=ctx.option("data", None))
        for name in ("batch_size", "data_shards", "eval_batches"):
            if getattr(opts, name) < 1:
                raise InvalidArgument(f"task option {name} must be >= 1, got {getattr(opts, name)}")
        return opts
