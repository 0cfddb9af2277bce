"""Per-fragment sync bookkeeping of one learner: anchors, base versions, token and step
counters, quantization residuals, and which replies to apply when; and the encoding of a
push. Pure; the worker feeds it replies that the streamer thread produced and asks it
what to apply at each inner step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from diloco.codec import EncodedTensor, decode, encode
from diloco.fragments import Piece


@dataclass(frozen=True)
class Sent:
    """A push of the fragment waiting for its reply (at most one per fragment)."""

    step: int
    params: list[torch.Tensor] | None
    """The fragment's parameters when it was sent (host copies; kept for the rebase rule)."""
    tokens: int
    steps: int
    residual: list[torch.Tensor] | None = None
    """What quantizing this push left out (error feedback): the fragment's residual once
    the shard has taken the push."""


@dataclass
class FragmentSync:
    anchor: list[torch.Tensor]
    """The global fragment at ``base_version`` (fp32, host): deltas are taken against it."""
    base_version: int
    tokens: int = 0
    """Tokens and inner steps since this fragment was last received."""
    steps: int = 0
    sent: Sent | None = None
    residual: list[torch.Tensor] | None = None
    """Error feedback: what quantization left out of the pushes the shard has taken so
    far; the next push adds it to its delta, so no part of an update is lost for good."""


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
    failed: bool = False
    """No values: the push was dropped or failed (the fragment may be sent again), or it
    was the learner's final push."""


@dataclass
class SyncBook:
    fragments: dict[int, FragmentSync]
    overlap_steps: int
    waiting: list[Reply] = field(default_factory=list)
    applied: int = 0
    late: int = 0
    stale_dropped: int = 0
    deferred: int = 0

    def count_step(self, tokens: int) -> None:
        for f in self.fragments.values():
            f.tokens += tokens
            f.steps += 1

    def sending(self, fragment: int, step: int, params: list[torch.Tensor] | None) -> bool:
        """Record a send; False (send nothing) while the fragment's previous push awaits
        its reply: the next send carries both, as deltas are cumulative since the anchor,
        and no progress is counted twice."""
        f = self.fragments[fragment]
        if f.sent is not None:
            self.deferred += 1
            return False
        f.sent = Sent(step, params, f.tokens, f.steps)
        return True

    def quantized(self, fragment: int, residual: list[torch.Tensor]) -> None:
        """What quantizing the push just recorded left out; it becomes the fragment's
        residual when the shard takes the push (a failed push keeps the old one: its delta,
        still against the same anchor, is sent again whole)."""
        f = self.fragments[fragment]
        assert f.sent is not None, "quantized() follows a sending() that returned True"
        f.sent = replace(f.sent, residual=residual)

    def receive(self, reply: Reply) -> None:
        if reply.failed:
            self._settle(reply)
            return
        self.waiting.append(reply)

    def _settle(self, reply: Reply) -> None:
        """The push ``reply`` answers is done with: the fragment may be sent again. A
        re-sync replaces the fragment with the shard's state: no residual carries over."""
        f = self.fragments[reply.fragment]
        if reply.sent_step < 0:
            f.sent, f.residual = None, None
        elif f.sent is not None and f.sent.step == reply.sent_step:
            if not reply.failed and f.sent.residual is not None:
                f.residual = f.sent.residual
            f.sent = None

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
                self._settle(reply)
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

    def rebase_from(self, reply: Reply) -> list[torch.Tensor] | None:
        """The parameters the reply's push was taken from, when the rebase rule can apply
        it (not to a re-sync, which replaces the fragment)."""
        sent = self.fragments[reply.fragment].sent
        if reply.sent_step >= 0 and sent is not None and sent.step == reply.sent_step and sent.params is not None:
            return sent.params
        return None

    def applied_reply(self, reply: Reply, rebased: bool = False) -> None:
        """The reply is in the parameters. Rebased, the progress made since the push stays
        and is still to be sent; otherwise it was overwritten."""
        f = self.fragments[reply.fragment]
        sent = f.sent
        f.anchor, f.base_version = reply.values, reply.version
        if rebased and sent is not None:
            f.tokens, f.steps = f.tokens - sent.tokens, f.steps - sent.steps
        else:
            f.tokens, f.steps = 0, 0
        self._settle(reply)
        self.applied += 1


