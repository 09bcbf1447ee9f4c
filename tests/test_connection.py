"""The sans-IO connection: handshake outcomes, sealing, tampering, replay, accounting."""

import os

import pytest

from blocktrain.protocol import (NEED_DATA, BlockUpdate, ConnectionClosed, ErrorCode, Goodbye, HandshakeComplete,
                                 LocalProtocolError, Ping, RemoteProtocolError, State, pack_tensor, peer_id_of)
from blocktrain.protocol.frames import HEADER_BYTES
from blocktrain.protocol.handshake import public_bytes

from conftest import ConnectionPair


def test_handshake_succeeds_and_identifies_both_peers(pair):
    ev_a, ev_b = pair.handshake()
    assert pair.a.state is State.ESTABLISHED and pair.b.state is State.ESTABLISHED
    (ca,), (cb,) = ev_a, ev_b
    assert isinstance(ca, HandshakeComplete) and isinstance(cb, HandshakeComplete)
    assert ca.peer_id == peer_id_of(public_bytes(pair.key_b)) and cb.peer_id == peer_id_of(public_bytes(pair.key_a))
    assert ca.info == {"who": "b"} and cb.info == {"who": "a"}
    assert ca.sealed and cb.sealed


def test_messages_flow_both_ways_after_handshake(pair):
    pair.handshake()
    assert pair.deliver(pair.a, pair.b, pair.a.send(Ping(nonce=1))) == [Ping(nonce=1)]
    assert pair.deliver(pair.b, pair.a, pair.b.send(Ping(nonce=2))) == [Ping(nonce=2)]


def test_no_application_message_before_established(pair):
    with pytest.raises(LocalProtocolError):
        pair.a.send(Ping(nonce=1))
    pair.b.receive_data(pair.a.initiate())
    pair.drain(pair.b)
    with pytest.raises(LocalProtocolError):
        pair.b.send(Ping(nonce=1))


def test_wrong_psk_fails_with_clear_error_and_delivers_nothing():
    p = ConnectionPair(psk_a=os.urandom(32), psk_b=os.urandom(32))
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    p.deliver(p.b, p.a)  # initiator reads 2, writes 3 (it cannot know yet)
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.a, p.b)
    assert ei.value.code is ErrorCode.AUTHENTICATION_FAILED
    assert p.b.state is State.ERROR and p.b.peer is None
    # the responder's refusal reaches the initiator as a clear error, never as ESTABLISHED
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.b, p.a)
    assert ei.value.code is ErrorCode.AUTHENTICATION_FAILED
    assert "refused" in str(ei.value)
    assert p.a.state is not State.ESTABLISHED


def test_allowlist_rejects_unknown_identity_on_both_sides():
    p = ConnectionPair(allow_b=["00" * 32])
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    p.deliver(p.b, p.a)
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.a, p.b)
    assert ei.value.code is ErrorCode.PEER_NOT_ALLOWED
    p = ConnectionPair(allow_a=["00" * 32])
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.b, p.a)
    assert ei.value.code is ErrorCode.PEER_NOT_ALLOWED


def test_allowlist_accepts_listed_identity():
    p = ConnectionPair()
    p.b.allowlist = {peer_id_of(public_bytes(p.key_a))}
    p.a.allowlist = {peer_id_of(public_bytes(p.key_b))}
    p.handshake()
    assert p.a.state is State.ESTABLISHED and p.b.state is State.ESTABLISHED


