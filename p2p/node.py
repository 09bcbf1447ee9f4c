"""A peer: listens, joins a swarm through any member, keeps the membership, reports bytes moved.

Rules:
- Membership is a full mesh kept by gossip: on every new connection both sides send Announce
  (themselves) and PeerList (every live member they know); a peer dials each member it learns
  of. Every ``heartbeat_s`` it pings each connection and gossips its list to one member at random.
- Everything that changes the membership goes through ``_set_liveness`` / ``_drop``, which emit
  one ``MembershipEvent`` each to the subscribers and wake ``wait_for``.
- A member whose connection closes without a Goodbye is SUSPECT and redialled; one that sent
  nothing for ``dead_after_s`` is DEAD: dropped, and redialled with backoff for ``redial_for_s``
  (a member that comes back is BACK, with the same identity). One that says Goodbye is dropped.
  When this peer's own event loop stalled (the process was stopped, or starved of CPU), the
  silence of others during the stall is not held against them.
- One connection per pair: when two appear, the one opened by the smaller peer id stays; the
  other is closed with the Goodbye reason DUPLICATE_REASON on both sides.
- Clients (role "client", e.g. ``bt-peer status``) are served but never become members; a client
  silent for ``client_idle_s`` is closed.
- Before authentication a connection costs at most one pending-handshake slot: at most
  MAX_PENDING_HANDSHAKES at once; a new one evicts the oldest, so silent sockets cannot lock
  out a legitimate caller; each is closed after ``handshake_s``.
- Bytes are counted per remote peer, message type, kind and direction (traffic.py); the report
  is written every ``report_every_s`` and at stop.
- Identities are free (any key holder makes as many as it likes), so nothing kept per remote
  identity grows with their number: members (MAX_MEMBERS; a new identity first displaces a
  member that is not alive, else is refused), membership events (MAX_EVENTS), traffic rows
  (MAX_TRAFFIC_ROWS; departed peers' counts fold into one row, so totals stay exact), identities
  remembered as seen (MAX_KNOWN_IDS), redials (MAX_REDIALS) and dials in flight (MAX_DIALS, with
  a cool-down for an address that failed): a PEER_LIST cannot make this peer dial the world.
- A handler that raises on a peer's message never takes the reader down: the message is the
  sender's fault, its connection is closed with an Error frame (MALFORMED_METADATA, or the
  ProtocolError's own code) and the reader goes on with the next connection.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import (Announce, BlockUpdate, Connection, ConnectionClosed, ErrorCode, PeerInfo, PeerList,
                                 Ping, ProtocolError, Role, Status)

from .identity import peer_id
from .link import LinkShaper, LinkSpec
from .services import Change, Liveness, MembershipEvent, MemberView, PeerUnreachable
from .traffic import PeerTraffic, merge_counts, traffic_totals
from .transport import (CLIENT_INFO, DUPLICATE_REASON, CloseCause, PeerConnection, Timeouts, make_connection,
                        open_connection)

log = logging.getLogger("blocktrain.p2p")

# Connections accepted before their handshake completes. An honest handshake takes a few round
# trips; 64 covers a swarm's worth of simultaneous joins. Past it the oldest pending one is
# evicted, so unauthenticated sockets hold at most 64 fds and a few KiB each.
MAX_PENDING_HANDSHAKES = 64
# Clients (status, assemble, generate) connected at once; past it the least recently heard goes.
MAX_CLIENTS = 256
# A dead member is redialled with backoff from REDIAL_MIN_S up to REDIAL_MAX_S, for redial_for_s.
REDIAL_MIN_S = 1.0
REDIAL_MAX_S = 30.0
# The event loop counts as stalled when a heartbeat tick comes this many intervals late.
STALL_TICKS = 3
# Bounds on what the peer keeps per remote identity, in total (identities are free). A swarm of a
# few hundred members fits each; past them the oldest or least useful entry goes.
MAX_MEMBERS = 1024  # members known at once (alive, suspect or dead)
MAX_EVENTS = 1024  # membership events kept for the report; the oldest go (``events_dropped`` counts them)
MAX_TRAFFIC_ROWS = 256  # per-peer traffic rows; departed peers past it fold into DEPARTED_ROW
MAX_KNOWN_IDS = 4096  # identities remembered as seen before (BACK rather than JOINED)
MAX_REDIALS = 64  # lost members redialled at once
MAX_DIALS = 16  # dials in flight at once; a PEER_LIST naming more waits for the next gossip
DIAL_COOLDOWN_S = 30.0  # an address whose dial failed is not dialled again from gossip this soon
MAX_FAILED_ADDRS = 1024  # addresses remembered as failed (for the cool-down)
# The traffic row that holds the counts of departed peers folded together.
DEPARTED_ROW = "departed"


class JoinError(ConnectionError):
    """No connection to the bootstrap peer within the join timeout."""


@dataclass
class _Member:
    info: PeerInfo
    last_heard: float
    conn: PeerConnection | None = None
    liveness: Liveness = Liveness.ALIVE

    def view(self, now: float) -> MemberView:
        heard = max(self.last_heard, self.conn.last_heard if self.conn is not None else 0.0)
        return MemberView(self.info.peer_id, self.info.addr, tuple(self.info.blocks), self.info.role, self.liveness,
                          round(now - heard, 3))


@dataclass
class _Redial:
    peer: str
    next_at: float
    backoff: float
    until: float


class Peer:
    """One BlockTrain peer; implements ``PeerServices`` for the services that run on it."""

    def __init__(self, identity: X25519PrivateKey, swarm_key: bytes, host: str = "127.0.0.1", port: int = 0,
                 blocks=(), role: str = "train", allowlist=None, timeouts: Timeouts = Timeouts(),
                 links: dict | None = None, seal: bool = True, report_path: str | Path | None = None,
                 report_every_s: float = 10.0, advertise: str | None = None, redial_for_s: float = 600.0):
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
        self.redial_for_s = redial_for_s
        self.addr = ""
        self.started_at = time.time()
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)  # membership changes
        self.events_dropped = 0
        self.input_failures: dict[str, int] = {}  # exception type -> messages refused (report)
        self._members: dict[str, _Member] = {}
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()  # identities seen
        self._traffic: collections.OrderedDict[str, PeerTraffic] = collections.OrderedDict()
        self._departed_peers = 0  # peers whose traffic rows were folded into DEPARTED_ROW
        self._failed: collections.OrderedDict[str, float] = collections.OrderedDict()  # addr -> when a dial failed
        self._clients: dict[str, PeerConnection] = {}
        self._client_conns: set[PeerConnection] = set()
        self._pending: collections.OrderedDict[PeerConnection, float] = collections.OrderedDict()
        self._dials: dict[str, asyncio.Future] = {}  # addr -> the dial in flight
        self._redial: dict[str, _Redial] = {}  # addr -> schedule, for members we lost
        self._handlers: dict[type, object] = {}
        self._inline: dict[type, object] = {}
        self._subscribers: list = []
        self._waiters: set[asyncio.Future] = set()
        self._sections: dict[str, object] = {}
        self._server = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._heard_list = False  # a member has told us its member list

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self):
        """Listen; raises OSError (e.g. the port is in use)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.addr = self.advertise or f"{self.host}:{self.port}"
        self.spawn(self._supervised("heartbeat", self._heartbeat_loop), "heartbeat")
        if self.report_path:
            self.spawn(self._supervised("reports", self._report_loop), "reports")
        log.info("peer %s listening on %s (blocks %s, role %s)", self.id[:12], self.addr, list(self.blocks), self.role)
        self.notify()
        return self

    async def join(self, host: str, port: int, timeout_s: float | None = None):
        """Connect to any member (retrying with backoff for ``timeout_s``, default the handshake
        timeout); the rest of the swarm follows by gossip. Raises JoinError."""
        addr = f"{host}:{port}"
        deadline = time.monotonic() + (self.timeouts.handshake_s if timeout_s is None else timeout_s)
        delay = 0.2
        while True:
            try:
                await self.connection(addr)
                return
            except PeerUnreachable as e:
                if time.monotonic() + delay > deadline:
                    tried = self.timeouts.handshake_s if timeout_s is None else timeout_s
                    raise JoinError(f"cannot join through {addr}: {e.why} (tried for {tried:.0f} s: check that a "
                                    f"member listens there and uses this swarm key, or wait longer with "
                                    f"--join-timeout)") from None
                log.info("bootstrap %s not reachable yet (%s); retrying in %.1f s", addr, e.why, delay)
                await asyncio.sleep(delay)  # backoff: the bootstrap may still be starting
                delay = min(2 * delay, 5.0)

    async def stop(self, reason: str = "shutting down"):
        """Goodbye to everyone, flush the report, close."""
        if self._stopping:
            return
        self._stopping = True
        t0 = time.monotonic()
        if self._server is not None:
            self._server.close()
        conns = [m.conn for m in self._members.values() if m.conn is not None] + list(self._client_conns)
        await asyncio.gather(*(c.close(reason) for c in conns), return_exceptions=True)
        for pc in list(self._pending):
            pc.abort("peer shutting down")
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        if self._server is not None:
            await self._server.wait_closed()
        self.write_report()
        log.info("peer %s stopped in %.2f s", self.id[:12], time.monotonic() - t0)

    def spawn(self, coro, name: str) -> asyncio.Task:
        """A task owned by the peer: cancelled and awaited at stop; a failure is logged."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task):
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None and not self._stopping:
            log.error("task %s failed: %r", t.get_name(), t.exception())

    async def _supervised(self, name: str, loop_fn):
        """Run a background loop for the peer's lifetime; restart it (after a pause) if it dies."""
        while not self._stopping:
            try:
                await loop_fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # e.g. EMFILE while writing the report
                log.error("%s loop failed (%r); restarting it in 1 s", name, e)
                await asyncio.sleep(1.0)

    def info(self) -> PeerInfo:
        return PeerInfo(self.id, self.addr, self.blocks, self.role, 0)

    def _hello(self) -> dict:
        return {"addr": self.addr, "blocks": list(self.blocks), "role": self.role}

    def _link_for(self, addr: str, pid: str | None = None) -> LinkSpec:
        links = self.links.get("links", {})
        return links.get(pid) or links.get(addr) or self.links.get("default") or LinkSpec()

    def _new_connection(self, role: Role) -> Connection:
        return make_connection(role, self.identity, self.swarm_key, allowlist=self.allowlist, info=self._hello(),
                               seal=self.seal)

    # --- services: handlers, members, connections, events ------------------------------------
    def on(self, msg_type: type, handler, *, inline: bool = False) -> None:
        (self._inline if inline else self._handlers)[msg_type] = handler

    def handles(self, msg_type: type) -> bool:
        return msg_type in self._inline or msg_type in self._handlers

    def members(self, *, block: int | None = None, role: str | None = None, alive: bool = True) -> list[MemberView]:
        now = time.monotonic()
        return [m.view(now) for pid, m in sorted(self._members.items())
                if (not alive or m.liveness is Liveness.ALIVE) and (block is None or block in m.info.blocks)
                and (role is None or m.info.role == role)]

    def member(self, peer_id: str) -> MemberView | None:
        m = self._members.get(peer_id)
        return m.view(time.monotonic()) if m is not None else None

    def settled(self) -> bool:
        """The membership view is as complete as gossip makes it: alone, or told a member list and
        every member learnt from it dialled (successfully or not)."""
        return (not self._members or self._heard_list) and not self._dials

    def live_connection(self, peer: str) -> PeerConnection | None:
        """The live connection to a member (by id or address), or None: never dials."""
        return self._live_conn(peer)

    def _live_conn(self, peer: str) -> PeerConnection | None:
        m = self._members.get(peer)
        if m is None:
            m = next((x for x in self._members.values() if x.info.addr == peer), None)
        if m is not None and m.conn is not None and not m.conn.closed.done():
            return m.conn
        return None

    async def connection(self, peer: str) -> PeerConnection:
        pc = self._live_conn(peer)
        if pc is not None:
            return pc
        m = self._members.get(peer)
        addr = m.info.addr if m is not None else peer
        if not addr or ":" not in addr or addr == self.addr:
            raise PeerUnreachable(m.info.peer_id if m else "", addr, "no address to dial")
        pc = await self._dial(addr)
        if pc is None or pc.closed.done():
            raise PeerUnreachable(m.info.peer_id if m else "", addr, "connection closed right after the handshake")
        return pc

    async def connection_to(self, addr: str) -> PeerConnection:
        """The live connection to the member listening on ``addr`` (alias of ``connection``)."""
        return await self.connection(addr)

    def client_connection(self, peer_id: str) -> PeerConnection | None:
        pc = self._clients.get(peer_id)
        return pc if pc is not None and not pc.closed.done() else None

    def on_membership(self, callback):
        self._subscribers.append(callback)

        def unsubscribe():
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while not predicate():
            if self._stopping:
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return predicate()
            finally:
                self._waiters.discard(fut)
        return True

    def notify(self) -> None:
        for f in list(self._waiters):
            if not f.done():
                f.set_result(None)

    def _emit(self, change: Change, pid: str, addr: str):
        if len(self.events) == self.events.maxlen:
            self.events_dropped += 1
        self.events.append({"event": change.value, "peer": pid, "addr": addr, "time": time.time()})
        ev = MembershipEvent(change, pid, addr)
        for cb in list(self._subscribers):
            try:
                cb(ev)
            except Exception:  # a subscriber's bug must not break membership
                log.exception("membership subscriber failed on %s", ev)
        self.notify()

    # --- connections ---------------------------------------------------------------------------
    def _accept(self) -> PeerConnection:
        pc = PeerConnection(self._new_connection(Role.RESPONDER), self.timeouts, self.links.get("default"),
                            name="inbound")
        if self._stopping:
            pc.abort("peer shutting down", CloseCause.REFUSED)
            return pc
        if len(self._pending) >= MAX_PENDING_HANDSHAKES:  # the oldest unauthenticated one makes room
            oldest, _ = self._pending.popitem(last=False)
            oldest.abort_with(ErrorCode.OVERLOADED, "too many pending handshakes", CloseCause.REFUSED)
        self._pending[pc] = time.monotonic()
        self.spawn(self._serve_inbound(pc), "serve inbound")
        return pc

    async def _serve_inbound(self, pc: PeerConnection):
        try:
            try:
                await asyncio.wait_for(asyncio.shield(pc.established), self.timeouts.handshake_s)
            except asyncio.TimeoutError:
                log.info("handshake from %s timed out", pc.peer_addr)
                pc.abort_timeout("handshake timed out")
                return
            except Exception as e:  # refused: wrong key, garbage, not allowed, evicted
                log.info("rejected connection from %s: %s", pc.peer_addr, e)
                return
            finally:
                self._pending.pop(pc, None)
            await self._run(pc, pc.established.result())
        finally:
            await pc.wait_closed()

    async def _dial(self, addr: str) -> PeerConnection | None:
        """Dial ``addr`` (one dial per address at a time) and register the connection; returns
        the member's live connection, or None when it was not kept. Raises PeerUnreachable."""
        return await asyncio.shield(self._start_dial(addr))

    def _start_dial(self, addr: str) -> asyncio.Future:
        """The dial to ``addr`` in flight, started now if none is (counted in ``_dials`` at once)."""
        fut = self._dials.get(addr)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._dials[addr] = fut
            self.spawn(self._dial_task(addr, fut), f"dial {addr}")
        return fut

    async def _dial_task(self, addr: str, fut: asyncio.Future):
        try:
            host, _, port = addr.rpartition(":")
            pc = await open_connection(host, int(port), self._new_connection(Role.INITIATOR), self.timeouts,
                                       self._link_for(addr), name=addr)
        except (OSError, ConnectionError, ValueError) as e:
            self._failed[addr] = time.monotonic()
            self._failed.move_to_end(addr)
            while len(self._failed) > MAX_FAILED_ADDRS:
                self._failed.popitem(last=False)
            self._dials.pop(addr, None)
            self.notify()
            fut.set_exception(PeerUnreachable("", addr, str(e)))
            fut.exception()  # retrieved: nobody may be waiting
            return
        hc = pc.established.result()
        kept = self._register(pc, hc)
        self._dials.pop(addr, None)
        self.notify()  # settled() may hold now
        fut.set_result(self._live_conn(hc.peer_id))  # ours, or the one kept instead of a duplicate
        if kept is None:
            await pc.wait_closed()
            return
        try:
            await self._read(pc, hc.peer_id, client=False)
        finally:
            await pc.wait_closed()

    async def _run(self, pc: PeerConnection, hc):
        kept = self._register(pc, hc)
        if kept is None:
            return
        await self._read(pc, hc.peer_id, client=self._is_client(hc))

    @staticmethod
    def _is_client(hc) -> bool:
        return isinstance(hc.info, dict) and hc.info.get("role") == "client"

    def _register(self, pc: PeerConnection, hc) -> PeerConnection | None:
        """Make an established connection a member's (or a client's); None if it is not kept."""
        pid, hello = hc.peer_id, hc.info
        if self._is_client(hc):
            if len(self._clients) >= MAX_CLIENTS:
                oldest = min(self._client_conns, key=lambda c: c.last_heard)
                oldest.abort("too many clients", CloseCause.REFUSED)
            old = self._clients.get(pid)
            if old is not None and old is not pc:
                self._client_conns.discard(old)
            self._clients[pid] = pc
            self._client_conns.add(pc)
            return pc
        try:
            if not isinstance(hello, dict):
                raise ValueError("hello info is not a map")
            info = PeerInfo(pid, str(hello.get("addr", "")), tuple(hello.get("blocks", ())),
                            str(hello.get("role", "train")), 0)
        except Exception as e:
            pc.abort(f"bad peer info: {e}", CloseCause.REFUSED)
            return None
        pc.name = info.addr or pid[:12]
        if self.links.get("links") and pc.shaper is None:
            spec = self._link_for(info.addr, pid)
            if spec.shaped:
                pc.shaper = LinkShaper(spec)
        m = self._members.get(pid)
        if m is not None and m.conn is not None and not m.conn.closed.done() and m.conn is not pc:
            if self._opener(pc, pid) > self._opener(m.conn, pid):  # keep the one opened by the smaller id
                self.spawn(pc.close(DUPLICATE_REASON, CloseCause.DUPLICATE), "close duplicate")
                return None
            old, m.conn = m.conn, pc
            self.spawn(old.close(DUPLICATE_REASON, CloseCause.DUPLICATE), "close duplicate")
        elif m is None:
            if not self._make_room():
                pc.abort_with(ErrorCode.OVERLOADED, f"{MAX_MEMBERS} members already", CloseCause.REFUSED)
                return None
            self._members[pid] = m = _Member(info, time.monotonic(), pc)
            log.info("peer %s joined (%s, blocks %s)", pid[:12], info.addr, list(info.blocks))
            self._redial.pop(info.addr, None)
            self._emit(Change.BACK if pid in self._known else Change.JOINED, pid, info.addr)
            self._remember(pid)
        else:
            m.conn, m.info = pc, info
        m.last_heard = time.monotonic()
        self._redial.pop(info.addr, None)
        if m.liveness is not Liveness.ALIVE:
            m.liveness = Liveness.ALIVE
            log.info("peer %s is back (%s)", pid[:12], info.addr)
            self._emit(Change.BACK, pid, info.addr)
        if self.role != "client":  # a client (assemble, status) tells nobody about itself
            try:
                pc.send_nowait(Announce(peer=self.info()))
                pc.send_nowait(PeerList(peers=self._peer_list()))
            except ConnectionError:
                pass
        self.notify()
        return pc

    def _make_room(self) -> bool:
        """Room for one more member: a member that is not alive (the longest silent) makes way."""
        if len(self._members) < MAX_MEMBERS:
            return True
        gone = [(m.last_heard, pid) for pid, m in self._members.items() if m.liveness is not Liveness.ALIVE]
        if not gone:
            return False
        self._drop(min(gone)[1], Change.DEAD, redial=False)
        return True

    def _remember(self, pid: str):
        self._known[pid] = None
        self._known.move_to_end(pid)
        while len(self._known) > MAX_KNOWN_IDS:
            self._known.popitem(last=False)

    def _opener(self, pc: PeerConnection, pid: str) -> str:
        return self.id if pc.conn.role is Role.INITIATOR else pid

    async def _read(self, pc: PeerConnection, pid: str, client: bool):
        try:
            while True:
                msg = None  # the last message (and the receive buffer its tensors view) is let go first
                msg = await pc.recv()
                if isinstance(msg, ConnectionClosed):
                    return
                m = None if client else self._members.get(pid)
                if m is not None:
                    m.last_heard = time.monotonic()
                if client and type(msg) in MEMBER_ONLY:
                    continue  # a client asks (status, streams, requests); it takes no part in rounds
                if not self.dispatch(msg, pc, pid, client):
                    return
        except (ConnectionError, ProtocolError) as e:  # the connection's end; already logged by it
            log.debug("connection to %s ended: %s", pid[:12], e)
        finally:
            self._account(pid, pc)
            if client:
                self._client_conns.discard(pc)
                if self._clients.get(pid) is pc:
                    del self._clients[pid]
            else:
                self._connection_ended(pid, pc)

    def dispatch(self, msg, pc: PeerConnection, pid: str, client: bool = False) -> bool:
        """Hand one message from ``pid`` (a member, or a client) to its handler; False when the
        message was refused and its connection closed. Raises only ConnectionError (``pc`` ended)."""
        inline = self._inline.get(type(msg))
        if inline is not None:  # in order, in the reader (stream chunks, round parts)
            try:
                inline(msg, pc, pid)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the sender's message did it: close its connection
                self._bad_input(pc, pid, msg, e)
                return False
            return True
        handler = self._handlers.get(type(msg))
        if handler is not None:
            self.spawn(self._guarded(handler, msg, pc, pid), f"handle {type(msg).__name__}")
        elif isinstance(msg, Status):
            if not msg.status:
                pc.send_nowait(Status(status=self.status()))
        elif client:
            pass
        elif isinstance(msg, Announce):
            if msg.peer.peer_id == pid:  # a member speaks for itself only (PROTOCOL.md 3.2)
                self._learn(msg.peer, direct=True)
        elif isinstance(msg, PeerList):
            for p in msg.peers:
                self._learn(p)
            if not self._heard_list:
                self._heard_list = True
                self.notify()
        return True

    async def _guarded(self, handler, msg, pc: PeerConnection, pid: str):
        """A spawned handler: what it raises on a peer's message closes that peer's connection."""
        try:
            await handler(msg, pc, pid)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - see _bad_input
            self._bad_input(pc, pid, msg, e)

    def _bad_input(self, pc: PeerConnection, pid: str, msg, e: Exception):
        """A handler raised on ``msg``: the sender's fault (its message did not fit what the handler
        needs). Closed with an Error frame; a ProtocolError keeps its own code. A TypeError or the
        like is also logged with its traceback: the handler should have refused the input by name."""
        code = e.code if isinstance(e, ProtocolError) else ErrorCode.MALFORMED_METADATA
        typed = isinstance(e, (ProtocolError, ValueError))
        (log.info if typed else log.warning)("closing %s: its %s was refused: %r", pid[:12], type(msg).__name__, e,
                                             exc_info=not typed)
        self.input_failures[type(e).__name__] = self.input_failures.get(type(e).__name__, 0) + 1
        pc.abort_with(code, f"bad {type(msg).__name__}: {type(e).__name__}: {str(e)[:200]}", CloseCause.REFUSED)

    def _connection_ended(self, pid: str, pc: PeerConnection):
        m = self._members.get(pid)
        if m is None or m.conn is not pc or self._stopping:
            return
        m.conn = None
        cause = pc.close_cause
        if cause is CloseCause.GOODBYE:
            self._drop(pid, Change.LEFT)
        elif cause is CloseCause.DUPLICATE:  # the peer kept the other connection: it is on its way
            self._schedule_redial(m.info.addr, pid, soon=True)
        elif m.liveness is Liveness.ALIVE:
            m.liveness = Liveness.SUSPECT
            log.info("peer %s: connection %s; redialling", pid[:12], pc.close_reason)
            self._schedule_redial(m.info.addr, pid, soon=True)
            self._emit(Change.SUSPECT, pid, m.info.addr)

    def _account(self, pid: str, pc: PeerConnection):
        t = self._traffic.get(pid)
        if t is None:
            m = self._members.get(pid)
            self._traffic[pid] = t = PeerTraffic(addr=m.info.addr if m is not None else "")
        t.add(pc.conn.counter.snapshot())
        self._fold_departed()

    def _fold_departed(self):
        """Past MAX_TRAFFIC_ROWS, the oldest rows of peers no longer connected fold into one."""
        excess = len(self._traffic) - MAX_TRAFFIC_ROWS
        if excess <= 0:
            return
        folded = self._traffic.get(DEPARTED_ROW) or PeerTraffic()
        for pid in [p for p in self._traffic if p != DEPARTED_ROW and p not in self._members and p not in self._clients]:
            folded.add(self._traffic.pop(pid).closed)
            self._departed_peers += 1
            excess -= 1
            if excess < 0:  # the folded row itself takes one
                break
        self._traffic[DEPARTED_ROW] = folded

    def _learn(self, p: PeerInfo, direct: bool = False):
        if p.peer_id == self.id or p.role == "client" or not p.addr or self.role == "client":
            return
        m = self._members.get(p.peer_id)
        if m is not None and direct:
            if m.info != p:
                m.info = p
                self.notify()
            return
        if (m is None or m.conn is None) and p.addr not in self._dials and not self._stopping \
                and len(self._dials) < MAX_DIALS and not self._cooling(p.addr):
            self._quiet_dial(p.addr)

    def _cooling(self, addr: str) -> bool:
        """A dial to ``addr`` failed less than DIAL_COOLDOWN_S ago (gossip does not retry it yet)."""
        t = self._failed.get(addr)
        if t is not None and time.monotonic() - t > DIAL_COOLDOWN_S:
            del self._failed[addr]
            return False
        return t is not None

    def _quiet_dial(self, addr: str):
        """Start a dial nobody awaits (gossip, redials): a failure is logged, not raised."""
        def done(f: asyncio.Future):
            if not f.cancelled() and f.exception() is not None:
                log.info("cannot connect to %s: %s", addr, getattr(f.exception(), "why", f.exception()))
        self._start_dial(addr).add_done_callback(done)

    def _peer_list(self) -> list[PeerInfo]:
        now = time.monotonic()
        return [PeerInfo(pid, m.info.addr, m.info.blocks, m.info.role, min(int((now - m.last_heard) * 1000), 2**32 - 1))
                for pid, m in self._members.items() if m.liveness is Liveness.ALIVE]

    def _drop(self, pid: str, change: Change, redial: bool = True):
        m = self._members.pop(pid, None)
        if m is None:
            return
        log.info("peer %s %s (%s)", pid[:12], change.value, m.info.addr)
        if m.conn is not None:
            m.conn.abort(f"peer {change.value}")
        if change is Change.DEAD and redial:
            self._schedule_redial(m.info.addr, pid)
        else:
            self._redial.pop(m.info.addr, None)
        self._emit(change, pid, m.info.addr)

    def _schedule_redial(self, addr: str, pid: str, soon: bool = False):
        if not addr or self._stopping:
            return
        now = time.monotonic()
        r = self._redial.get(addr)
        if r is None and len(self._redial) >= MAX_REDIALS:  # the one closest to giving up makes room
            del self._redial[min(self._redial, key=lambda a: self._redial[a].until)]
        if r is None:
            self._redial[addr] = _Redial(pid, now + (0.0 if soon else REDIAL_MIN_S), REDIAL_MIN_S,
                                         now + self.redial_for_s)
        elif soon:
            r.next_at = min(r.next_at, now)

    def _redial_due(self, now: float):
        for addr, r in list(self._redial.items()):
            if now > r.until:
                del self._redial[addr]
            elif now >= r.next_at and addr not in self._dials:
                r.next_at = now + r.backoff
                r.backoff = min(2 * r.backoff, REDIAL_MAX_S)
                self._quiet_dial(addr)

    async def _heartbeat_loop(self):
        nonce = 0
        interval = self.timeouts.heartbeat_s
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)  # the heartbeat: time is the behaviour here
            now = time.monotonic()
            if now - last_tick > STALL_TICKS * interval + 1.0:  # we, not they, were silent
                log.warning("event loop stalled %.1f s; not counting it against the members", now - last_tick - interval)
                for m in self._members.values():
                    m.last_heard = now
                    if m.conn is not None:
                        m.conn.last_heard = now
            last_tick = now
            for pid, m in list(self._members.items()):
                silent = now - max(m.last_heard, m.conn.last_heard if m.conn else 0)
                if silent > self.timeouts.dead_after_s:
                    self._drop(pid, Change.DEAD)
                elif m.conn is not None and not m.conn.closed.done():
                    nonce += 1
                    try:
                        m.conn.send_nowait(Ping(nonce=nonce))
                    except ConnectionError:
                        pass
            for pc in list(self._client_conns):
                if now - pc.last_heard > self.timeouts.client_idle_s:
                    pc.abort("client idle", CloseCause.TIMEOUT)
            self._redial_due(now)
            live = [m.conn for m in self._members.values() if m.conn is not None and not m.conn.closed.done()]
            if live:
                try:
                    random.choice(live).send_nowait(PeerList(peers=self._peer_list()))
                except ConnectionError:
                    pass

    # --- reports -------------------------------------------------------------------------------
    def traffic_report(self) -> dict:
        peers = {}
        for pid in set(self._traffic) | set(self._members) | set(self._clients):
            m = self._members.get(pid)
            pc = m.conn if m is not None else self._clients.get(pid)
            row = self._traffic.get(pid) or PeerTraffic()
            t = merge_counts(row.closed, pc.conn.counter.snapshot() if pc is not None else None)
            t["addr"] = m.info.addr if m else row.addr
            t["client"] = (m is None and pid in self._clients) or t["addr"] == ""
            if pid == DEPARTED_ROW:
                t.update(client=False, departed_peers=self._departed_peers)
            peers[pid] = t
        return {"peers": peers, **traffic_totals(peers.values())}

    def traffic_totals(self) -> dict:
        return self.traffic_report()["totals"]

    def status(self) -> dict:
        return {
            "peer_id": self.id, "addr": self.addr, "blocks": list(self.blocks), "role": self.role,
            "members": [{"peer_id": v.peer_id, "addr": v.addr, "blocks": list(v.blocks), "role": v.role,
                         "state": v.liveness.value, "last_heard_s": v.last_heard_s}
                        for v in self.members(alive=False)],
            "traffic": self.traffic_totals(),
            **{k: f() for k, f in self._sections.items() if k in STATUS_SECTIONS},
        }

    def report_section(self, name: str, fn) -> None:
        self._sections[name] = fn

    def report(self) -> dict:
        return {"kind": "blocktrain-transfer-report", "peer_id": self.id, "addr": self.addr,
                "blocks": list(self.blocks), "role": self.role, "start_time": self.started_at,
                "end_time": time.time(), "events": list(self.events), "events_dropped": self.events_dropped,
                "input_failures": dict(self.input_failures), **self.traffic_report(),
                **{k: f() for k, f in self._sections.items()}}

    def write_report(self):
        if not self.report_path:
            return
        try:
            self.report_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.report_path.with_suffix(self.report_path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.report(), indent=1))
            os.replace(tmp, self.report_path)
        except OSError as e:
            log.error("cannot write the report %s: %s", self.report_path, e)

    async def _report_loop(self):
        while True:
            await asyncio.sleep(self.report_every_s)  # the report cadence
            self.write_report()


