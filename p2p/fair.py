"""Compute slots shared fairly among clients (serving), whatever number of identities they use.

Rules:
- ``acquire(who)`` takes one of ``n`` slots or waits. Waiters are served round-robin by client:
  a client with one request waiting is served before any client's next one, so a client that
  floods (with many requests, or many sessions) delays another by at most one traversal per
  other active client.
- At most ``max_waiting`` requests wait in all. Past it, the client with the most waiting loses
  its newest waiter (``Saturated`` is raised in it) to make room for a client with fewer; a
  client that already has the most waiting is refused at once. So a flood from many identities
  fills the queue but never locks out a client with nothing waiting.
- A waiter cancelled after it was handed a slot hands the slot on.
"""

from __future__ import annotations

import asyncio
import collections


class Saturated(Exception):
    """The hop is saturated and this client holds at least its share of the waiting requests."""


class FairSlots:
    def __init__(self, n: int, max_waiting: int):
        self.free = n
        self.max_waiting = max_waiting
        self._queues: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()

    def waiting(self, who: str | None = None) -> int:
        if who is not None:
            return len(self._queues.get(who, ()))
        return sum(len(q) for q in self._queues.values())

    async def acquire(self, who: str) -> None:
        if self.free > 0 and not self._queues:
            self.free -= 1
            return
        if self.waiting() >= self.max_waiting:
            self._make_room(who)
        fut = asyncio.get_running_loop().create_future()
        self._queues.setdefault(who, collections.deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot as it was cancelled: pass it on
                self.release()
            else:
                self._forget(who, fut)
            raise

    def release(self) -> None:
        while self._queues:
            who, q = self._queues.popitem(last=False)
            fut = q.popleft()
            if q:
                self._queues[who] = q  # round robin: its next waiter goes behind every other client
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1

    def _make_room(self, who: str) -> None:
        top = max(self._queues, key=lambda c: len(self._queues[c]))
        if len(self._queues[top]) <= self.waiting(who) + 1:
            raise Saturated(f"{self.waiting()} requests already wait here")
        fut = self._queues[top].pop()  # its newest
        if not self._queues[top]:
            del self._queues[top]
        fut.set_exception(Saturated("the hop is saturated; this client holds the most waiting requests"))

    def _forget(self, who: str, fut) -> None:
        q = self._queues.get(who)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self._queues[who]
