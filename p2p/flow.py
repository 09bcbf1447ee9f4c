"""The send side of a PeerConnection (transport.py): its write queue with backpressure, and the
far end of a shaped link.

Rules:
- Two queues: control (stream 0) first, then bulk (chunked streams), so a transfer never delays
  a heartbeat by more than one frame.
- Senders wait in ``drain`` while the transport's buffer is above its high-water mark or the bulk
  queue is longer than ``BULK_QUEUE_FRAMES``; all of them share one drain waiter (aiohttp's
  ``_drain_helper``), and ``close`` wakes every waiter.
- A message stays in its queue until the writer takes it, where ``release`` finds it: the copy it
  leaves owns its bytes, so the sender may reuse the buffers at once.
- On a shaped link at most ``SHAPER_BUFFER_S`` of serialization is queued ahead (the link's send
  buffer); the frames scheduled on it are written at their arrival times, in order, by one task.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Callable

from blocktrain.protocol import BlockUpdate, Handshake, Message, PipelineForward, PipelineResult, StreamChunk

from .link import LinkShaper

# A shaped link accepts frames until this much serialization time is queued (its send buffer).
SHAPER_BUFFER_S = 0.05
# Bulk frames queued per connection before senders wait in drain(): enough to keep the writer busy
# while a sender prepares the next frame, few enough that a heartbeat never waits behind much.
BULK_QUEUE_FRAMES = 2


class SendQueue:
    """Messages waiting for the connection's one writer task, and the senders' shared drain waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop, closed: asyncio.Future):
        self.loop = loop
        self._closed = closed  # the connection's: once done, nobody waits
        self._control: collections.deque = collections.deque()
        self._bulk: collections.deque = collections.deque()
        self._wakeup = asyncio.Event()
        self._drain_waiter: asyncio.Future | None = None
        self._empty_waiter: asyncio.Future | None = None  # ``emptied``'s, resolved as the queues empty
        self.paused = False  # the transport's buffer is above its high-water mark
        self.idle = False  # True while the writer waits with empty queues

    def empty(self) -> bool:
        return not self._control and not self._bulk

    def queued(self) -> int:
        return len(self._control) + len(self._bulk)

    async def emptied(self):
        """Until the writer took every queued message (or the connection closed)."""
        while not self.empty() and not self._closed.done():
            if self._empty_waiter is None or self._empty_waiter.done():
                self._empty_waiter = self.loop.create_future()
            await asyncio.shield(self._empty_waiter)

    def ready(self) -> bool:
        """Nothing queued, the writer idle and the transport taking more: a frame may go out now."""
        return not self._control and not self._bulk and self.idle and not self.paused

    def put(self, msg: Message, bulk: bool = False):
        (self._bulk if bulk else self._control).append(msg)
        self._wakeup.set()

    def pop(self) -> Message:
        """The next message for the writer, control first; drainers may go on if the queue is short."""
        msg = self._control.popleft() if self._control else self._bulk.popleft()
        self.wake_drain()
        if self.empty() and self._empty_waiter is not None and not self._empty_waiter.done():
            self._empty_waiter.set_result(None)
        return msg

    async def wait_for_frames(self):
        """The writer's wait while both queues are empty (``put`` and ``close`` end it)."""
        self._wakeup.clear()
        self.idle = True
        try:
            await self._wakeup.wait()
        finally:
            self.idle = False

    def must_wait(self) -> bool:
        return (self.paused or len(self._bulk) > BULK_QUEUE_FRAMES) and not self._closed.done()

    async def drain(self):
        """Wait until the transport and the bulk queue can take more (or the connection closed);
        every concurrent drainer waits on the same future, which ``wake_drain`` and ``close`` resolve."""
        while self.must_wait():
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = self.loop.create_future()
            await asyncio.shield(self._drain_waiter)  # a cancelled drainer leaves it to the others

    def resume(self):
        self.paused = False
        self.wake_drain()

    def wake_drain(self):
        """Senders waiting in drain() may go on once the transport takes more and the bulk queue is
        short again (both the shaped and the plain path take frames off it)."""
        if self._drain_waiter is not None and not self._drain_waiter.done() and not self.must_wait():
            self._drain_waiter.set_result(None)

    def close(self):
        """The connection closed: wake every drainer and the writer."""
        for waiter in (self._drain_waiter, self._empty_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._wakeup.set()

    def release(self, msgs) -> int:
        """Queued messages among ``msgs`` (compared by identity) are replaced by copies that own
        their bytes: the caller may reuse the buffers they viewed at once. Returns how many."""
        ids = {id(m) for m in msgs}
        n = 0
        for q in (self._bulk, self._control):
            for i in range(len(q)):
                if id(q[i]) in ids:
                    q[i] = _owning_copy(q[i])
                    n += 1
        return n


def _owning_copy(msg: Message) -> Message:
    """``msg`` with its tensors' segments (or a chunk's data) copied into bytes of its own."""
    if isinstance(msg, (BlockUpdate, PipelineForward, PipelineResult)):  # the messages with tensors
        return dataclasses.replace(msg, tensors=tuple(
            dataclasses.replace(t, segments=tuple(bytes(s) for s in t.segments)) for t in msg.tensors))
    if isinstance(msg, (StreamChunk, Handshake)):  # the messages with data
        return dataclasses.replace(msg, data=bytes(msg.data))
    return msg


class ShapedLink:
    """Frames in flight on a shaped link: scheduled by a ``LinkShaper`` as they are sent, written
    at their arrival times, in order, by one deliverer task (the link's far end); they pipeline."""

    def __init__(self, loop: asyncio.AbstractEventLoop, closed: asyncio.Future, write: Callable[[list], bool],
                 fail: Callable[[str, BaseException], None], name: str = ""):
        self.loop = loop
        self._closed = closed  # the connection's
        self._write = write  # writes frames to the transport; False if it is closing
        self._fail = fail  # shuts the connection down: frames were lost in flight
        self.name = name
        self._in_flight: collections.deque = collections.deque()  # (arrival time, frames)
        self._in_flight_event = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        """Frames are in flight: anything written to the transport now would overtake them."""
        return bool(self._in_flight)

    async def room(self, shaper: LinkShaper):
        """Wait until the link's send buffer takes more: at most SHAPER_BUFFER_S queued ahead."""
        while shaper.busy_until() - time.monotonic() > SHAPER_BUFFER_S and not self._closed.done():
            await asyncio.sleep(shaper.busy_until() - time.monotonic() - SHAPER_BUFFER_S / 2)

    def put(self, shaper: LinkShaper, frames: list):
        """Schedule ``frames`` (which must go out whole) on the link."""
        arrive = shaper.schedule(time.monotonic(), sum(len(b) for b in frames))
        self._in_flight.append((arrive, frames))
        if self.task is None:
            self.task = self.loop.create_task(self._deliver_loop(), name=f"link {self.name}")
        self._in_flight_event.set()

    async def flush(self):
        """Wait until the frames in flight have arrived (or the connection closed)."""
        while self._in_flight and not self._closed.done():
            await asyncio.sleep(max(0.001, self._in_flight[-1][0] - time.monotonic()))

    async def _deliver_loop(self):
        """Write each frame at its arrival time, in order."""
        try:
            while not self._closed.done():
                if not self._in_flight:
                    self._in_flight_event.clear()
                    await self._in_flight_event.wait()
                    continue
                arrive, frames = self._in_flight[0]
                wait = arrive - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not self._write(frames):
                    break
                self._in_flight.popleft()
        except asyncio.CancelledError:
            if self._in_flight and not self._closed.done():
                self._fail("link cancelled with frames in flight", ConnectionError("link cancelled"))
            raise
