"""Messages (events): frozen dataclasses, validated in the constructor, and their payloads.

Rules:
- Rule 1: every message type has exactly one class here, registered in ``MESSAGES`` by its
  ``MessageType``; its payload encoding is ``encode_payload`` / ``decode_payload``, nowhere else.
- Rule 2: a msgpack payload is ``u32 meta_len | meta (msgpack map, string keys) | body``; the
  body is the tensors' stored segments, in the order the map lists them. Keys are exactly the
  class's wire fields: a missing or unknown key, a wrong type, or trailing bytes is
  MALFORMED_METADATA.
- Rule 3: HANDSHAKE carries raw Noise message bytes; STREAM_CHUNK carries ``u64 offset |
  u32 raw_len | data`` (lz4 block data of raw_len bytes when the frame's COMPRESSED flag is set).
- Rule 4: constructors raise LocalProtocolError; decoding converts to RemoteProtocolError.
- Rule 5: metadata is canonical msgpack (PROTOCOL.md section 3): a decoded map must re-encode to
  exactly the bytes received, so non-minimal integers and lengths, float 32, duplicate or
  non-string map keys and ext types are MALFORMED_METADATA; keys may come in any order.
- Rule 6: stream messages (``ON_STREAM``) use a stream id other than 0; every other message
  uses stream 0.
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass, field, fields
from typing import ClassVar

import lz4.block
import msgpack

from .errors import ErrorCode, LocalProtocolError
from .frames import COMPRESSIBLE_TYPES, MAX_FRAME_BYTES, Flags, FrameBuffer, FrameHeader, MessageType
from .tensors import Codec, WireTensor, maybe_lz4, describe, from_description

_U32 = struct.Struct(">I")
_CHUNK = struct.Struct(">QI")
# Bounds on metadata, so that a peer cannot make msgpack build huge objects.
MAX_META_BYTES = 1024 * 1024
MAX_LIST_LEN = 4096  # peers in a list, tensors in a message
MAX_STR_BYTES = 4096
# Error and StreamReset reasons: a diagnostic line, not a document.
MAX_REASON_CHARS = 4096
# A "host:port" address: a host of up to 255 chars (RFC 1035's bound on a name), ':' and a port
# of up to 5 digits, with one char to spare (the r0 bound, kept).
MAX_ADDR_CHARS = 262
# Blocks one peer record (or hello) may list: a peer holds a few blocks of a model cut into a
# handful (3 by default); 64 bounds the list far above any cut the model code allows in practice.
MAX_PEER_BLOCKS = 64
# Hops of a serving route: one per block, so the same bound as a record's blocks.
MAX_ROUTE_HOPS = MAX_PEER_BLOCKS


def _bad(msg: str) -> LocalProtocolError:
    return LocalProtocolError(msg, ErrorCode.MALFORMED_METADATA)


def _check(cond: bool, msg: str):
    if not cond:
        raise _bad(msg)


def _is_str(v, limit=MAX_STR_BYTES):
    return isinstance(v, str) and len(v) <= limit


def _is_uint(v, bits=64):
    return type(v) is int and 0 <= v < (1 << bits)  # type() is: bool is not an int here


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[MessageType]  # set by every subclass
    ON_STREAM: ClassVar[bool] = False  # True: sent on a stream id other than 0; False: on stream 0 only
    stream_id: int = field(default=0, kw_only=True)  # header stream id; 0 = control stream

    def __post_init__(self):
        if not (type(self.stream_id) is int and 0 <= self.stream_id <= 0xFFFF_FFFF):
            raise _bad(f"stream_id {self.stream_id!r} is not a u32")
        if (self.stream_id != 0) is not self.ON_STREAM:
            raise _bad(f"{type(self).__name__} must use " + ("a stream id other than 0" if self.ON_STREAM
                                                              else f"stream 0, not {self.stream_id}"))


# --- session -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Handshake(Message):
    TYPE = MessageType.HANDSHAKE
    data: bytes = b""

    def __post_init__(self):
        super().__post_init__()
        _check(isinstance(self.data, (bytes, bytearray, memoryview)) and len(self.data) <= 65535,
               "handshake data must be <= 65535 bytes")


@dataclass(frozen=True)
class Error(Message):
    TYPE = MessageType.ERROR
    code: int = int(ErrorCode.PROTOCOL_ERROR)
    reason: str = ""

    def __post_init__(self):
        super().__post_init__()
        if not (_is_uint(self.code, 16)):
            raise _bad(f"error code {self.code!r} is not a u16")
        _check(_is_str(self.reason, MAX_REASON_CHARS), "error reason must be a string of <= 4096 chars")


@dataclass(frozen=True)
class Goodbye(Message):
    TYPE = MessageType.GOODBYE
    reason: str = ""

    def __post_init__(self):
        super().__post_init__()
        _check(_is_str(self.reason), "goodbye reason must be a string of <= 4096 chars")


@dataclass(frozen=True)
class Ping(Message):
    TYPE = MessageType.PING
    nonce: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not (type(self.nonce) is int and 0 <= self.nonce <= 0xFFFF_FFFF_FFFF_FFFF):
            raise _bad("ping nonce must be a u64")


@dataclass(frozen=True)
class Pong(Message):
    TYPE = MessageType.PONG
    nonce: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not (type(self.nonce) is int and 0 <= self.nonce <= 0xFFFF_FFFF_FFFF_FFFF):
            raise _bad("pong nonce must be a u64")


# --- membership ----------------------------------------------------------------------------

ROLES = ("train", "serve", "client", "bootstrap")


def is_peer_id(x) -> bool:
    """A peer id as the handshake makes them: 64 lowercase hex characters (sha256 of a static key)."""
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


@dataclass(frozen=True)
class PeerInfo:
    peer_id: str  # hex sha256 of the peer's static public key
    addr: str  # "host:port" it listens on ("" for a client)
    blocks: tuple = ()
    role: str = "train"
    last_seen_ms: int = 0  # sender's age estimate of this record, milliseconds

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))
        _check(_is_str(self.peer_id, 64) and len(self.peer_id) == 64, "peer_id must be 64 hex chars")
        _check(is_peer_id(self.peer_id), "peer_id must be lowercase hex")
        _check(_is_str(self.addr, MAX_ADDR_CHARS), "addr must be a string 'host:port'")
        _check(len(self.blocks) <= MAX_PEER_BLOCKS and all(_is_uint(b, 16) for b in self.blocks), "blocks must be u16s")
        if not (self.role in ROLES):
            raise _bad(f"role must be one of {ROLES}")
        _check(_is_uint(self.last_seen_ms, 32), "last_seen_ms must be a u32")

    def to_wire(self) -> list:
        return [self.peer_id, self.addr, list(self.blocks), self.role, self.last_seen_ms]

    @classmethod
    def from_wire(cls, v) -> "PeerInfo":
        _check(isinstance(v, list) and len(v) == 5 and isinstance(v[2], list), "peer record must be a 5-list")
        return cls(v[0], v[1], tuple(v[2]), v[3], v[4])


@dataclass(frozen=True)
class Announce(Message):
    TYPE = MessageType.ANNOUNCE
    # None only as the missing argument's mark, which __post_init__ refuses (rule 4: a
    # LocalProtocolError, where a required field would raise TypeError)
    peer: PeerInfo = None  # type: ignore[assignment]

    def __post_init__(self):
        super().__post_init__()
        _check(isinstance(self.peer, PeerInfo), "announce needs a PeerInfo")


@dataclass(frozen=True)
class PeerList(Message):
    TYPE = MessageType.PEER_LIST
    peers: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "peers", tuple(self.peers))
        _check(len(self.peers) <= MAX_LIST_LEN and all(isinstance(p, PeerInfo) for p in self.peers),
               f"peer list must hold <= {MAX_LIST_LEN} PeerInfo")


@dataclass(frozen=True)
class Status(Message):
    """A status request (empty map) or reply (the peer's view: members, liveness, bytes moved)."""
    TYPE = MessageType.STATUS
    status: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        _check_meta(self.status)


# --- tensors -------------------------------------------------------------------------------

def _check_tensors(tensors):
    _check(len(tensors) <= MAX_LIST_LEN and all(isinstance(t, WireTensor) for t in tensors),
           f"tensors must be <= {MAX_LIST_LEN} WireTensors")
    names = [t.name for t in tensors]
    _check(len(set(names)) == len(names), "tensor names must be unique")


# BLOCK_UPDATE codecs: a tensor codec (every tensor encoded so), or ``topk``: a sparse update,
# three raw tensors (PROTOCOL.md section 7.1): ``idx`` int16 (C, k) positions in each chunk of
# TOPK_CHUNK_ELEMS elements, ``val`` int8 (C, k) and ``scale`` float32 (C,), value = val x scale.
# ``sign``: one bit per element and a scale per chunk, two raw tensors: ``bits`` uint8 (C, 512)
# (element i of a chunk is bit i % 8 of byte i // 8, least significant first) and ``scale``
# float32 (C,); value = +scale where the bit is 1, -scale where it is 0.
UPDATE_CODECS = ("raw", "fp16", "bf16", "int8", "topk", "sign")
TOPK_CHUNK_ELEMS = 4096
TOPK_TENSORS = (("idx", "int16"), ("val", "int8"), ("scale", "float32"))
SIGN_BYTES = TOPK_CHUNK_ELEMS // 8
SIGN_TENSORS = (("bits", "uint8"), ("scale", "float32"))


def _check_topk(tensors):
    """The structure of a ``topk`` update; the values (indices in range and increasing, scales
    finite) are the decoder's to check, before it uses any of them."""
    got = tuple((t.name, t.dtype) for t in tensors)
    if got != TOPK_TENSORS or any(t.codec is not Codec.RAW for t in tensors):
        raise LocalProtocolError(f"a topk update holds raw tensors {TOPK_TENSORS}, not {got}", ErrorCode.BAD_TENSOR)
    idx, val, scale = tensors
    if len(idx.shape) != 2 or idx.shape != val.shape or scale.shape != idx.shape[:1] \
            or idx.shape[1] > TOPK_CHUNK_ELEMS:
        raise LocalProtocolError(f"topk shapes idx {idx.shape}, val {val.shape}, scale {scale.shape}: expected "
                                 f"(C, k), (C, k), (C,) with k <= {TOPK_CHUNK_ELEMS}", ErrorCode.BAD_TENSOR)


def _check_sign(tensors):
    """The structure of a ``sign`` update; the values (scales finite, the padding's bits 0) are the
    decoder's to check, before it uses any of them."""
    got = tuple((t.name, t.dtype) for t in tensors)
    if got != SIGN_TENSORS or any(t.codec is not Codec.RAW for t in tensors):
        raise LocalProtocolError(f"a sign update holds raw tensors {SIGN_TENSORS}, not {got}", ErrorCode.BAD_TENSOR)
    bits, scale = tensors
    if len(bits.shape) != 2 or bits.shape[1] != SIGN_BYTES or scale.shape != bits.shape[:1]:
        raise LocalProtocolError(f"sign shapes bits {bits.shape}, scale {scale.shape}: expected (C, {SIGN_BYTES}), "
                                 "(C,)", ErrorCode.BAD_TENSOR)


def _check_meta(meta):
    _check(isinstance(meta, dict) and all(isinstance(k, str) for k in meta), "meta must be a str-keyed map")


@dataclass(frozen=True)
class BlockUpdate(Message):
    TYPE = MessageType.BLOCK_UPDATE
    block: int = 0
    round: int = 0
    codec: str = "raw"  # the update codec (error feedback, if any, is the sender's business)
    tensors: tuple = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _check(_is_uint(self.block, 16), "block must be a u16")
        _check(_is_uint(self.round), "round must be a u64")
        if not (self.codec in UPDATE_CODECS):
            raise _bad(f"unknown update codec {self.codec!r}")
        _check_tensors(self.tensors)
        if self.codec == "topk":
            _check_topk(self.tensors)
        elif self.codec == "sign":
            _check_sign(self.tensors)
        else:
            for t in self.tensors:  # one codec per update: the map's ``codec`` is every tensor's ``c``
                if t.codec.value != self.codec:
                    raise LocalProtocolError(f"tensor {t.name!r} uses codec {t.codec.value}, the update says "
                                             f"{self.codec}", ErrorCode.BAD_TENSOR)
        _check_meta(self.meta)


@dataclass(frozen=True)
class StreamOpen(Message):
    TYPE = MessageType.STREAM_OPEN
    ON_STREAM = True
    kind: str = "checkpoint"  # what the bytes are: checkpoint, lower-checkpoint, update, ...
    name: str = ""
    total_size: int = 0
    sha256: bytes = b"\0" * 32
    offset: int = 0  # first byte the sender will send (resume point)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        _check(_is_str(self.kind, 64) and _is_str(self.name, 1024), "kind/name too long")
        _check(_is_uint(self.total_size) and _is_uint(self.offset), "sizes must be u64s")
        if not (self.offset <= self.total_size):
            raise _bad(f"offset {self.offset} > total_size {self.total_size}")
        _check(isinstance(self.sha256, (bytes, bytearray)) and len(self.sha256) == 32, "sha256 must be 32 bytes")
        _check_meta(self.meta)


@dataclass(frozen=True)
class StreamChunk(Message):
    TYPE = MessageType.STREAM_CHUNK
    ON_STREAM = True
    offset: int = 0
    data: bytes | bytearray | memoryview = b""  # the raw (uncompressed) bytes; decoded: a view into the frame

    def __post_init__(self):
        super().__post_init__()
        _check(_is_uint(self.offset), "offset must be a u64")


@dataclass(frozen=True)
class StreamEnd(Message):
    TYPE = MessageType.STREAM_END
    ON_STREAM = True

    def __post_init__(self):
        super().__post_init__()


@dataclass(frozen=True)
class StreamRequest(Message):
    """Ask a peer to send payload (kind, name) from ``offset`` on this stream id."""
    TYPE = MessageType.STREAM_REQUEST
    ON_STREAM = True  # the stream id names the stream the answer will use
    kind: str = "checkpoint"
    name: str = ""
    offset: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not (_is_str(self.kind, 64) and _is_str(self.name, 1024) and _is_uint(self.offset)):
            raise _bad("stream request: kind/name too long or offset not a u64")


@dataclass(frozen=True)
class StreamReset(Message):
    """End one stream with an error code; the connection stays up (PROTOCOL.md section 7).

    Either end may send it: the receiver when the stream fails its checks (STREAM_ERROR,
    STREAM_INTEGRITY) or when it gives up (TIMEOUT, NO_ERROR), the sender when it cannot go on
    (INTERNAL_ERROR). Nothing more is sent on that stream id afterwards."""
    TYPE = MessageType.STREAM_RESET
    ON_STREAM = True
    code: int = int(ErrorCode.STREAM_ERROR)
    reason: str = ""

    def __post_init__(self):
        super().__post_init__()
        _check(_is_uint(self.code, 16), f"stream reset code {self.code!r} is not a u16")
        _check(_is_str(self.reason, MAX_REASON_CHARS), "stream reset reason must be a string of <= 4096 chars")


@dataclass(frozen=True)
class PipelineForward(Message):
    TYPE = MessageType.PIPELINE_FORWARD
    request_id: int = 0
    route: tuple = ()  # "host:port" of each hop, in order
    hop: int = 0  # index in route of the receiver
    tensors: tuple = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "route", tuple(self.route))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _check(_is_uint(self.request_id), "request_id must be a u64")
        _check(len(self.route) <= MAX_ROUTE_HOPS and all(_is_str(r, MAX_ADDR_CHARS) for r in self.route),
               f"route must be <= {MAX_ROUTE_HOPS} addrs")
        _check(_is_uint(self.hop, 16) and (not self.route or self.hop < len(self.route)), "hop outside route")
        _check_tensors(self.tensors)
        _check_meta(self.meta)


