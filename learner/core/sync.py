"""Per-fragment sync bookkeeping of one learner: anchors, base versions, token and step
counters, and which replies to apply when. Pure; the worker feeds it replies that the
streamer thread produced and asks it what to apply at each inner step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FragmentSync:
    anchor: list[torch.Tensor]
    """The global fragment at ``base_version`` (fp32, host): deltas are taken against it."""
    base_version: int
    tokens: int = 0
    """Tokens and inner steps since this fragment was last received."""
    steps: int = 0


@dataclass(frozen=True)
class Reply:
    """A new global fragment, decoded by the streamer thread."""

    fragment: int
    version: int
    values: list[torch.Tensor]
    sent_step: int
    """Inner step the push was sent at (-1 for a re-sync after a shard came back)."""
    staleness: int
    """Versions the global moved beyond the push's base, besides the push's own round."""


@dataclass
class SyncBook:
    fragments: dict[int, FragmentSync]
    overlap_steps: int
    waiting: list[Reply] = field(default_factory=list)
    applied: int = 0
    late: int = 0
    stale_dropped: int = 0

    def count_step(self, tokens: int) -> None:
        for f in self.fragments.values():
            f.tokens += tokens
            f.steps += 1

    def receive(self, reply: Reply) -> None:
        self.waiting.append(reply)

    def due(self, step: int) -> list[Reply]:
        """Replies to apply before inner step ``step``: each at its send step + tau, or as
        soon as it arrives after that (counted late). Only the newest per fragment, and
        never one older than what the fragment already holds."""
        ready, keep = {}, []
        resyncs = {r.fragment: r for r in self.waiting if r.sent_step < 0}
        for reply in self.waiting:
            if reply.sent_step < 0:
                continue
            if reply.fragment in resyncs:
                # The shard came back: answers to pushes sent before are about a state
                # it no longer has (a re-sync arrives after every push it supersedes).
                self.stale_dropped += 1
                continue
            if step < reply.sent_step + self.overlap_steps:
                keep.append(reply)
                continue
            if reply.version <= self.fragments[reply.fragment].base_version:
                self.stale_dropped += 1
                continue
            best = ready.get(reply.fragment)
            if best is None or reply.version > best.version:
                if best is not None:
                    self.stale_dropped += 1
                ready[reply.fragment] = reply
            else:
                self.stale_dropped += 1
        self.waiting = keep
        # A re-sync (the shard restarted, perhaps from an older state) applies whatever its
        # version: it is the shard's state now.
        ready.update(resyncs)
        for reply in ready.values():
            if reply.sent_step >= 0 and step > reply.sent_step + self.overlap_steps:
                self.late += 1
        return sorted(ready.values(), key=lambda r: r.fragment)

    def applied_reply(self, reply: Reply) -> None:
        f = self.fragments[reply.fragment]
        f.anchor, f.base_version, f.tokens, f.steps = reply.values, reply.version, 0, 0
        self.applied += 1


def delta(anchor: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outer gradient: anchor - params (positive where training moved params down)."""
    return [a - p for a, p in zip(anchor, params)]


@torch.no_grad()
def merge_into(params: list[torch.Tensor], values: list[torch.Tensor], alpha: float) -> None:
    """params <- alpha*params + (1-alpha)*global, in place on the model's own tensors.
    alpha = 0 copies the global values exactly (bit-identical to the shard)."""
    for p, g in zip(params, values):
        g = g.to(p.device, p.dtype)
        if alpha == 0.0:
            p.copy_(g)
        else:
            p.mul_(alpha).add_(g, alpha=1.0 - alpha)
