"""int4 symmetric block quantization: the fused C kernel, its torch reference, and the
dispatch between them.

The format, per block of ``block_size`` consecutive elements (the last may be partial):
``scale`` is the smallest value of the scale dtype such that ``x / scale``, computed in
float32, lies in [-7, 7] for every element (for float16 that means rounding ``absmax / 7``
*up*, so the bound survives the rounding of the scale); ``q = round_half_even(x / scale)``
or, with a generator, ``q = min(floor(x / scale + u), 7)`` with ``u = torch.rand(n)``; an
all-zero block has scale 0 and q = 0. Two values per byte: element 2i in the low nibble,
2i+1 in the high one, two's complement; for odd n the last high nibble is 0.

Dequantization is ``float32(q) * float32(scale)``, one IEEE multiply, on every path: the
learner and the shard must reach bit-identical parameters from the same bytes, whichever
of them has the C kernel. The tests hold the kernel to the reference bit for bit.

The kernel paths take numpy arrays and never import torch, so a syncer shard runs without
it; the torch-facing API (``quantize_int4``, ``dequantize_int4``, decoding for learners)
and the reference implementation import torch when called.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from typing import TYPE_CHECKING

import numpy as np

from diloco.codec.threads import math_threads
from diloco.config import BLOCK_SIZE
from diloco.errors import CodecError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

try:
    from diloco.codec import _int4 as _kernel

    _KERNEL_MISSING_REASON = ""
except ImportError as exc:  # not built: no compiler at install time
    _kernel = None
    _KERNEL_MISSING_REASON = str(exc)
if sys.byteorder != "little":
    # The kernel writes scales in native order and the wire format is little-endian.
    _kernel = None
    _KERNEL_MISSING_REASON = "big-endian host"

SCALE_DTYPES = ("float16", "float32")
SCALE_BYTES = {"float16": 2, "float32": 4}
_STATUS_NONFINITE = 1
_STATUS_SCALE_OVERFLOW = 2
QMAX = 7


def kernel() -> str:
    """Which implementation runs: "c" (the fused extension) or "torch" (the reference)."""
    return "c" if _kernel is not None else "torch"


@functools.cache
def _warn_fallback() -> None:
    # Once per process: a silent slowdown of this size would be mistaken for a slow network.
    logger.warning(
        "diloco.codec._int4 is unavailable (%s); the int4 codec falls back to torch ops, "
        "about 50x slower (build the extension: pip install -e . with a C compiler)",
        _KERNEL_MISSING_REASON or "not loaded",
    )


def native():
    """The C kernel (``_int4.c``) for a caller outside the codec that runs its own fused
    pass over int4 blocks (the shard's outer step, ``diloco.syncer.core.outer``), or None when it
    is unavailable: the caller then runs the same math in torch ops."""
    return _kernel if _use_kernel() else None


def _use_kernel() -> bool:
    if _kernel is None:
        _warn_fallback()
        return False
    return True


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_nbytes(numel: int) -> int:
    return (numel + 1) // 2


def int4_nbytes(numel: int, block_size: int, scale_dtype: str) -> int:
    """Payload bytes of one int4 tensor: packed nibbles, then one scale per block."""
    return packed_nbytes(numel) + num_blocks(numel, block_size) * SCALE_BYTES[scale_dtype]


def _describe(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "tensor"


def check_params(block_size: int, scale_dtype: str, name: str | None = None) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise CodecError(f"{_describe(name)}: block size must be a positive integer, got {block_size!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise CodecError(
            f"{_describe(name)}: scale dtype must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}"
        )


def as_numpy(x) -> np.ndarray:
    """A numpy view of a numpy array or a CPU torch tensor (no copy)."""
    return x if isinstance(x, np.ndarray) else x.numpy()


def flat_float32(x, name: str | None = None) -> np.ndarray:
    """A contiguous 1-D float32 numpy view or copy of a torch tensor (parameters may be
    bf16 or on an accelerator) or a numpy array; the wire is float32."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise CodecError(f"{_describe(name)}: expected a floating point array, got {x.dtype}")
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if not x.is_floating_point():
        raise CodecError(f"{_describe(name)}: expected a floating point tensor, got {x.dtype}")
    import torch

    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1).numpy()


