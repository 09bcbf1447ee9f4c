"""Reachability (p2p/reach.py, PROTOCOL.md section 4: ``seen``, ``dial_back``, ``dialed``): a peer
learns the address members see it from, asks them to dial it back, advertises only an address a
member reached it at, and says whether it is reachable; members dial back only where they see the
asker, within bounds. Loopback only: no router here, so "not reachable" is a port nobody listens
on, or one that accepts and never answers."""

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import blocktrain.p2p.reach as reach
from blocktrain.bench.ports import free_port
from blocktrain.p2p.node import Peer
from blocktrain.p2p.transport import Timeouts

FAST = Timeouts(connect_s=2, handshake_s=2, heartbeat_s=0.2, dead_after_s=30, close_s=1)


async def _peer(psk, host="127.0.0.1", **kw):
    return await Peer(X25519PrivateKey.generate(), psk, host, 0, timeouts=FAST, **kw).start()


async def test_a_peer_on_0_0_0_0_advertises_the_address_a_member_dialled_it_back_at():
    psk = os.urandom(32)
    a = await _peer(psk)
    b = await _peer(psk, "0.0.0.0")
    try:
        assert b.addr == ""  # never 0.0.0.0:port: nobody can dial that
        await b.join("127.0.0.1", a.port)
        assert await b.wait_for(lambda: b.reach.reachable is not None, 10.0)
        assert b.reach.reachable is True and b.addr == f"127.0.0.1:{b.port}", b.reach.status()
        assert b.reach.status()["observed"] == "127.0.0.1" and b.reach.confirmed_by == a.id
        # the member learns it (ANNOUNCE), and the dial-back never became a member's connection
        assert await a.wait_for(lambda: [m.addr for m in a.members()] == [b.addr], 5.0), a.members()
        assert [m.peer_id for m in b.members()] == [a.id] and a.reach.status()["dialled"] == 1
        assert "0.0.0.0" not in str(a.status()) and "reachable at 127.0.0.1" in b.reach.line()
        # a given listen address that a member connected to is reachable there
        assert a.reach.reachable is True and a.addr == f"127.0.0.1:{a.port}"
    finally:
        await b.stop()
        await a.stop()


async def test_a_peer_nobody_can_dial_back_says_it_is_not_reachable_and_keeps_working(monkeypatch):
    monkeypatch.setattr(reach, "DIAL_BACK_WAIT_S", 1.0)
    psk = os.urandom(32)
    nobody = free_port()  # as a router that forwards nothing: the port is closed to members
    a = await _peer(psk)
    b = await _peer(psk, "0.0.0.0", advertise=f"127.0.0.1:{nobody}")
    try:
        await b.join("127.0.0.1", a.port)
        assert await b.wait_for(lambda: b.reach.reachable is not None, 10.0)
        st = b.reach.status()
        assert st["reachable"] is False and f"port {nobody}" in st["why"] and st["asks"] == 1, st
        assert "not reachable" in b.reach.line() and b.addr == f"127.0.0.1:{nobody}"  # the user's word stays
        assert a.reach.status()["dialled"] == 1  # a member tried, where it sees b, at the port b asked
        assert [m.peer_id for m in a.members()] == [b.id]  # the connection b opened carries on
    finally:
        await b.stop()
        await a.stop()


async def test_loopback_listen_address_is_not_advertised_to_a_swarm_elsewhere():
    p = await _peer(os.urandom(32))
    try:
        p.reach.joining("127.0.0.1")
        assert p.addr == f"127.0.0.1:{p.port}"
        p.reach.joining("192.0.2.7")  # a member at another host cannot dial our loopback address
        assert p.addr == ""
    finally:
        await p.stop()


async def test_dial_backs_are_one_per_identity_per_interval_and_few_at_once(monkeypatch):
    """Any key holder may ask, with as many identities as it likes: the member dials only the
    host it sees the asker at, one dial-back per identity per DIAL_BACK_EVERY_S, MAX_DIAL_BACKS at
    once in all (a listener that accepts and never answers holds each until its timeout)."""
    monkeypatch.setattr(reach, "DIAL_BACK_TIMEOUT_S", 60.0)  # each dial-back stays in flight till the end
    psk = os.urandom(32)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0,
                   timeouts=Timeouts(connect_s=60, handshake_s=60, heartbeat_s=0.2, dead_after_s=60, close_s=1)).start()
    askers = []
    try:
        one = await _peer(psk, "0.0.0.0", advertise=f"127.0.0.1:{silent.getsockname()[1]}")
        askers.append(one)
        await one.join("127.0.0.1", a.port)
        for _ in range(3):  # the same identity asks again (each new connection's hello asks)
            await a.wait_for(lambda: False, 0.05)
            pc = a.live_connection(one.id)
            assert pc is not None
            a.reach.asked(one.id, pc, silent.getsockname()[1])
        assert a.reach.status()["dialled"] == 1 and a.reach.status()["refused"] == 3
        for _ in range(7):
            p = await _peer(psk, "0.0.0.0", advertise=f"127.0.0.1:{silent.getsockname()[1]}")
            askers.append(p)
            await p.join("127.0.0.1", a.port)
        await a.wait_for(lambda: a.reach.status()["asked_of_us"] >= 8, 5.0)
        st = a.reach.status()
        assert st["asked_of_us"] == 8 + 3 and st["dialled"] <= reach.MAX_DIAL_BACKS, st
        assert st["dialled"] + st["refused"] == st["asked_of_us"], st
        assert st["dialled"] == reach.MAX_DIAL_BACKS, st  # the silent listener holds them all
    finally:
        for p in askers:
            await p.stop()
        await a.stop()
        silent.close()


