"""zstd framing: the payloads of a message's tensors, concatenated, cut into chunks.

Each chunk is one self-contained zstd frame (content size and XXH64 checksum in its
header and trailer) holding at most ``max_chunk_bytes`` of payload, and compressing to at
most ``max_chunk_bytes`` too, so a chunk always fits a gRPC message of that size even when
the data does not compress. Chunk boundaries ignore tensor boundaries: the receiver
unframes the whole stream against the total byte length announced in the header, then
slices it by the specs' byte lengths.

Level 1 by default: int4 nibbles of Gaussian-like updates have no repeated strings, but
Huffman coding of the literals saves ~13%, at ~0.5-0.8 GB/s per core. Negative levels
turn literal compression off (ratio 1.00, ~3.5 GB/s): pick one for a fast network.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import numpy as np
import zstandard

from diloco.codec.threads import math_threads
from diloco.errors import CodecError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
DEFAULT_LEVEL = 1
MIN_CHUNK_BYTES = 4096
# Frame header (<= 18 bytes) and checksum (4) on top of the block-level bound, rounded up.
_FRAME_SLACK_BYTES = 64

BytesLike = bytes | bytearray | memoryview


def _compress_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the most a single-pass compression of ``size`` bytes emits."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small


def chunk_payload_bytes(max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> int:
    """The payload carried by each full chunk: the largest slice whose worst-case
    compressed frame still fits in ``max_chunk_bytes``."""
    if max_chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"max_chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {max_chunk_bytes}")
    budget = max_chunk_bytes - _FRAME_SLACK_BYTES
    size = budget * 256 // 257
    while _compress_bound(size) > budget:
        size -= 1
    return size


def _byte_view(payload: BytesLike) -> memoryview:
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _slices(payloads: Iterable[BytesLike], size: int) -> Iterator[BytesLike]:
    """The concatenation of ``payloads`` in pieces of ``size`` bytes (the last shorter).
    A piece inside one payload is a view of it; only pieces that straddle payloads are
    copied."""
    pending: list[memoryview] = []
    pending_len = 0
    for payload in payloads:
        view = _byte_view(payload)
        pos = 0
        if pending:
            pos = min(size - pending_len, len(view))
            pending.append(view[:pos])
            pending_len += pos
            if pending_len < size:
                continue
            yield b"".join(pending)
            pending, pending_len = [], 0
        while len(view) - pos >= size:
            yield view[pos : pos + size]
            pos += size
        if pos < len(view):
            pending, pending_len = [view[pos:]], len(view) - pos
    if pending:
        yield b"".join(pending)


def _compress_batch(
    cctx: zstandard.ZstdCompressor, batch: list[BytesLike], threads: int, max_chunk_bytes: int
) -> list[bytes]:
    if threads == 1 or len(batch) == 1 or not hasattr(cctx, "multi_compress_to_buffer"):
        chunks = [cctx.compress(piece) for piece in batch]
    else:
        # The one zstandard call that compresses on several threads: compress() itself
        # holds the GIL, so a Python thread pool would not help. Keeps input order.
        compressed = cctx.multi_compress_to_buffer(batch, threads=min(threads, len(batch)))
        chunks = [compressed[i].tobytes() for i in range(len(compressed))]
    for chunk in chunks:
        if len(chunk) > max_chunk_bytes:  # would mean _compress_bound is wrong
            raise CodecError(f"zstd frame of {len(chunk)} bytes exceeds the chunk limit {max_chunk_bytes}")
    return chunks


def frame(
    payloads: Iterable[BytesLike],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    level: int = DEFAULT_LEVEL,
    threads: int | None = None,
) -> Iterator[bytes]:
    """Chunks of the concatenated ``payloads``, each one zstd frame of at most
    ``max_chunk_bytes`` holding at most ``max_chunk_bytes`` of payload.

    Lazy: compresses 2 * ``threads`` chunks at a time (default: torch's intra-op thread
    count where torch is loaded, else the CPUs), so a sender can stream the first chunks while it frames the rest.
    """
    slice_bytes = chunk_payload_bytes(max_chunk_bytes)
    threads = max(1, threads if threads is not None else math_threads())
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    batch: list[BytesLike] = []
    for piece in _slices(payloads, slice_bytes):
        batch.append(piece)
        if len(batch) >= 2 * threads:
            yield from _compress_batch(cctx, batch, threads, max_chunk_bytes)
            batch = []
    if batch:
        yield from _compress_batch(cctx, batch, threads, max_chunk_bytes)


class Unframer:
    """Unframes a stream of chunks one chunk at a time into one preallocated buffer of
    ``expected_bytes``: a receiver can inflate each chunk as it arrives and let it go,
    instead of holding the whole compressed stream, its inflated parts and their join.

    Every frame header is checked before the frame is inflated: a content size that is
    missing, zero, larger than a chunk or past ``expected_bytes`` is refused, so a bad
    header cannot make the receiver allocate without bound. zstd verifies each frame's
    checksum. Any failure raises CodecError; ``result`` refuses a short stream, so nothing
    partial is ever returned.
    """

    def __init__(self, expected_bytes: int, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
        if expected_bytes < 0:
            raise CodecError(f"expected byte length must be >= 0, got {expected_bytes}")
        self.expected_bytes = expected_bytes
        self.max_chunk_bytes = max_chunk_bytes
        # Uninitialised: memory is touched only as chunks arrive, so a header announcing a
        # large payload costs nothing until its bytes do.
        self._view = memoryview(np.empty(expected_bytes, dtype=np.uint8))
        self._dctx = zstandard.ZstdDecompressor()
        self._chunks = 0
        self.received = 0
        """Payload bytes unframed so far."""

    def add(self, chunk: BytesLike) -> None:
        index = self._chunks
        size = _checked_size(index, chunk, self.received, self.expected_bytes, self.max_chunk_bytes)
        try:
            data = self._dctx.decompress(chunk, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CodecError(f"chunk {index}: corrupt zstd frame ({exc})") from None
        if len(data) != size:
            raise CodecError(f"chunk {index}: frame declared {size} bytes but held {len(data)}")
        self._view[self.received : self.received + size] = data
        self.received += size
        self._chunks += 1

    def result(self) -> memoryview:
        """The payload (a byte view); raises unless the chunks added up to exactly
        ``expected_bytes``."""
        if self.received != self.expected_bytes:
            raise CodecError(f"stream ended after {self.received} of the expected {self.expected_bytes} bytes")
        return self._view


def unframe(
    chunks: Iterable[BytesLike], expected_bytes: int, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
) -> memoryview:
    """The payload bytes of a stream of chunks, which must add up to ``expected_bytes``
    (see ``Unframer`` for the checks)."""
    unframer = Unframer(expected_bytes, max_chunk_bytes=max_chunk_bytes)
    for chunk in chunks:
        unframer.add(chunk)
    return unframer.result()


def _checked_size(index: int, chunk: BytesLike, total: int, expected_bytes: int, max_chunk_bytes: int) -> int:
    if len(chunk) > max_chunk_bytes:
        raise CodecError(f"chunk {index}: {len(chunk)} bytes exceeds the chunk limit {max_chunk_bytes}")
    try:
        size = zstandard.frame_content_size(chunk)
    except zstandard.ZstdError as exc:
        raise CodecError(f"chunk {index}: not a zstd frame ({exc})") from None
    if size <= 0:
        reason = "does not declare its content size" if size < 0 else "is empty"
        raise CodecError(f"chunk {index}: zstd frame {reason}")
    if size > max_chunk_bytes:
        raise CodecError(f"chunk {index}: declares {size} payload bytes, over the chunk limit {max_chunk_bytes}")
    if total + size > expected_bytes:
        raise CodecError(
            f"chunk {index}: stream carries more than the expected {expected_bytes} bytes "
            f"({total} so far plus {size})"
        )
    return size
