"""Peers over loopback TCP (port 0): handshake, link shaping, membership, bad input, processes."""

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.p2p.link import LinkShaper, LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.view import query_status
from blocktrain.p2p.transport import PeerConnection, Timeouts, open_connection
from blocktrain.protocol import Connection, Ping, Pong, Role, Status, StreamChunk
from blocktrain.bench.ports import free_port

from conftest import crash

FAST = Timeouts(connect_s=5, handshake_s=2, heartbeat_s=0.2, dead_after_s=1.5, close_s=1)


async def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def new_peer(psk, **kw):
    return Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=kw.pop("timeouts", FAST), **kw)


@pytest.fixture
def psk():
    return os.urandom(32)


async def _pair(psk, link=None):
    loop = asyncio.get_running_loop()
    accepted = []

    def factory():
        pc = PeerConnection(Connection(Role.RESPONDER, X25519PrivateKey.generate(), psk), FAST)
        accepted.append(pc)
        return pc

    server = await loop.create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    a = await open_connection("127.0.0.1", port, Connection(Role.INITIATOR, X25519PrivateKey.generate(), psk),
                              FAST, link)
    await wait_for(lambda: accepted and accepted[0].established.done(), what="server side established")
    return server, a, accepted[0]


async def test_messages_cross_a_real_socket(psk):
    server, a, b = await _pair(psk)
    try:
        a.send_nowait(Status(status={"hello": 1}))
        assert await asyncio.wait_for(b.recv(), 5) == Status(status={"hello": 1})
        a.send_nowait(Ping(nonce=7))  # answered by b's driver, never queued for b's reader
        assert await asyncio.wait_for(a.recv(), 5) == Pong(nonce=7)
        assert not b.inbox
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_shaped_link_never_delivers_early(psk):
    spec = LinkSpec(delay_ms=40, jitter_ms=5, rate_mbit=20)
    server, a, b = await _pair(psk, spec)
    shaper = LinkShaper(spec)
    try:
        sent = {}
        payload = os.urandom(50_000)
        for i in range(6):
            sent[i] = time.monotonic()
            a.send_nowait(StreamChunk(offset=i, data=payload, stream_id=1), bulk=True)
        for i in range(6):
            m = await asyncio.wait_for(b.recv(), 10)
            took = time.monotonic() - sent[m.offset]
            frame_bytes = 18 + 12 + len(payload) + 16
            # the i-th frame also waits for the i frames serialized before it
            bound = shaper.lower_bound(frame_bytes) + i * spec.serialization_s(frame_bytes)
            assert took >= bound, (i, took, bound)
    finally:
        await a.close()
        await b.close()
        server.close()


def test_shaper_schedule_math():
    s = LinkShaper(LinkSpec(delay_ms=10, rate_mbit=8))  # 1 byte per microsecond
    assert s.schedule(0.0, 1000) == pytest.approx(0.001 + 0.010)
    assert s.schedule(0.0, 1000) == pytest.approx(0.002 + 0.010)  # queued behind the first
    lossy = LinkShaper(LinkSpec(delay_ms=10, loss=0.999))
    assert lossy.schedule(0.0, 10) >= 0.2  # a lost frame waits for the retransmission
    with pytest.raises(ValueError):
        LinkSpec.parse("delay=5,bogus=1")


async def test_wrong_swarm_key_is_rejected_and_swarm_undisturbed(psk):
    a = await new_peer(psk).start()
    b = await new_peer(psk).start()
    intruder = await new_peer(os.urandom(32)).start()
    try:
        await b.join("127.0.0.1", a.port)
        await wait_for(lambda: len(a.members()) == 1, what="b joins a")
        with pytest.raises(ConnectionError, match="AUTHENTICATION_FAILED|wrong swarm key"):
            await intruder.join("127.0.0.1", a.port)
        await asyncio.sleep(0.5)
        assert [m.peer_id for m in a.members()] == [b.id] and not intruder.members()
    finally:
        for p in (a, b, intruder):
            await p.stop()


async def test_a_stopped_peers_report_counts_each_connection_once(psk):
    """At stop a member keeps its closed connection (nothing is redialled then), and the report
    took both the connection's counts, added to the peer's rows when it ended, and its live
    counter again: every row of a stopped peer's report doubled (2 goodbyes sent on one link)."""
    a = await new_peer(psk).start()
    b = await new_peer(psk).start()
    try:
        await b.join("127.0.0.1", a.port)
        await wait_for(lambda: len(a.members()) == 1 and len(b.members()) == 1, what="join")
        await a.stop()
        await wait_for(lambda: not b.members(), what="b sees a leave")
        rows = a.traffic_report()["peers"]
        assert list(rows) == [b.id] and rows[b.id]["sent"]["by_type"]["goodbye"]["frames"] == 1
        assert b.traffic_report()["peers"][a.id]["received"]["by_type"]["goodbye"]["frames"] == 1
    finally:
        for p in (a, b):
            await p.stop()


