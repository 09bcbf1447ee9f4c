"""The peer's connections: accepting, dialling, registering and reading them. The asyncio driver
between the sockets (transport.py) and the peer's mesh and handlers; the peer owns it.

Rules:
- Before authentication a connection costs at most one pending-handshake slot: at most
  MAX_PENDING_HANDSHAKES at once; a new one evicts the oldest, so silent sockets cannot lock
  out a legitimate caller; each is closed after ``handshake_s``.
- One dial per address at a time, counted in ``dials`` from the moment it starts; at most
  MAX_DIALS in flight from gossip (a PEER_LIST naming more waits for the next gossip), and none
  to an address cooling down after a failed dial (redial.py): a PEER_LIST cannot make this
  peer dial the world.
- An established connection is a client's (role "client", e.g. ``bt-peer status``) or a
  member's (the mesh admits it). Clients are served but never become members: at most
  MAX_CLIENTS at once (past it the least recently heard goes), one closed when silent for
  ``client_idle_s``, and the messages only members may send (MEMBER_ONLY) dropped unread.
- One reader per connection: it hands each message to the peer's dispatch, and when the
  connection ends adds its counts to the traffic ledger and tells the mesh.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from blocktrain.protocol import Announce, BlockUpdate, Connection, ConnectionClosed, ErrorCode, PeerInfo, PeerList, \
    ProtocolError, Role

from .ledger import TrafficLedger
from .link import LinkShaper, LinkSpec
from .mesh import Mesh
from .services import PeerUnreachable
from .transport import CloseCause, PeerConnection, make_connection, open_connection

if TYPE_CHECKING:
    from .node import Peer

log = logging.getLogger("blocktrain.p2p")

# Connections accepted before their handshake completes. An honest handshake takes a few round
# trips; 64 covers a swarm's worth of simultaneous joins. Past it the oldest pending one is
# evicted, so unauthenticated sockets hold at most 64 fds and a few KiB each.
MAX_PENDING_HANDSHAKES = 64
# Clients (status, assemble, generate) connected at once; past it the least recently heard goes.
MAX_CLIENTS = 256
MAX_DIALS = 16  # dials in flight at once; a PEER_LIST naming more waits for the next gossip
# Messages only members may send: a client's are dropped unread.
MEMBER_ONLY = frozenset({BlockUpdate, Announce, PeerList})


def is_client(hc: Any) -> bool:
    """The handshake's peer said it is a client."""
    return isinstance(hc.info, dict) and hc.info.get("role") == "client"