def raise_if_nonfinite(x: np.ndarray, name: str | None) -> None:
    """Names the first offending element: a NaN in an outer gradient means training
    diverged, and the index tells the user where to look."""
    finite = np.isfinite(x)
    if not finite.all():
        index = int(np.argmin(finite))
        raise CodecError(
            f"{_describe(name)}: element {index} is {float(x[index])}; only finite values can be encoded"
        )


def _raise_for_status(
    status: int, bad_block: int, x: np.ndarray, block_size: int, scale_dtype: str, name: str | None
) -> None:
    if status == _STATUS_NONFINITE:
        raise_if_nonfinite(x, name)
        raise CodecError(f"{_describe(name)}: block {bad_block} holds a non-finite value")
    if status == _STATUS_SCALE_OVERFLOW:
        block = x[bad_block * block_size : (bad_block + 1) * block_size]
        absmax = float(np.abs(block).max())
        raise CodecError(
            f"{_describe(name)}: block {bad_block} has |x| up to {absmax:.6g}, so its scale "
            f"{absmax / QMAX:.6g} overflows {scale_dtype} (max 65504); use scale_dtype='float32'"
        )
    raise CodecError(f"{_describe(name)}: int4 kernel failed with status {status}")


def empty_tensor(numel: int, dtype: str):
    """An uninitialised CPU torch tensor backed by numpy's allocator.

    numpy asks Linux for transparent huge pages on large arrays (madvise) and torch's
    allocator does not: first-touching a fresh 64 MiB torch tensor costs ~40 ms of page
    faults, more than dequantizing into it; from numpy it is ~4x cheaper.
    """
    import torch

    return torch.from_numpy(np.empty(numel, dtype=dtype))


def _uniforms(numel: int, generator) -> np.ndarray | None:
    if generator is None:
        return None
    import torch

    # Same stream as torch.rand(numel, generator=generator).
    return torch.rand(numel, generator=generator, dtype=torch.float32, out=empty_tensor(numel, "float32")).numpy()


# ---------------------------------------------------------------------------------------
# Public API


