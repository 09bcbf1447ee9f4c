"""The sans-IO connection: bytes in, events out; events in, bytes out.

Rules:
- Rule 1: everything that changes the connection's state goes through ``_transition`` and the
  one table ``TRANSITIONS``; an (state, event) pair missing from it is a protocol error.
- Rule 2: no application message is delivered, or may be sent, before ESTABLISHED. The
  initiator reaches ESTABLISHED only after the responder's sealed confirmation, so a peer
  without the swarm key never gets as far as a delivered message on either side.
- Rule 3: after the handshake every frame is sealed with AES-256-GCM (the 18-byte header is the
  associated data, nonces count frames per direction), unless both sides asked for
  ``seal=False`` (trusted networks); the confirmation frame is sealed either way.
- Rule 4: a remote error moves the connection to ERROR for good; ``next_event`` raises it once
  and ``error_frame()`` gives the bytes that tell the peer why.
- Rule 5: every frame sent or received is counted per direction and message type: frames,
  payload bytes (before lz4) and wire bytes (header, lz4 and seal included); and by kind of
  traffic, where the application hands in its classifier (``kind_of``): the core knows no
  application kinds, only that a stream's frames share the kind of its STREAM_REQUEST/OPEN.
- Rule 6: every frame's length is judged from its 18-byte header (``_check_header``) against
  the state's limit: before ESTABLISHED the handshake's (``MAX_HANDSHAKE_FRAME_BYTES``), and no
  payload is received in place, so a peer without the swarm key makes us hold at most one such
  frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError, as_remote
from .events import Error, Handshake, Message, StreamChunk, decode_payload, encode_payload
from .frames import (HEADER_BYTES, MAX_FRAME_BYTES, Flags, FrameBuffer, FrameHeader, MessageType, ReusableBuffer,
                     encode_header)
from .handshake import MAX_MESSAGE_BYTES, PROTOCOL_NAME, TAGLEN, CipherState, HandshakeError, NoiseHandshake, peer_id_of

PROLOGUE = b"BlockTrain/1 " + PROTOCOL_NAME
_SEALED = int(Flags.SEALED)
_CLOSE_TYPES = frozenset({MessageType.GOODBYE, MessageType.ERROR})
# A stream's kind is learnt from the frame that begins it and used for the frames that follow.
_STREAM_BEGIN = frozenset({MessageType.STREAM_OPEN, MessageType.STREAM_REQUEST})
_STREAM_FOLLOW = frozenset({MessageType.STREAM_CHUNK, MessageType.STREAM_END})
_STREAM_DONE = frozenset({MessageType.STREAM_END})
_STREAM_TYPES = _STREAM_BEGIN | _STREAM_FOLLOW
# Streams whose kind is remembered at once; beyond, the oldest is forgotten (its later frames
# are classified on their own). 4096 is far more than the few streams a peer runs at a time,
# and bounds what a peer that opens streams and never ends them can make us keep (~0.5 MiB).
MAX_TRACKED_STREAMS = 4096
# Distinct kinds counted per direction; a classifier returning more is counted under
# OVERFLOW_KIND, so a classifier that passes peer-chosen names through cannot grow the table.
MAX_TRAFFIC_KINDS = 64
OVERFLOW_KIND = "other"
# The largest frame before ESTABLISHED. Only HANDSHAKE frames (a Noise message, at most 65535
# bytes by Noise's own rule) and unsealed ERROR refusals (a code and a reason of at most 4096
# chars: under 16 KiB) may arrive then, so no legitimate frame is larger; and as the peer is not
# yet authenticated, this is all it can make us hold.
MAX_HANDSHAKE_FRAME_BYTES = MAX_MESSAGE_BYTES
_SIZED_TYPES = frozenset({MessageType.STREAM_CHUNK, MessageType.BLOCK_UPDATE, MessageType.PIPELINE_FORWARD,
                          MessageType.PIPELINE_RESULT})
_TYPE_NAMES = {t: t.name.lower() for t in MessageType}
# Payloads at least this large are sealed piecewise into a reused buffer, and opened into one:
# joining parts costs a memcpy and fresh buffers cost page faults; the piecewise cipher costs a
# few microseconds of setup, which small frames should not pay.
SEAL_PARTS_MIN_BYTES = 64 * 1024


class Role(Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


class State(Enum):
    START = "START"
    AWAIT_REPLY = "AWAIT_REPLY"  # initiator sent message 1
    AWAIT_FINISH = "AWAIT_FINISH"  # responder sent message 2
    AWAIT_CONFIRM = "AWAIT_CONFIRM"  # initiator sent message 3
    ESTABLISHED = "ESTABLISHED"
    CLOSED = "CLOSED"  # Goodbye or Error sent or received
    ERROR = "ERROR"  # a protocol error happened; nothing more is parsed


class Ev(Enum):
    SEND_HELLO = "send handshake message 1"
    RECV_HELLO = "receive handshake message 1"
    RECV_REPLY = "receive handshake message 2"
    RECV_FINISH = "receive handshake message 3"
    RECV_CONFIRM = "receive confirmation"
    SEND_MESSAGE = "send message"
    RECV_MESSAGE = "receive message"
    SEND_CLOSE = "send Goodbye/Error"
    RECV_CLOSE = "receive Goodbye/Error"


I, R = Role.INITIATOR, Role.RESPONDER
TRANSITIONS: dict[tuple[Role, State], dict[Ev, State]] = {
    (I, State.START): {Ev.SEND_HELLO: State.AWAIT_REPLY, Ev.SEND_CLOSE: State.CLOSED},
    (I, State.AWAIT_REPLY): {Ev.RECV_REPLY: State.AWAIT_CONFIRM, Ev.RECV_CLOSE: State.CLOSED,
                             Ev.SEND_CLOSE: State.CLOSED},
    (I, State.AWAIT_CONFIRM): {Ev.RECV_CONFIRM: State.ESTABLISHED, Ev.RECV_CLOSE: State.CLOSED,
                               Ev.SEND_CLOSE: State.CLOSED},
    (R, State.START): {Ev.RECV_HELLO: State.AWAIT_FINISH, Ev.RECV_CLOSE: State.CLOSED, Ev.SEND_CLOSE: State.CLOSED},
    (R, State.AWAIT_FINISH): {Ev.RECV_FINISH: State.ESTABLISHED, Ev.RECV_CLOSE: State.CLOSED,
                              Ev.SEND_CLOSE: State.CLOSED},
}
for _role in Role:
    TRANSITIONS[(_role, State.ESTABLISHED)] = {
        Ev.SEND_MESSAGE: State.ESTABLISHED, Ev.RECV_MESSAGE: State.ESTABLISHED,
        Ev.SEND_CLOSE: State.CLOSED, Ev.RECV_CLOSE: State.CLOSED}
    TRANSITIONS[(_role, State.CLOSED)] = {}
    TRANSITIONS[(_role, State.ERROR)] = {}


class _NeedData:
    def __repr__(self):
        return "NEED_DATA"


NEED_DATA = _NeedData()


@dataclass(frozen=True)
class HandshakeComplete:
    """The peer is authenticated: its id, static key and the info it sent."""
    peer_id: str
    remote_static: bytes
    info: dict
    sealed: bool


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer said Goodbye or sent an Error; no more events follow."""
    code: int
    reason: str


