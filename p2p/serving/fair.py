"""Compute slots shared fairly among clients (serving), whatever number of identities they use.

Rules:
- ``hold(who, cost)`` (``async with``) takes one of ``n`` slots or waits, and gives it back at
  the end; it yields ``between(cost)``, awaited between the parts of a request computed in parts
  (serving: a traversal in chunks of ``decode.CHUNK`` tokens, each part's ``cost`` its tokens).
- Flows: what is shared fairly is a flow. A client (whatever the caller counts as one: a serving
  hop counts the first identity of an address and the rest of it as one, shares.py) the hop
  knows is a flow of its own; every client it does not know yet shares one flow, the newcomers'
  (``NEWCOMERS``), until it was served ``newcomer_tokens`` (``NEWCOMER_TOKENS``, 256: a short
  traversal) there, counted for parts computed (a part cut short counts nothing); from its next
  request on it is a flow of its own, starting at the hop's time. Inside the newcomers' flow
  clients take turns part by part (a request between its parts goes behind another newcomer
  waiting). Identities are free: a flood of fresh identities takes one share, not one per
  identity. An identity made known costs its tokens, computed at the newcomers' one share; an
  attacker can so stock up known identities while the hop is idle, and flood with them later,
  one share each.
- Order: fair queuing over parts by start tag. Each flow has a virtual time, advanced by the
  cost of each part it is served; the hop's virtual time is the largest finish tag served
  (start + cost), so it moves on with every part served at or past it. A client busy here
  (waiting or computing) starts its next part at its virtual time. A client this hop knows that
  was idle starts at its virtual time or ``IDLE_CREDIT`` before the hop's, whichever is later:
  it banks at most that much. A flow without a virtual time yet (the newcomers' the first time,
  a client just made known) starts at the hop's time; back from idle later, any flow (the
  newcomers' too) starts with the credit above. The next slot goes to
  the smallest start tag; among equal tags first to a client that was idle, then to the longest
  waiting.
- So a client back from a round trip (a legitimate session: a few dozen tokens a traversal) is
  ahead of every client that kept the hop busy, while its credit lasts (``IDLE_CREDIT`` tokens),
  and waits for the one part being computed, not for whole long traversals; clients that flood
  share the rest in turn by the compute they take; fresh identities queue in the newcomers' flow.
  The share is per flow: many known identities at once take as many shares.
- ``between``: when a waiter comes before the request's next part, the slot goes to it and the
  part waits at the head of its flow's queue (a client's requests finish in turn instead of
  all advancing together); in the newcomers' flow, with another newcomer waiting, it goes
  behind the newcomers waiting instead; otherwise the request keeps the slot.
- Nobody waits forever: a flow passed over by ``MAX_BYPASS`` parts of other flows since it was
  last served (or since its first waiter came) goes first (oldest first), whatever the tags say.
  Counted per flow, not per waiter: its own parts served meanwhile do not count, and each part
  it is served starts the count again for its waiters. A flow with many waiting (a flood from
  one address) so takes at most one part in MAX_BYPASS of the others out of its turn; counted
  per waiter, each of its waiters, there long, was overdue when its turn at the head of the flow
  came, and the flood went first part after part.
- At most ``max_waiting`` parts wait in all (a request between its parts counts). Past it, room
  is made for an arriving part: the flow with the most waiting loses its newest waiter if it has
  two more than the arriving part's flow; else the waiter that would go last loses its place if
  the arriving part would go before it (a request refused between its parts is refused whole:
  serving drops its session); else the arriving part is refused at once (``Saturated``). So a
  flood from one identity never fills the queue against others, and a client back with credit
  takes the place of the last in line.
- What is kept per client is bounded: its waiters (``max_waiting`` in all), its slots held, and
  a virtual time with its count of parts served (at most ``MAX_CLIENTS``; past it the idle
  clients served the fewest parts are forgotten first, the newest among equals, and a client
  forgotten is a newcomer again); a newcomer's tokens served (at most ``MAX_CLIENTS``, the
  oldest forgotten first).
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
# Parts served past one waiter before it goes first. It also bounds how long a client waits once
# its credit is spent: in the live flood of experiments/hardening/key_holders.py with a new
# identity for every flood traversal, 256 made a client's generate 11.9x slower (one of 5 failed,
# 10ab6a2), 64 made it 4.6x (baf7c64). At 64 (= the waiters a hop keeps) waiters queued alike can
# turn overdue one after another ahead of a client with credit (a review's simulation: it then
# waited up to 23 chunks); the live runs favour 64.
MAX_BYPASS = 64
IDLE_CREDIT = 256  # how far before the hop's time a known idle client starts (tokens: a short traversal)
# Tokens a client is served as a newcomer, sharing one flow with every other newcomer, before it
# is a flow of its own: a flood of fresh identities takes one share, not one per identity.
NEWCOMER_TOKENS = 256
NEWCOMERS = "\x00newcomers"  # the newcomers' flow (no peer id: ids are hex)


@dataclass
class _Part:
    """One waiting part of a request."""
    seq: int  # when its request came (ties go to the longest waiting)
    who: str  # the client (its flow is its own, or NEWCOMERS)
    cost: float
    idle: bool  # its client had nothing waiting or computing here when the request came (ties go to it)
    tag: float  # its start tag
    started: bool = False  # a later part of a request that already had the slot
    since: int = 0  # parts served before it began to wait
    flow: str = ""  # the flow it waits in
    own_since: int = 0  # parts of that flow served before it began to wait
    fut: asyncio.Future | None = field(default=None, repr=False)


class FairSlots:
    def __init__(self, n: int, max_waiting: int, newcomer_tokens: float = NEWCOMER_TOKENS):
        """``n`` slots, at most ``max_waiting`` parts waiting; a client is a newcomer until it was
        served ``newcomer_tokens`` (0: every client is a flow of its own at once)."""
        self.free = n
        self.max_waiting = max_waiting
        self.newcomer_tokens = newcomer_tokens
        # Keyed by flow: a client's own id once the hop knows it, else NEWCOMERS.
        self._queues: dict[str, collections.deque[_Part]] = {}  # flow -> its waiting parts
        self._vtime: dict[str, float] = {}  # flow -> virtual time after its last part started
        self._parts: dict[str, int] = {}  # flow -> parts it was served (kept with its virtual time)
        self._held: collections.Counter[str] = collections.Counter()  # flow -> slots it holds
        self._trial: dict[str, tuple[float, int]] = {}  # newcomer -> tokens, parts computed (<= MAX_CLIENTS)
        self._lent: dict[str, collections.deque] = {}  # who -> (flow, cost) of each slot ``acquire`` lent
        self._now = 0.0  # the hop's virtual time: the largest finish tag served
        self._seq = 0
        self._served = 0  # parts served

    def waiting(self, who: str | None = None) -> int:
        """Parts waiting: of ``who``'s flow (its own, or every newcomer's), or in all."""
        if who is not None:
            return len(self._queues.get(self.flow(who), ()))
        return sum(len(q) for q in self._queues.values())

    def flow(self, who: str) -> str:
        """Whose turns ``who``'s parts take: its own once the hop knows it, else the newcomers'."""
        return who if who in self._vtime or self.newcomer_tokens <= 0 else NEWCOMERS

    @contextlib.asynccontextmanager
    async def hold(self, who: str, cost: float = 1.0):
        """A slot for the block (the request's first part costs ``cost``), given back at its end;
        yields ``between(cost)`` for the request's next part."""
        flow = self.flow(who)  # for the whole request, even if the hop comes to know ``who`` meanwhile
        seq = await self._acquire(flow, who, cost)
        held, running = True, cost

        async def between(cost: float = 1.0):
            nonlocal held, running
            self._credit(who, flow, running)  # the part before was computed
            running = cost
            part = _Part(seq, who, cost, False, self._vtime[flow], started=True)
            self._purge()
            q = self._queues.get(flow)
            rival = q is not None and any(p.who != who for p in q)  # another newcomer waits in the flow: turns
            first = min((self._order(c) for c in self._queues if c != flow), default=None)  # its own wait
            if rival or (first is not None and first < self._rank(part)):  # a live waiter (purged above)
                if rival:  # behind the newcomers waiting
                    assert q is not None
                    part.tag = q[-1].tag + q[-1].cost
                held = False  # while it waits it holds nothing; cancelled or refused, it never will
                self._release(flow)
                await self._wait(flow, part, first=not rival)
                held = True
                return
            self._served += 1
            self._start(flow, part)
        try:
            yield between
            self._credit(who, flow, running)  # the last part was computed
        finally:
            if held:
                self._release(flow)
            self._graduate(who)

    async def acquire(self, who: str, cost: float = 1.0) -> int:
        """A slot for a request of ``who`` costing ``cost``; give it back with ``release(who)``
        (the request computed). Returns the request's place in arrival order."""
        flow = self.flow(who)
        seq = await self._acquire(flow, who, cost)
        self._lent.setdefault(who, collections.deque()).append((flow, cost))
        return seq

    async def _acquire(self, who: str, client: str, cost: float) -> int:
        """``acquire`` for flow ``who`` (``client``'s)."""
        self._seq += 1
        seq, q = self._seq, self._queues.get(who)
        known, busy = who in self._vtime, bool(q) or self._held[who] > 0
        if busy:
            tag = q[-1].tag + q[-1].cost if q else self._vtime[who]
        else:
            tag = max(self._vtime[who], self._now - IDLE_CREDIT) if known else self._now
        part = _Part(seq, client, cost, not busy, tag)
        if self.free > 0 and not self._queues:
            self.free -= 1
            self._held[who] += 1
            self._served += 1
            self._start(who, part)
            return seq
        if self.waiting() >= self.max_waiting:
            self._make_room(who, part)
        await self._wait(who, part, first=False)
        return seq

    def release(self, who: str) -> None:
        """Give back the slot ``who`` took with ``acquire`` (the oldest, in the flow it took it in)."""
        lent = self._lent.get(who)
        assert lent, f"{who} holds no slot"
        flow, cost = lent.popleft()
        if not lent:
            del self._lent[who]
        self._release(flow)
        self._credit(who, flow, cost)
        self._graduate(who)

    def _rank(self, p: _Part) -> tuple:
        """Where part ``p`` stands: overdue first (oldest first), then the start tag, then a client
        that was idle, then the longest waiting."""
        if p.fut is not None and self._passed(p) >= MAX_BYPASS:
            return 0, p.seq, False, 0
        return 1, p.tag, not p.idle, p.seq

    def _passed(self, p: _Part) -> int:
        """Parts of other flows served since ``p`` began to wait."""
        return self._served - p.since - (self._parts.get(p.flow, 0) - p.own_since)

    def _order(self, who: str) -> tuple:
        return self._rank(self._queues[who][0])

    def _start(self, who: str, p: _Part) -> None:
        """Part ``p`` of flow ``who`` is served from its start tag; the flow's waiting parts start
        no earlier than this one ends, each after the one before it (a flow's later waiters
        otherwise keep the tags they came with, behind its time, and look first to ``_make_room``
        while a client of another flow looks last)."""
        cost, tag = p.cost, p.tag
        self._now = max(self._now, tag + cost)
        self._vtime[who] = max(self._vtime.get(who, tag + cost), tag + cost)  # never back
        self._parts[who] = self._parts.get(who, 0) + 1
        q = self._queues.get(who)
        end = tag + cost
        for w in q or ():  # the flow was served: its waiters count the parts that pass them over from now
            w.since, w.own_since = self._served, self._parts[who]
        for w in q or ():  # every waiter of the flow, not only the first: each starts after the one before
            if w.tag >= end:
                break
            w.tag, end = end, end + w.cost
        if len(self._vtime) > MAX_CLIENTS:
            self._prune()

    def _credit(self, who: str, flow: str, tokens: float) -> None:
        """A part of ``who`` in ``flow`` was computed: a newcomer's counts toward its own flow."""
        if flow != NEWCOMERS or who in self._vtime:
            return
        done, parts = self._trial.pop(who, (0.0, 0))
        self._trial[who] = (done + tokens, parts + 1)  # the most recent last
        if len(self._trial) > MAX_CLIENTS:
            del self._trial[next(iter(self._trial))]

    def _graduate(self, who: str) -> None:
        """A newcomer whose parts computed came to ``newcomer_tokens`` becomes a flow of its own
        (for its next request), from the hop's time, with the parts it was served (so the hop
        forgets it no sooner than a client served as much)."""
        done, parts = self._trial.get(who, (-1.0, 0))
        if done >= self.newcomer_tokens and who not in self._vtime:
            del self._trial[who]
            self._vtime[who] = self._now
            self._parts[who] = parts
            if len(self._vtime) > MAX_CLIENTS:
                self._prune()

    def _prune(self) -> None:
        """Forget idle clients down to 7/8 of MAX_CLIENTS (a sort per many new identities, not per
        part): those served the fewest parts first, the newest first among equals, so a stream of
        fresh identities pushes out each other, not a client the hop has served for long."""
        order = {c: i for i, c in enumerate(self._vtime)}  # first seen
        idle = sorted((c for c in self._vtime if c not in self._queues and not self._held[c]),
                      key=lambda c: (self._parts.get(c, 0), -order[c]))
        for c in idle[:max(0, len(self._vtime) - MAX_CLIENTS * 7 // 8)]:
            del self._vtime[c]
            self._parts.pop(c, None)

    async def _wait(self, who: str, p: _Part, first: bool) -> None:
        p.fut, p.since = asyncio.get_running_loop().create_future(), self._served
        p.flow, p.own_since = who, self._parts.get(who, 0)
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

    def _release(self, who: str) -> None:
        """``who`` gives its slot back; it goes to the first waiter still waiting."""
        assert self._held[who] > 0, f"{who} holds no slot"
        self._held[who] -= 1
        if self._held[who] <= 0:
            del self._held[who]
        while self._queues:
            nxt = min(self._queues, key=self._order)
            q = self._queues[nxt]
            p = q.popleft()
            if not q:
                del self._queues[nxt]
            assert p.fut is not None, "a waiting part has a future"
            if not p.fut.done():  # else cancelled, or refused (Saturated) while it waited
                self._held[nxt] += 1
                self._served += 1
                self._start(nxt, p)
                p.fut.set_result(None)
                return
        self.free += 1

    def _make_room(self, who: str, newcomer: _Part) -> None:
        """Room for ``newcomer`` of ``who`` in a full queue (the rules above), or Saturated."""
        self._purge()
        if self.waiting() < self.max_waiting:
            return
        top = max(self._queues, key=lambda c: len(self._queues[c]))
        victim: tuple[str, _Part] | None = None
        if len(self._queues[top]) > self.waiting(who) + 1:
            victim = top, max(self._queues[top], key=lambda p: p.seq)  # its newest request (not one started)
        else:
            victim = max(((c, p) for c, q in self._queues.items() for p in q), key=lambda cp: self._rank(cp[1]))
            if self._rank(victim[1]) < self._rank(newcomer):
                raise Saturated(f"{self.waiting()} requests already wait here")
        c, p = victim
        self._forget(c, p)
        assert p.fut is not None, "a waiting part has a future"
        if not p.fut.done():
            p.fut.set_exception(Saturated("the hop is saturated and this request would go last"))

    def _purge(self) -> None:
        """Drop waiting parts already cancelled or refused (their tasks have not run yet)."""
        for c in list(self._queues):
            for p in [p for p in self._queues[c] if p.fut is not None and p.fut.done()]:
                self._forget(c, p)

    def _forget(self, who: str, p: _Part) -> None:
        q = self._queues.get(who)
        if q is not None and p in q:
            q.remove(p)
            if not q:
                del self._queues[who]
