"""What a shard remembers of each learner's anchor, for condensed replies
(``MergeConfig.downlink``): a shared float32 *base* per fragment (its values at a recent
version) and, per learner, the anchor's difference from that base in int8 blocks: 1 byte per
parameter and a float32 scale per ``BLOCK`` (1.008 bytes per parameter in all).

An exact float32 mirror cost 4 bytes per parameter per learner: at 64 learners, 20x the
fragment. An int8 residual is not exact: each time the shard stores one it rounds, and the
learner's real anchor (which adds exactly the int4 updates it is sent) drifts from the
shard's belief by the sum of those roundings. The shard accounts for it: ``drift_sq`` sums
their expected squared norms (that of the random walk they make), ``rounding_sq`` the
expected squared norm of the int4 rounding of the learner's last reply (what an exact
mirror's learner carries too); a learner whose drift outgrows that rounding gets the
fragment's full values next (exact: its drift is 0 again; ``drifted``).

A base serves every mirror stored against it. A round makes a fresh one (a copy of the
values) once the shard has answered as many condensed replies against the last as it holds
mirrors: every round when all learners push in each, once per cycle of the learners when
they take turns. Either way a learner's residual spans about what its reply did (the
values' movement since the base), so its int8 rounding is a fraction of the reply's int4
step (its drift peaked at 0.39-0.48 of one int4 rounding with 8 learners taking turns:
docs/results/scale/). The mirrors still on the base before
last then move to the newest (``rebase``), so a fragment holds at most two bases between
rounds (8 bytes per parameter, whatever the number of learners)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diloco.codec import sparse
from diloco.codec.int4 import SCALE_BYTES, native, num_blocks

BLOCK = 512
"""Parameters per int8 scale of a residual."""


@dataclass(frozen=True, eq=False)
class Base:
    """A fragment's values at ``version``, flat float32 per piece; shared, never written."""

    version: int
    values: tuple[np.ndarray, ...]


@dataclass(eq=False)
class Mirror:
    """A learner's anchor of a fragment at ``version``: ``base`` plus the int8 residual
    (``codes`` x ``scales``, per piece), up to the accounted drift."""

    version: int
    base: Base
    codes: list[np.ndarray]
    scales: list[np.ndarray]
    drift_sq: float = 0.0
    rounding_sq: float = 0.0
    """What int4 rounding of the last reply was expected to cost (a uniform error of half a
    step per value): the yardstick of the drift."""

    @property
    def drifted(self) -> bool:
        """Whether the drift's expected norm exceeds what int4 rounding of one reply costs."""
        return self.drift_sq > self.rounding_sq

    @property
    def nbytes(self) -> int:
        """The bytes this learner's mirror holds (the base is shared)."""
        return sum(c.nbytes + s.nbytes for c, s in zip(self.codes, self.scales))

    def believed(self) -> list[np.ndarray]:
        """The anchor as the shard believes it, flat float32 per piece (for checks)."""
        return [self.anchor_into(i, np.empty(v.size, dtype=np.float32)) for i, v in enumerate(self.base.values)]

    def anchor_into(self, index: int, out: np.ndarray) -> np.ndarray:
        """Piece ``index`` of the anchor as the shard believes it, into ``out`` (float32, flat)."""
        kernel = native()
        if kernel is not None:
            kernel.mirror_load(self.codes[index], self.scales[index], self.base.values[index], out, out.size, BLOCK)
            return out
        dequantize8(self.codes[index], self.scales[index], out)
        np.add(out, self.base.values[index], out=out)
        return out


def base_of(version: int, values: Sequence[np.ndarray], copy: bool) -> Base:
    """A base of ``values`` (flattened; copied when ``copy``: a fragment's own values move on)."""
    flat = tuple(np.array(v, dtype=np.float32, copy=True).reshape(-1) if copy else np.asarray(v).reshape(-1)
                 for v in values)
    return Base(version, flat)


def exact(base: Base) -> Mirror:
    """The mirror of a learner whose anchor is ``base``'s values (a bootstrap, a full reply)."""
    return Mirror(base.version, base,
                  [np.zeros(v.size, dtype=np.int8) for v in base.values],
                  [np.zeros(num_blocks(v.size, BLOCK), dtype=np.float32) for v in base.values])


