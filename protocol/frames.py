"""Frame header: encoding and an incremental, transactional parser.

Rules:
- Rule 1: a frame is an 18-byte header followed by ``length`` payload bytes. The header is
  checked field by field the moment its 18 bytes are present, before any payload is buffered.
- Rule 2: the header is big-endian: magic "BT", version, type, flags, reserved (0), stream id
  (u32), payload length (u32), crc32 of the 14 bytes before it (u32).
- Rule 3: parsing is transactional: a frame is returned only once complete; until then the
  buffer is unchanged, so any split of the input yields the same frames.
- Rule 4: nothing here knows about sessions; the caller's ``check_header`` (the frame limit and
  the flag and type rules of the connection's state) runs the moment a header parses, before
  any byte of its payload is awaited.
- Rule 5: what a peer makes us hold is bounded by what it sent: small fed pieces are joined
  (``COALESCE_BYTES``), so a peer sending one byte at a time costs a few bytes of overhead per
  byte, not a Python object per byte.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections import deque
from typing import NamedTuple
from enum import IntEnum, IntFlag

from .errors import ErrorCode, LocalProtocolError

MAGIC = b"BT"
PROTOCOL_VERSION = 1
HEADER = struct.Struct(">2sBBBBIII")
HEADER_BYTES = HEADER.size  # 18
_CRC_SPAN = HEADER_BYTES - 4
# The largest payload one frame may carry. 16 MiB holds a 4 MiB chunk with room to spare and
# bounds what a peer can make us buffer per connection before a frame is complete (h2 uses the
# same bound for its 24-bit length). Larger payloads travel as chunked streams.
MAX_FRAME_BYTES = 16 * 1024 * 1024


class MessageType(IntEnum):
    HANDSHAKE = 0x01
    ERROR = 0x02
    GOODBYE = 0x03
    PING = 0x04
    PONG = 0x05
    ANNOUNCE = 0x10
    PEER_LIST = 0x11
    STATUS = 0x12
    BLOCK_UPDATE = 0x20
    STREAM_OPEN = 0x30
    STREAM_CHUNK = 0x31
    STREAM_END = 0x32
    STREAM_REQUEST = 0x33
    STREAM_RESET = 0x34
    PIPELINE_FORWARD = 0x40
    PIPELINE_RESULT = 0x41


# Types whose payload may hold lz4 data (PROTOCOL.md section 3); COMPRESSED on any other type is
# BAD_FLAGS, from the header alone.
COMPRESSIBLE_TYPES = frozenset({MessageType.BLOCK_UPDATE, MessageType.STREAM_CHUNK, MessageType.PIPELINE_FORWARD,
                                MessageType.PIPELINE_RESULT})

# Types sent on a stream id other than 0 (a STREAM_REQUEST's id names the stream its answer will
# use); every other type is sent on stream 0. A frame breaking this is MALFORMED_METADATA.
STREAM_TYPES = frozenset({MessageType.STREAM_OPEN, MessageType.STREAM_CHUNK, MessageType.STREAM_END,
                          MessageType.STREAM_REQUEST, MessageType.STREAM_RESET})


class Flags(IntFlag):
    NONE = 0
    COMPRESSED = 0x01  # some of the payload is lz4-compressed (see the message's rules)
    SEALED = 0x02  # the payload is AES-256-GCM ciphertext + 16-byte tag


KNOWN_FLAGS = int(Flags.COMPRESSED | Flags.SEALED)
_COMPRESSED = int(Flags.COMPRESSED)  # a plain int: IntFlag arithmetic costs a microsecond per frame


_TYPES = {int(t): t for t in MessageType}
_HEAD14 = struct.Struct(">2sBBBBII")
_CRC = struct.Struct(">I")


class FrameHeader(NamedTuple):
    type: MessageType
    flags: int  # Flags bits
    stream_id: int
    length: int
    version: int = PROTOCOL_VERSION
    raw: bytes | None = None  # the 18 bytes it was parsed from, when parsed

    def pack(self) -> bytes:
        if self.raw is not None:
            return self.raw
        head = _HEAD14.pack(MAGIC, self.version, self.type, self.flags, 0, self.stream_id, self.length)
        return head + _CRC.pack(zlib.crc32(head))


def encode_header(type_: MessageType, flags: int, stream_id: int, length: int) -> bytes:
    if not 0 <= stream_id < 2**32:
        raise LocalProtocolError(f"stream id {stream_id} out of range", ErrorCode.PROTOCOL_ERROR)
    if not 0 <= length <= MAX_FRAME_BYTES + 16:  # + the AEAD tag of a sealed frame
        raise LocalProtocolError(f"payload of {length} bytes exceeds MAX_FRAME_BYTES {MAX_FRAME_BYTES}",
                                 ErrorCode.FRAME_TOO_LARGE)
    head = _HEAD14.pack(MAGIC, PROTOCOL_VERSION, type_, flags, 0, stream_id, length)
    return head + _CRC.pack(zlib.crc32(head))


def parse_header(buf, max_frame_bytes: int | None = MAX_FRAME_BYTES) -> FrameHeader:
    """Validate and decode an 18-byte header; raises LocalProtocolError (callers convert).

    Checks, in order: magic, crc, version, type, reserved bits and byte, COMPRESSED on a type that
    never compresses, the stream id against the type, then (unless ``max_frame_bytes`` is None:
    the caller checks it with the rest of its state's rules) the length."""
    magic, version, type_, flags, reserved, stream_id, length, crc = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise LocalProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})", ErrorCode.BAD_MAGIC)
    if zlib.crc32(buf[:_CRC_SPAN]) != crc:
        raise LocalProtocolError("frame header checksum mismatch", ErrorCode.BAD_HEADER_CHECKSUM)
    if version != PROTOCOL_VERSION:
        raise LocalProtocolError(f"unsupported protocol version {version} (this peer speaks {PROTOCOL_VERSION})",
                                 ErrorCode.UNSUPPORTED_VERSION)
    mtype = _TYPES.get(type_)
    if mtype is None:
        raise LocalProtocolError(f"unknown message type 0x{type_:02x}", ErrorCode.UNKNOWN_TYPE)
    if flags & ~KNOWN_FLAGS or reserved != 0:
        raise LocalProtocolError(f"reserved flag bits or reserved byte set (flags 0x{flags:02x}, reserved {reserved})",
                                 ErrorCode.BAD_FLAGS)
    if flags & _COMPRESSED and mtype not in COMPRESSIBLE_TYPES:
        raise LocalProtocolError(f"COMPRESSED flag on a {mtype.name} frame", ErrorCode.BAD_FLAGS)
    if (stream_id != 0) is not (mtype in STREAM_TYPES):
        raise LocalProtocolError(f"{mtype.name} on stream {stream_id}: " + (
            "streams use a stream id other than 0" if stream_id == 0 else "only stream messages use a stream id"),
            ErrorCode.MALFORMED_METADATA)
    if max_frame_bytes is not None and length > max_frame_bytes:
        raise LocalProtocolError(f"frame length {length} exceeds limit {max_frame_bytes}", ErrorCode.FRAME_TOO_LARGE)
    return FrameHeader(mtype, flags, stream_id, length, version, bytes(buf[:HEADER_BYTES]))