@pytest.mark.parametrize("message", [0, 1, 2])
def test_tampered_handshake_fails(message):
    p = ConnectionPair()
    wire = [p.a.initiate()]
    flip = lambda b: b[:-1] + bytes([b[-1] ^ 1])  # noqa: E731  last byte: inside the payload/tag
    if message == 0:
        # with the psk modifier, message 1's ephemeral key is mixed into a key that seals its
        # (empty) payload: a changed key fails that tag at the responder
        p.b.receive_data(wire[0][:HEADER_BYTES] + bytes([wire[0][HEADER_BYTES] ^ 1]) + wire[0][HEADER_BYTES + 1:])
        with pytest.raises(RemoteProtocolError) as ei:
            p.drain(p.b)
        assert ei.value.code is ErrorCode.AUTHENTICATION_FAILED
        return
    p.b.receive_data(wire[0])
    p.drain(p.b)
    m2 = p.b.data_to_send()
    if message == 1:
        with pytest.raises(RemoteProtocolError) as ei:
            p.deliver(p.b, p.a, flip(m2))
        assert ei.value.code is ErrorCode.AUTHENTICATION_FAILED
        return
    p.deliver(p.b, p.a, m2)
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.a, p.b, flip(p.a.data_to_send()))
    assert ei.value.code is ErrorCode.AUTHENTICATION_FAILED


def test_truncated_handshake_fails():
    p = ConnectionPair()
    m1 = p.a.initiate()
    p.b.receive_data(m1[:-5])
    assert p.b.next_event() is NEED_DATA  # incomplete frame: waits, no event
    # a frame that is complete but whose Noise message is cut short
    from blocktrain.protocol.events import frame_message
    from blocktrain.protocol import Handshake
    q = ConnectionPair()
    q.b.receive_data(frame_message(Handshake(data=m1[HEADER_BYTES:HEADER_BYTES + 20])))
    with pytest.raises(RemoteProtocolError) as ei:
        q.drain(q.b)
    assert ei.value.code is ErrorCode.HANDSHAKE_FAILED


def test_tampered_sealed_frame_breaks_connection(pair):
    pair.handshake()
    data = bytearray(pair.a.send(Ping(nonce=5)))
    data[-3] ^= 0x40
    with pytest.raises(RemoteProtocolError) as ei:
        pair.deliver(pair.a, pair.b, bytes(data))
    assert ei.value.code is ErrorCode.DECRYPT_FAILED
    assert pair.b.state is State.ERROR
    # once in ERROR, even a valid frame is not delivered
    pair.b.receive_data(pair.a.send(Ping(nonce=6)))
    assert pair.b.next_event() is NEED_DATA


def test_tampered_header_breaks_connection(pair):
    pair.handshake()
    from blocktrain.protocol import StreamEnd
    data = bytearray(pair.a.send(StreamEnd(stream_id=2)))
    data[6:10] = (9).to_bytes(4, "big")  # another stream id, crc fixed up: only the AEAD can tell
    import zlib
    data[14:18] = zlib.crc32(bytes(data[:14])).to_bytes(4, "big")
    with pytest.raises(RemoteProtocolError) as ei:
        pair.deliver(pair.a, pair.b, bytes(data))
    assert ei.value.code is ErrorCode.DECRYPT_FAILED


def test_replayed_frame_breaks_connection(pair):
    pair.handshake()
    frame = pair.a.send(Ping(nonce=5))
    assert pair.deliver(pair.a, pair.b, frame) == [Ping(nonce=5)]
    with pytest.raises(RemoteProtocolError) as ei:
        pair.deliver(pair.a, pair.b, frame)
    assert ei.value.code is ErrorCode.DECRYPT_FAILED


def test_reordered_frames_break_connection(pair):
    pair.handshake()
    f1, f2 = pair.a.send(Ping(nonce=1)), pair.a.send(Ping(nonce=2))
    with pytest.raises(RemoteProtocolError):
        pair.deliver(pair.a, pair.b, f2 + f1)


def test_unsealed_session_when_both_agree():
    p = ConnectionPair(seal=(False, False))
    ev_a, ev_b = p.handshake()
    assert not ev_a[0].sealed
    frame = p.a.send(Ping(nonce=3))
    assert frame[4] & 2 == 0  # SEALED flag clear
    assert p.deliver(p.a, p.b, frame) == [Ping(nonce=3)]


