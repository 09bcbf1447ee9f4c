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
- Rule 6: every frame is judged from its 18-byte header first (``_check_header``): SEALED
  against the state, the state's length limit, the type against the state's row. Before
  ESTABLISHED the limit is the handshake's (``MAX_HANDSHAKE_FRAME_BYTES``) and no payload is
  received in place, so a peer without the swarm key makes us hold at most one such frame.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError, as_remote
from .events import (MAX_ADDR_CHARS, MAX_PEER_BLOCKS, MAX_REASON_CHARS, ROLES, Error, Goodbye, Handshake, Message,
                     StreamChunk, decode_payload, encode_payload, unpack_canonical)
from .frames import (HEADER_BYTES, MAX_FRAME_BYTES, Flags, FrameBuffer, FrameHeader, MessageType, ReusableBuffer,
                     encode_header)
from .handshake import (DHLEN, MAX_MESSAGE_BYTES, PROTOCOL_NAME, TAGLEN, CipherState, HandshakeError, NoiseHandshake,
                        peer_id_of)

PROLOGUE = b"BlockTrain/1 " + PROTOCOL_NAME
_SEALED = int(Flags.SEALED)
# A stream's kind is learnt from the frame that begins it and used for the frames that follow.
_STREAM_BEGIN = frozenset({MessageType.STREAM_OPEN, MessageType.STREAM_REQUEST})
_STREAM_FOLLOW = frozenset({MessageType.STREAM_CHUNK, MessageType.STREAM_END, MessageType.STREAM_RESET})
_STREAM_DONE = frozenset({MessageType.STREAM_END, MessageType.STREAM_RESET})
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
# Handshake message 1 is exactly the initiator's ephemeral key and the tag of its empty payload.
HELLO_MESSAGE_BYTES = DHLEN + TAGLEN
# The hello map (v, seal, info) of messages 2 and 3: the listen address, blocks and role need
# a few hundred bytes; 4 KiB leaves room for a few more keys and keeps both messages small.
MAX_HELLO_BYTES = 4096
# An ``info`` key names a field, it carries no data: 64 chars is ample (the defined keys have at
# most 6) and keeps a hello of many small keys from hiding data in them.
MAX_INFO_KEY_CHARS = 64
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
    SEND_ERROR = "send Error"  # before ESTABLISHED: a refusal or a timeout, unsealed
    RECV_ERROR = "receive Error"


I, R = Role.INITIATOR, Role.RESPONDER
TRANSITIONS: dict[tuple[Role, State], dict[Ev, State]] = {
    (I, State.START): {Ev.SEND_HELLO: State.AWAIT_REPLY, Ev.SEND_ERROR: State.CLOSED},
    (I, State.AWAIT_REPLY): {Ev.RECV_REPLY: State.AWAIT_CONFIRM, Ev.RECV_ERROR: State.CLOSED,
                             Ev.SEND_ERROR: State.CLOSED},
    (I, State.AWAIT_CONFIRM): {Ev.RECV_CONFIRM: State.ESTABLISHED, Ev.RECV_ERROR: State.CLOSED,
                               Ev.SEND_ERROR: State.CLOSED},
    (R, State.START): {Ev.RECV_HELLO: State.AWAIT_FINISH, Ev.RECV_ERROR: State.CLOSED, Ev.SEND_ERROR: State.CLOSED},
    (R, State.AWAIT_FINISH): {Ev.RECV_FINISH: State.ESTABLISHED, Ev.RECV_ERROR: State.CLOSED,
                              Ev.SEND_ERROR: State.CLOSED},
}
for _role in Role:
    TRANSITIONS[(_role, State.ESTABLISHED)] = {
        Ev.SEND_MESSAGE: State.ESTABLISHED, Ev.RECV_MESSAGE: State.ESTABLISHED,
        Ev.SEND_CLOSE: State.CLOSED, Ev.RECV_CLOSE: State.CLOSED}
    TRANSITIONS[(_role, State.CLOSED)] = {}
    TRANSITIONS[(_role, State.ERROR)] = {}
# Which receive event a HANDSHAKE frame is, by state (the row then says whether it may come).
_HANDSHAKE_EVENTS = {State.START: Ev.RECV_HELLO, State.AWAIT_REPLY: Ev.RECV_REPLY,
                     State.AWAIT_FINISH: Ev.RECV_FINISH, State.AWAIT_CONFIRM: Ev.RECV_CONFIRM}
