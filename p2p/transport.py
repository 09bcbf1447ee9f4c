"""The asyncio driver of one protocol Connection: a thin layer of I/O, flow control and timeouts.

Rules:
- One ``asyncio.Protocol`` per TCP connection feeds bytes to the sans-IO ``Connection`` and
  queues its events for one reader (``recv``, from an ``Inbox``). Above ``HIGH_WATER_EVENTS``
  queued events reading pauses; below ``LOW_WATER_EVENTS`` it resumes.
- One writer task per connection takes frames from two queues (``SendQueue``, flow.py), control
  (stream 0) first, then bulk (chunked streams), so a transfer never delays a heartbeat by more
  than one frame. Each frame is sealed as it is taken and written whole; a writer that cannot
  finish a frame (its task is cancelled, the link dies) marks the connection broken and closes
  it: a half-written sealed stream cannot be resynchronized.
- Writers wait for drain when the transport buffer is above its high-water mark or the bulk
  queue is long; all of them share one drain waiter (aiohttp's ``_drain_helper``), and
  ``connection_lost`` wakes every waiter with ``ConnectionError``.
- Why a connection closed is typed (``CloseCause``); nothing parses the reason text.
- Every phase has a named timeout (``Timeouts``); a timeout never swallows an outer cancel.
- A ``LinkShaper`` (optional) delays each frame as a WAN link would (see link.py); a ``ShapedLink``
  (flow.py) writes the frames at their arrival times.
- Pings are answered by the driver as they are parsed (``auto_pong``): liveness does not wait
  for the application's reader.
- A connection that used no large frame buffer for ``SHED_IDLE_S`` (and one that ended) sheds the
  protocol's pools (``Connection.shed``): what idle connections hold between them is bounded by
  the thread's spare list, whatever their number. What that frees is given back to the system by
  ``Trimmer``, in a thread of its own, never on the event loop. Once nothing was shed and no pool
  took a spare for QUIET_S, the spares go back too and a trim runs, QUIET_TRIMS times QUIET_S apart
  (what messages hold is freed later than their connections): after a burst the process keeps
  neither its buffers nor the heap they grew.
- A message's buffers (tensor segments, chunk data) are read when the writer takes it: sealed
  into a pool buffer, or, unsealed, copied. ``release_queued`` copies the given messages still
  queued, so that a sender may reuse their buffers once it returns (the averaging rounds reuse
  theirs round after round).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import collections
import concurrent.futures
import ctypes
import enum
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from blocktrain.protocol import (NEED_DATA, Connection, ConnectionClosed, ErrorCode, Goodbye, HandshakeComplete,
                                 Message, Ping, Pong, ProtocolError, Role)
from blocktrain.protocol.frames import ReusableBuffer

from .flow import SendQueue, ShapedLink
from .link import LinkShaper, LinkSpec

log = logging.getLogger("blocktrain.p2p")

# Events (messages) a connection may hold unread before it stops reading from the socket.
HIGH_WATER_EVENTS = 256
LOW_WATER_EVENTS = 64
# Transport write buffer limits (bytes): above high, writers wait for drain.
WRITE_HIGH_WATER_BYTES = 4 * 1024 * 1024
WRITE_LOW_WATER_BYTES = 1024 * 1024
# Frames smaller than this are joined into one buffer before writing: one syscall, one segment.
SMALL_FRAME_BYTES = 64 * 1024


class CloseCause(str, enum.Enum):
    GOODBYE = "goodbye"  # the peer said Goodbye: it is leaving
    DUPLICATE = "duplicate"  # one of two connections between the same pair was closed (either side)
    PEER_ERROR = "peer error"  # the peer sent an Error frame or broke the protocol
    LOST = "lost"  # the socket closed or failed without a Goodbye
    LOCAL = "local"  # we closed it
    TIMEOUT = "timeout"  # a phase timed out (handshake, idle)
    REFUSED = "refused"  # we refused it (overload, not allowed)


# The Goodbye reason that means "this connection is redundant; the peer stays" (the pair keeps
# the other connection). Compared for equality, never searched for.
DUPLICATE_REASON = "duplicate connection"


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0  # TCP connect
    handshake_s: float = 10.0  # from TCP connect to ESTABLISHED
    heartbeat_s: float = 1.0  # Ping interval on an idle connection
    dead_after_s: float = 6.0  # no frame from a peer for this long: declared dead
    close_s: float = 2.0  # Goodbye flush before the socket closes
    client_idle_s: float = 300.0  # a client (not a member) silent this long is closed


# A connection that took no large frame buffer (sealing, opening, assembling) for this long sheds
# them: back to back frames of a transfer or an averaging round (sub-second gaps) keep theirs;
# a connection then idle costs a page-faulted buffer (about 2 ms per 4 MiB) when it next needs one.
SHED_IDLE_S = 1.0
# glibc keeps most of the multi-MiB buffers freed in its heap (its mmap threshold rises to the
# largest freed), so RSS would stay at a flood's peak; malloc_trim gives it back. Asked TRIM_DELAY_S
# after this much was dropped (a message still viewed is freed once its reader is done with it),
# at most every TRIM_EVERY_S, in a thread: it holds the heap's lock while it walks it, which must
# never hold up the event loop's heartbeats. Less than TRIM_AFTER_BYTES may stay untrimmed.
TRIM_AFTER_BYTES = 32 * 1024 * 1024
TRIM_DELAY_S = 1.0
TRIM_EVERY_S = 5.0
# Quiet this long after the last shed (and no spare taken meanwhile): the thread's spare buffers go
# back to the allocator and a trim runs whatever was dropped (also what other paths of the burst
# freed: decrypted payloads, decoded parts). A connection in steady use sheds nothing and takes its
# own pool's buffers, so this never runs between a block's rounds.
QUIET_S = 10.0
# Trims after a burst's quiet one, QUIET_S apart while it stays quiet: what the burst's messages
# hold is freed with the last reader done with them (an averaging part kept for a later round, a
# message the cycle collector frees), later than the connections that brought it.
QUIET_TRIMS = 3


class Trimmer:
    """Gives freed memory back to the system (glibc's ``malloc_trim``; elsewhere nothing), off the
    event loop, rate-limited; ``seconds`` keeps how long the last trims took."""

    def __init__(self) -> None:
        self.dropped = 0  # bytes dropped since the last trim
        self.last = float("-inf")
        self.seconds: collections.deque = collections.deque(maxlen=16)
        self._running: concurrent.futures.Future | None = None
        self._due: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
        self._quiet: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
        self._quiet_trims = 0  # quiet trims left after the last shed (QUIET_TRIMS)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._trim: Callable[[int], int] | None = None
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass

    def dropped_bytes(self, n: int, loop: asyncio.AbstractEventLoop, moved: bool = False) -> None:
        """``n`` bytes of frame buffers were let go of (``moved``: a connection gave up buffers, to
        the spares or the allocator, or ended): trim once enough were, and once all is quiet
        (``_on_quiet``). Only a shed that moved something (re)starts the quiet trims: an idle look
        at a connection whose buffer a reader still holds, every SHED_IDLE_S, neither postpones
        nor restarts them."""
        self.dropped += n
        if n or moved:
            self._quiet_trims = QUIET_TRIMS
            self._arm_quiet(loop)
        if self._trim is None or self.dropped < TRIM_AFTER_BYTES:
            return
        self._schedule(loop)

    def _arm_quiet(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._quiet is not None and not self._quiet[0].is_closed():
            self._quiet[1].cancel()
        self._quiet = (loop, loop.call_later(QUIET_S, self._on_quiet, ReusableBuffer.spares_taken()))

    def _on_quiet(self, taken: int) -> None:
        """QUIET_S since the last shed: spares untouched since then go back, and a trim follows."""
        assert self._quiet is not None  # called by the timer _arm_quiet set
        loop, self._quiet = self._quiet[0], None
        if ReusableBuffer.spares_taken() != taken:
            if ReusableBuffer.spare_bytes():
                self._arm_quiet(loop)
            return
        self.dropped += ReusableBuffer.drop_spares()
        if self._trim is not None:
            self._schedule(loop)  # also what the burst freed outside the frame buffers
        self._quiet_trims -= 1
        if self._quiet_trims > 0:
            self._arm_quiet(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._due is not None and not self._due[0].is_closed():
            return  # one is due already
        delay = max(TRIM_DELAY_S, self.last + TRIM_EVERY_S - time.monotonic())
        self._due = (loop, loop.call_later(delay, self._start))

    def _start(self) -> None:
        assert self._due is not None  # called by the timer dropped_bytes set
        loop, self._due = self._due[0], None
        if self._running is not None and not self._running.done():
            self._due = (loop, loop.call_later(TRIM_DELAY_S, self._start))
            return
        self.dropped, self.last = 0, time.monotonic()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="malloc-trim")
        self._running = self._pool.submit(self._run)

    def _run(self) -> None:
        assert self._trim is not None  # submitted only where glibc has it
        t = time.perf_counter()
        self._trim(0)
        self.seconds.append(time.perf_counter() - t)
        log.info("malloc_trim took %.3f s", self.seconds[-1])


trimmer = Trimmer()


class Shedder:
    """Sheds a Connection's frame buffers (``Connection.shed``) once it took none for SHED_IDLE_S,
    and when it ends; a buffer still viewed (a message its reader keeps) is looked at again later.
    ``arm`` after anything that may have taken one: a timer runs only while there is something to
    shed."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop):
        self.conn, self.loop = conn, loop
        self._timer: asyncio.TimerHandle | None = None
        self._uses = 0  # conn.buffer_uses when last looked at
        self._closed = False

    def arm(self) -> None:
        if self._timer is None and not self._closed and self.conn.buffer_uses != self._uses:
            self._timer = self.loop.call_later(SHED_IDLE_S, self._look)

    def _look(self) -> None:
        self._timer = None
        uses = self.conn.buffer_uses
        if uses == self._uses:
            held = self.conn.buffer_bytes
            dropped = self.conn.shed()
            trimmer.dropped_bytes(dropped, self.loop, moved=self.conn.buffer_bytes < held)
            if not self.conn.buffer_bytes:
                return
        self._uses = uses
        if not self._closed:
            self._timer = self.loop.call_later(SHED_IDLE_S, self._look)

    def close(self) -> None:
        """The connection ended: shed now; what its reader still holds is freed with its last view."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        trimmer.dropped_bytes(self.conn.shed(ended=True), self.loop, moved=True)


# Bytes read at once when no large payload is in progress. One buffer per thread serves every
# connection (get_buffer and buffer_updated are called back to back), so a pending connection
# costs no read buffer of its own.
READ_BUFFER_BYTES = 256 * 1024
_read_buffers = threading.local()


def _shared_read_buffer() -> memoryview:
    buf = getattr(_read_buffers, "view", None)
    if buf is None:
        buf = _read_buffers.view = memoryview(bytearray(READ_BUFFER_BYTES))
    return buf


class Inbox:
    """The events a connection parsed, waiting for its one reader; reading from the transport
    pauses at HIGH_WATER_EVENTS of them and resumes at LOW_WATER_EVENTS, unless held (``hold``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: collections.deque = collections.deque()
        self.paused = False  # reading from the transport is paused
        self.held = False  # and held paused by the application (``hold``)
        self._held_until: float | None = None  # loop time
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self.events)

    def push(self, ev, transport: asyncio.Transport | None) -> None:
        self.events.append(ev)
        if len(self.events) >= HIGH_WATER_EVENTS and not self.paused and transport:
            self.pause(transport)
        self.wake()

    def pop(self, transport: asyncio.Transport | None):
        ev = self.events.popleft()
        if self.paused and len(self.events) <= LOW_WATER_EVENTS and transport:
            self.resume(transport)
        return ev

    def pause(self, transport: asyncio.Transport) -> None:
        self.paused = True
        transport.pause_reading()

    def resume(self, transport: asyncio.Transport) -> None:
        self.paused = False
        if not self.held:
            transport.resume_reading()

    def hold(self, transport: asyncio.Transport | None, seconds: float) -> None:
        """Read nothing from the transport for ``seconds`` (held again meanwhile: to the later end),
        whatever the events waiting: what the peer sends meanwhile waits in its socket's buffers,
        not in ours, and costs us nothing. A serving hop holds a client it refused as busy, for as
        long as the client should wait anyway."""
        if transport is None or transport.is_closing():
            return
        until = self.loop.time() + seconds
        if self._held_until is not None:
            self._held_until = max(self._held_until, until)
            return
        self._held_until, self.held = until, True
        transport.pause_reading()
        self.loop.call_at(until, self._end_hold, transport)

    def read_on(self, transport: asyncio.Transport) -> None:
        """Read again now, held or paused (a closing connection reads on to the peer's end)."""
        if self._held_until is not None:
            self._held_until = self.loop.time()
            self._end_hold(transport)
        if self.paused:
            self.resume(transport)

    def _end_hold(self, transport: asyncio.Transport) -> None:
        if self._held_until is None:  # ended already (unhold)
            return
        if self.loop.time() < self._held_until:  # held again meanwhile
            self.loop.call_at(self._held_until, self._end_hold, transport)
            return
        self._held_until, self.held = None, False
        if not transport.is_closing() and not self.paused:
            transport.resume_reading()

    async def wait(self) -> None:
        """Until an event is pushed or ``wake`` is called (the connection closed)."""
        self._waiter = self.loop.create_future()
        await self._waiter

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def owned_frames(frames: list, sealed: bool) -> list:
    """Frames that view no caller's memory: sealed ones are (the seal wrote them into our pool);
    unsealed views of a message's buffers are copied."""
    return frames if sealed else [bytes(f) if isinstance(f, memoryview) else f for f in frames]


def _bare(exc: BaseException, depth: int = 3) -> BaseException:
    """A copy of ``exc`` without a traceback (its cause too, ``depth`` deep). A connection keeps the
    error it ended with, and raises it to its reader: a traceback kept with it would hold the
    frames it went through, whose ``self`` is the connection, tying the connection, its messages
    and its buffers in a cycle that only Python's full collection frees (after a flood of
    connections that ended in errors, hundreds of MiB for minutes)."""
    try:
        bare = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an error that cannot be copied: kept as it is, its frames dropped
        bare = exc
    bare.__traceback__ = None
    if exc.__cause__ is not None:
        bare.__cause__ = _bare(exc.__cause__, depth - 1) if depth else None
    bare.__context__ = None
    bare.__suppress_context__ = True
    return bare


def _drop_tracebacks(exc: BaseException | None, depth: int = 4) -> None:
    """Let an error that a connection keeps forget the frames it went through (its cause's and
    context's too, ``depth`` deep): they hold the connection (see ``_bare``)."""
    while exc is not None and depth > 0:
        exc.__traceback__ = None
        if exc.__cause__ is not None:
            _drop_tracebacks(exc.__cause__, depth - 1)
        exc, depth = exc.__context__, depth - 1


class PeerConnection(asyncio.BufferedProtocol):
    def __init__(self, conn: Connection, timeouts: Timeouts = Timeouts(), link: LinkSpec | None = None,
                 name: str = ""):
        self.conn = conn
        self.timeouts = timeouts
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.established: asyncio.Future = self.loop.create_future()
        self.closed: asyncio.Future = self.loop.create_future()
        self.inbox = Inbox(self.loop)  # what ``recv`` returns next
        self._sendq = SendQueue(self.loop, self.closed)
        self._writer: asyncio.Task | None = None
        self.shaper = LinkShaper(link) if link is not None and link.shaped else None
        self._shaped: ShapedLink | None = None  # made with the first frame sent through the shaper
        self.last_heard = time.monotonic()
        self.close_reason: str | None = None  # for people: logs and error messages
        self.close_cause: CloseCause | None = None  # for code
        self.peer_addr = self.local_addr = None  # the socket's (host, port, ...): theirs, ours
        self.auto_pong = True  # a Ping is answered by the driver at once and never queued
        self._reading_direct = False
        self._closing: tuple[str, CloseCause] | None = None  # close() began: the reason and cause it closes with
        self._eof_sent = False  # close() lingers: our side of the stream has ended
        self.accounted = False  # its counts were added to the peer's traffic rows (ledger.py) once it ended
        self._shedder = Shedder(conn, self.loop)  # gives up the frame buffers once idle

    # --- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        if self.closed.done():  # refused before the transport existed (overload, shutdown)
            transport.abort()
            return
        self.peer_addr = transport.get_extra_info("peername")
        self.local_addr = transport.get_extra_info("sockname")
        if self.conn.role is Role.RESPONDER and isinstance(self.peer_addr, tuple) and len(self.peer_addr) >= 2:
            self.conn.tell("seen", f"{self.peer_addr[0]}:{self.peer_addr[1]}")  # where the initiator is seen from
        transport.set_write_buffer_limits(WRITE_HIGH_WATER_BYTES, WRITE_LOW_WATER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out now
            except OSError:
                pass
        self._writer = self.loop.create_task(self._write_loop(), name=f"writer {self.name}")
        if self.conn.role is Role.INITIATOR:
            transport.write(self.conn.initiate())

    def get_buffer(self, sizehint):
        view = self.conn.receive_buffer()  # the rest of a large payload: read straight into it
        if view is not None and len(view):
            self._reading_direct = True
            return view
        self._reading_direct = False
        return _shared_read_buffer()

    def buffer_updated(self, nbytes):
        if self._reading_direct:
            self.last_heard = time.monotonic()
            self.conn.received_into(nbytes)
            self._process()
        else:  # the shared buffer is refilled by the next read: keep a copy
            self.data_received(bytes(_shared_read_buffer()[:nbytes]))

    def data_received(self, data):
        self.last_heard = time.monotonic()
        self.conn.receive_data(data)
        self._process()

    def _process(self):
        try:
            while True:
                ev = self.conn.next_event()
                if ev is NEED_DATA:
                    break
                if isinstance(ev, HandshakeComplete):
                    if not self.established.done():
                        self.established.set_result(ev)
                    continue
                if self.auto_pong and type(ev) is Ping:  # answer heartbeats here, not via the reader
                    try:
                        self.send_nowait(Pong(nonce=ev.nonce))
                    except ConnectionError:
                        return
                    continue
                self.inbox.push(ev, self.transport)
                if isinstance(ev, ConnectionClosed):
                    cause = (CloseCause.DUPLICATE if ev.code == 0 and ev.reason == DUPLICATE_REASON
                             else CloseCause.GOODBYE if ev.code == 0 else CloseCause.PEER_ERROR)
                    self._shutdown(f"peer closed: {ev.reason or 'goodbye'} (code {ev.code})", cause=cause)
                    return
        except ProtocolError as e:
            out = self.conn.data_to_send()
            if out and not self.transport.is_closing():
                self.transport.write(out)
            log.info("%s: closing: %s", self.name or self.peer_addr, e)
            self._shutdown(f"protocol error: {e}", e, CloseCause.PEER_ERROR)
            _drop_tracebacks(e)  # the connection keeps it (``conn.error``): its frames hold us
            return
        out = self.conn.data_to_send()  # handshake replies
        if out:
            self.transport.write(out)
        self._shedder.arm()

    def connection_lost(self, exc):
        if self._closing is not None:  # the peer's end while we close (after our Goodbye): our close
            reason, cause = self._closing
            self._shutdown(reason, cause=cause)
            return
        self._shutdown(f"connection lost: {exc or 'EOF'}", ConnectionError(f"connection lost: {exc or 'EOF'}"),
                       CloseCause.LOST)

    def pause_writing(self):
        self._sendq.paused = True

    def resume_writing(self):
        self._sendq.resume()

    # --- events --------------------------------------------------------------------------------
    async def recv(self):
        """The next message; ``ConnectionClosed`` once the peer closes; raises after a failure."""
        while not self.inbox:
            if self.closed.done():
                exc = self.closed.result()
                if isinstance(exc, BaseException):
                    raise _bare(exc)  # a copy: the one kept stays without a traceback (``_bare``)
                return ConnectionClosed(0, self.close_reason or "closed")
            await self.inbox.wait()  # a pushed event and _shutdown end the wait
        return self.inbox.pop(self.transport)

    # --- sending -------------------------------------------------------------------------------
    def send_nowait(self, msg: Message, bulk: bool = False):
        if self.closed.done():
            raise ConnectionError(f"connection to {self.name or self.peer_addr} is closed: {self.close_reason}")
        if (not bulk and self.shaper is None and self._sendq.ready() and self.established.done()
                and self.transport is not None and not self.transport.is_closing()):
            # fast path: nothing queued, so nothing to order against: seal and write now
            try:
                self._write(self.conn.send_buffers(msg))
            except ProtocolError as e:  # e.g. the peer's goodbye closed the session meanwhile
                err = ConnectionError(f"cannot send to {self.name or self.peer_addr}: {e}")
                self._shutdown(f"cannot send: {e}", err)
                raise err from e
            return
        self._sendq.put(msg, bulk)

    async def send(self, msg: Message, bulk: bool = False):
        """Queue ``msg`` and wait until the transport can take more (backpressure)."""
        self.send_nowait(msg, bulk)
        await self.drain()

    async def drain(self):
        """Wait until the transport and the bulk queue can take more (``SendQueue.drain``)."""
        await self._sendq.drain()
        if self.closed.done():
            raise ConnectionError(f"connection to {self.name or self.peer_addr} closed: {self.close_reason}")

    async def _write_loop(self):
        try:
            if self.conn.role is Role.INITIATOR or not self.established.done():
                await asyncio.wait({self.established, self.closed}, return_when=asyncio.FIRST_COMPLETED)
            while not self.closed.done():
                if self._sendq.empty():
                    await self._sendq.wait_for_frames()
                    continue
                if self.shaper is not None:
                    # the link's send buffer is full: the next message waits in its queue meanwhile
                    # (where release_queued finds it)
                    await self._link().room(self.shaper)
                    if self.closed.done() or self._sendq.empty():
                        continue
                msg = self._sendq.pop()
                frames = owned_frames(self.conn.send_buffers(msg), self.conn.sealed_session)  # must go out whole
                if self.shaper is not None:
                    self._link().put(self.shaper, frames)  # frames in flight on the link: they pipeline
                    if isinstance(msg, Goodbye):
                        await self._link().flush()
                elif not self._write(frames):
                    break
                frames = []  # no view of our seal pool is kept while we wait for the next message
                if isinstance(msg, Goodbye):
                    break
        except asyncio.CancelledError:
            if not self.closed.done():  # cancelled with frames possibly half-sent: broken
                self._shutdown("writer cancelled mid-stream", ConnectionError("writer cancelled"))
            raise
        except ProtocolError as e:
            self._shutdown(f"cannot send: {e}", e)

    def _link(self) -> ShapedLink:
        if self._shaped is None:
            self._shaped = ShapedLink(self.loop, self.closed, self._write, self._shutdown, self.name)
        return self._shaped

    def release_queued(self, msgs) -> int:
        """Queued messages among ``msgs`` (compared by identity) are replaced by copies that own
        their bytes: the caller may reuse the buffers they viewed at once. Returns how many."""
        return self._sendq.release(msgs)

    def _write(self, frames: list) -> bool:
        """Write ``frames`` whole; False (nothing written) if the transport is closing."""
        transport = self.transport
        assert transport is not None  # frames are written only once established (after connection_made)
        if transport.is_closing():
            return False
        if len(frames) > 1 and sum(map(len, frames)) < SMALL_FRAME_BYTES:
            transport.write(b"".join(frames))  # one syscall for a small frame
        else:
            transport.writelines(frames)
            self._shedder.arm()
        return True

    # --- closing -------------------------------------------------------------------------------
    def _shutdown(self, reason: str, exc: BaseException | None = None, cause: CloseCause = CloseCause.LOCAL):
        if self.closed.done():
            return
        self.close_reason, self.close_cause = reason, cause
        exc = None if exc is None else _bare(exc)
        self.closed.set_result(exc)
        if not self.established.done():  # its own copy: an awaiter's traceback lands on it, not on closed's
            self.established.set_exception(_bare(exc) if exc is not None else ConnectionError(reason))
            self.established.exception()  # mark retrieved: the caller may have given up waiting
        self.inbox.wake()
        self._sendq.close()
        self._shedder.close()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def close(self, reason: str = "goodbye", cause: CloseCause = CloseCause.LOCAL, linger: bool = True):
        """Say Goodbye (after every queued frame: a stopping member's last parts of a round go out
        before it, averaging/driver.py), ``close_s`` for it to leave; then (``linger``) end our side
        of the stream and read to the peer's end, ``close_s`` more at most; then close. A socket
        closed with unread bytes in it sends a reset, and the reset discards what the sender has
        not sent yet: our Goodbye, queued behind a full window while the peer was busy, or
        stopping too and still sending to us (a swarm stopped at once: a member saw another's
        connection lost, not its Goodbye, 1 run in 12). A client that read its replies has
        nothing unread: it need not linger (a status query would wait a round trip more).
        A close begun already is waited for (its reason and cause stand); a close cancelled while
        it waits still closes the connection."""
        if self.closed.done():
            return
        if self._closing is not None:
            await asyncio.shield(self.closed)
            return
        self._closing = (f"closed by us: {reason}", cause)
        try:
            if self.established.done() and not self.established.exception():
                try:
                    self.send_nowait(Goodbye(reason=reason), bulk=True)
                    if self._writer is not None:
                        async with asyncio.timeout(self.timeouts.close_s):
                            await asyncio.shield(self._writer)
                    if linger:
                        async with asyncio.timeout(self.timeouts.close_s):
                            await self._linger()
                except (ConnectionError, ProtocolError, TimeoutError):
                    pass
        finally:  # cancelled too: the socket is closed, not left open with our side ended
            self._shutdown(f"closed by us: {reason}", cause=cause)
        await self.wait_closed()

    async def _linger(self):
        """After our Goodbye: end our side (FIN once the buffered frames are out) and read on,
        dropping what comes (the session is closed), until the peer ends its side."""
        transport = self.transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            return
        self._eof_sent = True
        try:
            transport.write_eof()  # a shaped link's frames are out: the writer flushed them before it ended
        except OSError:  # the peer's reset came first: nothing left to read
            return
        self.inbox.read_on(transport)  # to the peer's end, whatever was held or paused
        await asyncio.shield(self.closed)

    async def wait_closed(self):
        for task in (self._writer, self._shaped.task if self._shaped is not None else None):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    def abort_with(self, code: ErrorCode, reason: str, cause: CloseCause):
        """Tell the peer why (an Error frame: plain before the handshake, sealed after; not after our
        Goodbye; not past frames in flight on a shaped link, which a real one sends first), close."""
        if self.transport is not None and not self.transport.is_closing() and not self._eof_sent and \
                not (self._shaped and self._shaped.busy):
            with contextlib.suppress(ProtocolError):
                self.transport.write(self.conn.close_frame(code, reason))
        self.abort(reason, cause)

    def abort_timeout(self, reason: str):
        """Close a connection whose phase timed out, with ERROR TIMEOUT."""
        self.abort_with(ErrorCode.TIMEOUT, reason, CloseCause.TIMEOUT)

    def abort(self, reason: str, cause: CloseCause = CloseCause.LOCAL):
        self._shutdown(reason, ConnectionError(reason), cause)
        if self.transport is not None:
            self.transport.abort()


def unsent_bytes(pc: PeerConnection) -> int:
    """Bytes in the transport's buffer not yet taken by the socket, plus 1 per queued message
    (a lower bound: what the peer has not read of ours and we still hold)."""
    t = pc.transport
    if t is None:  # not connected, or no longer: nothing of ours waits for the peer to read it
        return 0
    return t.get_write_buffer_size() + pc._sendq.queued()


async def flushed(pc: PeerConnection) -> None:
    """Until every frame queued so far has left our buffers for the socket (or the connection
    closed): the transport's limits drop to zero meanwhile, so its resume says when."""
    t = pc.transport
    if t is None or pc.closed.done():
        return
    t.set_write_buffer_limits(1, 0)  # pause_writing now if anything is buffered; resume at empty
    try:
        await pc._sendq.emptied()  # the writer wrote each one as it took it
        await pc.drain()  # paused until the transport's buffer is empty
    finally:
        if not t.is_closing():
            t.set_write_buffer_limits(WRITE_HIGH_WATER_BYTES, WRITE_LOW_WATER_BYTES)
    if pc.closed.done():
        raise ConnectionError(f"connection to {pc.name or pc.peer_addr} closed: {pc.close_reason}")


def make_connection(role: Role, identity, swarm_key: bytes, *, allowlist=None, info: dict | None = None,
                    seal: bool = True) -> Connection:
    """The one place p2p makes a protocol Connection: the application's traffic classifier goes in."""
    from .traffic import kind_of
    return Connection(role, identity, swarm_key, allowlist=allowlist, info=info, seal=seal, kind_of=kind_of)


CLIENT_INFO = {"addr": "", "blocks": [], "role": "client"}


async def open_connection(host: str, port: int, conn: Connection, timeouts: Timeouts = Timeouts(),
                          link: LinkSpec | None = None, name: str = "", bind: str | None = None) -> PeerConnection:
    """Connect (from local address ``bind`` where given), run the handshake, return an
    ESTABLISHED PeerConnection (or raise)."""
    loop = asyncio.get_running_loop()
    local = (bind, 0) if bind else None
    try:
        async with asyncio.timeout(timeouts.connect_s):
            _, pc = await loop.create_connection(lambda: PeerConnection(conn, timeouts, link, name), host, port,
                                                 local_addr=local)
    except TimeoutError:
        raise ConnectionError(f"connect to {host}:{port} timed out after {timeouts.connect_s}s") from None
    try:
        async with asyncio.timeout(timeouts.handshake_s):
            await asyncio.shield(pc.established)
    except TimeoutError:
        pc.abort("handshake timed out", CloseCause.TIMEOUT)
        await pc.wait_closed()
        raise ConnectionError(f"handshake with {host}:{port} timed out after {timeouts.handshake_s}s") from None
    except ProtocolError as e:
        _drop_tracebacks(e)  # ``established`` holds it: its frames (this one's pc) would tie a cycle
        await pc.wait_closed()
        raise ConnectionError(f"handshake with {host}:{port} failed: {e}") from e
    except BaseException as e:
        await pc.wait_closed()
        if isinstance(e, Exception):  # as above; raised on as a copy
            _drop_tracebacks(e)
            raise _bare(e) from None
        raise
    return pc


def install_uvloop() -> bool:
    """Use uvloop where it is installed; say so once where it is not."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: using the default asyncio loop (slower)")
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
