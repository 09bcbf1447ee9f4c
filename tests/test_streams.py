"""Chunked streams: reassembly, sha256 verification, resume from an offset."""

import hashlib
import os

import pytest

from blocktrain.protocol import ErrorCode, RemoteProtocolError, StreamChunk, StreamEnd, StreamOpen, StreamReceiver
from blocktrain.protocol import stream_messages
from blocktrain.protocol.events import MessageReader, frame_message


def feed(rx, msgs):
    """Through real frames, as a peer would send them."""
    r = MessageReader()
    out = None
    for m in msgs:
        r.feed(frame_message(m))
        m = r.next_message()
        if isinstance(m, StreamOpen):
            rx.on_open(m)
        elif isinstance(m, StreamChunk):
            rx.on_chunk(m)
        else:
            out = rx.on_end(m)
    return out


def test_reassembles_and_verifies():
    data = os.urandom(100_000)
    msgs = list(stream_messages(5, "checkpoint", "b1", data, chunk_size=30_000))
    assert len(msgs) == 2 + 4
    assert feed(StreamReceiver(), msgs) == data


def test_resume_from_offset_with_another_sender():
    data = os.urandom(50_000)
    rx = StreamReceiver()
    first = list(stream_messages(5, "checkpoint", "b1", data, chunk_size=10_000))
    feed(rx, first[:3])  # open + 2 chunks, then the sender dies
    assert rx.resume_offset == 20_000
    rest = list(stream_messages(9, "checkpoint", "b1", data, offset=rx.resume_offset, chunk_size=10_000))
    assert rest[1].offset == 20_000
    assert feed(rx, rest) == data


def test_corrupted_stream_is_discarded():
    data = os.urandom(20_000)
    msgs = list(stream_messages(5, "checkpoint", "b1", data, chunk_size=10_000))
    bad = StreamChunk(offset=10_000, data=bytes(10_000), stream_id=5)
    rx = StreamReceiver()
    with pytest.raises(RemoteProtocolError) as ei:
        feed(rx, [msgs[0], msgs[1], bad, msgs[3]])
    assert ei.value.code is ErrorCode.STREAM_INTEGRITY
    assert rx.resume_offset == 0


def test_gap_and_overrun_are_stream_errors():
    data = os.urandom(20_000)
    op = StreamOpen(kind="checkpoint", name="b", total_size=len(data), sha256=hashlib.sha256(data).digest(),
                    stream_id=2)
    rx = StreamReceiver()
    rx.on_open(op)
    with pytest.raises(RemoteProtocolError) as ei:
        rx.on_chunk(StreamChunk(offset=5, data=b"x", stream_id=2))
    assert ei.value.code is ErrorCode.STREAM_ERROR
    with pytest.raises(RemoteProtocolError):
        rx.on_chunk(StreamChunk(offset=0, data=bytes(20_001), stream_id=2))
    with pytest.raises(RemoteProtocolError):
        rx.on_end(StreamEnd(stream_id=2))  # ended short


def test_oversized_stream_refused():
    rx = StreamReceiver(max_bytes=100)
    with pytest.raises(RemoteProtocolError):
        rx.on_open(StreamOpen(kind="checkpoint", name="b", total_size=101, sha256=bytes(32), stream_id=1))


# --- r4: a failed stream reaches the wire as a StreamReset; the connection stays up -------------

def test_integrity_failure_is_reset_on_the_wire_and_the_connection_stays_up():
    from blocktrain.protocol import NEED_DATA, Ping, State, StreamFailed, StreamReset

    from conftest import ConnectionPair
    p = ConnectionPair()
    p.handshake()
    data = os.urandom(20_000)
    msgs = list(stream_messages(5, "checkpoint", "b1", data, chunk_size=10_000))
    msgs[2] = StreamChunk(offset=10_000, data=bytes(10_000), stream_id=5)  # corrupted in transit
    rx = StreamReceiver()
    with pytest.raises(StreamFailed) as ei:
        for m in msgs:  # the sender (a) streams to the receiver (b)
            (got,) = p.deliver(p.a, p.b, p.a.send(m))
            {StreamOpen: rx.on_open, StreamChunk: rx.on_chunk, StreamEnd: rx.on_end}[type(got)](got)
    err = ei.value
    assert err.code is ErrorCode.STREAM_INTEGRITY and err.stream_id == 5 and not err.by_peer
    reset = err.reset_message()
    assert reset == StreamReset(code=int(ErrorCode.STREAM_INTEGRITY), reason=str(err), stream_id=5)
    assert p.deliver(p.b, p.a, p.b.send(reset)) == [reset]  # the sender learns why, on that stream
    assert p.a.state is State.ESTABLISHED and p.b.state is State.ESTABLISHED
    assert p.deliver(p.a, p.b, p.a.send(Ping(nonce=1))) == [Ping(nonce=1)]
    assert p.b.next_event() is NEED_DATA


def test_reset_by_the_sender_fails_the_stream_and_keeps_the_bytes():
    from blocktrain.protocol import StreamFailed, StreamReset
    data = os.urandom(30_000)
    rx = StreamReceiver()
    msgs = list(stream_messages(4, "checkpoint", "b1", data, chunk_size=10_000))
    feed(rx, msgs[:2])
    with pytest.raises(StreamFailed) as ei:
        rx.on_reset(StreamReset(code=int(ErrorCode.INTERNAL_ERROR), reason="file vanished", stream_id=4))
    assert ei.value.by_peer and ei.value.code is ErrorCode.INTERNAL_ERROR and "file vanished" in str(ei.value)
    assert rx.resume_offset == 10_000  # resumable from another holder


def test_stream_errors_name_their_stream():
    from blocktrain.protocol import StreamFailed
    rx = StreamReceiver()
    rx.on_open(StreamOpen(kind="checkpoint", name="b", total_size=10, sha256=bytes(32), stream_id=2))
    with pytest.raises(StreamFailed) as ei:
        rx.on_chunk(StreamChunk(offset=3, data=b"x", stream_id=2))
    assert ei.value.stream_id == 2 and ei.value.code is ErrorCode.STREAM_ERROR
    assert ei.value.reset_message().stream_id == 2