# HANDSHAKE frames of a fixed length: message 1, and the confirmation (a sealed empty payload).
_HANDSHAKE_LENGTHS = {State.START: HELLO_MESSAGE_BYTES, State.AWAIT_CONFIRM: TAGLEN}


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
        kind: str | None
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
        return None  # not reached: every stream type begins a stream or follows its start

    def add(self, direction: str, mtype: MessageType, payload: int, wire: int, kind: str | None = None):
        sent = direction == "sent"
        d, name = (self.sent if sent else self.received), _TYPE_NAMES[mtype]
        c = d.get(name)  # written out twice, not looped: this runs for every frame
        if c is None:
            c = d[name] = _counter()
        c["frames"] += 1
        c["payload_bytes"] += payload
        c["wire_bytes"] += wire
        if kind is not None:
            kinds = self.sent_kinds if sent else self.received_kinds
            c = kinds.get(kind)
            if c is None:
                if len(kinds) >= MAX_TRAFFIC_KINDS:
                    kind = OVERFLOW_KIND
                c = kinds.get(kind) or kinds.setdefault(kind, _counter())
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


def check_info(info) -> dict:
    """Validate a hello's ``info`` map (PROTOCOL.md section 4); raises MALFORMED_METADATA.

    Keys are strings of at most ``MAX_INFO_KEY_CHARS``; ``addr``, ``blocks`` and ``role``, when
    present, follow the peer record's rules; ``seen`` and ``dialed`` are addresses as ``addr`` is,
    ``dial_back`` a port; other keys are the application's."""
    def bad(why):
        return HandshakeError(f"hello info: {why}", ErrorCode.MALFORMED_METADATA)
    if type(info) is not dict:
        raise bad("not a map")
    for k in info:
        if type(k) is not str or len(k) > MAX_INFO_KEY_CHARS:
            raise bad(f"key {k!r:.80} is not a string of <= {MAX_INFO_KEY_CHARS} chars")
    addr, blocks, role = info.get("addr", ""), info.get("blocks", []), info.get("role", "train")
    if type(addr) is not str or len(addr) > MAX_ADDR_CHARS:
        raise bad(f"addr must be a 'host:port' string of <= {MAX_ADDR_CHARS} chars")
    if type(blocks) not in (list, tuple) or len(blocks) > MAX_PEER_BLOCKS or \
            not all(type(b) is int and 0 <= b < 1 << 16 for b in blocks):
        raise bad(f"blocks must be an array of at most {MAX_PEER_BLOCKS} u16")
    if role not in ROLES or type(role) is not str:
        raise bad(f"role must be one of {ROLES}")
    for key in ("seen", "dialed"):  # reachability (section 4): addresses, as ``addr``
        if key in info and (type(info[key]) is not str or len(info[key]) > MAX_ADDR_CHARS):
            raise bad(f"{key} must be a 'host:port' string of <= {MAX_ADDR_CHARS} chars")
    if "dial_back" in info and not (type(info["dial_back"]) is int and 0 < info["dial_back"] < 1 << 16):
        raise bad("dial_back must be a port: an integer in 1..65535")
    return info


def _header_check(conn: "Connection") -> Callable[[FrameHeader], None]:
    """``conn._check_header`` through a weak reference: the frame buffer a Connection owns must not
    hold it (a bound method would tie them in a cycle, so a dropped connection and the frame it was
    assembling would wait for Python's cycle collector, minutes or hours, instead of going at once)."""
    ref = weakref.ref(conn)

    def check(h: FrameHeader) -> None:
        c = ref()
        if c is not None:
            c._check_header(h)
    return check