@dataclass(frozen=True)
class PipelineResult(Message):
    TYPE = MessageType.PIPELINE_RESULT
    request_id: int = 0
    tensors: tuple = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _check(_is_uint(self.request_id), "request_id must be a u64")
        _check_tensors(self.tensors)
        _check_meta(self.meta)


_CONVERTED = frozenset({"tensors", "peer", "peers", "route"})  # wire forms that differ from the field

MESSAGES: dict[MessageType, type[Message]] = {
    cls.TYPE: cls for cls in (Handshake, Error, Goodbye, Ping, Pong, Announce, PeerList, Status, BlockUpdate,
                              StreamOpen, StreamChunk, StreamEnd, StreamRequest, StreamReset, PipelineForward,
                              PipelineResult)
}


# --- payload codec -------------------------------------------------------------------------

@functools.cache
def _wire_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name != "stream_id")


@functools.cache
def _wire_keys(cls) -> frozenset:
    return frozenset(_wire_fields(cls))


@functools.cache
def _converted_fields(cls) -> tuple[str, ...]:
    return tuple(n for n in _wire_fields(cls) if n in _CONVERTED)


_COMPRESSED = int(Flags.COMPRESSED)
_local = threading.local()  # one msgpack Packer per thread (a Packer is not thread-safe)


