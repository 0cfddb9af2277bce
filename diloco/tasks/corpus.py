"""A stream of training bytes: by default the Python standard library's own source files,
found from the interpreter's paths, so every machine has real text without a download.

Files are assigned to a held-out eval split (every 20th by a stable hash) or to one of
``data_shards`` disjoint training shards (by the same hash), so learners read disjoint
data and evaluate on the same bytes. A batch is ``batch_size`` windows of context + 1
bytes at offsets drawn from a generator seeded by (seed, shard, step): the data cursor is
just the step number, which makes a learner's data order part of its small state.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.errors import InvalidArgument, NotFound

_EVAL_EVERY = 20
_TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".json", ".c", ".h", ".html", ".csv", ".toml", ".yaml", ".yml"}


_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files outside its tests, site-packages and caches
    (one directory walk that never enters those: it is on every learner's start)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def corpus_files(data: str | None) -> list[Path]:
    """The files of ``--data PATH`` (a text file or a directory of them) or the stdlib."""
    if data is None:
        files = stdlib_sources()
    else:
        path = Path(data)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES)
        else:
            raise NotFound(f"no data at {data}")
    if not files:
        raise NotFound(f"no text files found in {data or 'the Python standard library'}")
    return files


def _bucket(path: Path, buckets: int) -> int:
    return int.from_bytes(hashlib.sha256(path.name.encode() + str(path.stat().st_size).encode()).digest()[:8], "little") % buckets


def _load(files: list[Path]) -> torch.Tensor:
    chunks = [f.read_bytes() for f in files]
    blob = b"\n".join(chunks)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


@dataclass
class Split:
    tokens: torch.Tensor  # uint8 bytes

    def batch(self, step: int, batch_size: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = context + 1
        if self.tokens.numel() <= span:
            raise InvalidArgument(f"corpus split of {self.tokens.numel()} bytes is too small for context {context}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - span, (batch_size,), generator=g)
        rows = torch.stack([self.tokens[s : s + span] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


@dataclass
class Corpus:
    train: Split
    eval: Split


def load_corpus(data: str | None, shard: int, shards: int) -> Corpus:
    """This learner's training shard and the shared eval split. With a single file the
    split is by position instead: the last 5% is eval, the rest is cut into shards."""
    files = corpus_files(data)
    if len(files) == 1:
        tokens = _load(files)
        n = tokens.numel()
        cut = n - max(n // _EVAL_EVERY, 1)
        size = cut // shards
        return Corpus(Split(tokens[shard * size : (shard + 1) * size]), Split(tokens[cut:]))
    eval_files = [f for f in files if _bucket(f, _EVAL_EVERY) == 0]
    train_files = [f for f in files if _bucket(f, _EVAL_EVERY) != 0]
    mine = [f for i, f in enumerate(train_files) if i % shards == shard]
    if not mine or not eval_files:
        raise InvalidArgument(f"{len(files)} files are too few for {shards} data shards plus an eval split")
    return Corpus(Split(_load(mine)), Split(_load(eval_files)))
