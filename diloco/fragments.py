"""The fragment plan: a deterministic, balanced partition of the model into P fragments.

Every learner and shard computes the plan from the model's ordered (name, shape) list
and must get the same plan (checked through ``plan_hash``). Balancing is LPT greedy
bin-packing (largest piece first into the lightest fragment). Tensors too large for
that to balance are split along dim 0 into pieces; we split only as finely as needed
for the heaviest fragment to stay within 4/3 of the lower bound
``max(total / P, largest piece)``. That bound is guaranteed once every piece is at most
a third of the fair share (LPT's heaviest bin is at most fair share + its last piece),
which dim-0 cuts can reach whenever rows are that small; with coarser rows the plan
still keeps LPT's guarantee of fair share + one piece.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco.errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np
    import torch

# Cut thresholds tried for balance: fair/1, fair/2, fair/3 (the last guarantees the bound).
_MAX_SPLIT_DIVISOR = 3


def is_embedding_name(name: str) -> bool:
    """Default embedding test: the project's model names its embedding tables '*embed*'."""
    return "embed" in name.lower()


@dataclass(frozen=True)
class Piece:
    """Rows [row_start, row_stop) of dim 0 of a model tensor."""

    tensor: str
    row_start: int
    row_stop: int
    shape: tuple[int, ...]
    embedding: bool
    tensor_rows: int
    buffer: bool = False
    """A floating-point buffer (running statistics): merged as the plain weighted mean of
    the learners' values, without RDA or outer momentum."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.row_start == 0 and self.row_stop == self.tensor_rows

    @property
    def name(self) -> str:
        return self.tensor if self.whole else f"{self.tensor}[{self.row_start}:{self.row_stop}]"

    def view(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """This piece of ``tensor`` (a torch tensor or numpy array) as a view (writes go
        through to the tensor)."""
        if tensor.ndim == 0:
            return tensor
        return tensor[self.row_start : self.row_stop]


@dataclass(frozen=True)
class Fragment:
    id: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    def owner(self, num_shards: int) -> int:
        return shard_of(self.id, num_shards)


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]
    plan_hash: str

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def owned_by(self, shard_id: int, num_shards: int) -> list[Fragment]:
        return [f for f in self.fragments if f.owner(num_shards) == shard_id]

    def gather(self, fragment_id: int, state: Mapping[str, torch.Tensor | np.ndarray]) -> list[torch.Tensor | np.ndarray]:
        """Views of the fragment's pieces in ``state`` (a state dict or named parameters)."""
        return [p.view(state[p.tensor]) for p in self.fragments[fragment_id].pieces]


def shard_of(fragment_id: int, num_shards: int) -> int:
    if num_shards <= 0:
        raise InvalidArgument(f"shard count must be positive, got {num_shards}")
    return fragment_id % num_shards


def _split(name: str, shape: tuple[int, ...], embedding: bool, buffer: bool, threshold: float) -> list[Piece]:
    rows = shape[0] if shape else 1
    numel = math.prod(shape)
    row_numel = numel // rows if rows else 0
    if numel <= threshold or rows <= 1:
        return [Piece(name, 0, rows, shape, embedding, rows, buffer)]
    rows_per_piece = max(1, int(threshold // row_numel)) if row_numel else rows
    count = math.ceil(rows / rows_per_piece)
    base, extra = divmod(rows, count)
    pieces, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        pieces.append(Piece(name, start, stop, (stop - start, *shape[1:]), embedding, rows, buffer))
        start = stop
    return pieces


def _pack(pieces: list[Piece], num_fragments: int) -> list[list[Piece]]:
    bins: list[list[Piece]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    # Stable order: size descending, then model order, so every machine packs identically.
    for piece in sorted(pieces, key=lambda p: -p.numel):
        lightest = min(range(num_fragments), key=lambda i: (loads[i], i))
        bins[lightest].append(piece)
        loads[lightest] += piece.numel
    return bins


def lower_bound(pieces: Sequence[Piece], num_fragments: int) -> float:
    return max(sum(p.numel for p in pieces) / num_fragments, max(p.numel for p in pieces))


def max_fragments(params: Sequence[tuple[str, Sequence[int]]]) -> int:
    """The most fragments ``params`` ((name, shape) pairs) can be cut into: a fragment
    holds whole rows (dim 0) of tensors, so one row each (a 0-d tensor is one row)."""
    return sum(int(shape[0]) if len(shape) else 1 for _, shape in params if math.prod(shape) > 0)


def plan_fragments(
    params: Sequence[tuple[str, Sequence[int]]],
    num_fragments: int,
    is_embedding: Callable[[str], bool] = is_embedding_name,
    is_buffer: Callable[[str], bool] = lambda name: False,
) -> FragmentPlan:
    """Balanced plan for ``params`` (ordered (name, shape) pairs) into ``num_fragments``."""
    if num_fragments <= 0:
        raise InvalidArgument(f"fragment count must be positive, got {num_fragments}")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        raise InvalidArgument("parameter names must be unique")
    specs = [(name, tuple(int(d) for d in shape), is_embedding(name), is_buffer(name)) for name, shape in params]
    specs = [s for s in specs if math.prod(s[1]) > 0]
    if not specs:
        raise InvalidArgument("the model has no parameters to fragment")
    fair = sum(math.prod(shape) for _, shape, _, _ in specs) / num_fragments

    best: list[list[Piece]] | None = None
    divisor = 1
    while True:
        pieces = [p for name, shape, emb, buf in specs for p in _split(name, shape, emb, buf, fair / divisor)]
        if len(pieces) >= num_fragments:
            best = _pack(pieces, num_fragments)
            heaviest = max(sum(p.numel for p in b) for b in best)
            if divisor >= _MAX_SPLIT_DIVISOR or heaviest <= 4 / 3 * lower_bound(pieces, num_fragments):
                break
        if fair / divisor < 1:  # every tensor is already cut into single rows
            break
        # Past a third of the fair share we only cut further to get one piece per fragment.
        divisor = divisor + 1 if divisor < _MAX_SPLIT_DIVISOR else divisor * 2
    if best is None:
        most = max_fragments(params)
        raise InvalidArgument(
            f"the model cannot be cut into {num_fragments} fragments: a fragment holds whole rows (dim 0) of tensors "
            f"and the model's {len(specs)} tensors have {most} rows in all; give --fragments {most} or fewer"
        )
    order = {name: i for i, (name, *_) in enumerate(specs)}
    fragments = tuple(
        Fragment(i, tuple(sorted(b, key=lambda p: (order[p.tensor], p.row_start)))) for i, b in enumerate(best)
    )
    return FragmentPlan(fragments, _hash(fragments))


def _hash(fragments: Sequence[Fragment]) -> str:
    canonical = [
        [[p.tensor, p.row_start, p.row_stop, list(p.shape), p.embedding, p.tensor_rows] + ([True] if p.buffer else [])
         for p in f.pieces]
        for f in fragments
    ]
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
