"""Sparse 2-bit deltas (``encoding="sparse"``): of each block of ``block_size`` values,
the ``kept`` largest in magnitude, each as a 2-bit code, with one scale per block.

Payload, in this order:

- **indices**: for each block, the in-block positions of its kept values, one byte each,
  strictly ascending (a block of ``r < kept`` values, the tensor's last, keeps all ``r``);
  none at all when ``kept == block_size``: every value is kept, a dense 2-bit encoding;
- **codes**: the kept values' codes c in 0..3, four to a byte, the first in the low bits;
  the value is ``(c - 1.5) * scale``: the levels ±0.5 and ±1.5 scales (no zero: a kept
  value is one of its block's largest);
- **scales**: one per block, float16 (or float32), rounded *up* so that 1.5 scales
  reach the block's largest kept magnitude.

Which values are kept is defined exactly: the ``kept`` largest |x| of the block, ties to
the lower index. Everything else is dropped; the sender's error feedback (a learner's
residual, a shard's mirror) sends it later. With blocks of 128 and 16 kept, a block costs
16 + 4 + 2 = 22 bytes against int4's 66: 1.375 bits per value; keeping all 128 (dense),
32 + 2 = 34 bytes, 2.125 bits per value.

The C kernel (``_int4.c``: ``sparse_quantize``, one pass per block in L1, threaded;
``sparse_apply``) and the numpy reference here use the same correctly rounded float32
operations (one true division, one add and a floor to encode; one subtract and one
multiply to decode), so both write the same bytes and every process decodes them to the
same values (tests check it bit for bit); nothing here imports torch (a shard never
loads it)."""

from __future__ import annotations

import numpy as np

from diloco.codec.int4 import SCALE_BYTES, native
from diloco.codec.threads import math_threads
from diloco.errors import CodecError

MAX_BLOCK = 256
"""In-block indices are one byte each."""
LEVEL = np.float32(1.5)
"""The largest code's magnitude in scales: codes 0..3 stand for -1.5, -0.5, 0.5, 1.5."""


def check_params(block_size: int, kept: int, scale_dtype: str, name: str) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK:
        raise CodecError(f"tensor {name!r}: sparse block size must be an integer in [2, {MAX_BLOCK}], got {block_size!r}")
    if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= block_size:
        raise CodecError(f"tensor {name!r}: values kept per block must be in [1, {block_size}], got {kept!r}")
    if scale_dtype not in SCALE_BYTES:
        raise CodecError(f"tensor {name!r}: scale dtype must be one of {sorted(SCALE_BYTES)}, got {scale_dtype!r}")


def kept_for(density: float, block_size: int) -> int:
    """Values kept per block for a density (a fraction of each block, (0, 1])."""
    return max(1, min(block_size, round(density * block_size)))


def layout(numel: int, block_size: int, kept: int) -> tuple[int, int, int]:
    """(full blocks, values of the last partial block (0: none), values kept in all)."""
    full, rest = divmod(numel, block_size)
    return full, rest, full * kept + min(kept, rest)


def index_bytes(numel: int, block_size: int, kept: int) -> int:
    """One byte per kept value, none when every value is kept."""
    return 0 if kept >= block_size else layout(numel, block_size, kept)[2]


def nbytes(numel: int, block_size: int, kept: int, scale_dtype: str) -> int:
    full, rest, total = layout(numel, block_size, kept)
    return index_bytes(numel, block_size, kept) + (total + 3) // 4 + (full + (rest > 0)) * SCALE_BYTES[scale_dtype]


def scales_offset(numel: int, block_size: int, kept: int) -> int:
    total = layout(numel, block_size, kept)[2]
    return index_bytes(numel, block_size, kept) + (total + 3) // 4


def _sections(view: memoryview, numel: int, block_size: int, kept: int, scale_dtype: str):
    full, rest, total = layout(numel, block_size, kept)
    index_end = index_bytes(numel, block_size, kept)
    code_end = index_end + (total + 3) // 4
    if kept >= block_size:  # dense: every value, in order
        indices = np.tile(np.arange(block_size, dtype=np.uint8), full + 1)[:total] if total else np.zeros(0, np.uint8)
    else:
        indices = np.frombuffer(view[:index_end], dtype=np.uint8)
    packed = np.frombuffer(view[index_end:code_end], dtype=np.uint8)
    scales = np.frombuffer(view[code_end:], dtype="<f2" if scale_dtype == "float16" else "<f4")
    return indices, packed, scales