def _packb(obj) -> bytes:
    p = getattr(_local, "packer", None)
    if p is None:
        p = _local.packer = msgpack.Packer(use_bin_type=True)
    return p.pack(obj)


def _map_pairs(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate map key")
    for k in d:
        if type(k) is not str:
            raise ValueError(f"map key {k!r:.40} is not a string")
    return d


def _no_ext(code, data):
    raise ValueError(f"msgpack ext type {code} is not allowed")


# msgpack bounds every string, array and map by the input's length (<= MAX_META_BYTES here);
# list lengths that matter are checked again by the constructors (MAX_LIST_LEN). Every map's
# keys are checked as it is built (strings, each once); timestamps (ext -1) decode to datetime,
# which the canonical re-encoding refuses like any other ext.
_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=False, object_pairs_hook=_map_pairs,
                             ext_hook=_no_ext, timestamp=3)


def unpack_canonical(data) -> object:
    """Decode canonical msgpack (PROTOCOL.md section 3.1), or raise MALFORMED_METADATA.

    Canonical: what msgpack's own packer (``use_bin_type=True``) gives for the decoded value:
    every integer, string, byte string, array and map in its shortest form, floats as float 64,
    str for text and bin for bytes, no ext types; maps with string keys, each once, in any order.
    The check is one re-encoding and a compare (about a microsecond for a small map)."""
    try:
        obj = _unpackb(data)
        again = _packb(obj)
    except Exception as e:  # msgpack raises many types on garbage; all mean "malformed"
        raise _bad(f"metadata is not valid msgpack: {type(e).__name__}: {e}") from None
    if again != data:
        raise _bad("metadata is not canonical msgpack (a value in a longer form than needed, or a float 32)")
    return obj