def test_sealing_mismatch_fails_handshake():
    p = ConnectionPair(seal=(True, False))
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.b, p.a)
    assert ei.value.code is ErrorCode.HANDSHAKE_FAILED


def test_goodbye_closes(pair):
    pair.handshake()
    evs = pair.deliver(pair.a, pair.b, pair.a.send(Goodbye(reason="bye")))
    assert evs == [ConnectionClosed(0, "bye")]
    assert pair.a.state is State.CLOSED and pair.b.state is State.CLOSED


def test_garbage_after_handshake_sends_sealed_error(pair):
    pair.handshake()
    with pytest.raises(RemoteProtocolError) as ei:
        pair.deliver(pair.a, pair.b, b"GET / HTTP/1.1\r\n\r\n")
    assert ei.value.code is ErrorCode.BAD_MAGIC
    evs = pair.deliver(pair.b, pair.a)  # a learns why b closes, authenticated
    assert len(evs) == 1 and isinstance(evs[0], ConnectionClosed)
    assert evs[0].code == ErrorCode.BAD_MAGIC and "magic" in evs[0].reason


def test_byte_accounting_counts_every_frame(pair):
    pair.handshake()
    t = pack_tensor("w", "float32", (1024,), bytes(4096), compress="always")
    frame = pair.a.send(BlockUpdate(block=1, round=1, tensors=[t]))
    pair.deliver(pair.a, pair.b, frame)
    sent = pair.a.counter.snapshot()["sent"]
    recv = pair.b.counter.snapshot()["received"]
    assert sent["by_type"]["block_update"]["frames"] == 1
    assert sent["by_type"]["block_update"]["wire_bytes"] == len(frame)
    assert recv["by_type"]["block_update"] == sent["by_type"]["block_update"]
    # payload bytes count the tensor before lz4; the wire carried far fewer
    assert sent["by_type"]["block_update"]["payload_bytes"] > 4096 > len(frame)
    assert sent["total"]["frames"] == sent["by_type"]["handshake"]["frames"] + 1
    assert pair.a.counter.snapshot()["received"]["total"]["wire_bytes"] == \
        pair.b.counter.snapshot()["sent"]["total"]["wire_bytes"]


@pytest.mark.parametrize("seal", [True, False])
def test_large_payload_received_in_place_equals_fed(seal):
    import random

    from blocktrain.protocol import StreamChunk
    p = ConnectionPair(seal=(seal, seal))
    p.handshake()
    data = os.urandom(300_000)
    wire = p.a.send(StreamChunk(offset=7, data=data, stream_id=2)) + p.a.send(Ping(nonce=1))
    rng = random.Random(0)
    pos, got, direct, receive_buffers = 0, [], 0, []
    p.b.receive_data(wire[:1000])  # the header and a little payload arrive the ordinary way
    pos = 1000
    got += p.drain(p.b)
    while pos < len(wire):
        view = p.b.receive_buffer()
        if view is None:  # no large payload in progress: feed
            n = min(len(wire) - pos, rng.randint(1, 5000))
            p.b.receive_data(wire[pos:pos + n])
        else:  # a socket would read straight into the payload's buffer
            n = min(len(view), len(wire) - pos, rng.randint(1, 70_000))
            view[:n] = wire[pos:pos + n]
            p.b.received_into(n)
            direct += 1
            receive_buffers.append(view.obj)
        pos += n
        got += p.drain(p.b)
    assert direct > 0 and got == [StreamChunk(offset=7, data=data, stream_id=2), Ping(nonce=1)]
    # unsealed, the chunk is a view of the buffer the socket wrote (zero-copy); sealed, it was opened
    # into a buffer of its own: AES-GCM must not decrypt in place (cryptography >= 51 refuses it)
    in_receive_buffer = any(got[0].data.obj is b for b in receive_buffers)
    assert in_receive_buffer is not seal


# --- r4: nothing unauthenticated is held beyond the handshake's own limit ---

