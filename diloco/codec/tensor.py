"""One tensor on the wire: its spec (what the receiver must know to check and decode the
bytes) and its payload.

Nothing is pickled and nothing is trusted: ``decode`` rebuilds the expected byte length
from the spec's shape, block size and scale dtype, checks it against the spec and the
payload, verifies the CRC-32C and the scales, and only then produces a tensor. Any
mismatch raises CodecError naming the tensor and the field; no partial tensor escapes.

Encoding takes torch tensors or numpy arrays; checking, measuring and accumulating work
on bytes and numpy arrays without importing torch (a syncer shard never loads it);
``decode`` produces torch tensors for learners.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from typing import TYPE_CHECKING

import google_crc32c
import numpy as np

from diloco.codec import int4, sparse
from diloco.config import BLOCK_SIZE
from diloco.errors import CodecError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENCODINGS = ("int4", "sparse", "fp32")
DTYPE = "float32"


@dataclass(frozen=True)
class TensorSpec:
    """Everything the receiver checks before it believes a payload."""

    name: str
    """Piece name from the fragment plan; named in every error."""
    shape: tuple[int, ...]
    dtype: str
    """Dtype of the decoded tensor; always "float32"."""
    encoding: str
    """"int4", "sparse" or "fp32"."""
    block_size: int
    """Elements per quantization block (int4, sparse); 0 for fp32."""
    scale_dtype: str
    """"float16" or "float32" (int4, sparse); "" for fp32."""
    byte_length: int
    """Length of the uncompressed payload in bytes."""
    checksum: int
    """CRC-32C of the uncompressed payload."""
    kept: int = 0
    """Values kept per block (sparse); 0 otherwise."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class EncodedTensor:
    spec: TensorSpec
    payload: bytes


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """CRC-32C of the payload (hardware-accelerated on x86 and ARM)."""
    # google_crc32c refuses memoryview and bytearray but takes a numpy view: no copy.
    return google_crc32c.value(np.frombuffer(payload, dtype=np.uint8))


def values_digest(tensors: Sequence[EncodedTensor]) -> bytes:
    """SHA-256 of a fragment's values: its pieces' payloads in order, each raw fp32 (as
    ``encode(..., encoding="fp32")`` writes them). Equal digests, bit-identical values."""
    if any(t.spec.encoding != "fp32" for t in tensors):
        raise CodecError("a values digest is taken over fp32 payloads only")
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.payload)
    return h.digest()


def expected_byte_length(shape: tuple[int, ...], encoding: str, block_size: int, scale_dtype: str,
                         kept: int = 0) -> int:
    """Bytes of the uncompressed payload of a tensor with this shape and encoding."""
    numel = math.prod(shape)
    if encoding == "fp32":
        return 4 * numel
    if encoding == "sparse":
        return sparse.nbytes(numel, block_size, kept, scale_dtype)
    return int4.int4_nbytes(numel, block_size, scale_dtype)


def encode(
    name: str,
    tensor: torch.Tensor | np.ndarray,
    *,
    encoding: str = "int4",
    block_size: int = BLOCK_SIZE,
    scale_dtype: str = "float16",
    generator: torch.Generator | None = None,
    kept: int = 0,
) -> EncodedTensor:
    """Encode ``tensor`` (a torch tensor of any floating dtype on any device, or a numpy
    array; sent as float32).

    int4 quantizes (stochastically when ``generator`` is given); sparse keeps ``kept``
    values of each block at 2 bits (``diloco.codec.sparse``); fp32 sends raw
    little-endian floats, for ablations and for learners too far behind for a chain of
    int4 updates. NaN or Inf raises CodecError naming the tensor and the element.
    """
    flat = int4.flat_float32(tensor, name)
    shape = tuple(int(d) for d in tensor.shape)
    if encoding == "fp32":
        int4.raise_if_nonfinite(flat, name)
        payload = flat.astype("<f4", copy=False).tobytes()
        block_size, scale_dtype = 0, ""
    elif encoding == "int4":
        int4.check_params(block_size, scale_dtype, name)
        payload = int4.quantize_to_payload(flat, block_size, scale_dtype, generator, name)
    elif encoding == "sparse":
        sparse.check_params(block_size, kept, scale_dtype, name)
        int4.raise_if_nonfinite(flat, name)
        payload = sparse.quantize(flat, block_size, kept, scale_dtype, name)
    else:
        raise CodecError(f"tensor {name!r}: unknown encoding {encoding!r}; expected one of {ENCODINGS}")
    return _wrapped(name, shape, encoding, block_size, scale_dtype, payload, kept if encoding == "sparse" else 0)