class Connection:
    """One end of a BlockTrain connection.

    ``static``: this peer's X25519 key; ``psk``: the 32-byte swarm key; ``allowlist``: peer ids
    accepted (None = any holder of the swarm key); ``info``: a small map sent to the peer inside
    the handshake (listen address, blocks, role: ``check_info``); ``seal``: AEAD on every frame
    after the handshake; ``kind_of``: the application's traffic classifier (``ByteCounter``).
    """

    def __init__(self, role: Role, static: X25519PrivateKey, psk: bytes, *, allowlist=None,
                 info: dict | None = None, seal: bool = True, max_frame_bytes: int = MAX_FRAME_BYTES,
                 compress: bool = True, ephemeral=None, kind_of: Callable[[Message], str] | None = None):
        if not 0 < max_frame_bytes <= MAX_FRAME_BYTES:
            raise LocalProtocolError(f"max_frame_bytes must be 1..{MAX_FRAME_BYTES}", ErrorCode.FRAME_TOO_LARGE)
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self._frames = FrameBuffer(max_frame_bytes, _header_check(self))
        self.state = State.START
        self.seal = seal
        self.compress = compress
        self.allowlist = None if allowlist is None else set(allowlist)
        self.info = check_info(dict(info or {}))
        if len(self._hello_payload()) > MAX_HELLO_BYTES:
            raise LocalProtocolError(f"hello info too large: the hello must fit {MAX_HELLO_BYTES} bytes",
                                     ErrorCode.HANDSHAKE_FAILED)
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
        """The state's rules for a frame, from its header alone (FrameBuffer calls it as the
        header parses): SEALED (BAD_FLAGS), length (FRAME_TOO_LARGE), type (UNEXPECTED_MESSAGE),
        fixed handshake lengths (HANDSHAKE_FAILED)."""
        st, t, sealed = self._state, h.type, bool(h.flags & _SEALED)
        if st is State.ESTABLISHED:  # the common case
            if sealed is not self.sealed_session:
                raise LocalProtocolError(f"{'sealed' if sealed else 'unsealed'} frame in a "
                                         f"{'sealed' if self.sealed_session else 'unsealed'} session",
                                         ErrorCode.BAD_FLAGS)
            limit = self.max_frame_bytes + TAGLEN if sealed else self.max_frame_bytes
            if h.length > limit:
                raise LocalProtocolError(f"frame length {h.length} exceeds limit {limit}", ErrorCode.FRAME_TOO_LARGE)
            if t is MessageType.HANDSHAKE:
                raise LocalProtocolError("handshake message after the handshake", ErrorCode.UNEXPECTED_MESSAGE)
            return
        confirmation = st is State.AWAIT_CONFIRM and t is MessageType.HANDSHAKE
        if sealed is not confirmation:
            raise LocalProtocolError("the confirmation must be sealed" if confirmation else
                                     f"sealed {t.name} frame before the session", ErrorCode.BAD_FLAGS)
        if h.length > MAX_HANDSHAKE_FRAME_BYTES:
            raise LocalProtocolError(f"frame length {h.length} exceeds the handshake limit {MAX_HANDSHAKE_FRAME_BYTES}",
                                     ErrorCode.FRAME_TOO_LARGE)
        ev: Ev | None
        if t is MessageType.ERROR:
            ev = Ev.RECV_ERROR
        else:
            ev = _HANDSHAKE_EVENTS.get(st) if t is MessageType.HANDSHAKE else None
        if ev is None or ev not in self._row:
            raise LocalProtocolError(f"{t.name} frame not allowed in state {st.value} ({self.role.value})",
                                     ErrorCode.UNEXPECTED_MESSAGE)
        want = _HANDSHAKE_LENGTHS.get(st)
        if t is MessageType.HANDSHAKE and want is not None and h.length != want:
            raise LocalProtocolError(f"{'confirmation' if confirmation else 'handshake message 1'} of {h.length} "
                                     f"bytes (it is {want})", ErrorCode.HANDSHAKE_FAILED)

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
        if t is MessageType.ERROR:
            ev = Ev.SEND_CLOSE if self._state is State.ESTABLISHED else Ev.SEND_ERROR
        else:
            ev = Ev.SEND_CLOSE if t is MessageType.GOODBYE else Ev.SEND_MESSAGE
        self._transition(ev)
        return self._frame(msg)

    def close_frame(self, code: ErrorCode | int, reason: str = "") -> bytes:
        """Bytes of an Error frame that closes the connection now, in any state (b"" once it is
        closed or failed): e.g. ``close_frame(ErrorCode.TIMEOUT, "handshake timed out")`` for a
        handshake that did not finish in time. Sealed exactly when the session's frames are: once
        this side holds the session keys of a sealed session (the initiator from message 3 on,
        the responder from ESTABLISHED); plaintext before. The connection is CLOSED after it."""
        if self._state is State.CLOSED or self._state is State.ERROR:
            return b""
        return self.send(Error(int(code), str(reason)[:MAX_REASON_CHARS]))

    def error_frame(self, exc: ProtocolError) -> bytes:
        """Bytes of the Error frame that tells the peer why we close (no state change): sealed
        under the same rule as ``close_frame``."""
        return self._frame_bytes(Error(int(exc.code), str(exc)[:MAX_REASON_CHARS]))

    def _frame_bytes(self, msg: Message) -> bytes:
        if self._send_cs is not None and self.sealed_session:
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
            cs = self._send_cs
            assert cs is not None  # a sealed session's frames (and the confirmation) follow _finish
            head = encode_header(msg.TYPE, flags | _SEALED, msg.stream_id, length + TAGLEN)
            sealed: list[bytes | memoryview]
            if length >= SEAL_PARTS_MIN_BYTES:
                sealed = [cs.seal_into(head, bufs, self._seal_buf.get(length + TAGLEN))]
            else:
                sealed = [cs.encrypt(head, b"".join(bufs))]
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
        if self._state is State.ERROR or self._state is State.CLOSED:
            return NEED_DATA
        try:
            got = self._frames.next_frame()
            if got is None:
                return NEED_DATA
            return self._handle(*got)
        except ProtocolError as e:
            err = e if isinstance(e, RemoteProtocolError) else as_remote(e)
            closed_by_peer = self._state is State.CLOSED
            if not closed_by_peer:  # tell the peer why; the caller sends data_to_send()
                self._out += self.error_frame(err)
            self.state = State.ERROR
            self.error = err
            raise err from None

    def _unseal(self, h: FrameHeader, payload: memoryview) -> memoryview:
        """Open a sealed payload (its SEALED flag was checked with the header)."""
        cs = self._recv_cs
        assert cs is not None  # sealed frames are accepted only after _finish
        n = h.length - TAGLEN
        if n >= SEAL_PARTS_MIN_BYTES:
            # opened into a reused buffer, never where it lies: the AEAD refuses overlapping input
            # and output (cryptography >= 51 raises ValueError). The receive buffer is free again
            # at once for the next frame; a connection that carries large sealed frames so keeps
            # one more frame-sized buffer (this pool's) than an unsealed one. Decrypting in place
            # through a small scratch buffer would save it, at the price of copying every piece
            # back and of a slower streaming decryptor
            return cs.decrypt_into(h.pack(), payload, self._open_buf.get(n))
        return memoryview(cs.decrypt(h.pack(), payload))

    def _handle(self, h: FrameHeader, payload: memoryview):
        wire = HEADER_BYTES + h.length
        t = h.type
        if self._state is State.ESTABLISHED:  # the common case
            if self.sealed_session:
                payload = self._unseal(h, payload)
            msg = decode_payload(t, h.flags & ~_SEALED, h.stream_id, payload)
            self.counter.add("received", t, _logical_len(msg, len(payload)), wire, self.counter.kind(msg))
            if t is MessageType.GOODBYE or t is MessageType.ERROR:
                assert isinstance(msg, (Goodbye, Error))  # MESSAGES maps each type to its class
                self._transition(Ev.RECV_CLOSE)
                return ConnectionClosed(msg.code if isinstance(msg, Error) else 0, msg.reason)
            self._transition(Ev.RECV_MESSAGE)
            return msg
        if t is MessageType.ERROR:  # a refusal during the handshake (unsealed: checked with the header)
            msg = decode_payload(t, h.flags, h.stream_id, payload)
            assert isinstance(msg, Error)  # MESSAGES maps ERROR to Error
            self.counter.add("received", t, h.length, wire, self.counter.kind(msg))
            self._transition(Ev.RECV_ERROR)
            code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.HANDSHAKE_FAILED
            raise RemoteProtocolError(f"peer refused the handshake: {msg.reason} ({code.name})", code)
        self.counter.add("received", t, h.length - TAGLEN if h.flags & _SEALED else h.length, wire,
                         self.counter.kind(_HANDSHAKE_MSG))
        if self._state is State.AWAIT_CONFIRM:  # the responder's sealed, empty confirmation
            self._unseal(h, payload)
            self._transition(Ev.RECV_CONFIRM)
            return self.peer
        return self._handle_handshake(payload)

    def _handle_handshake(self, payload: memoryview):
        noise = self._noise
        if self._state is State.START:  # responder reads 1 (its length, hence its empty payload, checked), writes 2
            noise.read_message(bytes(payload))
            self._transition(Ev.RECV_HELLO)
            self._out += self._frame_plain(Handshake(noise.write_message(self._hello_payload())))
            return NEED_DATA
        if self._state is State.AWAIT_REPLY:  # initiator reads 2, writes 3
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

    def tell(self, key: str, value) -> None:
        """Add ``key`` to the hello's ``info`` before the hello is written: what a side learns only
        once its socket is up (a responder's ``seen``, section 4)."""
        if self._state is not State.START:
            raise LocalProtocolError("the hello is already written", ErrorCode.PROTOCOL_ERROR)
        info = check_info({**self.info, key: value})
        before, self.info = self.info, info
        if len(self._hello_payload()) > MAX_HELLO_BYTES:
            self.info = before
            raise LocalProtocolError(f"hello info too large: the hello must fit {MAX_HELLO_BYTES} bytes",
                                     ErrorCode.MALFORMED_METADATA)

    def _hello_payload(self) -> bytes:
        return msgpack.packb({"v": 1, "seal": self.seal, "info": self.info}, use_bin_type=True)

    def _read_hello(self, payload: bytes) -> dict:
        if len(payload) > MAX_HELLO_BYTES:
            raise HandshakeError(f"hello of {len(payload)} bytes > {MAX_HELLO_BYTES}", ErrorCode.MALFORMED_METADATA)
        try:
            m = unpack_canonical(payload)
        except LocalProtocolError as e:
            raise HandshakeError(f"malformed hello: {e}", ErrorCode.MALFORMED_METADATA) from None
        if type(m) is not dict or m.keys() != {"v", "seal", "info"}:
            raise HandshakeError("malformed hello: expected the keys v, seal, info", ErrorCode.MALFORMED_METADATA)
        v, seal = m["v"], m["seal"]
        if type(v) is not int:  # type() is: true and 1.0 are not the version 1
            raise HandshakeError(f"malformed hello: v is {v!r}, not an integer", ErrorCode.MALFORMED_METADATA)
        if v != 1:
            raise HandshakeError(f"peer speaks protocol version {v}", ErrorCode.UNSUPPORTED_VERSION)
        if type(seal) is not bool:
            raise HandshakeError(f"malformed hello: seal is {seal!r}, not a boolean", ErrorCode.MALFORMED_METADATA)
        if seal is not self.seal:
            raise HandshakeError(f"sealing mismatch: peer seal={seal}, we seal={self.seal}",
                                 ErrorCode.HANDSHAKE_FAILED)
        return check_info(m["info"])

    def _check_peer(self, remote_static: bytes | None):
        assert remote_static is not None  # read from message 2 (initiator) or 3 (responder)
        pid = peer_id_of(remote_static)
        if self.allowlist is not None and pid not in self.allowlist:
            raise HandshakeError(f"peer {pid[:16]}... is not on the allowlist", ErrorCode.PEER_NOT_ALLOWED)

    def _finish(self, info: dict):
        result, rs = self._noise.result, self._noise.remote_static
        assert result is not None and rs is not None  # called once the last message is read or written
        self._send_cs, self._recv_cs = result
        self.sealed_session = self.seal
        self.peer = HandshakeComplete(peer_id_of(rs), rs, info, self.seal)

    @property
    def buffered_bytes(self) -> int:
        return self._frames.buffered

    # --- frame buffers -------------------------------------------------------------------
    def _pools(self) -> tuple:
        return self._seal_buf, self._open_buf, self._frames.assembly

    @property
    def buffer_uses(self) -> int:
        """Large frame buffers handed out so far (sealing, opening, assembling): a driver tells an
        idle connection by this count not moving."""
        return sum(p.uses for p in self._pools())

    @property
    def buffer_bytes(self) -> int:
        """Bytes the connection's frame buffer pools hold (a frame payload still viewed included)."""
        return sum(p.buffer_bytes for p in self._pools())

    def shed(self, ended: bool = False) -> int:
        """Give up the frame buffers no view holds (``ReusableBuffer.shed``): to the thread's
        bounded spares, the rest back to the allocator. Call it when the connection is idle, and
        with ``ended`` once it is over (buffers a message still views are then let go of too); a
        later large frame takes a spare or a fresh buffer. Returns the bytes dropped."""
        return sum(p.shed(ended) for p in self._pools())