def _header(mtype, flags, stream_id, length):
    import struct
    import zlib
    head = struct.pack(">2sBBBBII", b"BT", 1, mtype, flags, 0, stream_id, length)
    return head + struct.pack(">I", zlib.crc32(head))


def _responder_after_message_1():
    p = ConnectionPair()
    p.b.receive_data(p.a.initiate())
    assert p.drain(p.b) == [] and p.b.state is State.AWAIT_FINISH
    return p


def test_handshake_header_announcing_16_mib_is_refused_at_the_header():
    p = ConnectionPair()
    p.b.receive_data(_header(0x01, 0, 0, 16 * 1024 * 1024))  # 18 bytes, no payload
    assert p.b.receive_buffer() is None
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is ErrorCode.FRAME_TOO_LARGE
    assert p.b.state is State.ERROR and p.b.buffered_bytes == 0 and p.b.receive_buffer() is None
    # the limit before ESTABLISHED is the handshake's: 65,535 passes the header, 65,536 does not
    p = _responder_after_message_1()
    p.b.receive_data(_header(0x01, 0, 0, 65535))
    assert p.b.next_event() is NEED_DATA and p.b.receive_buffer() is None
    p = _responder_after_message_1()
    p.b.receive_data(_header(0x01, 0, 0, 65536))
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is ErrorCode.FRAME_TOO_LARGE


def test_no_receive_buffer_before_established():
    p = _responder_after_message_1()
    p.b.receive_data(_header(0x01, 0, 0, 65535) + bytes(100))
    assert p.b.next_event() is NEED_DATA
    assert p.b.receive_buffer() is None  # a socket never reads into a buffer the peer sized
    q = ConnectionPair()  # the initiator waiting for the confirmation: an unsealed ERROR may come
    q.b.receive_data(q.a.initiate())
    q.drain(q.b)
    q.deliver(q.b, q.a)
    assert q.a.state is State.AWAIT_CONFIRM
    q.a.receive_data(_header(0x02, 0, 0, 65535) + bytes(100))
    assert q.a.next_event() is NEED_DATA and q.a.receive_buffer() is None


def test_unauthenticated_peer_makes_us_hold_little_even_one_byte_at_a_time():
    """Measured: a responder fed a 65,535-byte handshake frame one byte at a time (the most an
    unauthenticated peer may announce) holds about what it was sent, not an object per byte."""
    import tracemalloc
    p = _responder_after_message_1()
    wire = _header(0x01, 0, 0, 65535) + bytes(60_000)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(len(wire)):
            p.b.receive_data(wire[i:i + 1])
            if i % 1000 == 0:
                assert p.b.next_event() is NEED_DATA and p.b.receive_buffer() is None
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert p.b.buffered_bytes == len(wire)
    assert held < 2 * len(wire), f"held {held} bytes for {len(wire)} received"


# --- r4: frame limits and flags from the header (finding 16) -------------------------------------

@pytest.mark.parametrize("seal", [True, False])
def test_frame_limit_is_max_frame_bytes_plus_the_tag_only_when_sealed(seal):
    from blocktrain.protocol import MAX_FRAME_BYTES
    sealed_flag = 0x02 if seal else 0
    limit = MAX_FRAME_BYTES + (16 if seal else 0)
    p = ConnectionPair(seal=(seal, seal))
    p.handshake()
    p.b.receive_data(_header(0x31, sealed_flag, 1, limit))
    assert p.b.next_event() is NEED_DATA  # the header is accepted; the payload may follow
    p = ConnectionPair(seal=(seal, seal))
    p.handshake()
    p.b.receive_data(_header(0x31, sealed_flag, 1, limit + 1))
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("seal,flags,code", [
    (True, 0x03, ErrorCode.BAD_FLAGS),  # COMPRESSED on a PING
    (True, 0x00, ErrorCode.BAD_FLAGS),  # unsealed frame in a sealed session
    (False, 0x02, ErrorCode.BAD_FLAGS),  # sealed frame in an unsealed session
])
def test_flags_are_checked_when_the_header_parses(seal, flags, code):
    p = ConnectionPair(seal=(seal, seal))
    p.handshake()
    p.b.receive_data(_header(0x04, flags, 0, 1000))  # the header alone, 1000 payload bytes announced
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is code


