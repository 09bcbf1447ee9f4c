"""The mesh: the peer's membership, kept by gossip over its connections. The asyncio-side driver
of the member table (members.py) and the redial schedule (redial.py); the peer owns it.

Rules:
- Membership is a full mesh kept by gossip: on every new connection both sides send Announce
  (themselves) and PeerList (every live member they know); a peer dials each member it learns
  of (``learn`` says which; connections.py dials within its bounds). Every ``heartbeat_s`` it
  pings each connection and gossips its list to one member at random.
- Everything that changes the membership goes through ``admit``, ``ended`` and ``drop``, which
  emit one ``MembershipEvent`` each (``emit``) to the subscribers and wake ``wait_for``.
- A member whose connection closes without a Goodbye is SUSPECT and redialled; one that sent
  nothing for ``dead_after_s`` is DEAD: dropped, and redialled with backoff for ``redial_for_s``
  (a member that comes back is BACK, with the same identity). One that says Goodbye is dropped.
- One connection per pair: when two appear, the one opened by the smaller peer id stays; the
  other is closed with the Goodbye reason DUPLICATE_REASON on both sides.
- Membership events are kept for the report, at most MAX_EVENTS (the oldest go; ``events_dropped``
  counts them).
"""

from __future__ import annotations

import collections
import logging
import random
import time
from typing import TYPE_CHECKING, Callable

from blocktrain.protocol import Announce, ErrorCode, PeerInfo, PeerList, Ping, Role

from .members import Member, MemberTable
from .reach import for_member
from .redial import Redials
from .services import Change, Liveness, MembershipEvent
from .transport import DUPLICATE_REASON, CloseCause, PeerConnection

if TYPE_CHECKING:
    from .node import Peer

log = logging.getLogger("blocktrain.p2p")

MAX_EVENTS = 1024  # membership events kept for the report; the oldest go (``events_dropped`` counts them)