# Messages only members may send: a client's are dropped unread.
MEMBER_ONLY = frozenset({BlockUpdate, Announce, PeerList})
# Report sections that are also part of the STATUS reply (small, and useful to `bt-peer status`).
STATUS_SECTIONS = ("work", "serving")


async def query_status(host: str, port: int, identity: X25519PrivateKey, swarm_key: bytes,
                       timeouts: Timeouts = Timeouts()) -> dict:
    """Ask one peer for its view of the swarm (as a client, never a member)."""
    conn = make_connection(Role.INITIATOR, identity, swarm_key, info=CLIENT_INFO)
    pc = await open_connection(host, port, conn, timeouts, name=f"{host}:{port}")
    try:
        pc.send_nowait(Status(status={}))
        while True:
            msg = await asyncio.wait_for(pc.recv(), timeouts.handshake_s)
            if isinstance(msg, Status):
                return msg.status
            if isinstance(msg, ConnectionClosed):
                raise ConnectionError(f"{host}:{port} closed before answering: {msg.reason}")
    except asyncio.TimeoutError:
        raise ConnectionError(f"{host}:{port} did not answer within {timeouts.handshake_s} s") from None
    finally:
        await pc.close("done")


class NothingListens(ConnectionRefusedError):
    """Nothing listened at a client's address for as long as it was told to wait."""