def _counter():
    return {"frames": 0, "payload_bytes": 0, "wire_bytes": 0}


@dataclass
class ByteCounter:
    """Per-direction frame and byte counts, by message type and by kind of traffic.

    ``kind_of(msg) -> str`` is the application's classifier (None: no counts by kind). The core
    adds one rule: STREAM_CHUNK, STREAM_END and STREAM_RESET frames count under the kind that the
    STREAM_REQUEST or STREAM_OPEN of their stream id was given (at most ``MAX_TRACKED_STREAMS``
    remembered); a stream id never seen is classified on its own.
    """

    kind_of: Callable[[Message], str] | None = None
    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    sent_kinds: dict = field(default_factory=dict)
    received_kinds: dict = field(default_factory=dict)
    _streams: dict = field(default_factory=dict)  # stream id -> kind, from STREAM_REQUEST/OPEN

    def kind(self, msg: Message) -> str | None:
        """The kind ``msg`` counts under (and the stream table's bookkeeping), or None."""
        classify = self.kind_of
        if classify is None:
            return None
        t = msg.TYPE
        if t not in _STREAM_TYPES:  # the common case
            return classify(msg)
        if t in _STREAM_BEGIN:
            kind = classify(msg)
            streams = self._streams
            if msg.stream_id not in streams and len(streams) >= MAX_TRACKED_STREAMS:
                streams.pop(next(iter(streams)))  # streams that never ended: forget the oldest
            streams[msg.stream_id] = kind
            return kind
        if t in _STREAM_FOLLOW:
            kind = self._streams.get(msg.stream_id)
            if kind is None:
                kind = classify(msg)
            elif t in _STREAM_DONE:
                del self._streams[msg.stream_id]
            return kind

    def add(self, direction: str, mtype: MessageType, payload: int, wire: int, kind: str | None = None):
        sent = direction == "sent"
        pairs = [(self.sent if sent else self.received, _TYPE_NAMES[mtype])]
        if kind is not None:
            kinds = self.sent_kinds if sent else self.received_kinds
            if kind not in kinds and len(kinds) >= MAX_TRAFFIC_KINDS:
                kind = OVERFLOW_KIND
            pairs.append((kinds, kind))
        for d, name in pairs:
            c = d.get(name)
            if c is None:
                c = d[name] = _counter()
            c["frames"] += 1
            c["payload_bytes"] += payload
            c["wire_bytes"] += wire

    def snapshot(self) -> dict:
        out = {}
        for name, d, kinds in (("sent", self.sent, self.sent_kinds), ("received", self.received, self.received_kinds)):
            tot = _counter()
            for c in d.values():
                for k in tot:
                    tot[k] += c[k]
            out[name] = {"by_type": {k: dict(v) for k, v in sorted(d.items())},
                         "by_kind": {k: dict(v) for k, v in sorted(kinds.items())}, "total": tot}
        return out


