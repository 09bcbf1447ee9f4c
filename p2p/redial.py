"""Redials and the dial cool-down: when a peer dials a lost member again, and which addresses
gossip leaves alone for a while. Sans-IO: time comes in as ``now`` (``time.monotonic()``); the
driver (the peer) dials what ``due`` returns and reports failed dials to ``failed``.

Rules:
- A member lost without a Goodbye is redialled: at once when its connection just closed
  (``soon``), else REDIAL_MIN_S after it was declared dead; then with a backoff that doubles up
  to REDIAL_MAX_S, until ``redial_for_s`` after it was first scheduled; then it is given up.
  Scheduling an address already scheduled only brings it forward (``soon``).
- An address whose dial is still in flight is not due (its backoff does not advance).
- At most MAX_REDIALS addresses are redialled at once; a new one displaces the one closest to
  giving up.
- An address whose dial failed is not dialled again from gossip for DIAL_COOLDOWN_S; at most
  MAX_FAILED_ADDRS failures are remembered (the oldest is forgotten first).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Container

# A dead member is redialled with backoff from REDIAL_MIN_S up to REDIAL_MAX_S, for redial_for_s.
REDIAL_MIN_S = 1.0
# A healed partition is found again within REDIAL_MAX_S and a dial: at 30 s, a 20 s partition's two
# sides met again 15 s after the heal (bt-bench faults: the next dial came 11 s after it).
REDIAL_MAX_S = 4.0
MAX_REDIALS = 64  # lost members redialled at once (identities are free: bounded in total)
DIAL_COOLDOWN_S = 30.0  # an address whose dial failed is not dialled again from gossip this soon
MAX_FAILED_ADDRS = 1024  # addresses remembered as failed (for the cool-down)


@dataclass
class Redial:
    """The schedule of one lost member's address."""
    peer: str
    next_at: float
    backoff: float
    until: float


class Redials:
    """The redial schedule (by address) and the addresses cooling down after a failed dial."""

    def __init__(self, redial_for_s: float, max_redials: int = MAX_REDIALS,
                 max_failed: int = MAX_FAILED_ADDRS):
        self.redial_for_s = redial_for_s
        self.max_redials, self.max_failed = max_redials, max_failed
        self.by_addr: dict[str, Redial] = {}  # addr -> schedule, for members we lost
        self.failures: collections.OrderedDict[str, float] = collections.OrderedDict()  # addr -> when it failed

    def schedule(self, addr: str, pid: str, now: float, soon: bool = False) -> None:
        """Redial ``addr`` (member ``pid``): at once if ``soon``, else after REDIAL_MIN_S."""
        if not addr:
            return
        r = self.by_addr.get(addr)
        if r is None and len(self.by_addr) >= self.max_redials:  # the one closest to giving up makes room
            del self.by_addr[min(self.by_addr, key=lambda a: self.by_addr[a].until)]
        if r is None:
            self.by_addr[addr] = Redial(pid, now + (0.0 if soon else REDIAL_MIN_S), REDIAL_MIN_S,
                                        now + self.redial_for_s)
        elif soon:
            r.next_at = min(r.next_at, now)

    def forget(self, addr: str) -> None:
        """The member at ``addr`` is connected again, gone for good, or said Goodbye."""
        self.by_addr.pop(addr, None)

    def due(self, now: float, dialing: Container[str] = ()) -> list[str]:
        """The addresses to dial now (their next attempt moves on by the backoff); those past their
        time are given up. An address in ``dialing`` (a dial in flight) waits."""
        out = []
        for addr, r in list(self.by_addr.items()):
            if now > r.until:
                del self.by_addr[addr]
            elif now >= r.next_at and addr not in dialing:
                r.next_at = now + r.backoff
                r.backoff = min(2 * r.backoff, REDIAL_MAX_S)
                out.append(addr)
        return out

    def failed(self, addr: str, now: float) -> None:
        """A dial to ``addr`` failed at ``now``: it cools down."""
        self.failures[addr] = now
        self.failures.move_to_end(addr)
        while len(self.failures) > self.max_failed:
            self.failures.popitem(last=False)

    def cooling(self, addr: str, now: float) -> bool:
        """A dial to ``addr`` failed less than DIAL_COOLDOWN_S ago (gossip does not retry it yet)."""
        t = self.failures.get(addr)
        if t is not None and now - t > DIAL_COOLDOWN_S:
            del self.failures[addr]
            return False
        return t is not None

    def __len__(self) -> int:
        return len(self.by_addr)
