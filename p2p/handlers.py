"""The handler registry: which code a peer runs on each message type it receives, and what a
handler's failure costs.

Rules:
- Every handler registered for a message type gets each message of it (fan-out), in the order
  they were registered, inline ones first: services that share a type (a training peer's
  checkpoint server and fetcher both take STREAM_RESET) each ignore what is not theirs. A later
  ``on`` never silently replaces an earlier one (it did: the server's resets were lost).
- An inline handler runs in the connection's reader, in arrival order (stream chunks, round
  parts); any other runs as a task of the peer, named ``handle <Type>``.
- A handler that raises on a peer's message never takes the reader down: the message is the
  sender's fault, its connection is closed with an Error frame (MALFORMED_METADATA, or the
  ProtocolError's own code), the refusal is counted by exception type (``input_failures``, in
  the report) and the reader goes on with the next connection. A ProtocolError or ValueError
  is logged in one line; anything else also with its traceback (the handler should have refused
  the input by name).
- ConnectionError and cancellation are not the sender's fault: they pass through.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from blocktrain.protocol import ErrorCode, ProtocolError

from .transport import CloseCause, PeerConnection

log = logging.getLogger("blocktrain.p2p")

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task"]


class Handlers:
    """The peer's handlers by message type, and the count of messages they refused."""

    def __init__(self, spawn: Spawn):
        self._spawn = spawn
        self._spawned: dict[type, list[Callable]] = {}
        self._inline: dict[type, list[Callable]] = {}
        self.input_failures: dict[str, int] = {}  # exception type -> messages refused (report)

    def on(self, msg_type: type, handler: Callable, *, inline: bool = False) -> None:
        (self._inline if inline else self._spawned).setdefault(msg_type, []).append(handler)

    def handles(self, msg_type: type) -> bool:
        return msg_type in self._inline or msg_type in self._spawned

    def deliver(self, msg: object, pc: PeerConnection, pid: str) -> bool | None:
        """Hand ``msg`` from ``pid`` to its handlers: True when handed (or spawned), False when one
        refused it and ``pc`` was closed (the others are not asked), None when no handler takes its
        type. Raises only ConnectionError (``pc`` ended)."""
        inline, spawned = self._inline.get(type(msg), ()), self._spawned.get(type(msg), ())
        if not inline and not spawned:
            return None
        for fn in inline:  # in order, in the reader (stream chunks, round parts)
            try:
                fn(msg, pc, pid)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the sender's message did it: close its connection
                self.bad_input(pc, pid, msg, e)
                return False
        for fn in spawned:
            self._spawn(self._guarded(fn, msg, pc, pid), f"handle {type(msg).__name__}")
        return True

    async def _guarded(self, handler: Callable, msg: object, pc: PeerConnection, pid: str) -> None:
        """A spawned handler: what it raises on a peer's message closes that peer's connection."""
        try:
            await handler(msg, pc, pid)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - see bad_input
            self.bad_input(pc, pid, msg, e)

    def bad_input(self, pc: PeerConnection, pid: str, msg: object, e: Exception) -> None:
        """A handler raised on ``msg``: the sender's fault (its message did not fit what the handler
        needs). Closed with an Error frame; a ProtocolError keeps its own code. A TypeError or the
        like is also logged with its traceback: the handler should have refused the input by name."""
        code = e.code if isinstance(e, ProtocolError) else ErrorCode.MALFORMED_METADATA
        typed = isinstance(e, (ProtocolError, ValueError))
        (log.info if typed else log.warning)("closing %s: its %s was refused: %r", pid[:12], type(msg).__name__, e,
                                             exc_info=not typed)
        self.input_failures[type(e).__name__] = self.input_failures.get(type(e).__name__, 0) + 1
        pc.abort_with(code, f"bad {type(msg).__name__}: {type(e).__name__}: {str(e)[:200]}", CloseCause.REFUSED)
