"""Compute slots shared fairly among clients (serving), whatever number of identities they use.

Rules:
- ``hold(who, cost)`` (``async with``) takes one of ``n`` slots or waits, and gives it back at
  the end; it yields ``between(cost)``, awaited between the parts of a request computed in parts
  (serving: a traversal in chunks of ``decode.CHUNK`` tokens, each part's ``cost`` its tokens).
- Order: start-time fair queuing (Goyal et al. 1996) over parts. Each client has a virtual
  time, advanced by the cost of each part it is served. A client busy here (waiting or
  computing) starts its next part at its virtual time. A client that was idle starts at its
  virtual time or ``IDLE_CREDIT`` before the hop's time (the largest start tag served),
  whichever is later: it banks at most that much. The next slot goes to the smallest start tag;
  among equal tags first to a client that was idle, then to the longest waiting.
- So a client back from a round trip (a legitimate session: a few dozen tokens a traversal) is
  ahead of every client that kept the hop busy, for up to ``IDLE_CREDIT`` tokens, and waits for
  one part already computing, not for whole long traversals; clients that flood share the rest
  in turn by the compute they take.
- ``between``: when a waiter comes before the request's next part, the slot goes to it and the
  part waits at the head of its client's queue (a client's requests finish in turn instead of
  all advancing together); otherwise the request keeps the slot.
- Nobody waits forever: a waiter passed over by ``MAX_BYPASS`` parts goes first (oldest first),
  whatever the tags say (a stream of fresh identities, each idle, would otherwise keep coming
  first).
- At most ``max_waiting`` requests wait in all. Past it, the client with the most waiting loses
  its newest waiter (``Saturated`` is raised in it) to make room for a client with fewer; a
  client that already has the most waiting is refused at once. So a flood from many identities
  fills the queue but never locks out a client with nothing waiting.
- What is kept per client is bounded: its waiters (``max_waiting`` in all), its slots held, and
  a virtual time while it is ahead of the hop's (at most ``MAX_CLIENTS`` of them: the furthest
  behind go first).
- A waiter cancelled after it was handed a slot hands the slot on; a request cancelled or
  refused while it waits between parts holds no slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field


class Saturated(Exception):
    """The hop is saturated and this client holds at least its share of the waiting requests."""


MAX_CLIENTS = 4096  # virtual times kept for clients with nothing waiting
MAX_BYPASS = 64  # parts served past one waiter before it goes first
IDLE_CREDIT = 256  # how far before the hop's time an idle client starts (tokens: a short traversal)


@dataclass
class _Part:
    """One waiting part of a request."""
    seq: int  # when its request came (ties go to the longest waiting)
    cost: float
    idle: bool  # its client was idle when the request came (ties go to it)
    tag: float  # its start tag: set when it came (idle) or when it reached its client's queue head
    since: int = 0  # parts served before it began to wait
    fut: asyncio.Future | None = field(default=None, repr=False)


class FairSlots:
    def __init__(self, n: int, max_waiting: int):
        self.free = n
        self.max_waiting = max_waiting
        self._queues: dict[str, collections.deque[_Part]] = {}  # client -> its waiting parts
        self._vtime: dict[str, float] = {}  # client -> virtual time after its last part started
        self._held: collections.Counter[str] = collections.Counter()  # client -> slots it holds
        self._now = 0.0  # the hop's virtual time: the largest start tag served
        self._seq = 0
        self._served = 0  # parts served from the queue

    def waiting(self, who: str | None = None) -> int:
        if who is not None:
            return len(self._queues.get(who, ()))
        return sum(len(q) for q in self._queues.values())

    @contextlib.asynccontextmanager
    async def hold(self, who: str, cost: float = 1.0):
        """A slot for the block (the request's first part costs ``cost``), given back at its end;
        yields ``between(cost)`` for the request's next part."""
        await self.acquire(who, cost)
        seq, held = self._seq, True

        async def between(cost: float = 1.0):
            nonlocal held
            first = min((self._order(c) for c in self._queues if c != who), default=None)  # its own wait
            if first is not None and first < (1, self._vtime[who], True, seq):
                held = False  # while it waits it holds nothing; cancelled or refused, it never will
                self._release(who)
                await self._wait(who, _Part(seq, cost, False, self._vtime[who]), first=True)
                held = True
            else:
                self._served += 1
                self._start(who, cost, self._vtime[who])
        try:
            yield between
        finally:
            if held:
                self._release(who)

    async def acquire(self, who: str, cost: float = 1.0) -> None:
        """A slot for a request of ``who`` costing ``cost``; give it back with ``release(who)``."""
        self._seq += 1
        q = self._queues.get(who)
        idle = not q and not self._held[who]
        vt = self._vtime.get(who, 0.0)
        tag = max(vt, self._now - IDLE_CREDIT) if idle else q[-1].tag + q[-1].cost if q else vt
        if self.free > 0 and not self._queues:
            self.free -= 1
            self._held[who] += 1
            self._start(who, cost, tag)
            return
        if self.waiting() >= self.max_waiting:
            self._make_room(who)
        await self._wait(who, _Part(self._seq, cost, idle, tag), first=False)

    def release(self, who: str | None = None) -> None:
        """Give a slot back (``who``: the client that held it, if it came by ``acquire``)."""
        self._release(who)

    def _order(self, who: str) -> tuple:
        """Where ``who``'s next waiting part stands: overdue first (oldest first), then the start
        tag, then a client that was idle, then the longest waiting."""
        p = self._queues[who][0]
        if self._served - p.since > MAX_BYPASS:
            return 0, p.seq, False, 0
        return 1, p.tag, not p.idle, p.seq

    def _start(self, who: str, cost: float, tag: float) -> None:
        """A part of ``who`` costing ``cost`` is served from start tag ``tag``; the client's next
        waiting part starts no earlier than this one ends."""
        self._now = max(self._now, tag)
        self._vtime[who] = tag + cost
        q = self._queues.get(who)
        if q:
            q[0].tag = max(q[0].tag, tag + cost)
        if len(self._vtime) > MAX_CLIENTS:
            self._prune()

    def _prune(self) -> None:
        idle = [c for c in self._vtime if c not in self._queues and not self._held[c]]
        for c in [c for c in idle if self._vtime[c] <= self._now]:  # at or behind the hop's time: they lose nothing
            del self._vtime[c]
        idle = sorted((c for c in idle if c in self._vtime), key=self._vtime.__getitem__)
        for c in idle[:max(0, len(self._vtime) - MAX_CLIENTS)]:  # then the furthest behind
            del self._vtime[c]

    async def _wait(self, who: str, p: _Part, first: bool) -> None:
        p.fut, p.since = asyncio.get_running_loop().create_future(), self._served
        q = self._queues.setdefault(who, collections.deque())
        q.appendleft(p) if first else q.append(p)
        try:
            await p.fut
        except asyncio.CancelledError:
            if p.fut.done() and not p.fut.cancelled() and p.fut.exception() is None:  # handed a slot: pass it on
                self._release(who)
            else:
                self._forget(who, p)
            raise

    def _release(self, who: str | None) -> None:
        if who is not None:
            self._held[who] -= 1
            if self._held[who] <= 0:
                del self._held[who]
        while self._queues:
            nxt = min(self._queues, key=self._order)
            q = self._queues[nxt]
            p = q.popleft()
            self._served += 1
            if not q:
                del self._queues[nxt]
            assert p.fut is not None, "a waiting part has a future"
            if not p.fut.done():  # else cancelled, or refused (Saturated) while it waited
                self._held[nxt] += 1
                self._start(nxt, p.cost, p.tag)
                p.fut.set_result(None)
                return
        self.free += 1

    def _make_room(self, who: str) -> None:
        top = max(self._queues, key=lambda c: len(self._queues[c]))
        if len(self._queues[top]) <= self.waiting(who) + 1:
            raise Saturated(f"{self.waiting()} requests already wait here")
        p = self._queues[top].pop()  # its newest
        if not self._queues[top]:
            del self._queues[top]
        assert p.fut is not None, "a waiting part has a future"
        p.fut.set_exception(Saturated("the hop is saturated; this client holds the most waiting requests"))

    def _forget(self, who: str, p: _Part) -> None:
        q = self._queues.get(who)
        if q is not None and p in q:
            q.remove(p)
            if not q:
                del self._queues[who]
