"""Types that cross the wire between services, in their domain form (the protos'
converters are in ``diloco.convert``): what a learner's push says about itself."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.clock import VectorClock
from diloco.codec import TensorSpec

MAX_VERSION = 1 << 53
"""Above any version a run issues (2**53 rounds); a version at or past it is hostile: its
successor would not fit the wire's uint64 or a float in a tape or JSON reader."""


@dataclass(frozen=True)
class PushMeta:
    """A push header, validated before any payload byte is accepted."""

    learner_id: str
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    step_time_s: float
    clock: VectorClock
    specs: tuple[TensorSpec, ...]
    snapshot_epoch: int = 0
    final: bool = False
    """The learner's last push of the fragment (it is leaving): its reply carries no values."""

    @property
    def seq(self) -> int:
        """The learner's own clock entry: with (learner, fragment) it identifies the push."""
        return self.clock[self.learner_id]

    @property
    def payload_bytes(self) -> int:
        return sum(s.byte_length for s in self.specs)