_TENSOR_MESSAGES = frozenset({MessageType.BLOCK_UPDATE, MessageType.PIPELINE_FORWARD, MessageType.PIPELINE_RESULT})


def encode_payload(msg: Message, compress: bool = True) -> tuple[int, list]:
    """``(flags, buffers)``: the payload as a list of buffers (tensor bytes by reference)."""
    if isinstance(msg, Handshake):
        return 0, [bytes(msg.data)]
    if isinstance(msg, StreamChunk):
        raw = memoryview(msg.data).cast("B")
        data, z = maybe_lz4(raw, "auto" if compress else "never")
        return (_COMPRESSED if z else 0), [_CHUNK.pack(msg.offset, len(raw)), data]
    cls: type = type(msg)  # plain ``type``: mypy takes a type[Message] for unhashable (the caches' key)
    if not _converted_fields(cls):  # plain fields only: the common small message
        packed = _packb({name: getattr(msg, name) for name in _wire_fields(cls)})
        if len(packed) > MAX_META_BYTES:
            raise LocalProtocolError(f"metadata of {len(packed)} bytes > {MAX_META_BYTES}",
                                     ErrorCode.MALFORMED_METADATA)
        return 0, [_U32.pack(len(packed)) + packed]
    meta, body = {}, []
    for name in _wire_fields(cls):
        v = getattr(msg, name)
        if name == "tensors":
            meta["tensors"] = [describe(t) for t in v]
            for t in v:
                body.extend(t.segments)
        elif name == "peer":
            meta[name] = v.to_wire()
        elif name == "peers":
            meta[name] = [p.to_wire() for p in v]
        elif name in ("route", "blocks"):
            meta[name] = list(v)
        else:
            meta[name] = v
    packed = _packb(meta)
    if len(packed) > MAX_META_BYTES:
        raise LocalProtocolError(f"metadata of {len(packed)} bytes > {MAX_META_BYTES}", ErrorCode.MALFORMED_METADATA)
    flags = _COMPRESSED if any(any(t.lz4) for t in getattr(msg, "tensors", ())) else 0
    return flags, [_U32.pack(len(packed)), packed, *body]


