"""A peer: listens, joins a swarm through any member, keeps the membership, reports bytes moved.

Rules:
- Membership is a full mesh kept by gossip: on every new connection both sides send Announce
  (themselves) and PeerList (every live member they know); a peer connects to each member it
  learns of. Every ``heartbeat_s`` it pings each connection and gossips its list to one
  member at random.
- A member that sent nothing for ``dead_after_s`` is declared dead and dropped; one that says
  Goodbye is dropped at once. A peer that comes back with the same identity is the same member.
- One connection per pair: when two appear, the one opened by the smaller peer id stays.
- Clients (role "client", e.g. ``bt-peer status``) are served but never become members.
- Bytes are counted per remote peer, message type and direction (the codec's counters, summed
  over that peer's connections); the report is written every ``report_every_s`` and at stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import (Announce, Connection, ConnectionClosed, PeerInfo, PeerList, Ping, ProtocolError, Role,
                                 Status)

from .identity import peer_id
from .link import LinkSpec
from .traffic import kind_of
from .transport import PeerConnection, Timeouts, open_connection

log = logging.getLogger("blocktrain.p2p")

# Connections a peer accepts before their handshake completes; more are refused at once.
MAX_PENDING_HANDSHAKES = 64


@dataclass
class Member:
    info: PeerInfo
    last_heard: float
    conn: PeerConnection | None = None
    state: str = "alive"  # alive | suspect (no connection, not yet timed out)


_BREAKDOWNS = ("by_type", "by_kind")


def _empty_traffic() -> dict:
    return {d: {b: {} for b in _BREAKDOWNS} for d in ("sent", "received")}


def _add_counts(into: dict, counts: dict):
    for name, c in counts.items():
        acc = into.setdefault(name, {"frames": 0, "payload_bytes": 0, "wire_bytes": 0})
        for k in acc:
            acc[k] += c[k]


@dataclass
class PeerTraffic:
    """Bytes exchanged with one remote peer over its closed connections."""
    closed: dict = field(default_factory=_empty_traffic)

    def add(self, snapshot: dict):
        for d in ("sent", "received"):
            for b in _BREAKDOWNS:
                _add_counts(self.closed[d][b], snapshot[d].get(b, {}))


def _merge(a: dict, b: dict) -> dict:
    """Closed-connection counts plus a live connection's snapshot, with totals."""
    out = {}
    for d in ("sent", "received"):
        out[d] = {}
        for br in _BREAKDOWNS:
            by: dict = {}
            _add_counts(by, a[d][br])
            _add_counts(by, b[d].get(br, {}))
            out[d][br] = dict(sorted(by.items()))
        out[d]["total"] = {k: sum(c[k] for c in out[d]["by_type"].values())
                           for k in ("frames", "payload_bytes", "wire_bytes")}
    return out


