"""A connection's frame buffers (the protocol's reused pools: sealing, opening, assembling) are
given up once it is idle or over: what many connections that each carried a large frame hold
between them is bounded by a constant (the thread's spare list), whatever their number.
"""

import asyncio
import gc
import os
import tracemalloc

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.p2p import transport
from blocktrain.p2p.transport import PeerConnection, Timeouts, make_connection, open_connection
from blocktrain.protocol import ProtocolError, Role, StreamChunk
from blocktrain.protocol.frames import REUSE_MIN_BYTES, ReusableBuffer

from conftest import ConnectionPair

CHUNK_BYTES = 2 * 1024 * 1024  # one large frame per connection
CONNECTIONS = 48  # 48 x (seal + assembly + open) x 2 MiB = 288 MiB held today
SPARE_CAP = ReusableBuffer.SPARE_BYTES
SLACK_BYTES = 16 * 1024 * 1024  # sockets, events, the shared read buffer: anything but frame pools
FAST = Timeouts(connect_s=5, handshake_s=5, heartbeat_s=1.0, dead_after_s=30, close_s=1)


async def _listen(psk: bytes) -> tuple:
    """A loopback server of PeerConnections with ``psk``: (server, port, the connections it made)."""
    servers: list = []

    def factory():
        pc = PeerConnection(make_connection(Role.RESPONDER, X25519PrivateKey.generate(), psk), FAST)
        servers.append(pc)
        return pc
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], servers


def _drain(conn):
    while True:
        ev = conn.next_event()
        if ev.__class__.__name__ == "_NeedData":
            return
        del ev


def test_pools_given_up_by_idle_connections_stay_under_the_spare_cap():
    """Sans-IO: many sealed connections, each sent and received a large frame read in place, are
    told to shed: their pools plus the thread's spares hold at most SPARE_BYTES."""
    ReusableBuffer.spares().clear()
    pairs = []
    for i in range(CONNECTIONS):
        p = ConnectionPair()
        p.handshake()
        wire = p.a.send(StreamChunk(offset=0, data=os.urandom(CHUNK_BYTES), stream_id=1))  # a's seal pool
        pos = 0
        while pos < len(wire):
            view = p.b.receive_buffer()  # b's assembly pool, then b's open pool
            if view is None:
                n = min(len(wire) - pos, 4096)
                p.b.receive_data(wire[pos:pos + n])
            else:
                n = min(len(view), len(wire) - pos)
                view[:n] = wire[pos:pos + n]
                p.b.received_into(n)
            pos += n
        _drain(p.b)
        pairs.append(p)
    conns = [c for p in pairs for c in (p.a, p.b)]
    held_before = sum(c.buffer_bytes for c in conns)
    assert held_before >= CONNECTIONS * 3 * CHUNK_BYTES  # what a connection keeps today while it lives
    released = sum(c.shed() for c in conns)
    held = sum(c.buffer_bytes for c in conns) + ReusableBuffer.spare_bytes()
    assert held <= SPARE_CAP, f"{held / 2**20:.0f} MiB held by idle connections"
    assert released >= held_before - SPARE_CAP
    # a connection that sheds and then carries a large frame again takes a spare, not fresh memory
    spare_ids = {id(b) for b in ReusableBuffer.spares()}
    p = pairs[0]
    p.b.receive_data(p.a.send(StreamChunk(offset=0, data=os.urandom(CHUNK_BYTES), stream_id=1)))
    got = []
    while (ev := p.b.next_event()).__class__.__name__ != "_NeedData":
        got.append(ev)
    assert len(got) == 1 and id(got[0].data.obj) in spare_ids
    ReusableBuffer.spares().clear()


def test_shed_never_gives_away_a_buffer_still_viewed():
    ReusableBuffer.spares().clear()
    pool = ReusableBuffer()
    held = pool.get(REUSE_MIN_BYTES * 4)
    held[:4] = b"kept"
    free = pool.get(REUSE_MIN_BYTES * 4)
    free_obj = free.obj
    del free
    pool.shed()
    assert pool.buffer_bytes == len(held.obj)  # the viewed one stays with its pool
    assert [id(b) for b in ReusableBuffer.spares()] == [id(free_obj)]
    other = ReusableBuffer().get(REUSE_MIN_BYTES * 4)
    assert other.obj is free_obj and bytes(held[:4]) == b"kept"
    ReusableBuffer.spares().clear()