@dataclass(frozen=True)
class Write:
    """A global fragment written into the model: rebased onto ``sent`` (the parameters its
    push was taken from) when given, else mixed with weight ``alpha`` on the parameters."""

    fragment: int
    values: list[torch.Tensor]
    sent: list[torch.Tensor] | None = None
    alpha: float = 0.0


def write_into(params: list[torch.Tensor], write: Write) -> None:
    if write.sent is not None:
        rebase_into(params, write.values, write.sent)
    else:
        merge_into(params, write.values, write.alpha)


def delta(anchor: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outer gradient: anchor - params (positive where training moved params down)."""
    return [a - p for a, p in zip(anchor, params)]


def encode_push(
    pieces: Sequence[Piece], params: list[torch.Tensor], anchor: list[torch.Tensor],
    residual: list[torch.Tensor] | None, codec: str, block_size: int, feedback: bool, kept: int = 0,
) -> tuple[list[EncodedTensor], list[torch.Tensor] | None]:
    """A push's tensors and, with ``feedback``, what their quantization left out (else
    None). A parameter travels as its
    delta against the anchor plus its ``residual`` (error feedback), in ``codec``; what the
    int4 encoding drops becomes the next residual (``SyncBook.quantized``), so the sum of
    the decoded pushes trails the sum of the deltas by one residual, never by more (a sparse
    encoding, ``kept`` values per block, drops more, and sends it as it grows). A
    buffer (running statistics) travels as its value, in fp32: the shard averages values
    (``diloco.syncer.core.shard._merge_buffer_values``); its residual is zero."""
    encoded, left_out = [], [] if feedback else None
    for i, (piece, value, d) in enumerate(zip(pieces, params, delta(anchor, params))):
        if piece.buffer:
            encoded.append(encode(piece.name, value, encoding="fp32"))
            if left_out is not None:
                left_out.append(torch.zeros_like(d))
            continue
        if residual is not None:
            d += residual[i]
        encoded.append(encode(piece.name, d, encoding=codec, block_size=block_size, kept=kept if codec == "sparse" else 0))
        if left_out is not None:
            left_out.append(d.sub_(decode(encoded[-1].spec, encoded[-1].payload).view_as(d)))
    return encoded, left_out


@torch.no_grad()
def rebase_into(params: list[torch.Tensor], values: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
    """params <- global + (params - sent): the new global fragment plus the progress made
    since the push was taken from ``sent``. Nothing a learner trained is overwritten."""
    for p, g, s in zip(params, values, sent):
        if p.dtype == torch.float32:
            # g + (p - s), not p + (g - s): with no progress since the push it is g, bit for bit.
            p.copy_(g.to(p.device) + (p - s.to(p.device)))
        else:  # bf16/fp16 parameters: the sum in fp32, rounded once
            p.copy_(g.to(p.device) + (p.float() - s.to(p.device)))


@torch.no_grad()
def merge_into(params: list[torch.Tensor], values: list[torch.Tensor], alpha: float) -> None:
    """params <- alpha*params + (1-alpha)*global, in place on the model's own tensors.
    alpha = 0 copies the global values exactly (bit-identical to the shard)."""
    for p, g in zip(params, values):
        if alpha == 0.0:
            p.copy_(g.to(p.device, p.dtype))
        elif p.dtype == torch.float32:
            p.mul_(alpha).add_(g.to(p.device), alpha=1.0 - alpha)
        else:  # bf16/fp16 parameters: the mix in fp32, rounded once
            p.copy_(p.float().mul_(alpha).add_(g.to(p.device), alpha=1.0 - alpha))
