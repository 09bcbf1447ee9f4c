"""Chunked streams: payloads larger than a frame, sent as offset-addressed chunks, resumable.

Rules:
- Rule 1: a stream is StreamOpen (kind, name, total size, sha256, first offset), StreamChunk*
  (each at the offset right after the previous one), StreamEnd, all on one stream id != 0.
- Rule 2: the receiver keeps what it has; a new StreamOpen for the same (kind, name, sha256)
  may start at any offset <= what it holds (resume), from the same sender or another.
- Rule 3: at StreamEnd the receiver checks size and sha256; a mismatch discards the data and is
  a ``StreamFailed`` (STREAM_INTEGRITY). A gap, an overrun or a short end is STREAM_ERROR.
- Rule 4: a failed stream is the stream's business, not the connection's: ``StreamFailed`` says
  which stream, and ``reset_message()`` is the StreamReset that tells the other end (the
  connection stays up). A StreamReset from the other end (``on_reset``) fails the stream too.
"""

from __future__ import annotations

import hashlib

from .errors import ErrorCode, RemoteProtocolError
from .events import MAX_REASON_CHARS, StreamChunk, StreamEnd, StreamOpen, StreamReset

# 4 MiB: large enough that per-frame costs vanish (header, seal, syscall), small enough that a
# heartbeat never waits behind more than a few milliseconds of one chunk on a 1 GB/s link.
CHUNK_SIZE_BYTES = 4 * 1024 * 1024
# Default bound on one stream a receiver accepts; callers pass their own.
MAX_STREAM_BYTES = 8 * 1024 * 1024 * 1024


class StreamFailed(RemoteProtocolError):
    """One stream failed (``code``: STREAM_ERROR, STREAM_INTEGRITY, or the code of the other end's
    StreamReset); the connection is not affected. ``by_peer``: the other end reset the stream
    (do not answer it with a reset)."""

    def __init__(self, msg: str, code: ErrorCode, stream_id: int, by_peer: bool = False):
        super().__init__(msg, code)
        self.stream_id = stream_id
        self.by_peer = by_peer

    def reset_message(self) -> StreamReset:
        """The StreamReset that tells the other end why this stream ended."""
        return StreamReset(code=int(self.code), reason=str(self)[:MAX_REASON_CHARS], stream_id=self.stream_id)


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

    def _err(self, msg, code=ErrorCode.STREAM_ERROR, stream_id=None):
        return StreamFailed(msg, code, self.stream_id if stream_id is None else stream_id)

    def on_open(self, m: StreamOpen):
        if m.total_size > self.max_bytes:
            raise self._err(f"stream of {m.total_size} bytes exceeds the limit {self.max_bytes}", stream_id=m.stream_id)
        if self.open is not None and (m.kind, m.name, m.sha256) != (self.open.kind, self.open.name, self.open.sha256):
            self.buf.clear()  # a different payload: start over
        if m.offset > len(self.buf):
            raise self._err(f"stream opens at offset {m.offset}, we hold only {len(self.buf)} bytes",
                            stream_id=m.stream_id)
        del self.buf[m.offset:]
        self.open, self.stream_id, self.done = m, m.stream_id, False

    def on_chunk(self, m: StreamChunk):
        if self.open is None or m.stream_id != self.stream_id:
            raise self._err(f"chunk for stream {m.stream_id}, which is not open", stream_id=m.stream_id)
        if m.offset != len(self.buf):
            raise self._err(f"chunk at offset {m.offset}, expected {len(self.buf)}")
        if len(self.buf) + len(m.data) > self.open.total_size:
            raise self._err(f"chunk runs past the announced size {self.open.total_size}")
        self.buf += m.data

    def on_end(self, m: StreamEnd) -> bytes:
        if self.open is None or m.stream_id != self.stream_id:
            raise self._err(f"end of stream {m.stream_id}, which is not open", stream_id=m.stream_id)
        if len(self.buf) != self.open.total_size:
            raise self._err(f"stream ended at {len(self.buf)} of {self.open.total_size} bytes")
        if hashlib.sha256(self.buf).digest() != self.open.sha256:
            self.buf.clear()
            raise self._err("stream sha256 mismatch: data discarded", ErrorCode.STREAM_INTEGRITY)
        self.done = True
        return bytes(self.buf)

    def on_reset(self, m: StreamReset):
        """The other end ended the stream: always raises ``StreamFailed`` (``by_peer``) with its
        code; the bytes received so far are kept for a resume from another sender."""
        try:
            code = ErrorCode(m.code)
        except ValueError:
            code = ErrorCode.STREAM_ERROR
        raise StreamFailed(f"the sender reset stream {m.stream_id}: {m.reason} ({code.name})", code, m.stream_id,
                           by_peer=True)