def store(mirror: Mirror, index: int, anchor: np.ndarray, base: Base) -> None:
    """Piece ``index`` of the learner's ``anchor`` (float32, flat; may be overwritten)
    stored against ``base``; its rounding goes to the drift. One pass in the C kernel
    (``_int4.c``: ``mirror_store``), the same float32 operations here without it."""
    kernel = native()
    if kernel is not None:
        mirror.drift_sq += kernel.mirror_store(anchor, base.values[index], mirror.codes[index], mirror.scales[index],
                                               anchor.size, BLOCK)
        return
    np.subtract(anchor, base.values[index], out=anchor)
    mirror.drift_sq += quantize8(anchor, mirror.codes[index], mirror.scales[index])


def rebase(mirror: Mirror, base: Base, scratch: np.ndarray) -> None:
    """Move ``mirror`` onto ``base`` (its old base can then be freed)."""
    if mirror.base is base:
        return
    for index, values in enumerate(base.values):
        store(mirror, index, mirror.anchor_into(index, scratch[: values.size]), base)
    mirror.base = base


def condense_sparse(mirror: Mirror, index: int, goal: np.ndarray, base: Base, scratch: np.ndarray, *,
                    block_size: int, kept: int, scale_dtype: str, name: str) -> tuple[bytes, float]:
    """Piece ``index`` of a sparse reply taking the learner's anchor (as ``mirror`` holds it)
    to ``goal`` (flat float32): its payload and the squared norm of what it left out, the
    mirror advanced by exactly what the reply decodes to and stored against ``base`` (its
    rounding added to the drift; on an error, partly). One pass in the C kernel (``mirror_condense``) when a
    mirror block holds whole sparse blocks; else the three passes it fuses, which are its
    reference: ``anchor_into`` (into ``scratch``, float32, at least the piece's size),
    ``sparse.condense`` and ``store``."""
    kernel = native()
    if kernel is None or BLOCK % block_size:
        values = mirror.anchor_into(index, scratch[: goal.size])
        payload, left_sq = sparse.condense(goal, values, block_size, kept, scale_dtype, name)
        store(mirror, index, values, base)
        return payload, left_sq
    status, bad, payload, left_sq, drift = kernel.mirror_condense(
        mirror.codes[index], mirror.scales[index], mirror.base.values[index], base.values[index], goal, goal.size,
        BLOCK, block_size, kept, SCALE_BYTES[scale_dtype])
    if status:
        sparse.refuse_update(status, bad, name)
    mirror.drift_sq += drift
    return payload, left_sq


def int4_rounding_sq(scales: np.ndarray, numel: int, block_size: int) -> float:
    """The expected squared norm of the int4 rounding of ``numel`` values quantized with
    ``scales`` (one per block of ``block_size``): each value off by a uniform error within
    half a step (the scale), so step**2 / 12 per value."""
    steps = scales.astype(np.float64)
    total = float(np.dot(steps, steps)) * block_size
    if numel % block_size:  # the last block is short
        total -= float(steps[-1] ** 2) * (block_size - numel % block_size)
    return total / 12


def _blocks(x: np.ndarray, size: int = BLOCK) -> list[np.ndarray]:
    """2-D views of flat ``x``: its whole blocks, then the rest as a block of its own."""
    whole = x.size // size * size
    views = [x[:whole].reshape(-1, size)] if whole else []
    if whole < x.size:
        views.append(x[whole:].reshape(1, -1))
    return views


def quantize8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> float:
    """``x`` (float32, flat) into int8 ``codes`` (symmetric, round to nearest) and a float32
    scale per block; returns the expected squared norm of what rounding lost (a uniform
    error within half a step per value: scale**2 / 12; the tests check it against the
    real one). Five passes over ``x``: it runs for every condensed reply."""
    lost, first = 0.0, 0
    for view, code in zip(_blocks(x), _blocks(codes)):
        scale = (np.abs(view).max(axis=1) / np.float32(127)).astype(np.float32)
        inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
        # |x| * 127 / absmax rounds to at most 127: no clipping needed.
        q = np.multiply(view, inverse[:, None])
        np.rint(q, out=q)
        code[...] = q
        lost += float(np.dot(scale.astype(np.float64), scale)) * view.shape[1] / 12
        scales[first : first + len(scale)] = scale
        first += len(scale)
    return lost


def dequantize8(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> np.ndarray:
    first = 0
    for code, view in zip(_blocks(codes), _blocks(out)):
        np.multiply(code, scales[first : first + len(code), None], out=view)
        first += len(code)
    return out
