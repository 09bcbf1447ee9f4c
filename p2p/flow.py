"""The send side of a PeerConnection (transport.py): its write queue with backpressure, and the
far end of a shaped link; and the receive pool that every connection's large frames share.

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
- Receiving: identities are free, so what large frames cost is bounded in total, not per
  connection. One ``ReceivePool`` per event loop (the process's, in a peer) holds the bytes of
  every frame of REUSE_MIN_BYTES or more from its header until its reader took the message, and
  at most RECEIVE_POOL_BYTES of them: a connection that would begin one more while the pool is
  full waits, reading paused, in arrival order; a frame whose bytes stopped coming for
  FRAME_STALL_S while others wait has its connection closed. Once the pool empties after a load,
  the C allocator is asked to give freed memory back (``release_memory``).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import dataclasses
import time
import weakref
from typing import Callable

from blocktrain.protocol import BlockUpdate, Handshake, Message, PipelineForward, PipelineResult, StreamChunk

from .link import LinkShaper

# A shaped link accepts frames until this much serialization time is queued (its send buffer).
SHAPER_BUFFER_S = 0.05
# Bulk frames queued per connection before senders wait in drain(): enough to keep the writer busy
# while a sender prepares the next frame, few enough that a heartbeat never waits behind much.
BULK_QUEUE_FRAMES = 2
# Bytes of large frames (header parsed, payload arriving, or parsed and not yet taken by the
# connection's reader) held at once by all connections together. Each costs about twice its length
# while it is opened (the sealed bytes read in place and the plaintext they open into): 64 MiB is
# 4 frames of the 16 MiB maximum or 16 averaging pieces of 4 MiB at once, more than loopback
# decrypts in the time a reader takes one; a frame past it waits for one of them to be taken.
RECEIVE_POOL_BYTES = 64 * 1024 * 1024
# A frame holding pool bytes that received nothing for this long, while another waits: its
# connection is closed (a peer that stalls mid-frame would otherwise keep the pool).
FRAME_STALL_S = 10.0
# After this many bytes passed through the pool since the allocator last gave memory back, the
# pool's emptying asks it to (malloc_trim): freed frame buffers leave the process after a load.
TRIM_AFTER_BYTES = 16 * 1024 * 1024
# A connection's own frame buffers (the protocol's, reused frame after frame: up to 3 of its largest
# frame each way) are freed only when it ends: the allocator is asked to give memory back this long
# after connections ended (once for a burst of them).
TRIM_AFTER_CLOSE_S = 1.0


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


class ReceivePool:
    """The bytes of large frames held by all connections of one event loop (RECEIVE_POOL_BYTES at
    most): ``charge`` at a frame's header, ``release`` when its reader took it (or the connection
    closed); a connection that may not begin a frame ``wait``s, and is resumed in arrival order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = RECEIVE_POOL_BYTES):
        self.loop, self.limit = loop, limit
        self.used = 0
        self.peak = 0  # the most held at once (reports, tests)
        self._held: dict = {}  # connection -> bytes it holds
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # connection -> resume callback
        self._timer: asyncio.TimerHandle | None = None
        self._since_trim = 0
        self._trim: asyncio.TimerHandle | None = None  # a trim due after connections ended

    def has_room(self) -> bool:
        return self.used < self.limit and not self._waiting

    def charge(self, owner, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        self._since_trim += n
        self._held[owner] = self._held.get(owner, 0) + n

    def release(self, owner, n: int) -> None:
        if n <= 0:
            return
        left = self._held.get(owner, 0) - n
        if left > 0:
            self._held[owner] = left
        else:
            self._held.pop(owner, None)
        self.used -= n
        self._wake()
        if not self.used and self._since_trim >= TRIM_AFTER_BYTES:
            self._since_trim = 0
            self.loop.call_soon(release_memory)

    def wait(self, owner, resume: Callable[[], None]) -> None:
        """``owner`` may not begin its frame now: ``resume()`` is called when it may."""
        self._waiting[owner] = resume
        if self._timer is None:
            self._timer = self.loop.call_later(FRAME_STALL_S, self._check_stalled)

    def forget(self, owner) -> None:
        """``owner`` closed: it waits no more (what it held is released by its own ``release``), and
        its buffers, freed with it, are given back to the system soon."""
        self._waiting.pop(owner, None)
        self._wake()
        if self._trim is None:
            self._trim = self.loop.call_later(TRIM_AFTER_CLOSE_S, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        release_memory()

    def _wake(self) -> None:
        while self._waiting and self.used < self.limit:
            _, resume = self._waiting.popitem(last=False)
            resume()

    def _check_stalled(self) -> None:
        """Close the connections whose frame stalled while others wait for the pool."""
        self._timer = None
        if not self._waiting:
            return
        now = time.monotonic()
        for owner in [o for o in self._held if now - o.last_heard > FRAME_STALL_S]:
            owner.frame_stalled()
        if self._waiting:
            self._timer = self.loop.call_later(FRAME_STALL_S, self._check_stalled)


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FrameCharges:
    """One connection's share of its loop's ``ReceivePool``: the frame being received (charged at
    its header), the messages queued for the reader, and the one the reader took last (released
    when it comes back for the next)."""

    def __init__(self, pool: ReceivePool, pc):
        self.pool, self.pc, self.owner = pool, pc, self
        self.frame = 0
        self._events: collections.deque = collections.deque()
        self._taken = 0

    @property
    def last_heard(self) -> float:
        return self.pc.last_heard

    def frame_stalled(self) -> None:
        """The pool's verdict: our frame holds pool bytes and nothing came for FRAME_STALL_S."""
        self.pc.abort_timeout("frame stalled while holding receive memory")

    def may_begin(self) -> bool:
        """A large frame may be received now (it is begun already, or the pool has room)."""
        return bool(self.frame) or self.pool.has_room()

    def begin(self, n: int) -> None:
        if not self.frame:
            self.frame = n
            self.pool.charge(self.owner, n)

    def pushed(self) -> None:
        """A message went to the reader's queue: the frame's bytes (if large) go with it."""
        self._events.append(self.frame)
        self.frame = 0

    def reader_back(self) -> None:
        """The reader asks for the next message: it is done with the one it took."""
        self.pool.release(self.owner, self._taken)
        self._taken = 0

    def taken(self) -> None:
        self._taken = self._events.popleft() if self._events else 0

    def release_all(self) -> None:
        held = self.frame + self._taken + sum(self._events)
        self.frame = self._taken = 0
        self._events.clear()
        self.pool.forget(self.owner)
        self.pool.release(self.owner, held)


def receive_pool(loop: asyncio.AbstractEventLoop) -> ReceivePool:
    """The receive pool of ``loop``: one per event loop, so one per peer process."""
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = ReceivePool(loop)
    return pool


def release_memory() -> bool:
    """Ask the C allocator to return freed memory to the system (glibc's malloc_trim; elsewhere a
    no-op). Frame buffers are freed when their connection ends; without this, glibc keeps much of
    what a load freed, and RSS stays at its peak."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