class Mesh:
    """Admissions, departures and liveness of the members, and the events they make."""

    def __init__(self, peer: Peer, table: MemberTable, redials: Redials, max_events: int = MAX_EVENTS):
        self.peer, self.table, self.redials = peer, table, redials
        self.events: collections.deque[dict] = collections.deque(maxlen=max_events)  # membership changes
        self.events_dropped = 0
        self._subscribers: list[Callable[[MembershipEvent], None]] = []
        self._nonce = 0  # of the last heartbeat Ping

    # --- events ----------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[MembershipEvent], None]) -> Callable[[], None]:
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    def emit(self, change: Change, pid: str, addr: str) -> None:
        if len(self.events) == self.events.maxlen:
            self.events_dropped += 1
        self.events.append({"event": change.value, "peer": pid, "addr": addr, "time": time.time()})
        ev = MembershipEvent(change, pid, addr)
        for cb in list(self._subscribers):
            try:
                cb(ev)
            except Exception:  # a subscriber's bug must not break membership
                log.exception("membership subscriber failed on %s", ev)
        self.peer.notify()

    # --- admissions --------------------------------------------------------------------------------
    def admit(self, pc: PeerConnection, info: PeerInfo) -> PeerConnection | None:
        """Make an established connection the member's (announcing ourselves on it); None if it is
        not kept (a duplicate, or the table is full of live members)."""
        pid = info.peer_id
        m = self.table.get(pid)
        if m is not None and m.conn is not None and not m.conn.closed.done() and m.conn is not pc:
            if not self._keep_newer(m, pc):
                return None
        elif m is None:
            m = self._join(pc, info)
            if m is None:
                return None
        else:
            m.conn, m.info = pc, info
        m.last_heard = time.monotonic()
        self.redials.forget(info.addr)
        if m.liveness is not Liveness.ALIVE:
            m.liveness = Liveness.ALIVE
            log.info("peer %s is back (%s)", pid[:12], info.addr)
            self.emit(Change.BACK, pid, info.addr)
        if self.peer.role != "client":  # a client (assemble, status) tells nobody about itself
            self._greet(pc)
        self.peer.notify()
        return pc

    def _keep_newer(self, m: Member, pc: PeerConnection) -> bool:
        """A second connection to member ``m``: the one opened by the smaller id stays, the other is
        closed as a duplicate. True when ``pc`` stays."""
        assert m.conn is not None
        pid = m.info.peer_id
        if self._opener(pc, pid) > self._opener(m.conn, pid):
            self.peer.spawn(pc.close(DUPLICATE_REASON, CloseCause.DUPLICATE), "close duplicate")
            return False
        old, m.conn = m.conn, pc
        self.peer.spawn(old.close(DUPLICATE_REASON, CloseCause.DUPLICATE), "close duplicate")
        return True

    def _opener(self, pc: PeerConnection, pid: str) -> str:
        return self.peer.id if pc.conn.role is Role.INITIATOR else pid

    def _join(self, pc: PeerConnection, info: PeerInfo) -> Member | None:
        """A new member, if there is room for it (else ``pc`` is refused as OVERLOADED)."""
        if not self._make_room():
            pc.abort_with(ErrorCode.OVERLOADED, f"{self.table.max_members} members already", CloseCause.REFUSED)
            return None
        back = self.table.add(info, pc, time.monotonic())
        log.info("peer %s joined (%s, blocks %s)", info.peer_id[:12], info.addr, list(info.blocks))
        self.redials.forget(info.addr)
        self.emit(Change.BACK if back else Change.JOINED, info.peer_id, info.addr)
        return self.table.get(info.peer_id)

    def _make_room(self) -> bool:
        """Room for one more member: a member that is not alive (the longest silent) makes way."""
        if not self.table.full():
            return True
        gone = self.table.displaced()
        if gone is None:
            return False
        self.drop(gone, Change.DEAD, redial=False)
        return True

    def announce_self(self) -> None:
        """Our record changed (reach.py: the address we advertise): tell every live member."""
        for pc in self.table.live_conns():
            try:
                pc.send_nowait(Announce(peer=self.peer.info()))
            except ConnectionError:
                pass

    def _greet(self, pc: PeerConnection) -> None:
        try:
            pc.send_nowait(Announce(peer=self.peer.info()))
            pc.send_nowait(self._peer_list(pc))
        except ConnectionError:
            pass

    def learn(self, p: PeerInfo, direct: bool = False) -> bool:
        """A member as gossip (or, ``direct``, the member itself) describes it; True when it is one
        this peer has no connection to (worth a dial)."""
        if p.peer_id == self.peer.id or p.role == "client" or not p.addr or self.peer.role == "client":
            return False
        m = self.table.get(p.peer_id)
        if m is not None and direct:
            if m.info != p:
                m.info = p
                self.peer.notify()
            return False
        return m is None or m.conn is None

    # --- departures --------------------------------------------------------------------------------
    def ended(self, pid: str, pc: PeerConnection) -> None:
        """The member's connection ``pc`` closed: it left (Goodbye), or is redialled."""
        m = self.table.get(pid)
        if m is None or m.conn is not pc or self.peer.stopping:
            return
        m.conn = None
        cause = pc.close_cause
        if cause is CloseCause.GOODBYE:
            self.drop(pid, Change.LEFT)
        elif cause is CloseCause.DUPLICATE:  # the peer kept the other connection: it is on its way
            self.schedule_redial(m.info.addr, pid, soon=True)
        elif m.liveness is Liveness.ALIVE:
            m.liveness = Liveness.SUSPECT
            log.info("peer %s: connection %s; redialling", pid[:12], pc.close_reason)
            self.schedule_redial(m.info.addr, pid, soon=True)
            self.emit(Change.SUSPECT, pid, m.info.addr)

    def drop(self, pid: str, change: Change, redial: bool = True) -> None:
        m = self.table.pop(pid)
        if m is None:
            return
        log.info("peer %s %s (%s)", pid[:12], change.value, m.info.addr)
        if m.conn is not None:
            m.conn.abort(f"peer {change.value}")
        if change is Change.DEAD and redial:
            self.schedule_redial(m.info.addr, pid)
        else:
            self.redials.forget(m.info.addr)
        self.emit(change, pid, m.info.addr)

    def schedule_redial(self, addr: str, pid: str, soon: bool = False) -> None:
        if self.peer.stopping:
            return
        self.redials.schedule(addr, pid, time.monotonic(), soon)

    # --- the heartbeat -------------------------------------------------------------------------------
    def heartbeat(self, now: float) -> None:
        """Drop the members silent for longer than ``dead_after_s``; ping the others."""
        for pid, m in list(self.table.by_id.items()):
            if now - m.heard() > self.peer.timeouts.dead_after_s:
                self.drop(pid, Change.DEAD)
            elif m.conn is not None and not m.conn.closed.done():
                self._nonce += 1
                try:
                    m.conn.send_nowait(Ping(nonce=self._nonce))
                except ConnectionError:
                    pass

    def _peer_list(self, pc: PeerConnection) -> PeerList:
        """Every live member we know, for the member at the other end of ``pc`` (reach.for_member)."""
        host = str(pc.peer_addr[0]) if isinstance(pc.peer_addr, tuple) and pc.peer_addr else None
        return PeerList(peers=for_member(self.table.peer_list(time.monotonic()), host))

    def gossip(self) -> None:
        """Send the member list to one live member, chosen at random."""
        live = self.table.live_conns()
        if live:
            try:
                pc = random.choice(live)
                pc.send_nowait(self._peer_list(pc))
            except ConnectionError:
                pass