def test_sealed_handshake_message_1_is_bad_flags():
    p = ConnectionPair()
    m1 = bytearray(p.a.initiate())
    m1[4] = 0x02
    import zlib
    m1[14:18] = zlib.crc32(bytes(m1[:14])).to_bytes(4, "big")
    p.b.receive_data(bytes(m1[:18]))  # the header is enough
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is ErrorCode.BAD_FLAGS


@pytest.mark.parametrize("hello,code", [
    ({"v": True, "seal": True, "info": {}}, ErrorCode.MALFORMED_METADATA),
    ({"v": 1.0, "seal": True, "info": {}}, ErrorCode.MALFORMED_METADATA),
    ({"v": 2, "seal": True, "info": {}}, ErrorCode.UNSUPPORTED_VERSION),
    ({"v": 1, "seal": 1, "info": {}}, ErrorCode.MALFORMED_METADATA),
    ({"v": 1, "seal": True, "info": {"role": "cat"}}, ErrorCode.MALFORMED_METADATA),
    ({"v": 1, "seal": True, "info": {"pad": "x" * 5000}}, ErrorCode.MALFORMED_METADATA),  # over 4 KiB
])
def test_hello_fields_are_type_exact(hello, code):
    import msgpack
    p = ConnectionPair()
    p.a._hello_payload = lambda: msgpack.packb(hello)
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    p.deliver(p.b, p.a)  # the initiator reads message 2 and writes message 3 with that hello
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.a, p.b)
    assert ei.value.code is code and p.b.peer is None


def test_info_is_checked_when_the_connection_is_made():
    from blocktrain.protocol import Connection, Role
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    for info in ({"role": "cat"}, {"blocks": [70000]}, {"addr": 5}, {"x" * 65: 1}, {"pad": "x" * 5000}):
        with pytest.raises(LocalProtocolError):
            Connection(Role.INITIATOR, X25519PrivateKey.generate(), os.urandom(32), info=info)


def test_goodbye_before_the_handshake_is_unexpected():
    p = ConnectionPair()
    with pytest.raises(LocalProtocolError):
        p.a.send(Goodbye(reason="no"))  # before ESTABLISHED only an Error closes (close_frame)
    from blocktrain.protocol.events import frame_message
    p.b.receive_data(frame_message(Goodbye(reason="no")))
    with pytest.raises(RemoteProtocolError) as ei:
        p.b.next_event()
    assert ei.value.code is ErrorCode.UNEXPECTED_MESSAGE


# --- r4: close_frame: ERROR TIMEOUT (and any code) from the driver, in any state ------------------

def test_close_frame_before_the_handshake_is_a_plain_error():
    from blocktrain.protocol.events import frame_message
    from vectors import VALID
    p = _responder_after_message_1()
    frame = p.b.close_frame(ErrorCode.TIMEOUT, "handshake timed out")
    assert frame == frame_message(VALID["error_timeout"])  # PROTOCOL.md's vector, unsealed
    assert p.b.state is State.CLOSED and p.b.close_frame(ErrorCode.TIMEOUT) == b""
    p.deliver(p.b, p.a)  # message 2 was queued before
    with pytest.raises(RemoteProtocolError) as ei:
        p.deliver(p.b, p.a, frame)
    assert ei.value.code is ErrorCode.TIMEOUT and "timed out" in str(ei.value)