def _round_up_scales(amax: np.ndarray, scale_dtype: str, name: str) -> np.ndarray:
    """The smallest scale of ``scale_dtype`` with 1.5 x scale >= amax (float32 values)."""
    t = amax / LEVEL
    if scale_dtype == "float32":
        return np.where(t * LEVEL < amax, np.nextafter(t, np.float32(np.inf)), t).astype(np.float32)
    with np.errstate(over="ignore"):
        half = t.astype(np.float16)
    bits = half.view(np.uint16) + (half.astype(np.float32) < t)
    s = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    bits = bits + ((s * LEVEL < amax) & (bits < 0x7C00))
    scales = bits.astype(np.uint16).view(np.float16)
    if not np.isfinite(scales).all():
        block = int(np.flatnonzero(~np.isfinite(scales))[0])
        raise CodecError(f"tensor {name!r}: block {block} has |x| up to {float(amax[block]):.6g}, so its scale "
                         f"overflows float16 (max 65504); use scale_dtype='float32'")
    return scales


def _select(blocks: np.ndarray, kept: int) -> np.ndarray:
    """In-block indices of each row's ``kept`` largest |x|, ties to the lower index, ascending."""
    order = np.argsort(-np.abs(blocks), axis=1, kind="stable")[:, :kept]
    return np.sort(order, axis=1)


def quantize(flat: np.ndarray, block_size: int, kept: int, scale_dtype: str, name: str) -> bytes:
    """The payload of ``flat`` (float32, finite)."""
    kernel = native()
    if kernel is None:
        return quantize_reference(flat, block_size, kept, scale_dtype, name)
    status, bad, payload = kernel.sparse_quantize(flat, flat.size, block_size, kept, SCALE_BYTES[scale_dtype],
                                                  math_threads())
    if status == 1:
        raise CodecError(f"tensor {name!r}: block {bad} holds a non-finite value")
    if status == 2:
        block = flat[bad * block_size: (bad + 1) * block_size]
        raise CodecError(f"tensor {name!r}: block {bad} has |x| up to {float(np.abs(block).max()):.6g}, so its scale "
                         f"overflows float16 (max 65504); use scale_dtype='float32'")
    return payload


def quantize_reference(flat: np.ndarray, block_size: int, kept: int, scale_dtype: str, name: str) -> bytes:
    """``quantize`` in numpy, the reference the C kernel is tested against."""
    full, rest, total = layout(flat.size, block_size, kept)
    parts = [(flat[: full * block_size].reshape(full, block_size), kept)]
    if rest:
        parts.append((flat[full * block_size :].reshape(1, rest), min(kept, rest)))
    indices, values, amax = [], [], []
    for blocks, k in parts:
        chosen = _select(blocks, k)
        v = np.take_along_axis(blocks, chosen, axis=1)
        indices.append(chosen.reshape(-1))
        values.append(v)
        amax.append(np.abs(v).max(axis=1) if v.size else np.zeros(0, np.float32))
    scales = _round_up_scales(np.concatenate(amax).astype(np.float32), scale_dtype, name)
    wide = scales.astype(np.float32)
    codes = []
    for v, s in zip(values, np.split(wide, [full])):
        safe = np.where(s > 0, s, np.float32(1))[:, None]
        codes.append(np.clip(np.floor(v / safe + np.float32(2)), 0, 3).astype(np.uint8).reshape(-1))
    code = np.concatenate(codes)
    code = np.concatenate([code, np.zeros(-total % 4, np.uint8)]).reshape(-1, 4)
    packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
    little = scales.astype(np.dtype(scale_dtype).newbyteorder("<"))
    listed = np.concatenate(indices).astype(np.uint8).tobytes() if kept < block_size else b""
    return b"".join((listed, packed.astype(np.uint8).tobytes(), little.tobytes()))


def condense(goal: np.ndarray, anchor: np.ndarray, block_size: int, kept: int, scale_dtype: str,
             name: str) -> tuple[bytes, float]:
    """An update from ``anchor`` to ``goal`` (float32, flat, the same size): the payload of
    ``goal - anchor``, ``anchor`` advanced in place by exactly what the payload decodes to
    (a float32 add, as the receiver applies it; +0 where nothing was kept), and the squared
    norm of what the payload left out (float64). One pass in the C kernel
    (``sparse_condense``); on an error, ``anchor`` may be partly advanced."""
    kernel = native()
    if kernel is None:
        return condense_reference(goal, anchor, block_size, kept, scale_dtype, name)
    status, bad, payload, left_sq = kernel.sparse_condense(goal, anchor, goal.size, block_size, kept,
                                                           SCALE_BYTES[scale_dtype])
    if status:
        refuse_update(status, bad, name)
    return payload, left_sq


