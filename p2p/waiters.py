"""Waiting for a condition without polling: ``wait_for(predicate)`` re-checks the predicate each
time something calls ``notify()`` (a membership change, a dial ending, a service's own state).

Rules:
- A waiter is a future; ``notify`` completes every one, and each re-checks its predicate.
- ``wait_for`` returns True once the predicate holds; False at once when the owner is stopping,
  and when the deadline passes (on a timeout it returns the predicate's last word).
- A cancel always ends the wait (CancelledError), even one that comes in the same turn of the
  loop as the notify: waits are bounded with ``asyncio.timeout``, never ``asyncio.wait_for``, which
  in Python 3.11 returns the inner result then and drops the cancel (a stopped trainer went on
  training to its end; the package's other timed waits follow the same rule).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class Waiters:
    """The futures of everyone waiting for a condition."""

    def __init__(self, stopping: Callable[[], bool]):
        self._stopping = stopping
        self._futures: set[asyncio.Future] = set()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while not predicate():
            if self._stopping():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            fut = loop.create_future()
            self._futures.add(fut)
            try:
                async with asyncio.timeout(left):
                    await fut
            except TimeoutError:
                return predicate()
            finally:
                self._futures.discard(fut)
        return True

    def notify(self) -> None:
        for f in list(self._futures):
            if not f.done():
                f.set_result(None)