def test_close_frame_once_the_keys_exist_is_sealed():
    p = ConnectionPair()
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    p.deliver(p.b, p.a)
    m3 = p.a.data_to_send()
    assert p.a.state is State.AWAIT_CONFIRM  # the initiator holds the keys from message 3 on
    frame = p.a.close_frame(ErrorCode.TIMEOUT, "no confirmation")
    assert frame[4] & 0x02
    evs = p.deliver(p.a, p.b, m3 + frame)
    assert isinstance(evs[0], HandshakeComplete) and evs[1] == ConnectionClosed(ErrorCode.TIMEOUT, "no confirmation")
    q = ConnectionPair()
    q.handshake()
    assert q.deliver(q.a, q.b, q.a.close_frame(ErrorCode.TIMEOUT, "silent")) == [
        ConnectionClosed(ErrorCode.TIMEOUT, "silent")]


# --- r4: the session may begin in the same read as the confirmation; handshake accounting -------

def test_session_frames_in_the_same_read_as_the_confirmation():
    from blocktrain.protocol import Announce, PeerInfo
    p = ConnectionPair()
    p.b.receive_data(p.a.initiate())
    p.drain(p.b)
    p.deliver(p.b, p.a)
    p.deliver(p.a, p.b)  # the responder is ESTABLISHED and may send at once
    ann = Announce(peer=PeerInfo("ab" * 32, "127.0.0.1:1", (0,), "train", 0))
    wire = p.b.data_to_send() + p.b.send(ann) + p.b.send(Ping(nonce=3))
    evs = p.deliver(p.b, p.a, wire)
    assert isinstance(evs[0], HandshakeComplete) and evs[1:] == [ann, Ping(nonce=3)]


def test_handshake_byte_accounting():
    p = ConnectionPair()
    p.handshake()
    a, b = p.a.counter.snapshot(), p.b.counter.snapshot()
    hs = lambda side, d: side[d]["by_type"]["handshake"]  # noqa: E731
    assert hs(a, "sent")["frames"] == 2 and hs(b, "sent")["frames"] == 2  # messages 1, 3 / 2, confirmation
    assert hs(a, "sent") == hs(b, "received") and hs(b, "sent") == hs(a, "received")
    # the confirmation: no payload bytes, header + tag on the wire
    assert hs(b, "sent")["wire_bytes"] - hs(b, "sent")["payload_bytes"] == 2 * 18 + 16
    assert hs(a, "sent")["wire_bytes"] - hs(a, "sent")["payload_bytes"] == 2 * 18


# --- r4: the core knows no application kinds; the application hands it its classifier ------------

def test_connection_module_names_no_application_kind():
    import inspect

    from blocktrain.protocol import connection
    src = inspect.getsource(connection)
    for word in ("checkpoint", "lower-checkpoint", '"update"', '"pipeline"', "join handshake", "STREAM_KINDS"):
        assert word not in src, f"protocol/connection.py knows the application word {word}"


def test_byte_counter_uses_the_classifier_and_remembers_stream_kinds():
    from blocktrain.protocol import ByteCounter, StreamChunk, StreamEnd, StreamOpen, StreamRequest, StreamReset
    from blocktrain.protocol.connection import MAX_TRACKED_STREAMS, MAX_TRAFFIC_KINDS
    seen = []

    def classify(msg):
        seen.append(type(msg).__name__)
        return msg.kind if isinstance(msg, (StreamOpen, StreamRequest)) else "rest"

    c = ByteCounter(classify)
    assert c.kind(StreamRequest(kind="k1", name="n", stream_id=5)) == "k1"
    assert c.kind(StreamChunk(offset=0, data=b"x", stream_id=5)) == "k1"  # from the table, not classify
    assert c.kind(StreamEnd(stream_id=5)) == "k1"
    assert c.kind(StreamChunk(offset=0, data=b"x", stream_id=5)) == "rest"  # forgotten: classified alone
    assert c.kind(StreamOpen(kind="k2", name="n", stream_id=6)) == "k2"
    assert c.kind(StreamReset(stream_id=6)) == "k2"
    assert c.kind(StreamChunk(offset=0, data=b"x", stream_id=6)) == "rest"
    for sid in range(1, MAX_TRACKED_STREAMS + 100):  # streams that never end: the table stays bounded
        c.kind(StreamOpen(kind="k", name="n", stream_id=sid))
    kinds = [c.kind(StreamChunk(offset=0, data=b"x", stream_id=sid)) for sid in range(1, MAX_TRACKED_STREAMS + 100)]
    assert kinds == ["rest"] * 99 + ["k"] * MAX_TRACKED_STREAMS  # the oldest forgotten, the last MAX kept
    for i in range(MAX_TRAFFIC_KINDS + 10):  # a classifier passing peer words through: bounded too
        c.add("received", StreamOpen.TYPE, 1, 1, f"kind{i}")
    assert len(c.received_kinds) == MAX_TRAFFIC_KINDS + 1 and c.received_kinds["other"]["frames"] == 10
    assert ByteCounter().kind(Ping(nonce=1)) is None  # no classifier: no counts by kind
    p = ConnectionPair()
    p.handshake()
    assert p.a.counter.snapshot()["sent"]["by_kind"] == {}