def test_the_cli_never_tells_others_to_join_at_0_0_0_0(tmp_path):
    """``bt-peer start/join --listen 0.0.0.0:P``: the start says to use this host's address; the
    joiner, once a member dialled it back, prints the address it was reached at (not 0.0.0.0)."""
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "key")
    base = [sys.executable, "-m", "blocktrain.p2p.cli"]
    keys = ["--swarm-key", str(tmp_path / "key"), "--no-train"]
    boot, port = free_port(), free_port()
    starter = subprocess.Popen(base + ["start", "--listen", f"0.0.0.0:{boot}", "--identity", str(tmp_path / "i0"),
                                       *keys], stderr=open(tmp_path / "start.log", "w"))
    joiner = None
    try:
        _until(tmp_path / "start.log", f"bt-peer join THIS_HOST:{boot}", starter, 60)
        joiner = subprocess.Popen(base + ["join", f"127.0.0.1:{boot}", "--listen", f"0.0.0.0:{port}", "--identity",
                                          str(tmp_path / "i1"), *keys], stderr=open(tmp_path / "join.log", "w"))
        _until(tmp_path / "join.log", f"others join with: bt-peer join 127.0.0.1:{port}", joiner, 60)
        for log in ("start.log", "join.log"):
            text = (tmp_path / log).read_text()
            assert "join 0.0.0.0" not in text and "Traceback" not in text, text
        assert f"reachable at 127.0.0.1:{port}" in (tmp_path / "join.log").read_text()
    finally:
        for p in (joiner, starter):
            if p is not None:
                p.terminate()
                p.wait(20)


def _until(path, text: str, proc, bound_s: float):
    deadline = time.monotonic() + bound_s
    while text not in path.read_text():
        assert proc.poll() is None, f"exited ({proc.returncode}) before saying {text!r}: {path.read_text()}"
        assert time.monotonic() < deadline, f"not said within {bound_s} s: {text!r}: {path.read_text()}"
        time.sleep(0.1)


@pytest.mark.parametrize("info,ok", [
    ({"seen": "203.0.113.7:41000", "dial_back": 7001, "dialed": "203.0.113.7:7001"}, True),
    ({"dial_back": 0}, False), ({"dial_back": 65536}, False), ({"dial_back": True}, False),
    ({"seen": 7}, False), ({"dialed": "x" * 263}, False)])
def test_the_reachability_keys_of_a_hello_are_checked(info, ok):
    from blocktrain.protocol.connection import check_info
    from blocktrain.protocol.handshake import HandshakeError
    if ok:
        assert check_info(info) == info
    else:
        with pytest.raises(HandshakeError):
            check_info(info)


async def test_a_responder_tells_the_initiator_where_it_sees_it_from():
    psk = os.urandom(32)
    a = await _peer(psk)
    b = await _peer(psk)
    try:
        await b.join("127.0.0.1", a.port)
        await asyncio.sleep(0)
        seen = b.reach.status()["observed"]
        assert seen == "127.0.0.1", b.reach.status()
    finally:
        await b.stop()
        await a.stop()


async def test_a_client_gives_a_peer_without_an_address_the_one_it_reached_it_at():
    """A lone peer on 0.0.0.0 (nobody has dialled it back) answers a status with no address: the
    client puts in the address it reached it at, and a chain never names a member nobody can dial."""
    from blocktrain.p2p.view import holders, query_status
    psk = os.urandom(32)
    p = await _peer(psk, "0.0.0.0", blocks=(0,), role="serve")
    try:
        assert p.status()["addr"] == ""
        st = await query_status("127.0.0.1", p.port, X25519PrivateKey.generate(), psk, FAST)
        assert st["addr"] == f"127.0.0.1:{p.port}"
        assert holders([{"peer_id": "a" * 64, "addr": "", "blocks": [0], "role": "serve", "state": "alive"}], 0,
                       "serve") == []
    finally:
        await p.stop()


