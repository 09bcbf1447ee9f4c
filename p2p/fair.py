"""Compute slots shared fairly among clients (serving), whatever number of identities they use.

Rules:
- ``acquire(who, cost)`` takes one of ``n`` slots or waits. Waiters are served by fair queuing
  over the compute they ask for (``cost``: a traversal's tokens): each client has a virtual
  time, advanced by the cost of each request it is served; the next slot goes to the waiting
  client whose next request would finish earliest in virtual time (it starts at the client's
  own virtual time, or the hop's if the client has been idle: an idle client banks no credit),
  ties to the longest waiting. So a client that asks little (a legitimate session: a few dozen
  tokens a traversal, then a round trip away) is served next when it comes back, ahead of
  clients that flood with large traversals, and equal requests go round-robin by client.
- At most ``max_waiting`` requests wait in all. Past it, the client with the most waiting loses
  its newest waiter (``Saturated`` is raised in it) to make room for a client with fewer; a
  client that already has the most waiting is refused at once. So a flood from many identities
  fills the queue but never locks out a client with nothing waiting.
- What is kept per client is bounded: its waiters (``max_waiting`` in all) and a virtual time
  while it is ahead of the hop's (at most ``MAX_CLIENTS`` of them: the furthest behind go first).
- A waiter cancelled after it was handed a slot hands the slot on.
"""

from __future__ import annotations

import asyncio
import collections


class Saturated(Exception):
    """The hop is saturated and this client holds at least its share of the waiting requests."""


MAX_CLIENTS = 4096  # virtual times kept for clients with nothing waiting


class FairSlots:
    def __init__(self, n: int, max_waiting: int):
        self.free = n
        self.max_waiting = max_waiting
        self._queues: dict[str, collections.deque] = {}  # client -> (seq, cost, future) waiting
        self._vtime: dict[str, float] = {}  # client -> virtual time after its last request served
        self._now = 0.0  # the hop's virtual time: the start of the last request served
        self._seq = 0

    def waiting(self, who: str | None = None) -> int:
        if who is not None:
            return len(self._queues.get(who, ()))
        return sum(len(q) for q in self._queues.values())

    def _start(self, who: str, cost: float) -> None:
        """``who`` is served a request of ``cost`` now: it began at the client's start tag (set when
        it began to wait) or, served at once, at the hop's time; the client's next starts after it."""
        begin = max(self._vtime.get(who, 0.0), self._now) if who not in self._queues else self._vtime[who]
        self._now = max(self._now, begin)
        self._vtime[who] = begin + cost
        if len(self._vtime) > MAX_CLIENTS:  # those at or behind the hop's time lose nothing; then the oldest
            idle = [c for c in self._vtime if c not in self._queues]
            for c in [c for c in idle if self._vtime[c] <= self._now]:
                del self._vtime[c]
            idle = sorted((c for c in self._vtime if c not in self._queues), key=self._vtime.__getitem__)
            for c in idle[:max(0, len(self._vtime) - MAX_CLIENTS)]:  # never a waiting client's
                del self._vtime[c]

    def _finish(self, who: str) -> tuple[float, int]:
        """When ``who``'s next request would finish in virtual time (then: how long it waited). Its
        start tag was fixed when it began to wait, so waiting never makes it later: every waiter is
        served once the others' tags pass its own."""
        seq, cost, _ = self._queues[who][0]
        return self._vtime[who] + cost, seq

    async def acquire(self, who: str, cost: float = 1.0) -> None:
        if self.free > 0 and not self._queues:
            self.free -= 1
            self._start(who, cost)
            return
        if self.waiting() >= self.max_waiting:
            self._make_room(who)
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        if who not in self._queues:  # its start tag: where it stopped, or the hop's time if that is later
            self._vtime[who] = max(self._vtime.get(who, 0.0), self._now)
        self._queues.setdefault(who, collections.deque()).append((self._seq, cost, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # handed a slot: pass it on
                self.release()
            else:
                self._forget(who, fut)
            raise

    def release(self) -> None:
        while self._queues:
            who = min(self._queues, key=self._finish)
            q = self._queues[who]
            _, cost, fut = q[0]
            if not fut.done():
                self._start(who, cost)  # while it still counts as waiting: from its start tag
            q.popleft()
            if not q:
                del self._queues[who]
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1

    def _make_room(self, who: str) -> None:
        top = max(self._queues, key=lambda c: len(self._queues[c]))
        if len(self._queues[top]) <= self.waiting(who) + 1:
            raise Saturated(f"{self.waiting()} requests already wait here")
        _, _, fut = self._queues[top].pop()  # its newest
        if not self._queues[top]:
            del self._queues[top]
        fut.set_exception(Saturated("the hop is saturated; this client holds the most waiting requests"))

    def _forget(self, who: str, fut) -> None:
        q = self._queues.get(who)
        if q is not None:
            for item in q:
                if item[2] is fut:
                    q.remove(item)
                    break
            if not q:
                del self._queues[who]