def test_application_classifier_counts_as_before():
    """p2p.traffic.kind_of gives the r3 kinds (PROTOCOL.md section 10) through the core's table."""
    from blocktrain.p2p.traffic import kind_of
    from blocktrain.protocol import (Connection, PipelineForward, Role, StreamChunk, StreamEnd, StreamOpen,
                                     StreamRequest)
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    psk = os.urandom(32)
    p = ConnectionPair()
    p.a = Connection(Role.INITIATOR, X25519PrivateKey.generate(), psk, kind_of=kind_of)
    p.b = Connection(Role.RESPONDER, X25519PrivateKey.generate(), psk, kind_of=kind_of)
    p.handshake()
    t = pack_tensor("w", "float32", (4,), bytes(16))
    msgs = [BlockUpdate(block=1, round=1, tensors=[t]), BlockUpdate(block=1, round=1, meta={"phase": "join"}),
            PipelineForward(request_id=1, tensors=[t]),
            StreamRequest(kind="lower-checkpoint", name="block1", stream_id=7),
            StreamOpen(kind="lower-checkpoint", name="block1", total_size=3, stream_id=7),
            StreamChunk(offset=0, data=b"abc", stream_id=7), StreamEnd(stream_id=7),
            StreamOpen(kind="weird", name="x", total_size=0, stream_id=8), StreamEnd(stream_id=8),
            StreamChunk(offset=0, data=b"z", stream_id=9), Ping(nonce=1)]
    for m in msgs:
        p.deliver(p.a, p.b, p.a.send(m))
    kinds = p.b.counter.snapshot()["received"]["by_kind"]
    assert {k: v["frames"] for k, v in kinds.items()} == {
        "update": 1, "control": 1 + 1 + 2, "pipeline": 1, "lower-checkpoint": 4, "stream-other": 3}


def test_reusable_buffers_spill_to_spares_and_never_hand_out_a_held_one():
    """Frames in flight beyond a pool (parts held for a later round, writes not yet taken) go to
    the thread's spares; another pool takes a spare over once nobody holds it, never before."""
    from blocktrain.protocol.frames import ReusableBuffer
    ReusableBuffer.spares().clear()  # this thread's spares from earlier tests
    a, b = ReusableBuffer(), ReusableBuffer()
    held = [a.get(1 << 20) for _ in range(ReusableBuffer.POOL + 2)]
    assert len({id(v.obj) for v in held}) == len(held)  # all held: each view has its own buffer
    oldest = held[0].obj
    v = b.get(1 << 20)
    assert v.obj is not oldest and all(v.obj is not h.obj for h in held)  # still held: not taken over
    del held[0]
    w = b.get(1 << 20)
    assert w.obj is oldest  # let go of: taken over instead of a fresh buffer
    w[:] = b"\x01" * len(w)
    assert all(bytes(h[:1]) == b"\x00" for h in held)  # nothing in use was written over