async def test_a_first_peer_on_0_0_0_0_asks_the_members_that_dial_it(monkeypatch):
    """A peer that starts a swarm never dials out: its own hello, answering a joiner, asks for the
    dial-back, and the joiner dials back the host it dialled."""
    psk = os.urandom(32)
    a = await _peer(psk, "0.0.0.0")
    b = await _peer(psk)
    try:
        assert a.addr == ""
        await b.join("127.0.0.1", a.port)
        assert await a.wait_for(lambda: a.reach.reachable is not None, 10.0)
        assert a.reach.reachable is True and a.addr == f"127.0.0.1:{a.port}", a.reach.status()
        assert b.reach.status()["dialled"] == 1
    finally:
        await b.stop()
        await a.stop()


async def test_a_refused_ask_is_asked_again(monkeypatch):
    """A member that refused (it dialled this identity back a moment ago: a restart) does not
    settle it: the next connection asks again, and a dial-back then confirms the address."""
    monkeypatch.setattr(reach, "DIAL_BACK_EVERY_S", 0.5)
    psk = os.urandom(32)
    a = await _peer(psk)
    key = X25519PrivateKey.generate()
    b = await Peer(key, psk, "0.0.0.0", 0, timeouts=FAST).start()
    try:
        a.reach._answered[b.id] = time.monotonic()  # as if it had dialled b back just now
        await b.join("127.0.0.1", a.port)
        assert await a.wait_for(lambda: a.reach.status()["refused"] == 1, 5.0), a.reach.status()
        assert b.reach.reachable is None and b.addr == ""
        await asyncio.sleep(0.6)
        pc = a.live_connection(b.id)
        assert pc is not None
        pc.abort("test: the connection drops; b dials again")
        assert await b.wait_for(lambda: b.reach.reachable is True, 10.0), b.reach.status()
        assert b.addr == f"127.0.0.1:{b.port}"
    finally:
        await b.stop()
        await a.stop()


def test_a_seen_that_is_not_an_ip_address_is_not_taken_and_status_lines_print_no_control_characters():
    from types import SimpleNamespace

    from blocktrain.p2p.reach import Reachability
    from blocktrain.p2p.reports import status_lines
    r = Reachability(SimpleNamespace(), lambda pid, pc: None)
    for seen in ("evil\x1b[2J:7000", "example.org:7000", "1.2.3.4\n:7000", "203.0.113.9:70000",
                 "[fe80::1%\x1b[2J]:7000"):
        r.observed("a" * 64, seen)
    assert not r.seen and r.observed_host() == ""
    r.observed("a" * 64, "203.0.113.9:41000")
    r.observed("b" * 64, "[2001:db8::1]:41000")
    assert list(r.seen.values()) == ["203.0.113.9:41000", "[2001:db8::1]:41000"]
    st = {"peer_id": "c" * 64, "addr": "\x1b]0;owned\x07:1", "blocks": [0], "role": "train\r\n", "members": [
        {"peer_id": "d" * 64, "addr": "x\x1b[31m:2", "blocks": [1], "role": "serve", "state": "alive",
         "last_heard_s": 0.5}], "traffic": {"sent": {"wire_bytes": 0}, "received": {"wire_bytes": 0}}}
    lines = status_lines(st)
    assert not any(c in line for line in lines for c in "\x1b\x07\r\n") and "x?[31m:2" in "".join(lines)


def test_loopback_records_go_only_to_members_on_loopback():
    from blocktrain.p2p.reach import for_member
    from blocktrain.protocol import PeerInfo
    recs = [PeerInfo("a" * 64, "127.0.0.1:7000", (0,), "train", 0),
            PeerInfo("b" * 64, "203.0.113.7:7000", (1,), "train", 0),
            PeerInfo("c" * 64, "", (2,), "train", 0), PeerInfo("d" * 64, "[::1]:7000", (2,), "train", 0)]
    assert for_member(recs, "127.0.0.2") == tuple(recs) and for_member(recs, None) == tuple(recs)
    assert [r.peer_id[0] for r in for_member(recs, "198.51.100.4")] == ["b", "c"]


def test_a_dial_back_at_a_loopback_address_is_not_advertised_to_a_swarm_elsewhere():
    from types import SimpleNamespace

    from blocktrain.p2p.reach import Reachability
    set_to = []
    peer = SimpleNamespace(advertise="", host="0.0.0.0", port=7001, addr="", set_addr=set_to.append,
                           notify=lambda: None, role="train")
    r = Reachability(peer, lambda pid, pc: None)
    r.joining("203.0.113.7")
    r.observed("a" * 64, "127.0.0.1:50000")  # a member on our machine sees us on loopback
    r.reached("a" * 64, "127.0.0.1:7001", dial_back=True, local=("127.0.0.1", 7001))
    assert r.reachable is None and set_to == [] and r.dial_back_port() == 7001  # says nothing; it asks on
    r2 = Reachability(SimpleNamespace(**{**peer.__dict__}), lambda pid, pc: None)
    r2.observed("a" * 64, "203.0.113.9:50000")
    r2.reached("a" * 64, "203.0.113.9:7001", dial_back=True)
    assert set_to == ["203.0.113.9:7001"]