def decode_payload(mtype: MessageType, flags: int, stream_id: int, payload: memoryview) -> Message:
    """Rebuild a message from its payload; raises LocalProtocolError (callers convert)."""
    cls: type = MESSAGES[mtype]  # plain ``type``: as in encode_payload
    if flags & _COMPRESSED and mtype not in COMPRESSIBLE_TYPES:  # parse_header checks it too
        raise LocalProtocolError(f"COMPRESSED flag on a {cls.__name__}", ErrorCode.BAD_FLAGS)
    if cls is Handshake:
        return Handshake(bytes(payload), stream_id=stream_id)
    if cls is StreamChunk:
        return _chunk_from_wire(flags, stream_id, payload)
    meta, end = _meta_from_wire(cls, payload)
    if not _converted_fields(cls):  # plain fields only: the common small message
        if end != len(payload):
            raise _bad(f"{len(payload) - end} trailing payload bytes after the metadata")
        return cls(**meta, stream_id=stream_id)  # the constructor validates every field
    kwargs = _fields_from_wire(cls, meta, payload[end:])
    if mtype in _TENSOR_MESSAGES:
        want_flag = any(any(t.lz4) for t in kwargs["tensors"])
        if bool(flags & _COMPRESSED) != want_flag:
            raise LocalProtocolError("COMPRESSED flag disagrees with the tensors' lz4 flags", ErrorCode.BAD_FLAGS)
    try:
        return cls(**kwargs, stream_id=stream_id)  # the constructor validates every field
    except TypeError as e:  # pragma: no cover - keys were checked above
        raise _bad(str(e)) from None