# Payloads at least this large, when they must be assembled from several pieces, go into a
# reused buffer: fresh multi-MiB allocations cost page faults (about 2 GB/s here, against
# 5-10 GB/s for memcpy into memory already mapped).
REUSE_MIN_BYTES = 64 * 1024
# Fed pieces smaller than this are joined to the piece before them while both fit in it: each
# piece costs about 200 bytes of Python objects (a bytes and a memoryview), so a peer sending
# one byte at a time would otherwise make us hold 200 times what it sent. 4 KiB keeps that
# overhead under 5% and each join's copy under a page.
COALESCE_BYTES = 4096


class ReusableBuffer:
    """A few bytearrays handed out again only when nobody still holds a view of them.

    ``get(n)`` returns a writable view of n bytes from the first buffer of the pool that no
    earlier view still holds (a message someone kept, a transport still sending it). When all are
    held, a buffer that another pool let go of and nobody holds any more is taken over, else a new
    one is made; a full pool hands its oldest (still held) buffer to the process's spare list,
    where any pool of this thread can take it over once its holders let go. Frames in flight
    beyond the pool (parts a member sent for a round we have not begun, writes the socket has not
    taken) so cost no fresh memory once the spares have grown to them. The spare list is bounded
    (SPARE_BYTES per thread). Reuse never overwrites data in use.

    A pool keeps its buffers while its owner lives; ``shed()`` (the driver calls it once a
    connection is idle or over) hands the free ones to the spares, whose overflow goes back to the
    allocator: what idle connections hold between them is so bounded by SPARE_BYTES, whatever their
    number. ``uses`` counts the buffers handed out, so a driver tells an idle pool by it not moving.
    The spares themselves are a cache of the thread's recent traffic: ``drop_spares()`` (the driver
    calls it once no pool took one for a while) gives them all back, so a burst's buffers do not
    stay with the process after it.
    """

    POOL = 3  # a frame being consumed, one being assembled, one spare
    SPARE_BYTES = 64 * 1024 * 1024

    def __init__(self) -> None:
        self._pool: list[bytearray] = []
        self.uses = 0

    @property
    def buffer_bytes(self) -> int:
        """Bytes this pool holds (free or still viewed)."""
        return sum(map(len, self._pool))

    @classmethod
    def spare_bytes(cls) -> int:
        """Bytes this thread's spare list holds (at most SPARE_BYTES)."""
        return sum(map(len, cls.spares()))

    @staticmethod
    def spares_taken() -> int:
        """How many spares this thread's pools took over so far (a driver tells idle spares by it)."""
        return getattr(_spare_buffers, "taken", 0)

    @classmethod
    def drop_spares(cls) -> int:
        """Let go of this thread's whole spare list (each buffer is freed with its last view); the
        bytes dropped."""
        spares = cls.spares()
        dropped = sum(map(len, spares))
        spares.clear()
        return dropped

    @classmethod
    def _cap_spares(cls, spares: list) -> int:
        """Drop the oldest spares beyond SPARE_BYTES (back to the allocator); the bytes dropped."""
        dropped, total = 0, sum(map(len, spares))
        while total > cls.SPARE_BYTES:
            n = len(spares.pop(0))
            dropped += n
            total -= n
        return dropped

    def shed(self, ended: bool = False) -> int:
        """Hand every free buffer (no view alive) to the spares; returns the bytes dropped from
        the spares to stay within SPARE_BYTES. Buffers still viewed stay in the pool, unless the
        owner ``ended``: then the pool lets go of them too (each is freed with its last view, not
        with its owner), and they count as dropped."""
        free = [self._free(b) for b in self._pool]
        spares = self.spares()
        spares.extend(b for b, f in zip(self._pool, free) if f and len(b) >= REUSE_MIN_BYTES)
        kept = [b for b, f in zip(self._pool, free) if not f]
        self._pool = [] if ended else kept
        return self._cap_spares(spares) + (sum(map(len, kept)) if ended else 0)

    @staticmethod
    def _free(buf: bytearray) -> bool:
        try:
            buf.append(0)  # resizing fails while any view of the buffer is alive
            del buf[-1]
            return True
        except BufferError:
            return False

    @staticmethod
    def spares() -> list:
        """This thread's spare buffers (at most SPARE_BYTES), which any pool of the thread may take over."""
        spares = getattr(_spare_buffers, "list", None)
        if spares is None:
            spares = _spare_buffers.list = []
        return spares

    def get(self, n: int) -> memoryview:
        self.uses += 1
        for buf in self._pool:
            if self._free(buf):
                if len(buf) < n:
                    buf.extend(bytes(n - len(buf)))
                return memoryview(buf)[:n]
        spares = self.spares()
        i = next((i for i, b in enumerate(spares) if len(b) >= n and self._free(b)), None)
        if i is not None:
            _spare_buffers.taken = self.spares_taken() + 1
        buf = spares.pop(i) if i is not None else bytearray(n)  # by position: bytearrays compare by content
        if len(self._pool) >= self.POOL:
            old = self._pool.pop(0)
            if len(old) >= REUSE_MIN_BYTES:
                spares.append(old)
                self._cap_spares(spares)
        self._pool.append(buf)
        return memoryview(buf)[:n]