def test_an_ended_pool_lets_go_of_buffers_still_viewed():
    """A connection that ended keeps none of its buffers: one a message still views is freed with
    that message, not with the connection (which may live on in a reference cycle)."""
    ReusableBuffer.spares().clear()
    pool = ReusableBuffer()
    held = pool.get(REUSE_MIN_BYTES * 4)
    held[:4] = b"kept"
    assert pool.shed() == 0 and pool.buffer_bytes == len(held.obj)
    assert pool.shed(ended=True) == len(held.obj)  # counted as given back: it goes with the view
    assert pool.buffer_bytes == 0 and ReusableBuffer.spare_bytes() == 0 and bytes(held[:4]) == b"kept"


async def test_idle_live_connections_hold_a_bounded_total(monkeypatch):
    """Loopback: CONNECTIONS clients each send one large frame to a server and stay connected,
    idle. Shortly after, everything the process holds (tracemalloc: both ends' frame pools, the
    spares, sockets and events) is under the spare cap plus a little, not CONNECTIONS x frames."""
    monkeypatch.setattr(transport, "SHED_IDLE_S", 0.05, raising=False)
    ReusableBuffer.spares().clear()
    psk = os.urandom(32)
    got: list = []
    server_conns: list = []

    def factory():
        pc = PeerConnection(make_connection(Role.RESPONDER, X25519PrivateKey.generate(), psk), FAST)
        server_conns.append(pc)
        return pc
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        data = os.urandom(CHUNK_BYTES)
        clients = []
        for _ in range(CONNECTIONS):
            pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, X25519PrivateKey.generate(),
                                                                          psk), FAST)
            await pc.send(StreamChunk(offset=0, data=data, stream_id=1), bulk=True)
            clients.append(pc)
        del data
        for pc in server_conns:
            while pc.transport is None or not pc.inbox:
                await asyncio.sleep(0.01)
            got.append(len((await pc.recv()).data))
        assert got == [CHUNK_BYTES] * CONNECTIONS
        await asyncio.sleep(0.5)  # idle: every connection had SHED_IDLE_S and more
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        assert held <= SPARE_CAP + SLACK_BYTES, (
            f"{held / 2**20:.0f} MiB held by {CONNECTIONS} idle connections after one frame of "
            f"{CHUNK_BYTES / 2**20:.0f} MiB each")
        for pc in clients + server_conns:
            pc.abort("test over")
        server.close()
        await server.wait_closed()
    finally:
        tracemalloc.stop()
        ReusableBuffer.spares().clear()


@pytest.mark.parametrize("rounds", [3])
async def test_a_busy_connection_keeps_its_buffers_between_frames(monkeypatch, rounds):
    """Shedding is for idle connections only: frames back to back reuse the same buffer."""
    monkeypatch.setattr(transport, "SHED_IDLE_S", 0.2, raising=False)
    ReusableBuffer.spares().clear()
    psk = os.urandom(32)
    server, port, servers = await _listen(psk)
    pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, X25519PrivateKey.generate(), psk),
                               FAST)
    objs = set()
    for _ in range(rounds):
        await pc.send(StreamChunk(offset=0, data=os.urandom(CHUNK_BYTES), stream_id=1), bulk=True)
        ev = await servers[0].recv()
        objs.add(id(ev.data.obj))
        del ev
    assert len(objs) <= 2
    assert servers[0].conn.buffer_bytes >= CHUNK_BYTES  # not shed while busy
    pc.abort("test over")
    servers[0].abort("test over")
    server.close()
    await server.wait_closed()
    ReusableBuffer.spares().clear()