def _wrapped(name: str, shape: tuple[int, ...], encoding: str, block_size: int, scale_dtype: str, payload: bytes,
             kept: int = 0) -> EncodedTensor:
    spec = TensorSpec(
        name=name,
        shape=shape,
        dtype=DTYPE,
        encoding=encoding,
        block_size=block_size,
        scale_dtype=scale_dtype,
        byte_length=len(payload),
        checksum=checksum(payload),
        kept=kept,
    )
    return EncodedTensor(spec, payload)


def sparse_tensor(name: str, shape: tuple[int, ...], payload: bytes, *, block_size: int, scale_dtype: str,
                  kept: int) -> EncodedTensor:
    """Wrap a sparse payload written elsewhere (a shard's condensed reply,
    ``diloco.syncer.core.mirrors.condense_sparse``) without encoding again."""
    sparse.check_params(block_size, kept, scale_dtype, name)
    shape = tuple(int(d) for d in shape)
    if len(payload) != sparse.nbytes(math.prod(shape), block_size, kept, scale_dtype):
        raise CodecError(f"tensor {name!r}: a sparse payload of {len(payload)} bytes does not match shape {shape}")
    return _wrapped(name, shape, "sparse", block_size, scale_dtype, payload, kept)


def encode_quantized(
    name: str,
    shape: tuple[int, ...],
    packed: torch.Tensor | np.ndarray,
    scales: torch.Tensor | np.ndarray,
    block_size: int,
    scale_dtype: str | None = None,
) -> EncodedTensor:
    """Wrap the output of ``quantize_int4`` (tensors) or of the shard's outer step (numpy
    arrays) without quantizing again.

    The shard quantizes an update once, applies exactly its dequantization and sends
    these very bytes; quantizing twice would double the cost, and with stochastic
    rounding would send something other than what was applied.
    """
    actual_scale_dtype = int4._scale_dtype_of(scales)
    if scale_dtype is not None and scale_dtype != actual_scale_dtype:
        raise CodecError(f"tensor {name!r}: scales are {actual_scale_dtype}, not {scale_dtype}")
    scale_dtype = actual_scale_dtype
    numel = math.prod(shape)
    int4.check_params(block_size, scale_dtype, name)
    packed = np.ascontiguousarray(_cpu_numpy(packed)).reshape(-1)
    scales = np.ascontiguousarray(_cpu_numpy(scales), dtype=np.dtype(scale_dtype).newbyteorder("<")).reshape(-1)
    if packed.dtype != np.uint8 or packed.size != int4.packed_nbytes(numel):
        raise CodecError(f"tensor {name!r}: packed nibbles do not match shape {tuple(shape)}")
    if scales.size != int4.num_blocks(numel, block_size):
        raise CodecError(f"tensor {name!r}: {scales.size} scales do not match shape {tuple(shape)}")
    payload = b"".join((packed.data, scales.view(np.uint8).data))
    spec = TensorSpec(
        name=name,
        shape=tuple(int(d) for d in shape),
        dtype=DTYPE,
        encoding="int4",
        block_size=block_size,
        scale_dtype=scale_dtype,
        byte_length=len(payload),
        checksum=checksum(payload),
    )
    return EncodedTensor(spec, payload)


def validate_spec(spec: TensorSpec, *, block_size: int | None = None, scale_dtype: str | None = None) -> None:
    """Checks a spec on its own (before its payload arrives): dtype, encoding, shape,
    block size, scale dtype, and byte_length against what the shape implies.

    ``block_size`` / ``scale_dtype``, when given, are what this receiver is configured
    for; a sender that disagrees is misconfigured, and silently accepting its bytes would
    hide that.
    """
    name = spec.name
    if spec.dtype != DTYPE:
        raise CodecError(f"tensor {name!r}: dtype {spec.dtype!r} is not supported; expected {DTYPE!r}")
    if spec.encoding not in ENCODINGS:
        raise CodecError(f"tensor {name!r}: unknown encoding {spec.encoding!r}; expected one of {ENCODINGS}")
    if not isinstance(spec.shape, tuple) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in spec.shape
    ):
        raise CodecError(f"tensor {name!r}: shape {spec.shape!r} must be a tuple of non-negative integers")
    if spec.encoding != "sparse" and spec.kept != 0:
        raise CodecError(f"tensor {name!r}: only sparse payloads keep values per block, got kept {spec.kept!r}")
    if spec.encoding == "fp32":
        if spec.block_size != 0 or spec.scale_dtype != "":
            raise CodecError(
                f"tensor {name!r}: fp32 payloads have no blocks or scales, got block size "
                f"{spec.block_size!r} and scale dtype {spec.scale_dtype!r}"
            )
    else:
        if spec.encoding == "sparse":
            sparse.check_params(spec.block_size, spec.kept, spec.scale_dtype, name)
        else:
            int4.check_params(spec.block_size, spec.scale_dtype, name)
        if block_size is not None and spec.block_size != block_size:
            raise CodecError(
                f"tensor {name!r}: block size {spec.block_size} does not match the configured {block_size}"
            )
        if scale_dtype is not None and spec.scale_dtype != scale_dtype:
            raise CodecError(
                f"tensor {name!r}: scale dtype {spec.scale_dtype!r} does not match the configured {scale_dtype!r}"
            )
    expected = expected_byte_length(spec.shape, spec.encoding, spec.block_size, spec.scale_dtype, spec.kept)
    if spec.byte_length != expected:
        detail = (
            "fp32" if spec.encoding == "fp32" else f"{spec.encoding}, block size {spec.block_size}, {spec.scale_dtype} scales"
            + (f", {spec.kept} kept per block" if spec.encoding == "sparse" else "")
        )
        raise CodecError(
            f"tensor {name!r}: shape {spec.shape} ({detail}) needs {expected} payload bytes, "
            f"but byte_length says {spec.byte_length}"
        )