async def test_bad_input_gets_bounded_cost(psk):
    a = await new_peer(psk).start()
    b = await new_peer(psk).start()
    try:
        await b.join("127.0.0.1", a.port)
        await wait_for(lambda: len(a.members()) == 1, what="join")
        async def raw(data: bytes, expect_close_within: float):
            r, w = await asyncio.open_connection("127.0.0.1", a.port)
            if data:
                w.write(data)
                await w.drain()
            t0 = time.monotonic()
            try:
                got = await asyncio.wait_for(r.read(), expect_close_within)  # read to EOF: we get closed
            finally:
                w.close()
            return got, time.monotonic() - t0

        # an HTTP client: refused with a plaintext Error frame, then closed
        got, _ = await raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 5)
        assert got[:2] == b"BT" and b"magic" in got
        # an oversized frame header: refused from the header alone
        import struct, zlib
        head = struct.pack(">2sBBBBII", b"BT", 1, 4, 0, 0, 0, 1 << 30)
        got, _ = await raw(head + struct.pack(">I", zlib.crc32(head)), 5)
        assert b"exceeds" in got
        # a peer that stalls mid-handshake is cut off after the handshake timeout
        _, took = await raw(b"BT\x01", FAST.handshake_s + 5)
        assert took >= FAST.handshake_s * 0.5
        # a port scanner: connect and leave
        s = socket.create_connection(("127.0.0.1", a.port))
        s.close()
        # a flood of connection attempts, bounded in count
        socks = [socket.create_connection(("127.0.0.1", a.port)) for _ in range(100)]
        for s in socks:
            s.close()
        await asyncio.sleep(0.5)
        # the swarm view and the honest member are untouched
        assert [m.peer_id for m in a.members()] == [b.id] and a.member(b.id).alive
        st = await query_status("127.0.0.1", a.port, X25519PrivateKey.generate(), psk, FAST)
        assert [m["peer_id"] for m in st["members"]] == [b.id]
    finally:
        await a.stop()
        await b.stop()


async def test_crash_and_leave_detection_in_process(psk):
    peers = [await new_peer(psk).start() for _ in range(4)]
    try:
        for p in peers[1:]:
            await p.join("127.0.0.1", peers[0].port)
        await wait_for(lambda: all(len(p.members()) == 3 for p in peers), what="full mesh of 4")
        await peers[3].stop("bye")  # a clean leave: dropped at once
        await wait_for(lambda: all(p.member(peers[3].id) is None for p in peers[:3]), timeout=3, what="leave")
        assert any(e["event"] == "left" for e in peers[0].events)
        # a crash: peer 2's sockets die without a Goodbye and it stops answering
        crash(peers[2])
        await wait_for(lambda: all(p.member(peers[2].id) is None for p in peers[:2]), timeout=FAST.dead_after_s + 5,
                       what="dead peer dropped")
        assert any(e["event"] == "dead" for e in peers[0].events)
    finally:
        for p in peers:
            await p.stop()


async def test_32_peers_join_through_one_bootstrap(psk):
    slow = Timeouts(connect_s=10, handshake_s=10, heartbeat_s=1.0, dead_after_s=30, close_s=1)
    peers = [await new_peer(psk, timeouts=slow).start() for _ in range(32)]
    try:
        for p in peers[1:]:
            await p.join("127.0.0.1", peers[0].port)
        await wait_for(lambda: all(len(p.members()) == 31 for p in peers), timeout=60, what="32 peers see 31 members")
        ids = {p.id for p in peers}
        for p in peers:
            assert {m.peer_id for m in p.members()} == ids - {p.id}
    finally:
        await asyncio.gather(*(p.stop() for p in peers))


# --- processes -----------------------------------------------------------------------------------

@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:  # stop only what this test started, by pid
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _peer_cmd(tmp_path, i, port, block, bootstrap=None):
    cmd = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if bootstrap else "start"]
    if bootstrap:
        cmd.append(bootstrap)
    return cmd + ["--block", str(block), "--listen", f"127.0.0.1:{port}", "--swarm-key", str(tmp_path / "swarm.key"),
                  "--identity", str(tmp_path / f"id{i}"), "--report", str(tmp_path / f"r{i}.json"),
                  "--report-every", "1", "--heartbeat", "0.2", "--dead-after", "2", "--quiet", "-v", "--no-train"]


