"""The push log: every accepted push's header and int4 payload, appended to a file in
the shard's data directory, so ``diloco replay`` can re-run the shard's rounds exactly.

Record: ``<u32 header length><u32 payload length><JSON header><payload>`` (little
endian). The header is the push's meta as ``diloco.syncer.core.snapshot.push_out`` writes it
(without the payload) plus ``wire_bytes``. Each record is flushed to the OS as it is
written (a killed shard loses nothing; a power cut may lose the tail, which the reader
reports and skips).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from diloco.errors import InvalidArgument, NotFound
from diloco.files import private_append
from diloco.wire import PushMeta
from diloco.syncer.core.shard import PushPayload, inspect_payload
from diloco.syncer.core.snapshot import meta_in, meta_out

logger = logging.getLogger(__name__)

_LENGTHS = struct.Struct("<II")


def log_name(shard_id: int) -> str:
    return f"pushes-S{shard_id}.log"


class PushLogWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = private_append(self.path, binary=True)

    def append(self, meta: PushMeta, payload: PushPayload, wire_bytes: int) -> None:
        if self._file is None:
            raise InvalidArgument(f"push log {self.path} is closed")
        header = json.dumps({"meta": meta_out(meta), "wire_bytes": wire_bytes}, separators=(",", ":")).encode()
        body = [bytes(t.payload) for t in payload.tensors]
        self._file.write(_LENGTHS.pack(len(header), sum(len(b) for b in body)))
        self._file.write(header)
        for b in body:
            self._file.write(b)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_push_log(path: str | Path) -> Iterator[tuple[PushMeta, PushPayload, int]]:
    """Pushes in the order they were accepted, each payload validated again. A truncated
    last record is skipped with a warning."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no push log at {path}")
    data = memoryview(path.read_bytes())
    offset = 0
    while offset < len(data):
        if offset + _LENGTHS.size > len(data):
            logger.warning("push log %s: skipping a truncated last record", path)
            return
        header_len, payload_len = _LENGTHS.unpack_from(data, offset)
        start = offset + _LENGTHS.size
        end = start + header_len + payload_len
        if end > len(data):
            logger.warning("push log %s: skipping a truncated last record", path)
            return
        try:
            header = json.loads(bytes(data[start : start + header_len]))
            meta = meta_in(header["meta"])
        except (ValueError, KeyError, TypeError) as error:
            raise InvalidArgument(f"push log {path}: corrupt header at byte {offset}: {error}") from None
        yield meta, inspect_payload(meta.specs, data[start + header_len : end]), int(header["wire_bytes"])
        offset = end