async def status_when_listening(host: str, port: int, identity: X25519PrivateKey, swarm_key: bytes,
                                timeouts: Timeouts = Timeouts(), wait_s: float = 0.0, log=lambda s: None,
                                ready=lambda st: True) -> dict:
    """The one rule of every client command (status, generate, assemble): ask HOST:PORT for its
    status; while nothing listens there (connection refused: a peer still starting) or its answer
    is not ``ready`` yet, ask again with backoff for up to ``wait_s`` seconds, saying so in one
    line when the waiting begins. Any other failure (a wrong key, no answer within the timeouts)
    is raised at once. NothingListens names how long it waited and how often it asked."""
    t0, delay, tries, said = time.monotonic(), 0.1, 0, False
    while True:
        tries += 1
        try:
            st = await query_status(host, port, identity, swarm_key, timeouts)
            why = ready(st)
            if why is True:
                return st
        except ConnectionRefusedError:
            st, why = None, f"nothing listens at {host}:{port} yet (a peer still starting?)"
        if time.monotonic() - t0 + delay > wait_s:
            if st is not None:
                return st  # the caller says what is missing from the answer
            raise NothingListens(f"nothing listens at {host}:{port} (connection refused; asked {tries} time(s) in "
                                 f"{time.monotonic() - t0:.0f} s: is the peer running? --wait asks for longer)")
        if not said:
            said = True
            log(f"{why}; asking again for up to {wait_s:g} s (--wait)")
        await asyncio.sleep(delay)  # backoff, as the node's join
        delay = min(2 * delay, 2.0)