def check_payload(
    spec: TensorSpec,
    payload: bytes | bytearray | memoryview,
    *,
    block_size: int | None = None,
    scale_dtype: str | None = None,
) -> memoryview:
    """Every check ``decode`` makes (spec, length, checksum, scales; finite values for
    fp32), without producing the tensor. Returns the payload as a byte view."""
    validate_spec(spec, block_size=block_size, scale_dtype=scale_dtype)
    view = _bytes(payload)
    if view.nbytes != spec.byte_length:
        raise CodecError(f"tensor {spec.name!r}: payload is {view.nbytes} bytes, expected {spec.byte_length}")
    actual = checksum(view)
    if actual != spec.checksum:
        raise CodecError(
            f"tensor {spec.name!r}: checksum mismatch (expected 0x{spec.checksum:08x}, got 0x{actual:08x})"
        )
    if spec.encoding == "fp32":
        values = np.frombuffer(view, dtype="<f4")
        finite = np.isfinite(values)
        if not finite.all():
            index = int(np.argmin(finite))
            raise CodecError(f"tensor {spec.name!r}: element {index} is {float(values[index])}; expected finite values")
    elif spec.encoding == "sparse":
        _check_scales(view[sparse.scales_offset(spec.numel, spec.block_size, spec.kept) :], spec.scale_dtype, spec.name)
        sparse.check_indices(view, spec.numel, spec.block_size, spec.kept, spec.scale_dtype, spec.name)
    else:
        _check_scales(view[int4.packed_nbytes(spec.numel) :], spec.scale_dtype, spec.name)
    return view


def norm_of(spec: TensorSpec, payload: bytes | bytearray | memoryview) -> float:
    """L2 norm of the decoded tensor, computed from the encoded bytes. The payload must
    have passed ``check_payload``."""
    view = _bytes(payload)
    if spec.encoding == "fp32":
        values = np.frombuffer(view, dtype="<f4").astype(np.float64)
        return float(np.sqrt(np.dot(values, values)))
    if spec.encoding == "sparse":
        return math.sqrt(sparse.sumsq(view, spec.numel, spec.block_size, spec.kept, spec.scale_dtype))
    split = int4.packed_nbytes(spec.numel)
    return math.sqrt(int4.sumsq_int4(view[:split], view[split:], spec.numel, spec.block_size, spec.scale_dtype))


def accumulate(
    items: Sequence[tuple[EncodedTensor, float]], out: np.ndarray | torch.Tensor, overwrite: bool = False
) -> float:
    """``out (+)= sum alpha * decoded`` over (tensor, alpha) pairs of one shape, straight
    from the encoded bytes: int4 inputs in one fused pass over ``out`` (contiguous float32:
    a numpy array or a CPU tensor, written in place). Returns the squared norm of the
    resulting ``out``. Every payload must have passed ``check_payload``. Sparse inputs add
    at their kept positions only."""
    base = int4.as_numpy(out)
    numel = base.size
    if base.dtype != np.float32 or not base.flags.c_contiguous:
        raise CodecError(f"tensor 'accumulator': out must be a contiguous float32 CPU tensor of {numel} elements")
    flat = base.reshape(-1)
    groups: dict[tuple[int, str], list[tuple[EncodedTensor, float]]] = {}
    fp32, sparse_items = [], []
    for tensor, alpha in items:
        if tensor.spec.numel != numel:
            raise CodecError(f"tensor {tensor.spec.name!r}: {tensor.spec.numel} elements, expected {numel}")
        if tensor.spec.encoding == "fp32":
            fp32.append((tensor, alpha))
        elif tensor.spec.encoding == "sparse":
            sparse_items.append((tensor, alpha))
        else:
            groups.setdefault((tensor.spec.block_size, tensor.spec.scale_dtype), []).append((tensor, alpha))
    if overwrite and (fp32 or sparse_items or not groups):
        flat.fill(0)
        overwrite = False
    for tensor, alpha in fp32:
        flat += np.float32(alpha) * np.frombuffer(_bytes(tensor.payload), dtype="<f4")
    for tensor, alpha in sparse_items:
        s = tensor.spec
        sparse.axpy(_bytes(tensor.payload), alpha, numel, s.block_size, s.kept, s.scale_dtype, flat)
    sumsq = None
    split = int4.packed_nbytes(numel)
    for (block_size, scale_dtype), group in groups.items():
        inputs = [(_bytes(t.payload)[:split], _bytes(t.payload)[split:]) for t, _ in group]
        sumsq = int4.axpy_many_int4(inputs, [a for _, a in group], numel, block_size, scale_dtype, flat, overwrite)
        overwrite = False
    # The int4 groups run last, so the last one measured the final ``out``.
    if sumsq is not None:
        return sumsq
    return sumsq_f32(flat)


