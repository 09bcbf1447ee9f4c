"""A serving hop's sessions: each client session's caches at this hop, within fixed bounds.

Rules:
- Sans-IO: time comes from the ``clock`` given (``time.monotonic`` at a hop), nothing else is
  read; the server calls ``get`` before a traversal, ``begin``/``end`` around its compute, ``drop``
  when a session ends or its caches are no longer trusted, ``expire`` as requests come.
- A session's caches are freed at its end, after SESSION_IDLE_S unused, or when the hop holds
  more than MAX_SESSIONS: an idle session goes, the least recently used of the client holding
  the most, of those unused for RECENT_S since their last traversal here; past twice
  MAX_SESSIONS, with none such, a recent one of a client with several idle, and with none such
  either a new session is refused (``SessionsFull``). A client holds at most
  MAX_SESSIONS_PER_CLIENT (its own oldest goes first). Identities are free: a flood of sessions,
  from a few identities or a fresh one per traversal, must not push out a client with one
  between its traversals.
- A session in use (``begin`` without ``end``) is never pushed out by other clients' sessions or
  expired (a client's own new session past MAX_SESSIONS_PER_CLIENT still replaces its oldest); its
  idle time starts when its traversal ends here (``end``), not when it came.
- A new session's caches are made only for a session's first traversal (``start`` 0): a request
  naming a session the hop does not hold costs no place (``UnknownSession``).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Generic, TypeVar

SESSION_IDLE_S = 60.0  # caches unused this long are freed
# Sessions one hop holds at once (an idle one goes; up to twice as many while they are in use or
# recent: RECENT_S), and per client. A session's caches are at most (max_seq_len + 256) tokens
# per layer plus the draft model's drafting steps: about 13 MiB for the d 128 model at the spec
# bounds, 1.5 MiB for 256 bytes of d 192.
MAX_SESSIONS = 64
MAX_SESSIONS_PER_CLIENT = 8
# A session used this recently (since its last traversal here ended) is not pushed out by a new one
# while the hop holds at most twice MAX_SESSIONS; past it, only a client's that holds several, else
# the new session is refused. A client between two traversals (its round trip) so keeps its caches
# however many new sessions come (identities are free: a flood of a fresh identity per traversal,
# with every other session's traversal running here, pushed out the client's one idle session).
RECENT_S = 5.0

C = TypeVar("C")  # what a session holds (a BlockCache at a hop)


class UnknownSession(LookupError):
    """A traversal after the first for a session this hop does not hold (expired, evicted, or
    the hop restarted)."""


class SessionsFull(RuntimeError):
    """A new session, while every session held is in use or each a client's one and recent."""

    def __init__(self, held: int):
        super().__init__(f"this hop holds {held} sessions, in use or each a client's one, used in the last "
                         f"{RECENT_S:.0f} s")
        self.held = held


class SessionTable(Generic[C]):
    """Sessions by key ``(client, session, ...)``: the key's first item names the client."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_sessions: int = MAX_SESSIONS,
                 per_client: int = MAX_SESSIONS_PER_CLIENT, recent_s: float = RECENT_S,
                 idle_s: float = SESSION_IDLE_S):
        self.clock, self.max_sessions, self.per_client = clock, max_sessions, per_client
        self.recent_s, self.idle_s = recent_s, idle_s
        self._held: collections.OrderedDict[tuple, C] = collections.OrderedDict()  # least recently used first
        self._used: dict[tuple, float] = {}
        self._busy: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: tuple) -> bool:
        return key in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def is_busy(self, key: tuple) -> bool:
        return key in self._busy

    def get(self, key: tuple, new: Callable[[], C], start: int) -> C:
        """The session's caches, made by ``new`` for its first traversal (``start`` 0); room is
        made by the rules above, or the new session refused (``SessionsFull``)."""
        held = self._held.pop(key, None)
        if held is None:
            if start != 0:
                raise UnknownSession(key)
            mine = [k for k in self._held if k[0] == key[0]]
            if len(mine) >= self.per_client:  # a client's own oldest session goes first
                self.drop(mine[0])
            held = new()
        self._held[key] = held  # most recently used last
        self._used[key] = self.clock()
        self._make_room(key, start)
        return held

    def _make_room(self, key: tuple, start: int):
        while len(self._held) > self.max_sessions:
            # An idle session goes (not this one, nor one in use), of those unused for recent_s:
            # the least recently used of the client holding the most. Past twice max_sessions, a
            # recent one of a client with several idle, and with none such the new one is refused
            # (the table passes 2 x max_sessions only by sessions in use).
            now, free = self.clock(), [k for k in self._held if k != key and k not in self._busy]
            held = collections.Counter(k[0] for k in self._held)
            idle = [k for k in free if now - self._used[k] > self.recent_s]
            if not idle and len(self._held) > 2 * self.max_sessions:
                held = collections.Counter(k[0] for k in free)
                idle = [k for k in free if held[k[0]] > 1]
                if not idle and start == 0:
                    self.drop(key)
                    raise SessionsFull(len(self._held))
            if not idle:
                return
            self.drop(max(idle, key=lambda k: held[k[0]]))  # the first of the most: least recently used

    def begin(self, key: tuple):
        """A traversal of the session is computed here from now on (never pushed out meanwhile)."""
        self._busy.add(key)

    def end(self, key: tuple):
        """Its traversal ended: its idle time (recent_s) starts now."""
        self._busy.discard(key)
        if key in self._used:
            self._used[key] = self.clock()

    def drop(self, key: tuple):
        self._held.pop(key, None)
        self._used.pop(key, None)

    def expire(self):
        """Free the sessions unused for idle_s (none in use)."""
        now = self.clock()
        for key in [k for k, t in self._used.items() if now - t > self.idle_s and k not in self._busy]:
            self.drop(key)

    def clear(self):
        self._held.clear()
        self._used.clear()
        self._busy.clear()