_spare_buffers = threading.local()


class FrameBuffer:
    """Incremental frame splitter: ``feed(bytes)``, then ``next_frame()`` until it returns None.

    Fed ``bytes`` (and read-only views) are kept by reference (no copy); a payload that lies
    inside one fed piece is returned as a view of it, one spread over several pieces is copied
    once, into a reused buffer when it is large. Mutable inputs (bytearray, writable memoryview)
    are copied on feed, since the caller may reuse them.

    Large payloads can also be received in place: ``receive_buffer()`` hands out the rest of the
    current payload's buffer and ``received_into(n)`` says how much was written there, so a
    socket reads straight into it (no copy after the kernel's).
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES, check_header=None):
        self._chunks: deque[memoryview] = deque()
        self._size = 0
        self._header: FrameHeader | None = None
        self.max_frame_bytes = max_frame_bytes
        # fn(FrameHeader) run as each header parses; raises LocalProtocolError to refuse the frame.
        # The default checks the length against ``max_frame_bytes``.
        self.check_header = check_header or self._check_length
        self._assembly = ReusableBuffer()
        self._direct: memoryview | None = None  # the payload being received in place
        self._direct_pos = 0

    def _check_length(self, h: FrameHeader) -> None:
        if h.length > self.max_frame_bytes:
            raise LocalProtocolError(f"frame length {h.length} exceeds limit {self.max_frame_bytes}",
                                     ErrorCode.FRAME_TOO_LARGE)

    def _parse(self, buf) -> FrameHeader:
        h = parse_header(buf, None)
        self.check_header(h)
        return h

    @property
    def assembly(self) -> ReusableBuffer:
        """The pool large payloads are assembled or received in place into."""
        return self._assembly

    def clear(self) -> None:
        """Drop everything buffered (the connection is over: nothing more will be parsed)."""
        self._chunks.clear()
        self._size = 0
        self._header, self._direct, self._direct_pos = None, None, 0

    def receive_buffer(self) -> memoryview | None:
        """Where to write the rest of the current large payload, or None (use ``feed``)."""
        if self._direct is not None:
            return self._direct[self._direct_pos:]
        h = self._header
        if h is None or h.length < REUSE_MIN_BYTES or self._size >= HEADER_BYTES + h.length:
            return None
        target = self._assembly.get(h.length)
        self._take(HEADER_BYTES)
        n = self._size  # every buffered byte belongs to this payload: the frame is incomplete
        pos = 0
        while self._chunks:
            c = self._chunks.popleft()
            target[pos:pos + len(c)] = c
            pos += len(c)
        self._size = 0
        self._direct, self._direct_pos = target, n
        return target[n:]

    def received_into(self, n: int) -> None:
        if self._direct is None or not 0 <= n <= len(self._direct) - self._direct_pos:
            raise LocalProtocolError("received_into without a matching receive_buffer")
        self._direct_pos += n

    def feed(self, data) -> None:
        if not len(data):
            return
        n = len(data)
        if n < COALESCE_BYTES and self._chunks and len(self._chunks[-1]) + n <= COALESCE_BYTES:
            self._chunks[-1] = memoryview(b"".join((self._chunks[-1], data)))  # a few KiB copied at most
            self._size += n
            return
        if not (isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly)):
            data = bytes(data)
        self._chunks.append(memoryview(data))
        self._size += n

    @property
    def buffered(self) -> int:
        return self._size + self._direct_pos

    def _take(self, n: int) -> memoryview:
        """Remove and return the next n bytes (a view when they lie in one piece)."""
        first = self._chunks[0]
        if len(first) >= n:
            out = first[:n]
            if len(first) == n:
                self._chunks.popleft()
            else:
                self._chunks[0] = first[n:]
            self._size -= n
            return out
        out = self._assembly.get(n) if n >= REUSE_MIN_BYTES else memoryview(bytearray(n))
        pos = 0
        while pos < n:
            c = self._chunks[0]
            k = min(len(c), n - pos)
            out[pos:pos + k] = c[:k]
            pos += k
            if k == len(c):
                self._chunks.popleft()
            else:
                self._chunks[0] = c[k:]
        self._size -= n
        return out

    def _peek(self, n: int) -> bytes | memoryview:
        first = self._chunks[0]
        if len(first) >= n:
            return first[:n]
        out = bytearray()
        for c in self._chunks:
            out += c[:n - len(out)]
            if len(out) == n:
                break
        return bytes(out)

    def next_frame(self) -> tuple[FrameHeader, memoryview] | None:
        """The next complete (header, payload) or None; raises LocalProtocolError on a bad header."""
        if self._direct is not None:
            if self._direct_pos < len(self._direct):
                return None
            h, payload = self._header, self._direct
            assert h is not None  # receive_buffer gives a payload in place only for a parsed header
            self._header, self._direct, self._direct_pos = None, None, 0
            return h, payload
        if self._header is None and self._chunks and len(self._chunks[0]) >= HEADER_BYTES:
            first = self._chunks[0]  # fast path: the whole frame lies in the first piece
            h = self._parse(first)
            end = HEADER_BYTES + h.length
            if len(first) >= end:
                if len(first) == end:
                    self._chunks.popleft()
                else:
                    self._chunks[0] = first[end:]
                self._size -= end
                return h, first[HEADER_BYTES:end]
            self._header = h
        if self._header is None:
            if self._size < HEADER_BYTES:
                return None
            self._header = self._parse(self._peek(HEADER_BYTES))
        h = self._header
        if self._size < HEADER_BYTES + h.length:
            return None
        self._take(HEADER_BYTES)
        payload = self._take(h.length) if h.length else memoryview(b"")
        self._header = None
        return h, payload
