"""The member table: the swarm's members as this peer knows them, bounded. Sans-IO: time comes in
as ``now`` (``time.monotonic()``); joining, dropping, events and dials are the driver's (mesh.py).

Rules:
- Identities are free (any key holder makes as many as it likes), so the table is bounded in
  total: at most MAX_MEMBERS members at once (alive, suspect or dead). When it is full, a new
  identity first displaces the member that is not alive and was heard from longest ago
  (``displaced``), else it is refused.
- At most MAX_KNOWN_IDS identities are remembered as seen before (one that comes back is BACK
  rather than JOINED); the one seen longest ago is forgotten first.
- A member was last heard at the later of the table's time and its connection's.
- The member list this peer gossips (PEER_LIST) names its alive members only, each with how long
  ago it was heard, in milliseconds capped to 32 bits.
- Services see members as ``MemberView`` snapshots, sorted by peer id; never a ``Member``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from blocktrain.protocol import PeerInfo

from .services import Liveness, MemberView

if TYPE_CHECKING:
    from .transport import PeerConnection

# Bounds on what the peer keeps per remote identity (identities are free). A swarm of a few
# hundred members fits each; past them the oldest or least useful entry goes.
MAX_MEMBERS = 1024  # members known at once (alive, suspect or dead)
MAX_KNOWN_IDS = 4096  # identities remembered as seen before (BACK rather than JOINED)


@dataclass
class Member:
    """The table's entry for one member: what it said of itself, its connection, its liveness."""
    info: PeerInfo
    last_heard: float
    conn: PeerConnection | None = None
    liveness: Liveness = Liveness.ALIVE

    def heard(self) -> float:
        """When it was last heard: by the table, or on its connection."""
        return max(self.last_heard, self.conn.last_heard if self.conn is not None else 0.0)

    def view(self, now: float) -> MemberView:
        return MemberView(self.info.peer_id, self.info.addr, tuple(self.info.blocks), self.info.role, self.liveness,
                          round(now - self.heard(), 3))

    def live_conn(self) -> PeerConnection | None:
        return self.conn if self.conn is not None and not self.conn.closed.done() else None


class MemberTable:
    """Members by peer id, and the identities seen before; both bounded."""

    def __init__(self, max_members: int = MAX_MEMBERS, max_known: int = MAX_KNOWN_IDS):
        self.max_members, self.max_known = max_members, max_known
        self.by_id: dict[str, Member] = {}
        self.known: collections.OrderedDict[str, None] = collections.OrderedDict()  # identities seen

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, pid: object) -> bool:
        return pid in self.by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_id)

    def get(self, pid: str) -> Member | None:
        return self.by_id.get(pid)

    def find(self, peer: str) -> Member | None:
        """A member by peer id, else by listen address."""
        m = self.by_id.get(peer)
        if m is None:
            m = next((x for x in self.by_id.values() if x.info.addr == peer), None)
        return m

    def live_conn(self, peer: str) -> PeerConnection | None:
        """The live connection to a member (by id or address), or None."""
        m = self.find(peer)
        return m.live_conn() if m is not None else None

    def views(self, now: float, *, block: int | None = None, role: str | None = None,
              alive: bool = True) -> list[MemberView]:
        return [m.view(now) for pid, m in sorted(self.by_id.items())
                if (not alive or m.liveness is Liveness.ALIVE) and (block is None or block in m.info.blocks)
                and (role is None or m.info.role == role)]

    def view(self, pid: str, now: float) -> MemberView | None:
        m = self.by_id.get(pid)
        return m.view(now) if m is not None else None

    def peer_list(self, now: float) -> tuple[PeerInfo, ...]:
        """The alive members, as gossiped in a PEER_LIST."""
        return tuple(PeerInfo(pid, m.info.addr, m.info.blocks, m.info.role,
                              min(int((now - m.last_heard) * 1000), 2**32 - 1))
                     for pid, m in self.by_id.items() if m.liveness is Liveness.ALIVE)

    def conns(self) -> list[PeerConnection]:
        """Every member's connection (live or closing)."""
        return [m.conn for m in self.by_id.values() if m.conn is not None]

    def live_conns(self) -> list[PeerConnection]:
        return [m.conn for m in self.by_id.values() if m.conn is not None and not m.conn.closed.done()]

    def full(self) -> bool:
        return len(self.by_id) >= self.max_members

    def displaced(self) -> str | None:
        """The member that makes way for a new identity when the table is full: the longest silent
        of those not alive; None when every member is alive (the newcomer is refused)."""
        gone = [(m.last_heard, pid) for pid, m in self.by_id.items() if m.liveness is not Liveness.ALIVE]
        return min(gone)[1] if gone else None

    def add(self, info: PeerInfo, conn: PeerConnection, now: float) -> bool:
        """A new member (the caller made room); True when its identity was seen before (BACK)."""
        self.by_id[info.peer_id] = Member(info, now, conn)
        back = info.peer_id in self.known
        self.remember(info.peer_id)
        return back

    def remember(self, pid: str) -> None:
        self.known[pid] = None
        self.known.move_to_end(pid)
        while len(self.known) > self.max_known:
            self.known.popitem(last=False)

    def pop(self, pid: str) -> Member | None:
        return self.by_id.pop(pid, None)

    def forgive(self, now: float) -> None:
        """This peer's own event loop stalled: the others' silence meanwhile is not theirs."""
        for m in self.by_id.values():
            m.last_heard = now
            if m.conn is not None:
                m.conn.last_heard = now