def refuse_update(status: int, block: int, name: str) -> None:
    """The error for a C kernel's status on an update (1: non-finite, 2: scale overflow)."""
    if status == 1:
        raise CodecError(f"tensor {name!r}: block {block} of the update holds a non-finite value")
    raise CodecError(f"tensor {name!r}: block {block} of the update has a value whose scale overflows float16 "
                     f"(max 65504); use scale_dtype='float32'")


def condense_reference(goal: np.ndarray, anchor: np.ndarray, block_size: int, kept: int, scale_dtype: str,
                       name: str) -> tuple[bytes, float]:
    """``condense`` in numpy, the reference the C kernel is tested against."""
    update = np.subtract(goal, anchor, dtype=np.float32)
    if not np.isfinite(update).all():
        refuse_update(1, int(np.flatnonzero(~np.isfinite(update))[0]) // block_size, name)
    payload = quantize_reference(update, block_size, kept, scale_dtype, name)
    positions, values = positions_values(memoryview(payload), update.size, block_size, kept, scale_dtype)
    sent = np.zeros_like(update)
    sent[positions] = values
    left = update.astype(np.float64) - sent
    np.add(anchor, sent, out=anchor)
    return payload, float(np.dot(left, left))


def check_indices(view: memoryview, numel: int, block_size: int, kept: int, scale_dtype: str, name: str) -> None:
    """Each block's indices point inside the block and strictly ascend (no repeats)."""
    if kept >= block_size:
        return  # none sent
    full, rest, _ = layout(numel, block_size, kept)
    indices, _, _ = _sections(view, numel, block_size, kept, scale_dtype)
    parts = [(indices[: full * kept].reshape(full, kept), block_size, 0)]
    if rest:
        parts.append((indices[full * kept :].reshape(1, -1), rest, full))
    for rows, size, first in parts:
        bad = (rows >= size).any(axis=1)
        if rows.shape[1] > 1:
            bad |= (np.diff(rows.astype(np.int16), axis=1) <= 0).any(axis=1)
        if bad.any():
            block = first + int(np.flatnonzero(bad)[0])
            raise CodecError(f"tensor {name!r}: block {block}'s indices {rows[block - first].tolist()} must ascend "
                             f"strictly and stay below {size}")


def positions_values(view: memoryview, numel: int, block_size: int, kept: int,
                     scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat positions, float32 values) of the kept values. The payload must have passed
    ``check_indices``."""
    full, rest, total = layout(numel, block_size, kept)
    indices, packed, scales = _sections(view, numel, block_size, kept, scale_dtype)
    per_block = np.full(full + (rest > 0), kept, dtype=np.int64)
    if rest:
        per_block[-1] = min(kept, rest)
    starts = np.repeat(np.arange(per_block.size, dtype=np.int64) * block_size, per_block)
    codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:total]
    steps = codes.astype(np.float32) - LEVEL
    return starts + indices, steps * np.repeat(scales.astype(np.float32), per_block)


def decode_into(view: memoryview, numel: int, block_size: int, kept: int, scale_dtype: str,
                out: np.ndarray) -> np.ndarray:
    """The dense float32 values into ``out`` (flat, ``numel``): zero where nothing was kept."""
    kernel = native()
    if kernel is not None:
        kernel.sparse_apply(view, numel, block_size, kept, SCALE_BYTES[scale_dtype], out, 1.0, 0)
        return out
    positions, values = positions_values(view, numel, block_size, kept, scale_dtype)
    out.fill(0)
    out[positions] = values
    return out


def axpy(view: memoryview, alpha: float, numel: int, block_size: int, kept: int, scale_dtype: str,
         out: np.ndarray) -> None:
    """``out += alpha * decoded``, touching only the kept positions."""
    kernel = native()
    if kernel is not None:
        kernel.sparse_apply(view, numel, block_size, kept, SCALE_BYTES[scale_dtype], out, alpha, 1)
        return
    positions, values = positions_values(view, numel, block_size, kept, scale_dtype)
    out[positions] += np.float32(alpha) * values


def sumsq(view: memoryview, numel: int, block_size: int, kept: int, scale_dtype: str) -> float:
    kernel = native()
    if kernel is not None:
        return kernel.sparse_apply(view, numel, block_size, kept, SCALE_BYTES[scale_dtype], None, 0.0, 2)
    _, values = positions_values(view, numel, block_size, kept, scale_dtype)
    wide = values.astype(np.float64)
    return float(np.dot(wide, wide))
