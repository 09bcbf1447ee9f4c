"""A peer: listens, joins a swarm through any member, keeps the membership, reports bytes moved.

``Peer`` implements ``PeerServices`` (services.py) for the services that run on it, over parts
that each open with their own rules:
- connections.py: accepting, dialling, registering and reading connections; clients;
- mesh.py: the membership kept by gossip (admissions, duplicates, liveness, events), over
  members.py (the bounded member table) and redial.py (redials and the dial cool-down);
- ledger.py: bytes moved per remote peer (the bounded traffic rows);
- handlers.py: the handler registry, and what a handler's failure costs;
- waiters.py: ``wait_for``, woken by events (a membership change, ``notify()``), never polling.

Rules:
- The peer owns its parts and its tasks: ``stop`` says Goodbye on every connection, aborts the
  pending handshakes, cancels and awaits every task, wakes every waiter and writes the report.
- Every ``heartbeat_s`` the mesh pings each member and gossips its member list, idle clients are
  closed and due redials dialled. When this peer's own event loop stalled (the process was
  stopped, or starved of CPU; a tick STALL_TICKS intervals late), the silence of others during
  the stall is not held against them.
- Bytes are counted per remote peer, message type, kind and direction (traffic.py, ledger.py);
  the report is written every ``report_every_s`` and at stop, atomically.
- Identities are free (any key holder makes as many as it likes), so nothing kept per remote
  identity grows with their number: members (MAX_MEMBERS), identities remembered as seen
  (MAX_KNOWN_IDS), membership events (MAX_EVENTS), traffic rows (MAX_TRAFFIC_ROWS), redials
  (MAX_REDIALS), failed addresses (MAX_FAILED_ADDRS), dials in flight (MAX_DIALS), pending
  handshakes (MAX_PENDING_HANDSHAKES) and clients (MAX_CLIENTS). Each is defined (and justified)
  where it is applied, re-exported here, and handed to its part when the peer is built.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import Announce, PeerInfo, PeerList, Status

from .connections import MAX_CLIENTS, MAX_DIALS, MAX_PENDING_HANDSHAKES, MEMBER_ONLY, Connections
from .handlers import Handlers
from .identity import peer_id
from .ledger import DEPARTED_ROW, MAX_TRAFFIC_ROWS, TrafficLedger
from .link import LinkSpec
from .members import MAX_KNOWN_IDS, MAX_MEMBERS, MemberTable
from .mesh import MAX_EVENTS, Mesh
from .reach import Reachability
from .redial import DIAL_COOLDOWN_S, MAX_FAILED_ADDRS, MAX_REDIALS, REDIAL_MAX_S, REDIAL_MIN_S, Redials
from .services import MemberView, PeerServices, PeerUnreachable
from .transport import PeerConnection, Timeouts
from .waiters import Waiters

__all__ = ["STALL_TICKS", "STATUS_SECTIONS", "JoinError", "Peer"]

log = logging.getLogger("blocktrain.p2p")

# The event loop counts as stalled when a heartbeat tick comes this many intervals late.
STALL_TICKS = 3
# Report sections that are also part of the STATUS reply (small, and useful to `bt-peer status`).
STATUS_SECTIONS = ("work", "serving")


class JoinError(ConnectionError):
    """No connection to the bootstrap peer within the join timeout."""


class Peer(PeerServices):
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
        # the parts, each bound read from this module when the peer is built (tests shrink them here)
        self._table = MemberTable(MAX_MEMBERS, MAX_KNOWN_IDS)
        self._redials = Redials(redial_for_s, MAX_REDIALS, MAX_FAILED_ADDRS)
        self._ledger = TrafficLedger(MAX_TRAFFIC_ROWS)
        self._mesh = Mesh(self, self._table, self._redials, MAX_EVENTS)
        self._connections = Connections(self, self._mesh, self._ledger, MAX_PENDING_HANDSHAKES, MAX_CLIENTS, MAX_DIALS)
        # the address we advertise, and whether members can dial it (reach.py)
        self.reach = Reachability(self, self._connections.account)
        self._handlers = Handlers(self.spawn)
        self._waiters = Waiters(lambda: self._stopping)
        self._sections: dict[str, Callable[[], object]] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._heard_list = False  # a member has told us its member list

    # what the report and the tests read of the parts
    events = property(lambda self: self._mesh.events, doc="membership changes (at most MAX_EVENTS)")
    events_dropped = property(lambda self: self._mesh.events_dropped, doc="membership events let go")
    input_failures = property(lambda self: self._handlers.input_failures, doc="exception type -> refused")
    stopping = property(lambda self: self._stopping, doc="stop() has begun")
    redials = property(lambda self: self._redials.by_addr, doc="address -> its redial schedule (read only)")

    def kept(self) -> dict[str, int]:
        """How many of each record this peer keeps about other identities (each bounded in total)."""
        return {"members": len(self._table.by_id), "known": len(self._table.known), "dials": len(self._connections.dials),
                "traffic_rows": len(self._ledger.rows), "redials": len(self._redials.by_addr)}

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self):
        """Listen; raises OSError (e.g. the port is in use)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connections.accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.addr = self.reach.listen_addr()  # none ("") for 0.0.0.0 until a dial-back confirms one (reach.py)
        self.spawn(self._supervised("heartbeat", self._heartbeat_loop), "heartbeat")
        if self.report_path:
            self.spawn(self._supervised("reports", self._report_loop), "reports")
        log.info("peer %s listening on %s:%s, advertising %s (blocks %s, role %s)", self.id[:12], self.host, self.port,
                 self.addr or "no address yet", list(self.blocks), self.role)
        self.notify()
        return self

    async def join(self, host: str, port: int, timeout_s: float | None = None, on_retry=None):
        """Connect to any member (retrying with backoff for ``timeout_s``, default the handshake
        timeout); the rest of the swarm follows by gossip. The whole attempt ends within
        ``timeout_s``, a dial in progress included (a bootstrap that accepts and never answers
        would otherwise hold it for the connect and handshake timeouts, each try).
        ``timeout_s`` 0: one try. ``on_retry(why)``: called once, when the first try fails. Raises
        JoinError."""
        addr = f"{host}:{port}"
        self.reach.joining(host)
        limit = self.timeouts.handshake_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        delay, why, tries = 0.2, "", 0
        try:
            async with asyncio.timeout(limit if limit > 0 else None):  # 0: one try; an outer cancel stays a cancel
                while True:
                    try:
                        await self.connection(addr)
                        return
                    except PeerUnreachable as e:
                        why, tries = e.why, tries + 1
                        if tries == 1 and on_retry is not None:
                            on_retry(why)
                        if time.monotonic() + delay > deadline:
                            break
                        log.info("bootstrap %s not reachable yet (%s); retrying in %.1f s", addr, e.why, delay)
                        await asyncio.sleep(delay)  # backoff: the bootstrap may still be starting
                        delay = min(2 * delay, 5.0)
        except TimeoutError:
            why = f"{why}, then no answer in time" if tries else "no answer in time"
        raise JoinError(f"cannot join through {addr}: {why} (tried for {limit:g} s: check that a member "
                        f"listens there and uses this swarm key, or wait longer with --join-timeout)")

    async def stop(self, reason: str = "shutting down"):
        """Goodbye to everyone, flush the report, close."""
        if self._stopping:
            return
        self._stopping = True
        t0 = time.monotonic()
        if self._server is not None:
            self._server.close()
        conns = self._table.conns() + list(self._connections.client_conns)
        await asyncio.gather(*(c.close(reason) for c in conns), return_exceptions=True)
        self._connections.abort_pending()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._waiters.notify()
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

    async def _heartbeat_loop(self):
        interval = self.timeouts.heartbeat_s
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)  # the heartbeat: time is the behaviour here
            now = time.monotonic()
            if now - last_tick > STALL_TICKS * interval + 1.0:  # we, not they, were silent
                log.warning("event loop stalled %.1f s; not counting it against the members",
                            now - last_tick - interval)
                self._table.forgive(now)
            last_tick = now
            self._mesh.heartbeat(now)
            self._connections.close_idle_clients(now)
            self._redial_due(now)
            self._mesh.gossip()

    def info(self) -> PeerInfo:
        return PeerInfo(self.id, self.addr, self.blocks, self.role, 0)

    def set_addr(self, addr: str) -> None:
        """Advertise ``addr`` from now on (reach.py), and tell the members we are connected to."""
        if addr == self.addr:
            return
        log.info("advertising %s (was %s)", addr or "no address", self.addr or "none")
        self.addr = addr
        self._mesh.announce_self()

    # --- services: handlers, members, connections, events ------------------------------------
    def on(self, msg_type: type, handler, *, inline: bool = False) -> None:
        self._handlers.on(msg_type, handler, inline=inline)

    def handles(self, msg_type: type) -> bool:
        return self._handlers.handles(msg_type)

    def members(self, *, block: int | None = None, role: str | None = None, alive: bool = True) -> list[MemberView]:
        return self._table.views(time.monotonic(), block=block, role=role, alive=alive)

    def member(self, peer_id: str) -> MemberView | None:
        return self._table.view(peer_id, time.monotonic())

    def settled(self) -> bool:
        """The membership view is as complete as gossip makes it: alone, or told a member list and
        every member learnt from it dialled (successfully or not)."""
        return (not self._table or self._heard_list) and not self._connections.dials

    def live_connection(self, peer: str) -> PeerConnection | None:
        """The live connection to a member (by id or address), or None: never dials."""
        return self._table.live_conn(peer)

    async def connection(self, peer: str) -> PeerConnection:
        pc = self._table.live_conn(peer)
        if pc is not None:
            return pc
        m = self._table.get(peer)
        addr = m.info.addr if m is not None else peer
        if not addr or ":" not in addr or addr == self.addr:
            raise PeerUnreachable(m.info.peer_id if m else "", addr, "no address to dial")
        pc = await self._connections.dial(addr)
        if pc is None or pc.closed.done():
            raise PeerUnreachable(m.info.peer_id if m else "", addr, "connection closed right after the handshake")
        return pc

    async def connection_to(self, addr: str) -> PeerConnection:
        """The live connection to the member listening on ``addr`` (alias of ``connection``)."""
        return await self.connection(addr)

    def client_connection(self, peer_id: str) -> PeerConnection | None:
        return self._connections.client(peer_id)

    def on_membership(self, callback):
        return self._mesh.subscribe(callback)

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        return await self._waiters.wait_for(predicate, timeout)

    def notify(self) -> None:
        self._waiters.notify()

    # --- what members say --------------------------------------------------------------------
    def dispatch(self, msg, pc: PeerConnection, pid: str, client: bool = False) -> bool:
        """Hand one message from ``pid`` (a member, or a client) to its handler; False when the
        message was refused and its connection closed. Raises only ConnectionError (``pc`` ended)."""
        if isinstance(msg, Status) and not msg.status:  # a request: the node's own to answer, always
            pc.send_nowait(Status(status=self.status()))
            return True
        handed = self._handlers.deliver(msg, pc, pid)  # a reply (the swarm page) and every service's
        if handed is not None:
            return handed
        if client:
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

    def _learn(self, p: PeerInfo, direct: bool = False):
        if self._mesh.learn(p, direct) and self._connections.may_dial(p.addr):
            self._quiet_dial(p.addr)

    def _quiet_dial(self, addr: str):
        """Start a dial nobody awaits (gossip, redials): a failure is logged, not raised."""
        self._connections.quiet_dial(addr)

    def _schedule_redial(self, addr: str, pid: str, soon: bool = False):
        self._mesh.schedule_redial(addr, pid, soon)

    def _redial_due(self, now: float):
        for addr in self._redials.due(now, self._connections.dials):
            self._quiet_dial(addr)

    # --- reports -------------------------------------------------------------------------------
    def traffic_report(self) -> dict:
        return self._ledger.report(self._table.by_id, self._connections.clients)

    def traffic_totals(self) -> dict:
        return self.traffic_report()["totals"]

    def status(self) -> dict:
        return {
            "peer_id": self.id, "addr": self.addr, "blocks": list(self.blocks), "role": self.role,
            "members": [{"peer_id": v.peer_id, "addr": v.addr, "blocks": list(v.blocks), "role": v.role,
                         "state": v.liveness.value, "last_heard_s": v.last_heard_s}
                        for v in self.members(alive=False)],
            "traffic": self.traffic_totals(), "reach": self.reach.status(),
            **{k: f() for k, f in self._sections.items() if k in STATUS_SECTIONS},
        }

    def report_section(self, name: str, fn: Callable[[], object]) -> None:
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
