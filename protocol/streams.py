"""Chunked streams: payloads larger than a frame, sent as offset-addressed chunks, resumable.

Rules:
- Rule 1: a stream is StreamOpen (kind, name, total size, sha256, first offset), StreamChunk*
  (each at the offset right after the previous one), StreamEnd, all on one stream id != 0.
- Rule 2: the receiver keeps what it has; a new StreamOpen for the same (kind, name, sha256)
  may start at any offset <= what it holds (resume), from the same sender or another.
- Rule 3: at StreamEnd the receiver checks size and sha256; a mismatch discards the data and is
  a RemoteProtocolError(STREAM_INTEGRITY). A gap or overlap is STREAM_ERROR.
"""

from __future__ import annotations

import hashlib

from .errors import ErrorCode, RemoteProtocolError
from .events import StreamChunk, StreamEnd, StreamOpen

# 4 MiB: large enough that per-frame costs vanish (header, seal, syscall), small enough that a
# heartbeat never waits behind more than a few milliseconds of one chunk on a 1 GB/s link.
CHUNK_SIZE_BYTES = 4 * 1024 * 1024
# Default bound on one stream a receiver accepts; callers pass their own.
MAX_STREAM_BYTES = 8 * 1024 * 1024 * 1024


def stream_messages(stream_id: int, kind: str, name: str, data, offset: int = 0,
                    chunk_size: int = CHUNK_SIZE_BYTES, meta: dict | None = None):
    """Yield StreamOpen, the chunks from ``offset``, StreamEnd (chunks are zero-copy views)."""
    mv = memoryview(data).cast("B")
    yield StreamOpen(kind=kind, name=name, total_size=len(mv), sha256=hashlib.sha256(mv).digest(),
                     offset=offset, meta=dict(meta or {}), stream_id=stream_id)
    for off in range(offset, len(mv), chunk_size):
        yield StreamChunk(offset=off, data=mv[off:off + chunk_size], stream_id=stream_id)
    yield StreamEnd(stream_id=stream_id)


class StreamReceiver:
    """Reassembles one logical payload (identified by kind, name, sha256) across attempts."""

    def __init__(self, max_bytes: int = MAX_STREAM_BYTES):
        self.max_bytes = max_bytes
        self.open: StreamOpen | None = None
        self.buf = bytearray()
        self.stream_id = 0
        self.done = False

    @property
    def resume_offset(self) -> int:
        return len(self.buf)

    def _err(self, msg, code=ErrorCode.STREAM_ERROR):
        return RemoteProtocolError(msg, code)

    def on_open(self, m: StreamOpen):
        if m.total_size > self.max_bytes:
            raise self._err(f"stream of {m.total_size} bytes exceeds the limit {self.max_bytes}")
        if self.open is not None and (m.kind, m.name, m.sha256) != (self.open.kind, self.open.name, self.open.sha256):
            self.buf.clear()  # a different payload: start over
        if m.offset > len(self.buf):
            raise self._err(f"stream opens at offset {m.offset}, we hold only {len(self.buf)} bytes")
        del self.buf[m.offset:]
        self.open, self.stream_id, self.done = m, m.stream_id, False

    def on_chunk(self, m: StreamChunk):
        if self.open is None or m.stream_id != self.stream_id:
            raise self._err(f"chunk for stream {m.stream_id}, which is not open")
        if m.offset != len(self.buf):
            raise self._err(f"chunk at offset {m.offset}, expected {len(self.buf)}")
        if len(self.buf) + len(m.data) > self.open.total_size:
            raise self._err(f"chunk runs past the announced size {self.open.total_size}")
        self.buf += m.data

    def on_end(self, m: StreamEnd) -> bytes:
        if self.open is None or m.stream_id != self.stream_id:
            raise self._err(f"end of stream {m.stream_id}, which is not open")
        if len(self.buf) != self.open.total_size:
            raise self._err(f"stream ended at {len(self.buf)} of {self.open.total_size} bytes")
        if hashlib.sha256(self.buf).digest() != self.open.sha256:
            self.buf.clear()
            raise self._err("stream sha256 mismatch: data discarded", ErrorCode.STREAM_INTEGRITY)
        self.done = True
        return bytes(self.buf)
