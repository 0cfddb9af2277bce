"""Vector clocks: the causal order behind the event tape, snapshot cuts and staleness.

Every process keeps one (learners ``L<id>``, shards ``S<m>``, the coordinator ``C``),
ticks its own entry on each send and merges on each receive. Clocks are immutable
values so they can be shared between the event loop and worker threads freely.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from diloco.errors import InvalidArgument


class Order(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


@dataclass(frozen=True)
class VectorClock:
    """A map process -> counter; absent entries are 0 (so {"a": 0} == {})."""

    entries: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean = {}
        for process, count in self.entries.items():
            if not isinstance(process, str) or not process:
                raise InvalidArgument(f"vector clock process names must be non-empty strings, got {process!r}")
            if not isinstance(count, int) or count < 0:
                raise InvalidArgument(f"vector clock entry {process!r} must be a non-negative int, got {count!r}")
            if count:
                clean[process] = count
        object.__setattr__(self, "entries", dict(sorted(clean.items())))

    def __getitem__(self, process: str) -> int:
        return self.entries.get(process, 0)

    def __hash__(self) -> int:
        return hash(tuple(self.entries.items()))

    def tick(self, process: str) -> VectorClock:
        """The clock after one local event (a send) of ``process``."""
        return VectorClock({**self.entries, process: self[process] + 1})

    def merge(self, other: VectorClock) -> VectorClock:
        """Element-wise maximum: what a receiver knows after a message arrives."""
        keys = self.entries.keys() | other.entries.keys()
        return VectorClock({k: max(self[k], other[k]) for k in keys})

    def receive(self, process: str, other: VectorClock, known: Collection[str] | None = None) -> VectorClock:
        """Merge an incoming clock and tick the receiver, as on every RPC receipt. With
        ``known`` (the ids the receiver's run issued), the result keeps only those
        processes and the receiver: names a sender made up cannot grow it."""
        # One pass and one clock built (not merge, tick and restrict in turn): a coordinator
        # of hundreds of learners does this on every heartbeat, over every learner's entry.
        entries = dict(self.entries)
        for k, v in other.entries.items():
            if v > entries.get(k, 0):
                entries[k] = v
        entries[process] = entries.get(process, 0) + 1
        if known is not None:
            entries = {k: v for k, v in entries.items() if k in known or k == process}
        return VectorClock(entries)

    def restricted_to(self, known: Collection[str], *also: str) -> VectorClock:
        """The entries of the processes in ``known`` (or ``also``) only."""
        return VectorClock({k: v for k, v in self.entries.items() if k in known or k in also})

    def compare(self, other: VectorClock) -> Order:
        keys = self.entries.keys() | other.entries.keys()
        less = any(self[k] < other[k] for k in keys)
        greater = any(self[k] > other[k] for k in keys)
        if less and greater:
            return Order.CONCURRENT
        if less:
            return Order.BEFORE
        if greater:
            return Order.AFTER
        return Order.EQUAL

    def happened_before(self, other: VectorClock) -> bool:
        return self.compare(other) is Order.BEFORE

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}:{v}" for k, v in self.entries.items()) + "}"
