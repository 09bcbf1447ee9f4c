"""Protocol errors and wire error codes.

Rules:
- ``LocalProtocolError``: our caller asked for something the protocol forbids.
- ``RemoteProtocolError``: the peer sent something the protocol forbids.
- Every error carries the ``ErrorCode`` sent in the Error frame that closes the connection.
- Code ranges: 0x0000-0x00FF framing and messages, 0x0100-0x01FF handshake and session,
  0x0200-0x02FF application, 0x8000-0xFFFF private use (never sent by this implementation).
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    NO_ERROR = 0x0000
    PROTOCOL_ERROR = 0x0001  # generic violation
    BAD_MAGIC = 0x0002
    UNSUPPORTED_VERSION = 0x0003
    UNKNOWN_TYPE = 0x0004
    FRAME_TOO_LARGE = 0x0005
    BAD_HEADER_CHECKSUM = 0x0006
    BAD_FLAGS = 0x0007
    MALFORMED_METADATA = 0x0008
    UNEXPECTED_MESSAGE = 0x0009  # valid message, wrong state
    BAD_TENSOR = 0x000A
    STREAM_ERROR = 0x000B  # offset, size or ordering of a chunked stream
    STREAM_INTEGRITY = 0x000C  # sha256 of a reassembled stream differs
    HANDSHAKE_FAILED = 0x0100
    AUTHENTICATION_FAILED = 0x0101  # wrong swarm key, or a tampered handshake
    PEER_NOT_ALLOWED = 0x0102  # identity outside the allowlist
    DECRYPT_FAILED = 0x0103  # a sealed frame was tampered, reordered or replayed
    INTERNAL_ERROR = 0x0200
    OVERLOADED = 0x0201
    TIMEOUT = 0x0202
    BAD_UPDATE = 0x0203  # an update failed validation (shape, dtype, finiteness, norm)


class ProtocolError(Exception):
    """Base of protocol errors; ``code`` is the ErrorCode for the closing Error frame."""

    def __init__(self, msg: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR):
        super().__init__(msg)
        self.code = ErrorCode(code)

    def __repr__(self):
        return f"{type(self).__name__}({str(self)!r}, code={self.code.name})"


class LocalProtocolError(ProtocolError):
    """Our caller violated the protocol (e.g. sent before the handshake finished)."""


class RemoteProtocolError(ProtocolError):
    """The peer violated the protocol; the connection is in ERROR after this."""


def as_remote(err: LocalProtocolError) -> RemoteProtocolError:
    """Parsing code raises Local errors internally; input from the peer converts them."""
    e = RemoteProtocolError(str(err), err.code)
    e.__cause__ = err
    return e