def _checked_length(bufs) -> int:
    n = sum(map(len, bufs))
    if n > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"message payload of {n} bytes > MAX_FRAME_BYTES {MAX_FRAME_BYTES}; "
                                 "send it as a chunked stream", ErrorCode.FRAME_TOO_LARGE)
    return n


def _logical_len(msg: Message, framed: int) -> int:
    """Payload bytes before lz4 (what the message means), from its framed length."""
    if msg.TYPE not in _SIZED_TYPES:
        return framed
    if isinstance(msg, StreamChunk):
        return 12 + len(msg.data)
    tensors = getattr(msg, "tensors", ())
    return framed + sum(t.raw_bytes - t.stored_bytes for t in tensors)


_HANDSHAKE_MSG = Handshake()  # what handshake frames are classified as (their bytes are not a message)


class Connection:
    """One end of a BlockTrain connection.

    ``static``: this peer's X25519 key; ``psk``: the 32-byte swarm key; ``allowlist``: peer ids
    accepted (None = any holder of the swarm key); ``info``: a small map sent to the peer inside
    the handshake (listen address, role); ``seal``: AEAD on every frame after the handshake;
    ``kind_of``: the application's traffic classifier (``ByteCounter``).
    """

    def __init__(self, role: Role, static: X25519PrivateKey, psk: bytes, *, allowlist=None,
                 info: dict | None = None, seal: bool = True, max_frame_bytes: int = MAX_FRAME_BYTES,
                 compress: bool = True, ephemeral=None, kind_of: Callable[[Message], str] | None = None):
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self._frames = FrameBuffer(max_frame_bytes + TAGLEN, self._check_header)
        self.state = State.START
        self.seal = seal
        self.compress = compress
        self.allowlist = None if allowlist is None else set(allowlist)
        self.info = dict(info or {})
        self._noise = NoiseHandshake(role is Role.INITIATOR, static, psk, PROLOGUE, ephemeral)
        self._send_cs: CipherState | None = None
        self._recv_cs: CipherState | None = None
        self._out = bytearray()  # handshake bytes produced while receiving
        self.error: ProtocolError | None = None
        self.peer: HandshakeComplete | None = None
        self.counter = ByteCounter(kind_of)
        self._seal_buf, self._open_buf = ReusableBuffer(), ReusableBuffer()
        self.sealed_session = False

    # --- state ---------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, value: State):
        self._state = value
        self._row = TRANSITIONS[(self.role, value)]  # the current row, looked up once per change
        if value is State.CLOSED or value is State.ERROR:
            self._frames.clear()  # nothing more is parsed: hold nothing the peer sent

    def _transition(self, ev: Ev):
        nxt = self._row.get(ev)
        if nxt is None:
            raise LocalProtocolError(f"{ev.value} is not allowed in state {self._state.value} ({self.role.value})",
                                     ErrorCode.UNEXPECTED_MESSAGE)
        if nxt is not self._state:
            self.state = nxt

    def _check_header(self, h: FrameHeader) -> None:
        """The state's length limit, from the header alone (FrameBuffer calls it as it parses)."""
        if self._state is State.ESTABLISHED:
            limit = self.max_frame_bytes + TAGLEN
        else:
            limit = MAX_HANDSHAKE_FRAME_BYTES
        if h.length > limit:
            raise LocalProtocolError(f"frame length {h.length} exceeds the limit {limit} (state {self._state.value})",
                                     ErrorCode.FRAME_TOO_LARGE)

    # --- sending -------------------------------------------------------------------------
    def initiate(self) -> bytes:
        """The initiator's first bytes (handshake message 1)."""
        if self.role is not Role.INITIATOR:
            raise LocalProtocolError("only the initiator starts the handshake")
        self._transition(Ev.SEND_HELLO)
        return self._frame_plain(Handshake(self._noise.write_message(b"")))

    def send(self, msg: Message) -> bytes:
        """Bytes for one application message (joined; see ``send_buffers`` for zero-copy)."""
        return b"".join(self.send_buffers(msg))

    def send_buffers(self, msg: Message) -> list:
        t = msg.TYPE
        if t is MessageType.HANDSHAKE:
            raise LocalProtocolError("handshake messages are the connection's own", ErrorCode.UNEXPECTED_MESSAGE)
        self._transition(Ev.SEND_CLOSE if t in _CLOSE_TYPES else Ev.SEND_MESSAGE)
        return self._frame(msg)

    def error_frame(self, exc: ProtocolError) -> bytes:
        """Bytes of the Error frame that tells the peer why we close: sealed once the peer is
        authenticated, plaintext before (a handshake refusal carries no secrets)."""
        msg = Error(int(exc.code), str(exc)[:4000])
        if self.peer is not None and self._send_cs is not None and self.sealed_session:
            return b"".join(self._frame(msg))
        return self._frame_plain(msg)

    def _frame_plain(self, msg: Message) -> bytes:
        flags, bufs = encode_payload(msg, self.compress)
        length = _checked_length(bufs)
        head = encode_header(msg.TYPE, flags, msg.stream_id, length)
        self.counter.add("sent", msg.TYPE, length, HEADER_BYTES + length, self.counter.kind(msg))
        return head + b"".join(bytes(b) for b in bufs)

    def _frame(self, msg: Message, force_seal: bool = False) -> list:
        flags, bufs = encode_payload(msg, self.compress)
        length = _checked_length(bufs)
        logical = _logical_len(msg, length)
        if self.sealed_session or force_seal:
            head = encode_header(msg.TYPE, flags | _SEALED, msg.stream_id, length + TAGLEN)
            if length >= SEAL_PARTS_MIN_BYTES:
                sealed = [self._send_cs.seal_into(head, bufs, self._seal_buf.get(length + TAGLEN))]
            else:
                sealed = [self._send_cs.encrypt(head, b"".join(bufs))]
            self.counter.add("sent", msg.TYPE, logical, HEADER_BYTES + length + TAGLEN, self.counter.kind(msg))
            return [head, *sealed]
        head = encode_header(msg.TYPE, flags, msg.stream_id, length)
        self.counter.add("sent", msg.TYPE, logical, HEADER_BYTES + length, self.counter.kind(msg))
        return [head, *bufs]

    def data_to_send(self) -> bytes:
        """Handshake bytes produced by ``next_event`` that must go to the peer now."""
        out = bytes(self._out)
        self._out.clear()
        return out

    # --- receiving -----------------------------------------------------------------------
    def receive_data(self, data) -> None:
        if self._state is State.ERROR or self._state is State.CLOSED:
            return
        self._frames.feed(data)

    def receive_buffer(self) -> memoryview | None:
        """A writable view to receive the rest of a large incoming payload into, or None.
        Only once ESTABLISHED: before, nothing is allocated for a frame the peer announces."""
        if self._state is not State.ESTABLISHED:
            return None
        return self._frames.receive_buffer()

    def received_into(self, n: int) -> None:
        """``n`` bytes were written at the start of the view ``receive_buffer`` returned."""
        if self._state is State.ERROR or self._state is State.CLOSED:
            return  # closed meanwhile: the bytes are dropped with the rest
        self._frames.received_into(n)

    def next_event(self):
        """The next event, or NEED_DATA; raises RemoteProtocolError once on peer errors."""
        if self.state in (State.ERROR, State.CLOSED):
            return NEED_DATA
        try:
            got = self._frames.next_frame()
            if got is None:
                return NEED_DATA
            return self._handle(*got)
        except ProtocolError as e:
            err = e if isinstance(e, RemoteProtocolError) else as_remote(e)
            closed_by_peer = self.state is State.CLOSED
            self.state = State.ERROR
            self.error = err
            if not closed_by_peer:  # tell the peer why; the caller sends data_to_send()
                self._out += self.error_frame(err)
            raise err from None

    def _open(self, h: FrameHeader, payload: memoryview, expect_sealed: bool) -> memoryview:
        """Check the SEALED flag against the session and open a sealed payload."""
        sealed = bool(h.flags & _SEALED)
        if sealed is not expect_sealed:
            raise LocalProtocolError(f"{'sealed' if sealed else 'unsealed'} frame in a "
                                     f"{'sealed' if expect_sealed else 'unsealed'} session", ErrorCode.BAD_FLAGS)
        if not sealed:
            return payload
        n = h.length - TAGLEN
        if n >= SEAL_PARTS_MIN_BYTES:
            return self._recv_cs.decrypt_into(h.pack(), payload, self._open_buf.get(n))
        return memoryview(self._recv_cs.decrypt(h.pack(), payload))

    def _handle(self, h: FrameHeader, payload: memoryview):
        wire = HEADER_BYTES + h.length
        if self._state is State.ESTABLISHED:  # the common case
            payload = self._open(h, payload, self.sealed_session)
            t = h.type
            if t is MessageType.HANDSHAKE:
                raise LocalProtocolError("handshake message after the handshake", ErrorCode.UNEXPECTED_MESSAGE)
            msg = decode_payload(t, h.flags & ~_SEALED, h.stream_id, payload)
            self.counter.add("received", t, _logical_len(msg, len(payload)), wire, self.counter.kind(msg))
            if t in _CLOSE_TYPES:
                self._transition(Ev.RECV_CLOSE)
                return ConnectionClosed(msg.code if isinstance(msg, Error) else 0, msg.reason)
            self._transition(Ev.RECV_MESSAGE)
            return msg
        if h.type is MessageType.ERROR and not h.flags & _SEALED:  # a refusal during the handshake
            msg = decode_payload(h.type, h.flags, h.stream_id, payload)
            self.counter.add("received", h.type, h.length, wire, self.counter.kind(msg))
            self._transition(Ev.RECV_CLOSE)
            code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.HANDSHAKE_FAILED
            raise RemoteProtocolError(f"peer refused the handshake: {msg.reason} ({code.name})", code)
        if self._state in (State.START, State.AWAIT_REPLY, State.AWAIT_FINISH):
            return self._handle_handshake(h, payload)
        # AWAIT_CONFIRM: the responder's sealed, empty confirmation
        payload = self._open(h, payload, True)
        if h.type is not MessageType.HANDSHAKE or len(payload):
            raise LocalProtocolError("expected the handshake confirmation", ErrorCode.UNEXPECTED_MESSAGE)
        self.counter.add("received", h.type, 0, wire, self.counter.kind(_HANDSHAKE_MSG))
        self._transition(Ev.RECV_CONFIRM)
        return self.peer

    def _handle_handshake(self, h: FrameHeader, payload: memoryview):
        if h.type is not MessageType.HANDSHAKE or h.flags != 0:
            raise LocalProtocolError(f"expected a handshake frame, got {h.type.name}", ErrorCode.UNEXPECTED_MESSAGE)
        self.counter.add("received", h.type, h.length, HEADER_BYTES + h.length,
                         self.counter.kind(_HANDSHAKE_MSG))
        noise = self._noise
        if self.state is State.START:  # responder reads 1, writes 2
            noise.read_message(bytes(payload))
            self._transition(Ev.RECV_HELLO)
            self._out += self._frame_plain(Handshake(noise.write_message(self._hello_payload())))
            return NEED_DATA
        if self.state is State.AWAIT_REPLY:  # initiator reads 2, writes 3
            info = self._read_hello(noise.read_message(bytes(payload)))
            self._check_peer(noise.remote_static)
            self._out += self._frame_plain(Handshake(noise.write_message(self._hello_payload())))
            self._finish(info)
            self._transition(Ev.RECV_REPLY)
            return NEED_DATA
        # responder reads 3, sends the sealed confirmation
        info = self._read_hello(noise.read_message(bytes(payload)))
        self._check_peer(noise.remote_static)
        self._finish(info)
        self._out += b"".join(self._frame(Handshake(b""), force_seal=True))
        self._transition(Ev.RECV_FINISH)
        return self.peer

    def _hello_payload(self) -> bytes:
        return msgpack.packb({"v": 1, "seal": self.seal, "info": self.info}, use_bin_type=True)

    def _read_hello(self, payload: bytes) -> dict:
        try:
            m = msgpack.unpackb(payload, raw=False, max_str_len=65535, max_array_len=1024, max_map_len=1024)
        except Exception as e:
            raise HandshakeError(f"malformed handshake payload: {e}", ErrorCode.MALFORMED_METADATA) from None
        if not isinstance(m, dict) or set(m) != {"v", "seal", "info"} or not isinstance(m["info"], dict):
            raise HandshakeError("malformed handshake payload", ErrorCode.MALFORMED_METADATA)
        if m["v"] != 1:
            raise HandshakeError(f"peer speaks protocol version {m['v']}", ErrorCode.UNSUPPORTED_VERSION)
        if m["seal"] is not self.seal:
            raise HandshakeError(f"sealing mismatch: peer seal={m['seal']}, we seal={self.seal}",
                                 ErrorCode.HANDSHAKE_FAILED)
        return m["info"]

    def _check_peer(self, remote_static: bytes):
        pid = peer_id_of(remote_static)
        if self.allowlist is not None and pid not in self.allowlist:
            raise HandshakeError(f"peer {pid[:16]}... is not on the allowlist", ErrorCode.PEER_NOT_ALLOWED)

    def _finish(self, info: dict):
        self._send_cs, self._recv_cs = self._noise.result
        self.sealed_session = self.seal
        rs = self._noise.remote_static
        self.peer = HandshakeComplete(peer_id_of(rs), rs, info, self.seal)

    @property
    def buffered_bytes(self) -> int:
        return self._frames.buffered
