"""How fast the codec is, next to how fast this machine copies memory.

Absolute GB/s say little across machines; the ratio to a memcpy measured in the same
process, on the same data, right before, says whether the codec would slow a sync down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from diloco.codec import sparse
from diloco.config import BLOCK_SIZE
from diloco.errors import InvalidArgument
from diloco.codec import decode, dequantize_int4, encode, frame, kernel, quantize_int4, unframe

logger = logging.getLogger(__name__)

SCALE_DTYPE = "float16"
SPARSE_DENSITY = 0.125
"""The sparse codec's default density (``LearnerConfig.delta_density``)."""


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, lazy thread start, allocator caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(size_mib: int = 64, repeats: int = 5) -> dict:
    """Measure on ``size_mib`` MiB of float32 N(0, 1) data; report the best of ``repeats``.

    Best-of rather than median: on a shared machine noise only ever adds time, so the
    fastest run is the closest to what the code costs. Throughputs are in GB/s (1e9
    bytes) of the *input*: fp32 bytes for memcpy, quantize, dequantize (whose output is
    fp32), encode and decode; int4 payload bytes for zstd (frame) and unzstd (unframe).

    - memcpy: ``dst.copy_(src)`` into a preallocated tensor (torch may use its threads).
    - quantize: ``quantize_int4`` including the allocation of its outputs, as callers run it.
    - dequantize: ``dequantize_int4`` into a preallocated ``out`` (a fresh 64 MiB tensor
      costs its page faults, about as much as the work; the learner and shard reuse one).
    - encode / decode: the whole per-tensor path, CRC-32C and validation included, fresh
      output each time.
    - sparse, dense2: the sparse codec's C kernels (``diloco.codec.sparse``) keeping 1/8 of
      each block, and all of it (2 bits per value); decoding into a preallocated array.
    """
    if size_mib <= 0 or repeats <= 0:
        raise InvalidArgument(f"size and repeats must be positive, got {size_mib} MiB x {repeats}")
    numel = size_mib * (1 << 20) // 4
    fp32_bytes = 4 * numel
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))

    dst = torch.empty_like(x)
    memcpy_s = _best_seconds(lambda: dst.copy_(x), repeats)
    del dst

    quantize_s = _best_seconds(lambda: quantize_int4(x, BLOCK_SIZE, SCALE_DTYPE), repeats)
    packed, scales = quantize_int4(x, BLOCK_SIZE, SCALE_DTYPE)
    out = torch.empty_like(x)
    dequantize_s = _best_seconds(lambda: dequantize_int4(packed, scales, numel, BLOCK_SIZE, out=out), repeats)
    del out

    encoded = encode("bench", x, block_size=BLOCK_SIZE, scale_dtype=SCALE_DTYPE)
    encode_s = _best_seconds(lambda: encode("bench", x, block_size=BLOCK_SIZE, scale_dtype=SCALE_DTYPE), repeats)
    decode_s = _best_seconds(lambda: decode(encoded.spec, encoded.payload), repeats)

    flat = x.numpy()
    target = np.empty(numel, np.float32)
    sparse_figures = {}
    for label, kept in (("sparse", sparse.kept_for(SPARSE_DENSITY, BLOCK_SIZE)), ("dense2", BLOCK_SIZE)):
        quantize_sparse_s = _best_seconds(lambda: sparse.quantize(flat, BLOCK_SIZE, kept, SCALE_DTYPE, "bench"), repeats)
        packed_sparse = memoryview(sparse.quantize(flat, BLOCK_SIZE, kept, SCALE_DTYPE, "bench"))
        decode_sparse_s = _best_seconds(
            lambda: sparse.decode_into(packed_sparse, numel, BLOCK_SIZE, kept, SCALE_DTYPE, target), repeats)
        sparse_figures[label] = (quantize_sparse_s, decode_sparse_s, len(packed_sparse))
    del target

    payload = encoded.payload
    chunks = list(frame([payload]))
    zstd_s = _best_seconds(lambda: list(frame([payload])), repeats)
    unzstd_s = _best_seconds(lambda: unframe(chunks, len(payload)), repeats)

    def gbps(nbytes: int, seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 3)

    memcpy = gbps(fp32_bytes, memcpy_s)
    quantize = gbps(fp32_bytes, quantize_s)
    dequantize = gbps(fp32_bytes, dequantize_s)
    result = {
        "memcpy_gbps": memcpy,
        "quantize_gbps": quantize,
        "dequantize_gbps": dequantize,
        "zstd_gbps": gbps(len(payload), zstd_s),
        "quantize_ratio": round(quantize / memcpy, 3),
        "dequantize_ratio": round(dequantize / memcpy, 3),
        "unzstd_gbps": gbps(len(payload), unzstd_s),
        "zstd_ratio": round(sum(map(len, chunks)) / len(payload), 3),
        **{f"{label}_{what}_ratio": round(gbps(fp32_bytes, seconds) / memcpy, 3)
           for label, (q, d, _) in sparse_figures.items() for what, seconds in (("quantize", q), ("dequantize", d))},
        **{f"{label}_bits_per_value": round(8 * nbytes / numel, 3) for label, (_, _, nbytes) in sparse_figures.items()},
        "encode_gbps": gbps(fp32_bytes, encode_s),
        "decode_gbps": gbps(fp32_bytes, decode_s),
        "kernel": kernel(),
        "threads": torch.get_num_threads(),
        "size_mib": size_mib,
        "repeats": repeats,
        "statistic": "best",
    }
    logger.debug("codec bench: %s", result)
    return result
