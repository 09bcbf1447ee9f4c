"""What the round in progress has to send, and how it goes out: the ``Averager``'s outbox (driver.py).

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 8 (here, its sending part): the parts go out in the order the round made them, each sent
  with backpressure, while what comes meanwhile is fed to the round by the connections' readers
  (which add its answers here); a member we cannot reach departs the round. A round stopped in
  the middle hands out what it has ready without waiting (``hand_out``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from blocktrain.protocol import ProtocolError

from ..services import PeerServices
from .round import AveragingRound, Part

log = logging.getLogger("blocktrain.p2p")

# Bytes of parts a round stopped mid-send still queues (``hand_out``): past it the rest is dropped,
# since the queued copies (and, on a slow link, the Goodbye behind them) must stay small.
HAND_OUT_BYTES = 8 << 20


class Outbox:
    """The parts the round in progress has to send next (``parts``, in order), over ``peer``'s
    connections."""

    def __init__(self, peer: PeerServices):
        self.peer = peer
        self.parts: list[Part] = []

    async def send(self, r: AveragingRound, conns: dict, sent: list, unreachable: Callable[[str, str], None]) -> int:
        """Sends the parts in order (what comes meanwhile is fed in as it comes); a member we cannot
        reach departs (``unreachable(peer, why)``). Returns the payload bytes sent."""
        bytes_sent = 0
        while self.parts:
            p = self.parts.pop(0)
            if p.peer in r.departed:  # queued before it departed: not waited for
                continue
            queued = False
            try:
                if p.peer not in conns:
                    conns[p.peer] = await self.peer.connection(p.peer)
                sent.append(p.msg)
                queued = True
                await conns[p.peer].send(p.msg, bulk=True)
                bytes_sent += p.stored_bytes
            except (ConnectionError, ProtocolError) as e:
                log.info("round %d: sending to %s failed: %s", r.round, p.peer[:12], e)
                unreachable(p.peer, f"unreachable: {e}")
            except asyncio.CancelledError:
                if not queued:
                    self.parts.insert(0, p)
                self.hand_out(r, conns, sent)
                raise
        return bytes_sent

    def hand_out(self, r: AveragingRound | None, conns: dict, sent: list) -> None:
        """We stop in the middle of round ``r`` (cancelled: the peer stops, or the round is not ours
        any more): the parts it has ready are queued on the connections we hold, without waiting,
        so that every member receives all of them (a member that departs mid-round counts in what
        it sent before leaving, rule 4, at every member that received it: where some members had a
        part that others never got, their results, and their points, would part). Best effort:
        whole pieces (every member's part of one, or none) up to HAND_OUT_BYTES, and only where
        a live connection is at hand."""
        parts = [p for p in self.parts if r is None or p.peer not in r.departed]
        size: dict = {}
        for p in parts:
            j = p.msg.meta.get("part")
            size[j] = size.get(j, 0) + p.stored_bytes
        pieces, total = set(), 0
        for j, n in size.items():  # in the outbox's order: the pieces it began first
            total += n
            if total > HAND_OUT_BYTES:
                break
            pieces.add(j)
        for p in parts:
            if p.msg.meta.get("part") not in pieces:
                continue
            pc = conns.get(p.peer) or self.peer.live_connection(p.peer)
            if pc is None:
                continue
            try:
                pc.send_nowait(p.msg, bulk=True)
            except (ConnectionError, ProtocolError):
                continue
            conns[p.peer] = pc
            sent.append(p.msg)  # released (copied) by ``average`` as it returns, like the others
        self.parts = []