def quantize_int4(
    x: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    scale_dtype: str = "float16",
    generator: torch.Generator | None = None,
    *,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (flattened) to (packed uint8 [ceil(n/2)], scales [ceil(n/block_size)]).

    Deterministic round-to-nearest-even unless ``generator`` is given, then stochastic
    rounding from ``torch.rand(n, generator=generator)``, so a seeded run is replayable.
    Raises CodecError on NaN/Inf or a scale that overflows float16.
    """
    check_params(block_size, scale_dtype, name)
    flat = flat_float32(x, name)
    numel = flat.size
    u = _uniforms(numel, generator)
    if not _use_kernel():
        return quantize_int4_reference(flat, block_size, scale_dtype, u, name=name)
    packed = empty_tensor(packed_nbytes(numel), "uint8")
    scales = empty_tensor(num_blocks(numel, block_size), scale_dtype)
    status, bad_block, _ = _kernel.quantize(
        flat, numel, block_size, SCALE_BYTES[scale_dtype], u, math_threads(), packed.numpy(), scales.numpy()
    )
    if status:
        _raise_for_status(status, bad_block, flat, block_size, scale_dtype, name)
    return packed, scales


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32(q) * float32(scale), as a 1-D float32 tensor of ``numel`` elements.

    Trusts its inputs' values (the shard feeds it its own quantize_int4 output); use
    ``decode`` for bytes from the network. ``out`` (contiguous float32, numel elements)
    avoids a fresh allocation, whose page faults cost as much as the work itself.
    """
    import torch

    scale_dtype = _scale_dtype_of(scales)
    check_params(block_size, scale_dtype)
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(numel):
        raise CodecError(
            f"packed nibbles must be {packed_nbytes(numel)} uint8 values for {numel} elements, "
            f"got {packed.numel()} {packed.dtype}"
        )
    if scales.numel() != num_blocks(numel, block_size):
        raise CodecError(
            f"need {num_blocks(numel, block_size)} scales for {numel} elements in blocks of "
            f"{block_size}, got {scales.numel()}"
        )
    packed = packed.detach().cpu().contiguous().view(-1)
    scales = scales.detach().cpu().contiguous().view(-1)
    return _dequantize(packed.numpy(), scales.numpy(), numel, block_size, scale_dtype, out)


def _scale_dtype_of(scales) -> str:
    """"float16" or "float32" for a numpy array or torch tensor of scales."""
    name = str(scales.dtype).removeprefix("torch.")
    if name not in SCALE_DTYPES:
        raise CodecError(f"scales must be float16 or float32, got {scales.dtype}")
    return name


def _dequantize(
    packed: np.ndarray | memoryview,
    scales: np.ndarray | memoryview,
    numel: int,
    block_size: int,
    scale_dtype: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Shared by dequantize_int4 and decode (learners); buffers are already length-checked."""
    import torch

    if out is None:
        out = empty_tensor(numel, "float32")
    elif out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != numel:
        raise CodecError(f"out must be a contiguous float32 CPU tensor of {numel} elements")
    out = out.view(-1)
    if numel == 0:
        return out
    if _use_kernel():
        _kernel.dequantize(packed, scales, numel, block_size, SCALE_BYTES[scale_dtype], out.numpy(), math_threads())
        return out
    packed_t = torch.from_numpy(np.frombuffer(packed, dtype=np.uint8).copy())
    little_endian = np.dtype(scale_dtype).newbyteorder("<")
    scales_t = torch.from_numpy(np.frombuffer(scales, dtype=little_endian).astype(scale_dtype))
    out.copy_(dequantize_int4_reference(packed_t, scales_t, numel, block_size))
    return out


def dequantize_payload(payload: bytes | memoryview, numel: int, block_size: int, scale_dtype: str,
                       out: np.ndarray) -> np.ndarray:
    """``decode`` of an int4 payload of one's own making (nibbles, then scales) into
    ``out`` (flat float32 numpy), bit for bit what a learner decodes; without torch when
    the kernel is built (a shard never loads torch)."""
    view = memoryview(payload).cast("B")
    split = packed_nbytes(numel)
    if _use_kernel():
        _kernel.dequantize(view[:split], view[split:], numel, block_size, SCALE_BYTES[scale_dtype], out, math_threads())
        return out
    import torch

    _dequantize(view[:split], view[split:], numel, block_size, scale_dtype, torch.from_numpy(out))
    return out


def int4_scales(payload: bytes | memoryview, numel: int, block_size: int, scale_dtype: str) -> np.ndarray:
    """The scales of an int4 payload (after its nibbles): one per block, read in place."""
    dtype = {"float16": "<f2", "float32": "<f4"}[scale_dtype]
    return np.frombuffer(payload, dtype=dtype, count=num_blocks(numel, block_size), offset=packed_nbytes(numel))


def quantize_to_payload(
    flat: np.ndarray,
    block_size: int,
    scale_dtype: str,
    generator: torch.Generator | None,
    name: str | None,
) -> bytes:
    """The wire payload (packed nibbles then little-endian scales) of a flat float32
    array. The kernel writes straight into the bytes object: no copy on the hot path."""
    numel = flat.size
    u = _uniforms(numel, generator)
    if _use_kernel():
        status, bad_block, payload = _kernel.quantize(flat, numel, block_size, SCALE_BYTES[scale_dtype], u, math_threads())
        if status:
            _raise_for_status(status, bad_block, flat, block_size, scale_dtype, name)
        return payload
    packed, scales = quantize_int4_reference(flat, block_size, scale_dtype, u, name=name)
    return packed.numpy().tobytes() + scales.numpy().astype(np.dtype(scale_dtype).newbyteorder("<")).tobytes()


# ---------------------------------------------------------------------------------------
# Reference implementation in torch ops: the fallback, and the definition the kernel is
# tested against. Each step is an exactly rounded IEEE operation, like the kernel's.


def block_scales_reference(absmax: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Per-block scales in ``scale_dtype`` (inf where a float16 scale overflows)."""
    import torch

    t = absmax / QMAX
    if scale_dtype == "float32":
        # One float up when absmax / t still rounds above 7 (also lifts a t that
        # underflowed to 0 for a subnormal absmax: absmax / 0 = inf).
        bump = absmax / t > QMAX
        return torch.where(bump, torch.nextafter(t, torch.full_like(t, math.inf)), t)
    # Smallest half >= t: round to nearest, then one half up if that landed below t.
    # Stepping the bit pattern of a non-negative half moves to the next half up (and from
    # 65504 to inf).
    bits = t.to(torch.float16).view(torch.int16)
    bits = bits + (bits.view(torch.float16).float() < t).to(torch.int16)
    # t itself may be below absmax / 7; scale * 7 is exact for a half, so this test is.
    s = bits.view(torch.float16).float()
    bits = bits + ((s * QMAX < absmax) & (bits < 0x7C00)).to(torch.int16)
    return bits.view(torch.float16)


def quantize_int4_reference(
    x: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    scale_dtype: str = "float16",
    uniforms: torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops quantization; ``uniforms`` (float32 in [0, 1), one per element) selects
    stochastic rounding."""
    import torch

    check_params(block_size, scale_dtype, name)
    values = flat_float32(x, name)
    raise_if_nonfinite(values, name)
    flat = torch.from_numpy(values)
    numel = flat.numel()
    nblocks = num_blocks(numel, block_size)
    pad = nblocks * block_size - numel
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(nblocks, block_size)
    absmax = blocks.abs().amax(dim=1) if numel else torch.zeros(0)
    scales = block_scales_reference(absmax, scale_dtype)
    overflow = torch.isinf(scales)
    if bool(overflow.any()):
        _raise_for_status(
            _STATUS_SCALE_OVERFLOW, int(overflow.nonzero()[0, 0]), values, block_size, scale_dtype, name
        )
    s = scales.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    y = blocks / s[:, None]
    if uniforms is None:
        q = torch.round(y)
    else:
        u = torch.nn.functional.pad(torch.as_tensor(uniforms).reshape(-1).float(), (0, pad)).view(nblocks, block_size)
        # y >= -7 and u >= 0 keep the floor >= -7; y = 7 plus u near 1 rounds to 8.
        q = torch.floor(y + u).clamp_(max=QMAX)
    q = q.to(torch.int16).view(-1)
    pairs = packed_nbytes(numel)
    q = torch.nn.functional.pad(q[:numel], (0, 2 * pairs - numel)).view(pairs, 2) & 15
    packed = (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)
    return packed, scales


def dequantize_int4_reference(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int
) -> torch.Tensor:
    """Torch-ops dequantization: float32(q) * float32(scale)."""
    import torch

    p = packed.reshape(-1).to(torch.int16)
    lo = ((p & 15) ^ 8) - 8
    hi = ((p >> 4) ^ 8) - 8
    q = torch.stack([lo, hi], dim=1).view(-1)[:numel]
    nblocks = scales.numel()
    q = torch.nn.functional.pad(q, (0, nblocks * block_size - numel)).view(nblocks, block_size)
    values = q.float() * scales.reshape(-1).float()[:, None]
    return values.view(-1)[:numel].clone()


def axpy_many_int4(
    inputs: list[tuple[memoryview, memoryview]], alphas: list[float], numel: int, block_size: int, scale_dtype: str,
    out: np.ndarray, overwrite: bool = False,
) -> float:
    """``out (+)= sum_k alphas[k] * dequant(q_k)`` in one pass over ``out`` (flat float32;
    the shard's merge); returns the squared norm of the resulting ``out``. ``inputs`` are
    (packed, scales) byte views that passed ``decode``'s checks."""
    if numel and _use_kernel():
        return float(_kernel.axpy_many(
            [p for p, _ in inputs], [s for _, s in inputs], [float(a) for a in alphas],
            numel, block_size, SCALE_BYTES[scale_dtype], out, math_threads(), overwrite,
        ))
    if overwrite:
        out.fill(0)
    for (packed, scales), alpha in zip(inputs, alphas):
        out += np.float32(alpha) * _dequantize(packed, scales, numel, block_size, scale_dtype, None).numpy()
    return float(np.dot(out.astype(np.float64), out.astype(np.float64)))


def sumsq_int4(
    packed: np.ndarray | memoryview, scales: np.ndarray | memoryview, numel: int, block_size: int, scale_dtype: str
) -> float:
    """Squared norm of the decoded tensor, without decoding it (double precision)."""
    if numel == 0:
        return 0.0
    if _use_kernel():
        return float(_kernel.sumsq(packed, scales, numel, block_size, SCALE_BYTES[scale_dtype], math_threads()))
    values = _dequantize(packed, scales, numel, block_size, scale_dtype, None).double()
    return float(values.square().sum())
