"""Frame header: encoding and an incremental, transactional parser.

Rules:
- Rule 1: a frame is an 18-byte header followed by ``length`` payload bytes. The header is
  checked field by field the moment its 18 bytes are present, before any payload is buffered.
- Rule 2: the header is big-endian: magic "BT", version, type, flags, reserved (0), stream id
  (u32), payload length (u32), crc32 of the 14 bytes before it (u32).
- Rule 3: parsing is transactional: a frame is returned only once complete; until then the
  buffer is unchanged, so any split of the input yields the same frames.
- Rule 4: nothing here knows about sessions or messages; the length limit is the caller's.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
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
    BLOCK_UPDATE = 0x20
    STREAM_OPEN = 0x30
    STREAM_CHUNK = 0x31
    STREAM_END = 0x32
    PIPELINE_FORWARD = 0x40
    PIPELINE_RESULT = 0x41


class Flags(IntFlag):
    NONE = 0
    COMPRESSED = 0x01  # some of the payload is lz4-compressed (see the message's rules)
    SEALED = 0x02  # the payload is AES-256-GCM ciphertext + 16-byte tag


KNOWN_FLAGS = int(Flags.COMPRESSED | Flags.SEALED)


@dataclass(frozen=True)
class FrameHeader:
    type: MessageType
    flags: Flags
    stream_id: int
    length: int
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        head = HEADER.pack(MAGIC, self.version, int(self.type), int(self.flags), 0, self.stream_id, self.length, 0)
        return head[:_CRC_SPAN] + struct.pack(">I", zlib.crc32(head[:_CRC_SPAN]))


def encode_header(type_: MessageType, flags: int, stream_id: int, length: int) -> bytes:
    if not 0 <= stream_id < 2**32:
        raise LocalProtocolError(f"stream id {stream_id} out of range", ErrorCode.PROTOCOL_ERROR)
    if not 0 <= length <= MAX_FRAME_BYTES:
        raise LocalProtocolError(f"payload of {length} bytes exceeds MAX_FRAME_BYTES {MAX_FRAME_BYTES}",
                                 ErrorCode.FRAME_TOO_LARGE)
    return FrameHeader(MessageType(type_), Flags(flags), stream_id, length).pack()


def parse_header(buf, max_frame_bytes: int = MAX_FRAME_BYTES) -> FrameHeader:
    """Validate and decode an 18-byte header; raises LocalProtocolError (callers convert)."""
    magic, version, type_, flags, reserved, stream_id, length, crc = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise LocalProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})", ErrorCode.BAD_MAGIC)
    if zlib.crc32(bytes(buf[:_CRC_SPAN])) != crc:
        raise LocalProtocolError("frame header checksum mismatch", ErrorCode.BAD_HEADER_CHECKSUM)
    if version != PROTOCOL_VERSION:
        raise LocalProtocolError(f"unsupported protocol version {version} (this peer speaks {PROTOCOL_VERSION})",
                                 ErrorCode.UNSUPPORTED_VERSION)
    try:
        mtype = MessageType(type_)
    except ValueError:
        raise LocalProtocolError(f"unknown message type 0x{type_:02x}", ErrorCode.UNKNOWN_TYPE) from None
    if flags & ~KNOWN_FLAGS or reserved != 0:
        raise LocalProtocolError(f"reserved flag bits or reserved byte set (flags 0x{flags:02x}, reserved {reserved})",
                                 ErrorCode.BAD_FLAGS)
    if length > max_frame_bytes:
        raise LocalProtocolError(f"frame length {length} exceeds limit {max_frame_bytes}", ErrorCode.FRAME_TOO_LARGE)
    return FrameHeader(mtype, Flags(flags), stream_id, length, version)


class FrameBuffer:
    """Incremental frame splitter: ``feed(bytes)``, then ``next_frame()`` until it returns None."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        self._buf = bytearray()
        self._pos = 0
        self._header: FrameHeader | None = None
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data) -> None:
        if self._pos and self._pos > len(self._buf) // 2:  # compact without quadratic copying
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def next_frame(self) -> tuple[FrameHeader, memoryview] | None:
        """The next complete (header, payload) or None; raises LocalProtocolError on a bad header."""
        if self._header is None:
            if self.buffered < HEADER_BYTES:
                return None
            self._header = parse_header(memoryview(self._buf)[self._pos:self._pos + HEADER_BYTES],
                                        self.max_frame_bytes)
        h = self._header
        if self.buffered < HEADER_BYTES + h.length:
            return None
        start = self._pos + HEADER_BYTES
        payload = bytes(self._buf[start:start + h.length])
        self._pos = start + h.length
        self._header = None
        return h, memoryview(payload)