def _chunk_from_wire(flags: int, stream_id: int, payload: memoryview) -> StreamChunk:
    """A StreamChunk: its 12-byte prefix (offset, raw length), then its data, raw or lz4."""
    _check(len(payload) >= _CHUNK.size, "stream chunk shorter than its 12-byte prefix")
    offset, raw_len = _CHUNK.unpack_from(payload, 0)
    data = payload[_CHUNK.size:]
    if flags & _COMPRESSED:
        _check(raw_len <= 16 * 1024 * 1024 and 0 < len(data) < raw_len, "bad compressed chunk lengths")
        try:
            data = lz4.block.decompress(data, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as e:
            raise _bad(f"bad lz4 chunk: {e}") from None
        _check(len(data) == raw_len, "lz4 chunk decompressed to the wrong length")
    else:
        if not (len(data) == raw_len):
            raise _bad(f"chunk holds {len(data)} bytes, prefix says {raw_len}")
    return StreamChunk(offset=offset, data=data, stream_id=stream_id)  # a view: zero-copy


def _meta_from_wire(cls: type, payload: memoryview) -> tuple[dict, int]:
    """``(metadata, where it ends)``: a u32 length, then a canonical msgpack map with exactly
    ``cls``'s wire keys."""
    _check(len(payload) >= 4, "payload shorter than its metadata length")
    (mlen,) = _U32.unpack_from(payload, 0)
    if not (mlen <= MAX_META_BYTES and 4 + mlen <= len(payload)):
        raise _bad(f"metadata length {mlen} does not fit the payload")
    meta = unpack_canonical(payload[4:4 + mlen])
    if not isinstance(meta, dict):
        raise _bad("metadata must be a msgpack map")
    want = _wire_keys(cls)
    if not (meta.keys() == want):
        raise _bad(f"{cls.__name__} metadata keys {sorted(map(str, meta))} != {sorted(want)}")
    return meta, 4 + mlen


def _fields_from_wire(cls: type, meta: dict, body: memoryview) -> dict:
    """``meta`` with ``cls``'s converted fields in their Python form; the tensors' bytes are read
    from ``body`` in order, and must use all of it."""
    pos = 0
    for name in _converted_fields(cls):
        if name == "tensors":
            meta[name], pos = _tensors_from_wire(meta[name], body, pos)
        else:
            meta[name] = _FROM_WIRE[name](meta[name])
    if not (pos == len(body)):
        raise _bad(f"{len(body) - pos} trailing payload bytes after the tensors")
    return meta


def _tensors_from_wire(v, body: memoryview, pos: int) -> tuple[tuple, int]:
    _check(isinstance(v, list), "tensors must be a list")
    ts = []
    for d in v:
        t, pos = from_description(d, body, pos)
        ts.append(t)
    return tuple(ts), pos


def _peers_from_wire(v) -> tuple:
    _check(isinstance(v, list), "peers must be a list")
    return tuple(PeerInfo.from_wire(p) for p in v)


def _route_from_wire(v) -> tuple:
    _check(isinstance(v, list), "route must be a list")
    return tuple(v)


# The converted fields (_CONVERTED) other than tensors, from their wire form.
_FROM_WIRE = {"peer": PeerInfo.from_wire, "peers": _peers_from_wire, "route": _route_from_wire}
assert _FROM_WIRE.keys() == _CONVERTED - {"tensors"}, "every converted field has its decoder"


# --- plain framing (unsealed): the form used before the handshake and in test vectors ------

def frame_message(msg: Message, compress: bool = True) -> bytes:
    """One message as an unsealed frame: header + payload."""
    from .frames import encode_header

    flags, bufs = encode_payload(msg, compress)
    payload = b"".join(bufs)
    if len(payload) > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"payload of {len(payload)} bytes > MAX_FRAME_BYTES", ErrorCode.FRAME_TOO_LARGE)
    return encode_header(msg.TYPE, flags, msg.stream_id, len(payload)) + payload


