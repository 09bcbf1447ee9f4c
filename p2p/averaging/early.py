"""Parts that come for a round the driver has not begun: held within bounds, or dropped.

A member can finish a round before us and start the next one while we are finishing: what it
sends then must not be lost, nor may anyone make us hold without bound what it sends for rounds to
come. ``EarlyParts`` is the ``Averager``'s base (driver.py): the buffer's state lives on the
driver; what to tell a sender whose parts are for a round we are not in is the driver's matter.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass

import msgpack

from blocktrain.protocol import BlockUpdate

log = logging.getLogger("blocktrain.p2p")

# Rounds ahead of the one in progress whose parts are held; anything later is dropped. A member
# can be one round ahead of us (it finished the round we are finishing), never more.
AHEAD_ROUNDS = 2
# Parts held for rounds not yet begun: from members only, and at most this many bytes in all, or,
# for larger vectors, what an honest group sends us in one round: every other member's parts of a
# whole vector (robust rounds; a plain mean sends us less). A member finishes a round before us and
# starts the next one while we are finishing: what it sends then must not be lost.
MAX_EARLY_BYTES = 64 * 1024 * 1024


def _held_bytes(msg: BlockUpdate) -> int:
    """What holding ``msg`` costs: its tensors' bytes and its metadata's (re-encoded)."""
    return sum(t.stored_bytes for t in msg.tensors) + len(msgpack.packb(msg.meta, use_bin_type=True))


@dataclass(frozen=True)
class Held:
    """What is held of parts for rounds not begun (``EarlyParts.held``): bytes in all, of members
    outside our last and next rounds (``strangers``), by member, the rounds they are for, and the
    caps (from one member, from all strangers together)."""
    total: int
    strangers: int
    by_member: dict
    rounds: tuple
    caps: tuple[int, int]


class EarlyParts:
    """The parts held for rounds not begun (``_early``), what they cost, and from whom."""

    def __init__(self, block: int, floats: int):
        self.block = block
        self._floats, self._others = floats, 0  # the last round's vector size and other members
        self._early: dict[int, list] = {}  # round -> (pid, msg) that came before we began it
        self._early_bytes = 0
        self._early_from: dict[str, int] = {}  # member -> bytes of it held in _early
        self._stranger_bytes = 0  # of _early_bytes, from members that were not in our last round
        self._last_ids: frozenset = frozenset()  # the members of our last round
        self.next_members: frozenset = frozenset()  # those the group expects in our next round
        self._early_dropped: set = set()  # rounds whose early parts overflowed (logged once each)
        self.current = 0  # the round in progress, or the last one

    def _hold(self, rnd: int, pid: str, msg: BlockUpdate) -> None:
        """A member's part for round ``rnd``, not begun: held within the caps, else dropped (the
        first drop of a round logged)."""
        size = _held_bytes(msg)
        per_sender, strangers = self._early_caps()
        known = self._known(pid)
        if self._early_from.get(pid, 0) + size <= per_sender and (known or self._stranger_bytes + size <= strangers):
            self._early.setdefault(rnd, []).append((pid, msg))
            self._early_bytes += size
            self._early_from[pid] = self._early_from.get(pid, 0) + size
            self._stranger_bytes += 0 if known else size
        elif rnd not in self._early_dropped:
            self._early_dropped.add(rnd)
            log.warning("block %d: parts for round %d came before we began it and exceed what is held "
                        "(%d bytes from one member, %d from members not in our last round); dropped from "
                        "%s (that round will miss them)", self.block, rnd, per_sender, strangers, pid[:12])

    def held(self) -> Held:
        """What is held now, and the caps it is held under (for a status, a report, a test)."""
        return Held(self._early_bytes, self._stranger_bytes, dict(self._early_from), tuple(sorted(self._early)),
                    self._early_caps())

    def _early_caps(self) -> tuple[int, int]:
        """(from one member, from all members outside our last and next rounds): bytes held of
        parts for rounds not begun. An honest member sends us at most one vector's worth for the
        next round (a robust round: its part of every piece). The members of our last round and of
        the next one the group expects get that each; anyone else (identities made for the
        purpose: they are free) shares one pool, so what is held is bounded by the group, not by
        how many identities exist."""
        vector = 4 * self._floats + (1 << 20)
        return max(vector, MAX_EARLY_BYTES // max(1, self._others)), max(MAX_EARLY_BYTES // 4, vector)

    def _recount_early(self) -> None:
        self._early_bytes, self._early_from, self._stranger_bytes = 0, {}, 0
        for items in self._early.values():
            for pid, m in items:
                size = _held_bytes(m)  # re-encodes the metadata: once per message
                self._early_bytes += size
                self._early_from[pid] = self._early_from.get(pid, 0) + size
                self._stranger_bytes += 0 if self._known(pid) else size

    def _known(self, pid: str) -> bool:
        """A member of our last round or of the next one the group expects (the driver's word):
        its early parts are held up to a vector's worth each (a group's first round, a joiner's)."""
        return pid in self._last_ids or pid in self.next_members

    def expect_members(self, ids) -> None:
        """The members the group expects in our next round (the swarm's group view)."""
        self.next_members = frozenset(ids)
        self._recount_early()

    def _drop_early(self, before: int) -> list[tuple[int, str, BlockUpdate]]:
        """Takes out what is held for rounds before ``before``, as (round, sender, message)."""
        return [(old, pid, msg) for old in [k for k in self._early if k < before] for pid, msg in self._early.pop(old)]

    def _begin_early(self, rnd: int, ids, floats: int) -> list:
        """We begin round ``rnd`` with ``ids`` (us included) over ``floats``: what was held for it,
        as (sender, message), in order; what was held for earlier rounds is dropped."""
        self._floats, self._others, self._last_ids = floats, len(ids) - 1, frozenset(ids)
        self._early_dropped = {k for k in self._early_dropped if k > rnd}
        early = self._early.pop(rnd, [])  # parts that came before we began the round
        for old in [k for k in self._early if k < rnd]:
            del self._early[old]
        self._recount_early()
        return early