class Connections:
    """Pending handshakes, dials in flight, clients; the reader of every connection."""

    def __init__(self, peer: Peer, mesh: Mesh, ledger: TrafficLedger, max_pending: int = MAX_PENDING_HANDSHAKES,
                 max_clients: int = MAX_CLIENTS, max_dials: int = MAX_DIALS):
        self.peer, self.mesh, self.ledger = peer, mesh, ledger
        self.max_pending, self.max_clients, self.max_dials = max_pending, max_clients, max_dials
        self.pending: collections.OrderedDict[PeerConnection, float] = collections.OrderedDict()
        self.dials: dict[str, asyncio.Future] = {}  # addr -> the dial in flight
        self.clients: dict[str, PeerConnection] = {}
        self.client_conns: set[PeerConnection] = set()

    def new_connection(self, role: Role) -> Connection:
        p = self.peer
        info: dict = {"addr": p.addr, "blocks": list(p.blocks), "role": p.role}
        port = p.reach.dial_back_port()
        if port is not None:
            info["dial_back"] = port  # "dial me back here": are we reachable? (reach.py)
        return make_connection(role, p.identity, p.swarm_key, allowlist=p.allowlist, info=info, seal=p.seal)

    def link_for(self, addr: str, pid: str | None = None) -> LinkSpec:
        links = self.peer.links.get("links", {})
        return links.get(pid) or links.get(addr) or self.peer.links.get("default") or LinkSpec()

    # --- inbound ---------------------------------------------------------------------------------
    def accept(self) -> PeerConnection:
        """The protocol factory of the peer's server."""
        pc = PeerConnection(self.new_connection(Role.RESPONDER), self.peer.timeouts, self.peer.links.get("default"),
                            name="inbound")
        if self.peer.stopping:
            pc.abort("peer shutting down", CloseCause.REFUSED)
            return pc
        if len(self.pending) >= self.max_pending:  # the oldest unauthenticated one makes room
            oldest, _ = self.pending.popitem(last=False)
            oldest.abort_with(ErrorCode.OVERLOADED, "too many pending handshakes", CloseCause.REFUSED)
        self.pending[pc] = time.monotonic()
        self.peer.spawn(self._serve_inbound(pc), "serve inbound")
        return pc

    async def _serve_inbound(self, pc: PeerConnection) -> None:
        try:
            try:
                async with asyncio.timeout(self.peer.timeouts.handshake_s):
                    await asyncio.shield(pc.established)
            except TimeoutError:
                log.info("handshake from %s timed out", pc.peer_addr)
                pc.abort_timeout("handshake timed out")
                return
            except Exception as e:  # refused: wrong key, garbage, not allowed, evicted
                log.info("rejected connection from %s: %s", pc.peer_addr, e)
                e.__traceback__ = e.__context__ = e.__cause__ = None  # kept in pc.established: its frames hold pc
                return
            finally:
                self.pending.pop(pc, None)
            hc = pc.established.result()
            if self._dial_back(pc, hc):
                return
            if self.register(pc, hc) is not None:
                if not is_client(hc):
                    self._reach_hellos(pc, hc)
                    self.peer.reach.reached(hc.peer_id, None, dial_back=False)
                await self.read(pc, hc.peer_id, client=is_client(hc))
        finally:
            await pc.wait_closed()

    def _reach_hellos(self, pc: PeerConnection, hc: Any) -> None:
        """A member's connection is up: our hello's dial-back ask was taken; its hello's asks one."""
        if "dial_back" in pc.conn.info:
            self.peer.reach.asked_member()
        if isinstance(hc.info, dict) and "dial_back" in hc.info:
            self.peer.reach.asked(hc.peer_id, pc, hc.info["dial_back"])

    def _dial_back(self, pc: PeerConnection, hc: Any) -> bool:
        """A member's dial-back (its hello says ``dialed``): it shows us reachable, and carries
        nothing else; closed here, never registered (reach.py). False for any other connection."""
        if not isinstance(hc.info, dict) or "dialed" not in hc.info or is_client(hc):
            return False
        self.peer.reach.reached(hc.peer_id, hc.info["dialed"], dial_back=True, local=pc.local_addr)
        pc.abort("dial-back received")
        self.account(hc.peer_id, pc)
        return True

    def abort_pending(self) -> None:
        for pc in list(self.pending):
            pc.abort("peer shutting down")

    # --- outbound ----------------------------------------------------------------------------------
    async def dial(self, addr: str) -> PeerConnection | None:
        """Dial ``addr`` (one dial per address at a time) and register the connection; returns
        the member's live connection, or None when it was not kept. Raises PeerUnreachable."""
        return await asyncio.shield(self.start_dial(addr))

    def start_dial(self, addr: str) -> asyncio.Future:
        """The dial to ``addr`` in flight, started now if none is (counted in ``dials`` at once)."""
        fut = self.dials.get(addr)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self.dials[addr] = fut
            self.peer.spawn(self._dial_task(addr, fut), f"dial {addr}")
        return fut

    def quiet_dial(self, addr: str) -> None:
        """Start a dial nobody awaits (gossip, redials): a failure is logged, not raised."""
        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.info("cannot connect to %s: %s", addr, getattr(f.exception(), "why", f.exception()))
        self.start_dial(addr).add_done_callback(done)

    def may_dial(self, addr: str) -> bool:
        """Gossip may dial ``addr`` now: no dial to it in flight, fewer than MAX_DIALS in all, and
        it is not cooling down after a failed dial."""
        return addr not in self.dials and not self.peer.stopping and len(self.dials) < self.max_dials \
            and not self.mesh.redials.cooling(addr, time.monotonic())

    async def _dial_task(self, addr: str, fut: asyncio.Future) -> None:
        try:
            host, _, port = addr.rpartition(":")
            pc = await open_connection(host, int(port), self.new_connection(Role.INITIATOR), self.peer.timeouts,
                                       self.link_for(addr), name=addr)
        except (OSError, ConnectionError, ValueError) as e:
            self.mesh.redials.failed(addr, time.monotonic())
            self.dials.pop(addr, None)
            self.peer.notify()
            fut.set_exception(PeerUnreachable("", addr, str(e)))
            fut.exception()  # retrieved: nobody may be waiting
            return
        hc = pc.established.result()
        kept = self.register(pc, hc, dialled=addr)
        if kept is not None and not is_client(hc):
            self.peer.reach.observed(hc.peer_id, hc.info.get("seen"))
            self._reach_hellos(pc, hc)
        self.dials.pop(addr, None)
        self.peer.notify()  # settled() may hold now
        fut.set_result(self.mesh.table.live_conn(hc.peer_id))  # ours, or the one kept instead of a duplicate
        try:
            if kept is not None:
                await self.read(pc, hc.peer_id, client=False)
        finally:
            await pc.wait_closed()

    # --- registering -------------------------------------------------------------------------------
    def register(self, pc: PeerConnection, hc: Any, dialled: str = "") -> PeerConnection | None:
        """Make an established connection a member's (or a client's); None if it is not kept.
        ``dialled``: the address we dialled it at, its address where its hello gives none (it
        listens on 0.0.0.0 and has not learnt the address it is reached at: reach.py)."""
        if is_client(hc):
            return self._add_client(hc.peer_id, pc)
        info = self._member_info(pc, hc, dialled)
        if info is None:
            return None
        pc.name = info.addr or info.peer_id[:12]
        if self.peer.links.get("links") and pc.shaper is None:
            spec = self.link_for(info.addr, info.peer_id)
            if spec.shaped:
                pc.shaper = LinkShaper(spec)
        return self.mesh.admit(pc, info)

    def _add_client(self, pid: str, pc: PeerConnection) -> PeerConnection:
        if len(self.clients) >= self.max_clients:
            oldest = min(self.client_conns, key=lambda c: c.last_heard)
            oldest.abort("too many clients", CloseCause.REFUSED)
        old = self.clients.get(pid)
        if old is not None and old is not pc:
            self.client_conns.discard(old)
        self.clients[pid] = pc
        self.client_conns.add(pc)
        return pc

    @staticmethod
    def _member_info(pc: PeerConnection, hc: Any, dialled: str = "") -> PeerInfo | None:
        """What a member said of itself in its handshake; None (``pc`` refused) when it is malformed."""
        pid, hello = hc.peer_id, hc.info
        try:
            if not isinstance(hello, dict):
                raise ValueError("hello info is not a map")
            return PeerInfo(pid, str(hello.get("addr", "")) or dialled, tuple(hello.get("blocks", ())),
                            str(hello.get("role", "train")), 0)
        except Exception as e:
            pc.abort(f"bad peer info: {e}", CloseCause.REFUSED)
            return None

    def client(self, pid: str) -> PeerConnection | None:
        pc = self.clients.get(pid)
        return pc if pc is not None and not pc.closed.done() else None

    def close_idle_clients(self, now: float) -> None:
        for pc in list(self.client_conns):
            if now - pc.last_heard > self.peer.timeouts.client_idle_s:
                pc.abort("client idle", CloseCause.TIMEOUT)

    # --- reading -----------------------------------------------------------------------------------
    async def read(self, pc: PeerConnection, pid: str, client: bool) -> None:
        try:
            while True:
                msg = None  # the last message (and the receive buffer its tensors view) is let go first
                msg = await pc.recv()
                if isinstance(msg, ConnectionClosed):
                    return
                m = None if client else self.mesh.table.get(pid)
                if m is not None:
                    m.last_heard = time.monotonic()
                if client and type(msg) in MEMBER_ONLY:
                    continue  # a client asks (status, streams, requests); it takes no part in rounds
                if not self.peer.dispatch(msg, pc, pid, client):
                    return
        except (ConnectionError, ProtocolError) as e:  # the connection's end; already logged by it
            log.debug("connection to %s ended: %s", pid[:12], e)
        finally:
            self.account(pid, pc)
            if client:
                self.client_conns.discard(pc)
                if self.clients.get(pid) is pc:
                    del self.clients[pid]
            else:
                self.mesh.ended(pid, pc)

    def account(self, pid: str, pc: PeerConnection) -> None:
        """Add ``pc``'s counts to the traffic rows, under ``pid`` (once it has ended, or is ending)."""
        m = self.mesh.table.get(pid)
        self.ledger.add(pid, pc.conn.counter.snapshot(), m.info.addr if m is not None else "",
                        lambda p: p in self.mesh.table or p in self.clients)
        pc.accounted = True  # a member that still holds it (we are stopping) must not count it twice