async def test_the_trim_runs_off_the_event_loop_once_for_a_burst(monkeypatch):
    """Dropped buffers ask for one malloc_trim, TRIM_DELAY_S later, in a thread of its own: never
    on the event loop's thread, however many connections ended."""
    import threading
    monkeypatch.setattr(transport, "TRIM_DELAY_S", 0.05)
    calls = []
    t = transport.Trimmer()
    monkeypatch.setattr(t, "_trim", lambda pad: calls.append(threading.current_thread()) or 1)
    loop = asyncio.get_running_loop()
    for _ in range(40):
        t.dropped_bytes(transport.TRIM_AFTER_BYTES // 4, loop)
    assert calls == []  # not at once: the readers still viewing their last messages let go first
    await asyncio.sleep(0.3)
    assert len(calls) == 1 and calls[0] is not threading.current_thread() and len(t.seconds) == 1
    t.dropped_bytes(transport.TRIM_AFTER_BYTES, loop)
    await asyncio.sleep(0.3)
    assert len(calls) == 1  # at most every TRIM_EVERY_S


async def test_quiet_gives_the_spares_back_and_trims(monkeypatch):
    """QUIET_S after the last shed with no spare taken, the thread's spares go back to the allocator
    and a trim runs (even for less than TRIM_AFTER_BYTES), then QUIET_TRIMS - 1 more QUIET_S apart
    (what messages hold is freed after their connections), and no more; a spare taken meanwhile
    postpones it."""
    monkeypatch.setattr(transport, "TRIM_DELAY_S", 0.01)
    monkeypatch.setattr(transport, "TRIM_EVERY_S", 0.01)
    monkeypatch.setattr(transport, "QUIET_S", 0.15)
    calls = []
    t = transport.Trimmer()
    monkeypatch.setattr(t, "_trim", lambda pad: calls.append(pad) or 1)
    loop = asyncio.get_running_loop()
    spares = ReusableBuffer.spares()
    spares.clear()
    spares.extend(bytearray(REUSE_MIN_BYTES) for _ in range(3))
    t.dropped_bytes(0, loop, moved=True)  # a connection ended
    await asyncio.sleep(0.1)
    ReusableBuffer().get(REUSE_MIN_BYTES)  # a pool takes a spare: not quiet
    t.dropped_bytes(0, loop)  # an idle connection looked at again: postpones nothing
    await asyncio.sleep(0.1)
    assert calls == [] and len(spares) == 2
    for _ in range(50):  # quiet since the spare was taken
        if calls:
            break
        await asyncio.sleep(0.02)
    assert spares == [] and calls == [0]
    for _ in range(100):
        if len(calls) >= transport.QUIET_TRIMS:
            break
        await asyncio.sleep(0.02)
        t.dropped_bytes(0, loop)  # idle looks (a reader holds a buffer) restart nothing
    for _ in range(30):
        await asyncio.sleep(0.02)
        t.dropped_bytes(0, loop)
    assert calls == [0] * transport.QUIET_TRIMS  # then no more while nothing is shed


def test_a_connection_dropped_mid_frame_is_freed_without_the_cycle_collector():
    """A Connection holds no reference cycle: dropped while a large frame is half assembled (a peer
    gone mid-message), it and its buffers are freed at once, not at Python's next full collection
    (after a flood of identities that had not come for hours)."""
    import weakref
    gc.disable()
    try:
        p = ConnectionPair()
        p.handshake()
        wire = p.a.send(StreamChunk(offset=0, data=os.urandom(CHUNK_BYTES), stream_id=1))
        p.b.receive_data(wire[:len(wire) // 2])  # half the frame, in the connection's assembly buffer
        assert ConnectionPair.drain(p.b) == []
        conn = weakref.ref(p.b)
        del p
        assert conn() is None, "the connection waits for the cycle collector"
    finally:
        gc.enable()


async def test_a_peer_connection_that_failed_is_freed_without_the_cycle_collector():
    """The error a PeerConnection ended with is raised to its reader without tying the connection
    to the traceback (connection -> its error -> traceback -> the reader's frame -> connection)."""
    import weakref
    psk = os.urandom(32)
    server, port, servers = await _listen(psk)
    pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, X25519PrivateKey.generate(), psk),
                               FAST)
    await servers[0].established
    gc.collect()
    gc.disable()
    try:
        pc.transport.abort()  # a reset: the server's reader gets an error
        with pytest.raises(ConnectionError):
            while True:
                await servers[0].recv()
        await asyncio.sleep(0.05)
        ref = weakref.ref(servers.pop())
        for _ in range(20):
            if ref() is None:
                break
            await asyncio.sleep(0.05)
        assert ref() is None, "the failed connection waits for the cycle collector"
    finally:
        gc.enable()
        server.close()
        await server.wait_closed()


async def test_a_connection_refused_in_its_handshake_is_freed_without_the_cycle_collector():
    """A handshake that fails (here: another swarm key) leaves neither end in a cycle: the error
    ``established`` holds keeps no traceback of the frames that awaited it (open_connection's, the
    server's), whose ``pc`` it would tie to itself."""
    import weakref
    server, port, servers = await _listen(os.urandom(32))  # another swarm key than the dialler's
    gc.collect()
    gc.disable()
    try:
        made = []
        orig = PeerConnection.__init__

        def spy(self, *a, **k):
            orig(self, *a, **k)
            made.append(weakref.ref(self))
        PeerConnection.__init__ = spy
        try:
            with pytest.raises((ConnectionError, ProtocolError)):
                await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, X25519PrivateKey.generate(),
                                                                         os.urandom(32)), FAST)
        finally:
            PeerConnection.__init__ = orig
        with pytest.raises(Exception):
            await servers[0].established
        ref = weakref.ref(servers.pop())
        for _ in range(20):
            if ref() is None and all(r() is None for r in made):
                break
            await asyncio.sleep(0.05)
        assert made and all(r() is None for r in made), "the dialler waits for the cycle collector"
        assert ref() is None, "the server's end waits for the cycle collector"
    finally:
        gc.enable()
        server.close()
        await server.wait_closed()