class Peer:
    def __init__(self, identity: X25519PrivateKey, swarm_key: bytes, host: str = "127.0.0.1", port: int = 0,
                 blocks=(), role: str = "train", allowlist=None, timeouts: Timeouts = Timeouts(),
                 links: dict | None = None, seal: bool = True, report_path: str | Path | None = None,
                 report_every_s: float = 10.0, advertise: str | None = None):
        self.identity, self.swarm_key = identity, swarm_key
        self.id = peer_id(identity)
        self.host, self.port = host, port
        self.blocks, self.role = tuple(blocks), role
        self.allowlist = allowlist
        self.timeouts = timeouts
        self.links = links or {"default": LinkSpec(), "links": {}}
        self.seal = seal
        self.report_path = Path(report_path) if report_path else None
        self.report_every_s = report_every_s
        self.advertise = advertise
        self.members: dict[str, Member] = {}
        self.traffic: dict[str, PeerTraffic] = {}
        self.events: list[dict] = []  # joined / left / dead, for reports and tests
        self.report_extra: dict[str, object] = {}  # report section -> fn() giving its JSON (training)
        self.started_at = time.time()
        self._server = None
        self._tasks: set[asyncio.Task] = set()
        self._connecting: set[str] = set()
        self._pending = 0
        self._client_conns: set[PeerConnection] = set()
        self.clients: dict[str, PeerConnection] = {}  # connected clients by peer id (pipeline replies)
        self.handlers: dict[type, object] = {}  # message type -> async fn(msg, pc, peer_id), see on()
        self.inline_handlers: dict[type, object] = {}  # message type -> fn(msg, pc, peer_id), in order
        self.addr = ""
        self._stopping = False

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self):
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.addr = self.advertise or f"{self.host}:{self.port}"
        self._spawn(self._heartbeat_loop(), "heartbeat")
        if self.report_path:
            self._spawn(self._report_loop(), "reports")
        log.info("peer %s listening on %s (blocks %s, role %s)", self.id[:12], self.addr, list(self.blocks), self.role)
        return self

    async def join(self, host: str, port: int):
        """Connect to any member; the rest of the swarm follows by gossip."""
        await self._connect(f"{host}:{port}", wait=True)

    async def stop(self, reason: str = "shutting down"):
        """Goodbye to everyone, flush the report, close."""
        if self._stopping:
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        conns = [m.conn for m in self.members.values() if m.conn is not None] + list(self._client_conns)
        await asyncio.gather(*(c.close(reason) for c in conns), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self.write_report()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def info(self) -> PeerInfo:
        return PeerInfo(self.id, self.addr, self.blocks, self.role, 0)

    def _hello(self) -> dict:
        return {"addr": self.addr, "blocks": list(self.blocks), "role": self.role}

    def _link_for(self, addr: str, pid: str | None = None) -> LinkSpec:
        links = self.links.get("links", {})
        return links.get(pid) or links.get(addr) or self.links.get("default") or LinkSpec()

    # --- connections ---------------------------------------------------------------------------
    def _accept(self) -> PeerConnection:
        conn = Connection(Role.RESPONDER, self.identity, self.swarm_key, allowlist=self.allowlist,
                          info=self._hello(), seal=self.seal, kind_of=kind_of)
        pc = PeerConnection(conn, self.timeouts, self.links.get("default"), name="inbound")
        if self._pending >= MAX_PENDING_HANDSHAKES or self._stopping:
            asyncio.get_running_loop().call_soon(pc.abort, "too many pending handshakes")
            return pc
        self._pending += 1
        self._spawn(self._serve(pc, inbound=True), "serve inbound")
        return pc

    async def _connect(self, addr: str, wait: bool = False):
        if addr in self._connecting or addr == self.addr:
            return
        self._connecting.add(addr)
        try:
            host, _, port = addr.rpartition(":")
            conn = Connection(Role.INITIATOR, self.identity, self.swarm_key, allowlist=self.allowlist,
                              info=self._hello(), seal=self.seal, kind_of=kind_of)
            pc = await open_connection(host, int(port), conn, self.timeouts, self._link_for(addr), name=addr)
        except (OSError, ConnectionError, ValueError) as e:
            log.info("cannot connect to %s: %s", addr, e)
            if wait:
                raise ConnectionError(f"cannot join through {addr}: {e}") from None
            return
        finally:
            self._connecting.discard(addr)
        task = self._spawn(self._serve(pc, inbound=False), f"serve {addr}")
        if wait:
            await asyncio.sleep(0)  # let it register before returning
        return task

    async def _serve(self, pc: PeerConnection, inbound: bool):
        try:
            if inbound:
                try:
                    await asyncio.wait_for(asyncio.shield(pc.established), self.timeouts.handshake_s)
                except asyncio.TimeoutError:
                    log.info("handshake from %s timed out", pc.peer_addr)
                    pc.abort("handshake timed out")
                    return
                except (ConnectionError, Exception) as e:  # refused: wrong key, garbage, not allowed
                    log.info("rejected connection from %s: %s", pc.peer_addr, e)
                    return
                finally:
                    self._pending -= 1
            hc = pc.established.result()
            await self._run_member(pc, hc)
        finally:
            await pc.wait_closed()

    async def _run_member(self, pc: PeerConnection, hc):
        pid, hello = hc.peer_id, hc.info
        role = hello.get("role", "train") if isinstance(hello, dict) else "train"
        if role == "client":
            self._client_conns.add(pc)
            self.clients[pid] = pc
            try:
                await self._reader(pc, pid, client=True)
            except (ConnectionError, ProtocolError) as e:
                log.debug("client %s: connection ended: %s", pid[:12], e)
            finally:
                self._account(pid, pc)
                self._client_conns.discard(pc)
                if self.clients.get(pid) is pc:
                    del self.clients[pid]
            return
        try:
            info = PeerInfo(pid, str(hello.get("addr", "")), tuple(hello.get("blocks", ())), role, 0)
        except Exception as e:
            pc.abort(f"bad peer info: {e}")
            return
        pc.name = info.addr or pid[:12]
        if self.links.get("links") and pc.shaper is None:
            spec = self._link_for(info.addr, pid)
            if spec.shaped:
                from .link import LinkShaper
                pc.shaper = LinkShaper(spec)
        m = self.members.get(pid)
        if m is not None and m.conn is not None and not m.conn.closed.done():
            # duplicate: keep the connection opened by the smaller id
            mine = pc.conn.role is Role.INITIATOR  # we opened pc
            keep_new = (self.id < pid) == mine
            if not keep_new:
                await pc.close("duplicate connection")
                return
            old = m.conn
            m.conn = pc
            self._spawn(old.close("duplicate connection"), "close duplicate")
        elif m is None:
            self.members[pid] = m = Member(info, time.monotonic(), pc)
            self.events.append({"event": "joined", "peer": pid, "addr": info.addr, "time": time.time()})
            log.info("peer %s joined (%s, blocks %s)", pid[:12], info.addr, list(info.blocks))
        else:
            m.conn, m.info = pc, info
            if m.state != "alive":
                self.events.append({"event": "rejoined", "peer": pid, "addr": info.addr, "time": time.time()})
                log.info("peer %s is back (%s)", pid[:12], info.addr)
        m.state, m.last_heard = "alive", time.monotonic()
        try:
            pc.send_nowait(Announce(peer=self.info()))
            pc.send_nowait(PeerList(peers=self._peer_list()))
            await self._reader(pc, pid)
        except (ConnectionError, ProtocolError) as e:  # the connection's end; already logged by it
            log.debug("connection to %s ended: %s", pid[:12], e)
        finally:
            self._account(pid, pc)
            m = self.members.get(pid)
            reason = pc.close_reason or ""
            if m is not None and m.conn is pc:
                m.conn = None
                if "duplicate" in reason:
                    pass  # the other connection carries on
                elif reason.startswith("peer closed"):
                    self._drop(pid, "left")
                elif not self._stopping:
                    m.state = "suspect"

    def _account(self, pid: str, pc: PeerConnection):
        self.traffic.setdefault(pid, PeerTraffic()).add(pc.conn.counter.snapshot())

    async def _reader(self, pc: PeerConnection, pid: str, client: bool = False):
        while True:
            msg = await pc.recv()
            m = self.members.get(pid)
            if m is not None:
                m.last_heard = time.monotonic()
            if isinstance(msg, ConnectionClosed):
                return
            inline = self.inline_handlers.get(type(msg))
            handler = self.handlers.get(type(msg))
            if inline is not None:  # in order, in the reader (stream chunks)
                inline(msg, pc, pid)
            elif handler is not None:
                self._spawn(handler(msg, pc, pid), f"handle {type(msg).__name__}")
            elif isinstance(msg, Status):
                if not msg.status:
                    pc.send_nowait(Status(status=self.status()))
            elif client:
                continue
            elif isinstance(msg, Announce):
                self._learn(msg.peer, direct=True)
            elif isinstance(msg, PeerList):
                for p in msg.peers:
                    self._learn(p)

    def on(self, msg_type: type, handler, inline: bool = False):
        """Run ``await handler(msg, pc, peer_id)`` (as its own task) for every message of that type;
        ``inline``: call ``handler(msg, pc, peer_id)`` in the reader itself, in arrival order."""
        (self.inline_handlers if inline else self.handlers)[msg_type] = handler

    async def connection_to(self, addr: str) -> PeerConnection:
        """The live connection to the member listening on ``addr``, connecting if there is none."""
        for attempt in range(2):
            for m in self.members.values():
                if m.info.addr == addr and m.conn is not None and not m.conn.closed.done():
                    return m.conn
            if attempt == 0:
                task = await self._connect(addr)
                deadline = time.monotonic() + self.timeouts.handshake_s
                while task is not None and time.monotonic() < deadline and not any(
                        m.info.addr == addr and m.conn is not None for m in self.members.values()):
                    await asyncio.sleep(0.01)
        raise ConnectionError(f"no connection to {addr}")

    def _learn(self, p: PeerInfo, direct: bool = False):
        if p.peer_id == self.id or p.role == "client" or not p.addr:
            return
        m = self.members.get(p.peer_id)
        if m is None or (m.conn is None and not direct):
            if p.addr not in self._connecting:
                self._spawn(self._connect(p.addr), f"connect {p.addr}")
        elif direct:
            m.info = p

    def _peer_list(self) -> list[PeerInfo]:
        now = time.monotonic()
        return [PeerInfo(pid, m.info.addr, m.info.blocks, m.info.role, min(int((now - m.last_heard) * 1000), 2**32 - 1))
                for pid, m in self.members.items() if m.state == "alive"]

    def _drop(self, pid: str, why: str):
        m = self.members.pop(pid, None)
        if m is None:
            return
        self.events.append({"event": why, "peer": pid, "addr": m.info.addr, "time": time.time()})
        log.info("peer %s %s (%s)", pid[:12], why, m.info.addr)
        if m.conn is not None:
            m.conn.abort(f"peer {why}")

    async def _heartbeat_loop(self):
        nonce = 0
        while True:
            await asyncio.sleep(self.timeouts.heartbeat_s)
            now = time.monotonic()
            for pid, m in list(self.members.items()):
                silent = now - max(m.last_heard, m.conn.last_heard if m.conn else 0)
                if silent > self.timeouts.dead_after_s:
                    self._drop(pid, "dead")
                elif m.conn is not None and not m.conn.closed.done():
                    nonce += 1
                    try:
                        m.conn.send_nowait(Ping(nonce=nonce))
                    except ConnectionError:
                        pass
            live = [m.conn for m in self.members.values() if m.conn is not None and not m.conn.closed.done()]
            if live:
                try:
                    random.choice(live).send_nowait(PeerList(peers=self._peer_list()))
                except ConnectionError:
                    pass

    # --- reports -------------------------------------------------------------------------------
    def traffic_report(self) -> dict:
        peers = {}
        for pid in set(self.traffic) | set(self.members) | set(self.clients):
            closed = self.traffic.get(pid, PeerTraffic()).closed
            m = self.members.get(pid)
            pc = m.conn if m is not None else self.clients.get(pid)
            t = _merge(closed, pc.conn.counter.snapshot() if pc is not None else _empty_traffic())
            t["addr"] = m.info.addr if m else next((e["addr"] for e in reversed(self.events) if e["peer"] == pid), "")
            t["client"] = m is None and pid in self.clients or t["addr"] == ""
            peers[pid] = t
        totals = {d: {"frames": 0, "payload_bytes": 0, "wire_bytes": 0} for d in ("sent", "received")}
        by_kind = {d: {} for d in ("sent", "received")}
        for t in peers.values():
            for d in totals:
                for k in totals[d]:
                    totals[d][k] += t[d]["total"][k]
                _add_counts(by_kind[d], t[d]["by_kind"])
        return {"peers": peers, "totals": totals, "by_kind": by_kind}

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "peer_id": self.id, "addr": self.addr, "blocks": list(self.blocks), "role": self.role,
            "members": [{"peer_id": pid, "addr": m.info.addr, "blocks": list(m.info.blocks), "role": m.info.role,
                         "state": m.state, "last_heard_s": round(now - m.last_heard, 3)}
                        for pid, m in sorted(self.members.items())],
            "traffic": self.traffic_report()["totals"],
        }

    def report(self) -> dict:
        return {"kind": "blocktrain-transfer-report", "peer_id": self.id, "addr": self.addr,
                "blocks": list(self.blocks), "role": self.role, "start_time": self.started_at,
                "end_time": time.time(), "events": self.events, **self.traffic_report(),
                **{k: f() for k, f in self.report_extra.items()}}

    def write_report(self):
        if not self.report_path:
            return
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.report_path.with_suffix(self.report_path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.report(), indent=1))
        os.replace(tmp, self.report_path)

    async def _report_loop(self):
        while True:
            await asyncio.sleep(self.report_every_s)
            self.write_report()


async def query_status(host: str, port: int, identity: X25519PrivateKey, swarm_key: bytes,
                       timeouts: Timeouts = Timeouts()) -> dict:
    """Ask one peer for its view of the swarm (as a client, never a member)."""
    conn = Connection(Role.INITIATOR, identity, swarm_key, info={"addr": "", "blocks": [], "role": "client"},
                      kind_of=kind_of)
    pc = await open_connection(host, port, conn, timeouts, name=f"{host}:{port}")
    try:
        pc.send_nowait(Status(status={}))
        while True:
            msg = await asyncio.wait_for(pc.recv(), timeouts.handshake_s)
            if isinstance(msg, Status):
                return msg.status
            if isinstance(msg, ConnectionClosed):
                raise ConnectionError(f"{host}:{port} closed before answering: {msg.reason}")
    finally:
        await pc.close("done")