def sumsq_f32(flat: np.ndarray) -> float:
    """The sum of squares of a float32 array, summed in float64: one pass in the C kernel
    (``dot_f32``'s fixed order), float64 numpy without it (equal up to the summation order)."""
    kernel = int4.native()
    if kernel is not None:
        return kernel.dot_f32(flat, flat)
    wide = flat.astype(np.float64)
    return float(np.dot(wide, wide))


def dot_and_sumsq(tensor: EncodedTensor, y: np.ndarray, scratch: np.ndarray) -> tuple[float, float]:
    """(decoded . ``y``, decoded . decoded) of a checked tensor against flat float32 ``y``,
    in float64: a sparse one straight from its bytes in the C kernel, else decoded into
    ``scratch`` (float32, its size) first, then one pass (``dot_f32``; numpy's float64
    without the kernel, equal up to the summation order)."""
    s = tensor.spec
    kernel = int4.native()
    if s.encoding == "sparse" and kernel is not None:
        return kernel.sparse_dot(_bytes(tensor.payload), s.numel, s.block_size, s.kept,
                                 int4.SCALE_BYTES[s.scale_dtype], y)
    norm_sq = accumulate([(tensor, 1.0)], scratch, overwrite=True)
    if kernel is not None:
        return kernel.dot_f32(scratch, y), norm_sq
    return float(np.dot(scratch.astype(np.float64), y.astype(np.float64))), norm_sq


def _bytes(payload: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode(
    spec: TensorSpec,
    payload: bytes | bytearray | memoryview,
    *,
    block_size: int | None = None,
    scale_dtype: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check everything, then return the float32 tensor of shape ``spec.shape``.

    ``out`` (contiguous float32, spec.numel elements) is written only after every check
    has passed, so a failed decode never leaves half a tensor behind.
    """
    import torch

    view = check_payload(spec, payload, block_size=block_size, scale_dtype=scale_dtype)
    numel = spec.numel
    if out is not None:
        _check_out(out, numel, spec.name)
    if spec.encoding == "fp32":
        values = torch.from_numpy(np.frombuffer(view, dtype="<f4").astype(np.float32))
        return (values if out is None else out.view(-1).copy_(values)).view(spec.shape)
    if spec.encoding == "sparse":
        target = np.empty(numel, np.float32) if out is None else out.view(-1).numpy()
        sparse.decode_into(view, numel, spec.block_size, spec.kept, spec.scale_dtype, target)
        return (torch.from_numpy(target) if out is None else out).view(spec.shape)
    split = int4.packed_nbytes(numel)
    values = int4._dequantize(view[:split], view[split:], numel, spec.block_size, spec.scale_dtype, out)
    return values.view(spec.shape)


def _cpu_numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()


def _check_out(out: torch.Tensor, numel: int, name: str) -> None:
    import torch

    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != numel:
        raise CodecError(f"tensor {name!r}: out must be a contiguous float32 CPU tensor of {numel} elements")


def _check_scales(scales: memoryview, scale_dtype: str, name: str) -> None:
    """Scales must be finite and non-negative; a NaN scale would turn a whole block into
    NaN in the global parameters. Done on the bit patterns: exact, and no float16 math."""
    if scale_dtype == "float16":
        bits = np.frombuffer(scales, dtype="<u2")
        bad = ((bits & 0x7C00) == 0x7C00) | (bits > 0x8000)
    else:
        bits = np.frombuffer(scales, dtype="<u4")
        bad = ((bits & 0x7F800000) == 0x7F800000) | (bits > 0x80000000)
    if bad.any():
        block = int(np.flatnonzero(bad)[0])
        value = float(np.frombuffer(scales, dtype="<f2" if scale_dtype == "float16" else "<f4")[block])
        raise CodecError(
            f"tensor {name!r}: scale of block {block} is {value}; scales must be finite and non-negative"
        )
