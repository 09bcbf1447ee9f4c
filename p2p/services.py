"""The one interface between a peer and the services that run on it.

Rules:
- A service (averaging, checkpoint streams, serving, swarm training) gets a ``PeerServices`` and
  uses nothing else of the peer: no member tables, no connection maps, no private fields.
- Membership is read as ``MemberView`` snapshots (frozen); changes arrive as ``MembershipEvent``
  callbacks, in order, on the event loop, and wake ``wait_for``. Nobody polls.
- Failures are typed: ``PeerUnreachable`` names the peer and the address it could not reach.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

if TYPE_CHECKING:
    import asyncio

    from .transport import PeerConnection, Timeouts


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"  # its connection closed without a Goodbye; not yet timed out


@dataclass(frozen=True)
class MemberView:
    """One member of the swarm as this peer sees it."""
    peer_id: str
    addr: str
    blocks: tuple[int, ...]
    role: str  # train | serve | bootstrap
    liveness: Liveness
    last_heard_s: float  # seconds since we last heard from it

    @property
    def alive(self) -> bool:
        return self.liveness is Liveness.ALIVE


class Change(str, enum.Enum):
    JOINED = "joined"  # a new member
    BACK = "back"  # a member we had lost contact with (or declared dead) is connected again
    SUSPECT = "suspect"  # its connection closed without a Goodbye
    LEFT = "left"  # it said Goodbye
    DEAD = "dead"  # silent for longer than dead_after_s


@dataclass(frozen=True)
class MembershipEvent:
    change: Change
    peer_id: str
    addr: str

    @property
    def departed(self) -> bool:
        """The member can no longer take part in what is under way (a round, a stream)."""
        return self.change in (Change.SUSPECT, Change.LEFT, Change.DEAD)


class PeerUnreachable(ConnectionError):
    """No live connection to a member could be had."""

    def __init__(self, peer: str, addr: str, why: str):
        super().__init__(f"cannot reach {peer[:12] if peer else addr} ({addr}): {why}")
        self.peer, self.addr, self.why = peer, addr, why


Handler = Callable[[object, "PeerConnection", str], Awaitable[None]]
InlineHandler = Callable[[object, "PeerConnection", str], None]


class PeerServices(Protocol):
    """What a service may use of the peer it runs on."""

    id: str
    addr: str
    timeouts: "Timeouts"

    def on(self, msg_type: type, handler, *, inline: bool = False) -> None:
        """Route every message of ``msg_type`` to ``handler(msg, conn, peer_id)``: awaited as its own
        task, or (``inline``) called in the connection's reader, in arrival order. Every handler of
        a type hears each message (in registration order, inline ones first); each ignores what is
        not its own."""

    def members(self, *, block: int | None = None, role: str | None = None,
                alive: bool = True) -> list[MemberView]:
        """Members (sorted by peer id), optionally only those holding ``block`` / with ``role``."""

    def member(self, peer_id: str) -> MemberView | None:
        """One member, or None."""

    async def connection(self, peer: str) -> "PeerConnection":
        """A live connection to a member (by peer id or listen address), dialling if needed;
        raises PeerUnreachable."""

    def settled(self) -> bool:
        """Whether the membership view is as complete as gossip makes it (no dial in flight)."""

    def live_connection(self, peer: str) -> "PeerConnection | None":
        """The live connection to a member (by id or address), or None; never dials (messages sent
        on it keep their order with everything else sent on it)."""

    def client_connection(self, peer_id: str) -> "PeerConnection | None":
        """The connection of a client (not a member) that is connected to us, or None."""

    def on_membership(self, callback: Callable[[MembershipEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on every membership change; returns the function that unsubscribes."""

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``predicate()`` holds, re-checked after every membership change or ``notify()``;
        False on timeout."""

    def notify(self) -> None:
        """Wake ``wait_for`` waiters: a service's own state changed."""

    def spawn(self, coro, name: str) -> "asyncio.Task":
        """Run ``coro`` as a task the peer owns: cancelled and awaited when it stops; failures logged."""

    def report_section(self, name: str, fn: Callable[[], object]) -> None:
        """Add ``fn()`` (JSON-able) to this peer's report under ``name``."""

    def write_report(self) -> None:
        """Write the report now (when the peer has a report file)."""

    def traffic_totals(self) -> dict:
        """Wire bytes sent and received so far, all peers and clients together."""

    def status(self) -> dict:
        """This peer's answer to a STATUS request: itself, its members as it sees them, its traffic
        totals and the small report sections (``work``, ``serving``)."""

    def report(self) -> dict:
        """This peer's whole transfer report (what ``write_report`` writes): traffic by peer, kind
        and direction, membership events, and every report section."""