async def _status(tmp_path, port):
    from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key
    return await query_status("127.0.0.1", port, load_or_create_identity(tmp_path / "client"),
                              load_swarm_key(tmp_path / "swarm.key"), FAST)


async def test_processes_join_crash_leave_restart(tmp_path, procs):
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "swarm.key")
    ports = [free_port() for _ in range(4)]
    boot = f"127.0.0.1:{ports[0]}"
    procs.append(subprocess.Popen(_peer_cmd(tmp_path, 0, ports[0], 0), stderr=subprocess.PIPE, text=True))

    async def members(port):
        try:
            return {m["addr"]: m["state"] for m in (await _status(tmp_path, port))["members"]}
        except (ConnectionError, OSError):
            return None

    async def until(port, want, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = await members(port)
            if got is not None and set(got) == want:
                return got
            await asyncio.sleep(0.2)
        raise AssertionError(f"peer on {port} never saw {want}; last {got}")

    deadline = time.monotonic() + 30
    while await members(ports[0]) is None:
        assert time.monotonic() < deadline and procs[0].poll() is None, "bootstrap did not start"
        await asyncio.sleep(0.2)
    for i in (1, 2, 3):
        procs.append(subprocess.Popen(_peer_cmd(tmp_path, i, ports[i], i % 3, boot), stderr=subprocess.PIPE, text=True))
    addrs = {f"127.0.0.1:{p}" for p in ports}
    await until(ports[3], addrs - {f"127.0.0.1:{ports[3]}"})
    # crash: killed by its pid, no Goodbye; the others drop it after --dead-after
    os.kill(procs[2].pid, signal.SIGKILL)
    procs[2].wait(timeout=10)
    await until(ports[0], {f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[3]}"})
    # leave: SIGTERM -> Goodbye, report flushed, exit 0
    procs[3].send_signal(signal.SIGTERM)
    assert procs[3].wait(timeout=15) == 0
    report = json.loads((tmp_path / "r3.json").read_text())
    assert report["kind"] == "blocktrain-transfer-report" and report["totals"]["sent"]["wire_bytes"] > 0
    assert any(t["sent"]["by_type"].get("goodbye") for t in report["peers"].values())
    await until(ports[0], {f"127.0.0.1:{ports[1]}"})
    # restart the crashed peer with the same identity: it rejoins as itself
    from blocktrain.p2p.identity import load_or_create_identity, peer_id
    pid2 = peer_id(load_or_create_identity(tmp_path / "id2"))
    procs.append(subprocess.Popen(_peer_cmd(tmp_path, 2, ports[2], 2, boot), stderr=subprocess.PIPE, text=True))
    await until(ports[0], {f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"})
    st = await _status(tmp_path, ports[0])
    assert pid2 in {m["peer_id"] for m in st["members"]}
    out = subprocess.run([sys.executable, "-m", "blocktrain.p2p.cli", "report", str(tmp_path / "r3.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "total wire bytes" in out.stdout and "goodbye" not in out.stdout  # the summary
    out = subprocess.run([sys.executable, "-m", "blocktrain.p2p.cli", "report", "--details", str(tmp_path / "r3.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "goodbye" in out.stdout


def test_identity_file_is_private(tmp_path):
    from blocktrain.p2p.identity import KeyError_, load_or_create_identity
    p = tmp_path / "id"
    k = load_or_create_identity(p)
    assert (p.stat().st_mode & 0o777) == 0o600
    assert load_or_create_identity(p).private_bytes_raw() == k.private_bytes_raw()
    p.chmod(0o644)
    with pytest.raises(KeyError_, match="readable by others"):
        load_or_create_identity(p)


async def test_shaped_link_pipelines_frames(psk):
    """Frames in flight overlap, as on a real link: ten frames take one delay, not ten."""
    spec = LinkSpec(delay_ms=150, rate_mbit=1000)
    server, a, b = await _pair(psk, spec)
    try:
        t0 = time.monotonic()
        for i in range(10):
            a.send_nowait(StreamChunk(offset=i, data=b"x" * 1000, stream_id=1), bulk=True)
        for i in range(10):
            m = await asyncio.wait_for(b.recv(), 10)
            assert m.offset == i  # in order
        took = time.monotonic() - t0
        assert 0.15 <= took < 0.15 * 5, took
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_goodbye_reaches_a_busy_peer_that_was_still_sending_to_us(psk):
    """A swarm stopped at once: each side closes while the other is still sending to it and is
    too busy to read. A socket closed with unread bytes sends a reset, which throws away the
    frames it had not sent yet, our Goodbye among them: the peer saw its connection lost and
    took us for a suspect (1 run in 12 of the whole-swarm stop test). Closing lingers: our side
    ends after the Goodbye and we read on, so the peer reads the Goodbye once it reads again."""
    from blocktrain.p2p.transport import CloseCause
    from blocktrain.protocol import BlockUpdate, ConnectionClosed
    server, a, b = await _pair(psk)
    try:
        for pc in (a, b):  # neither reads: the one stopping, nor the busy peer
            pc.inbox.pause(pc.transport)
        for r in range(40):
            b.send_nowait(BlockUpdate(block=0, round=r, meta={"phase": "reduce", "part": 0}), bulk=True)
        for k in range(16):  # a -> b: more than b's socket takes while it does not read
            a.send_nowait(StreamChunk(stream_id=1, offset=k << 20, data=os.urandom(1 << 20)), bulk=True)
        await asyncio.sleep(0.3)
        await a.close("stopping")
        assert a.close_cause is CloseCause.LOCAL
        b.inbox.resume(b.transport)
        while not isinstance(m := await asyncio.wait_for(b.recv(), 5), ConnectionClosed):
            pass
        assert m.reason == "stopping" and b.close_cause is CloseCause.GOODBYE
    finally:
        await a.close()
        await b.close()
        server.close()


async def _lingering_close(a, b):
    """``a``'s close, begun and lingering: ``b`` reads nothing, so it lingers up to its close_s,
    30 s here (long enough to be aborted or cancelled in it on a loaded machine)."""
    b.transport.pause_reading()
    a.timeouts = dataclasses.replace(FAST, close_s=30)
    closing = asyncio.ensure_future(a.close("stopping"))
    await wait_for(lambda: a._eof_sent, what="a lingering")
    return closing


async def test_a_lingering_close_keeps_its_cause_and_can_be_aborted(psk):
    """The peer's end, after our Goodbye, ends the close we began: with our cause (a duplicate's
    stays a duplicate, not a lost connection) and no exception as its result. A bad frame handled
    while we linger aborts the connection (our side of the stream has ended: no Error is written)."""
    from blocktrain.p2p.transport import CloseCause
    from blocktrain.protocol import ErrorCode
    server, a, b = await _pair(psk)
    try:
        await a.close("duplicate", CloseCause.DUPLICATE)
        assert a.close_cause is CloseCause.DUPLICATE and a.closed.result() is None
        assert a._eof_sent  # it lingered
    finally:
        await b.close()
        server.close()
    server, a, b = await _pair(psk)
    try:
        closing = await _lingering_close(a, b)
        a.abort_with(ErrorCode.MALFORMED_METADATA, "bad frame", CloseCause.PEER_ERROR)
        await asyncio.wait_for(closing, 5)
        assert a.close_cause is CloseCause.PEER_ERROR
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_a_second_close_waits_for_the_first_and_a_cancelled_close_still_closes(psk):
    """Two closes at once: the first close's cause stands (the later one replaced it before) and
    the peer reads one Goodbye. A close cancelled while it lingers closes the socket all the same
    (it was left open, our side of the stream ended, the connection never done)."""
    from blocktrain.p2p.transport import CloseCause
    from blocktrain.protocol import ConnectionClosed
    server, a, b = await _pair(psk)
    try:
        first = asyncio.ensure_future(a.close("duplicate", CloseCause.DUPLICATE))
        second = asyncio.ensure_future(a.close("stopping"))
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert a.close_cause is CloseCause.DUPLICATE and a.close_reason == "closed by us: duplicate"
        m = await asyncio.wait_for(b.recv(), 5)
        assert isinstance(m, ConnectionClosed) and m.reason == "duplicate"
        assert b.conn.counter.snapshot()["received"]["by_type"]["goodbye"]["frames"] == 1
    finally:
        await a.close()
        await b.close()
        server.close()
    server, a, b = await _pair(psk)
    try:
        closing = await _lingering_close(a, b)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert a.closed.done() and a.transport.is_closing() and a.close_cause is CloseCause.LOCAL
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_goodbye_goes_after_the_frames_queued_before_it(psk):
    """A stopping member's last parts of a round are queued as bulk frames (averaging/outbox.py,
    ``Outbox.hand_out``): its Goodbye follows them, so the receiver gets every one before the close."""
    from blocktrain.protocol import BlockUpdate, ConnectionClosed
    server, a, b = await _pair(psk)
    try:
        sent = [BlockUpdate(block=0, round=r, meta={"phase": "reduce", "part": 0}) for r in range(6)]
        for m in sent:
            a.send_nowait(m, bulk=True)
        await a.close("stopping")
        got = []
        while True:
            m = await asyncio.wait_for(b.recv(), 5)
            if isinstance(m, ConnectionClosed):
                break
            got.append(m)
        assert got == sent and m.reason == "stopping"
    finally:
        await a.close()
        await b.close()
        server.close()