class MessageReader:
    """Unsealed frames outside a session in, messages out; any violation is a RemoteProtocolError.

    The header rules of section 2 run as each header parses: SEALED is BAD_FLAGS here, and the
    limit is ``MAX_FRAME_BYTES`` (no tag)."""

    def __init__(self, max_frame_bytes: int | None = None):
        self.max_frame_bytes = max_frame_bytes or MAX_FRAME_BYTES
        self._frames = FrameBuffer(self.max_frame_bytes, self._check_header)

    def _check_header(self, h: FrameHeader) -> None:
        if h.flags & Flags.SEALED:
            raise LocalProtocolError("sealed frame outside a session", ErrorCode.BAD_FLAGS)
        if h.length > self.max_frame_bytes:
            raise LocalProtocolError(f"frame length {h.length} exceeds limit {self.max_frame_bytes}",
                                     ErrorCode.FRAME_TOO_LARGE)

    def feed(self, data) -> None:
        self._frames.feed(data)

    @property
    def buffered_bytes(self) -> int:
        """Bytes fed and not yet taken as a message (as ``Connection.buffered_bytes``)."""
        return self._frames.buffered

    def next_message(self) -> Message | None:
        from .errors import as_remote

        try:
            got = self._frames.next_frame()
            if got is None:
                return None
            h, payload = got
            return decode_payload(h.type, h.flags, h.stream_id, payload)
        except LocalProtocolError as e:
            raise as_remote(e) from None
