"""Checkpoint streaming between peers: serve files from a directory, fetch them resumably.

Rules:
- A peer with a ``CheckpointServer`` answers STREAM_REQUEST(kind, name, offset) with the file
  ``DIR/kind/name.safetensors`` as a chunked stream from ``offset``, on the asker's stream id,
  queued as bulk frames (heartbeats go first) with backpressure. Names are
  ``[A-Za-z0-9_.-]{1,128}``: nothing outside DIR is ever read. A name ``sha-<64 hex>`` asks for
  the file of that kind whose sha256 is that (content addressing: resume from any holder of the
  same bytes).
- The server reads a file chunk by chunk from one open descriptor (a file replaced meanwhile is
  not mixed in) and never holds more than a chunk of it; a file's sha256 is computed once per
  version (inode, size, mtime) and cached. At most MAX_STREAMS_PER_PEER streams per asker run at
  once, and MAX_STREAMS in all (identities are free); more are refused ("busy"), never queued. A
  stream keeps its place until its last byte has left our buffers for the socket, not merely been
  queued (an asker that reads nothing would otherwise make us hold every stream it asks for, one
  after the other); one whose asker takes nothing for STREAM_STALL_S has its connection closed,
  which frees what was queued for it. A refusal is sent only while the asker has read what we
  sent it before (REFUSAL_BACKLOG_BYTES): else the request is dropped unanswered.
- ``fetch`` asks the holders in turn; a holder that dies or stalls (no chunk for
  ``chunk_timeout_s``) is left for the next one, which continues from the bytes already received
  when it holds the same bytes (asked by their sha256), else starts over. The result is verified
  by sha256 before it is returned; a corrupt stream is discarded whole.
- ``probe`` asks from near the end of the copy we hold: the answer's STREAM_OPEN gives the holder's
  size and sha256, so checking whether a checkpoint changed costs a few hundred bytes of traffic
  and, on the holder, a stat and a cached hash.
- A peer without a server refuses every STREAM_REQUEST at once ("not served here").
- A stream that fails on the receiving side (gap, size, sha256) is answered with STREAM_RESET,
  and the sender stops sending it; a sender that resets a stream is left for the next holder.
- Bytes are counted by kind (the stream's ``kind``) beside the connections' own counters.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import re
import threading
from pathlib import Path

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.checkpoint import SUFFIX
from blocktrain.protocol import (ErrorCode, ProtocolError, StreamChunk, StreamEnd, StreamOpen, StreamReceiver,
                                 StreamRequest, StreamReset)
from blocktrain.protocol.streams import StreamFailed
from blocktrain.protocol.streams import CHUNK_SIZE_BYTES

from .services import PeerServices
from .transport import CloseCause, flushed, unsent_bytes

log = logging.getLogger("blocktrain.p2p")

CHECKPOINT = "checkpoint"  # a block's full checkpoint: parameters, optimizer state, step
LOWER = "lower-checkpoint"  # a block's parameters only: the input handoff to the blocks above
PROBE_TAIL = 1024
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
SHA_PREFIX = "sha-"
# Streams one asker may have running at once: a fetch, a probe and a lower block or two.
MAX_STREAMS_PER_PEER = 4
# Streams served at once, to everyone (identities are free: a per-asker bound alone lets many
# identities hold a chunk and a queue each). Each running stream holds about one chunk read ahead
# and its connection's bulk queue: 8 of them, a few MiB at most.
MAX_STREAMS = 8
# The chunks we send (the protocol takes up to 16 MiB): a frame occupies a link whole, so a
# heartbeat behind one waits its whole time on the wire. 32 KiB leaves a 0.1 Mbit/s home uplink in
# 2.6 s, inside a member's liveness timeout (6 s) and far inside STREAM_STALL_S; 4 MiB took 335 s
# there (34 s at 1 Mbit/s: every stream then stalled and every heartbeat behind it was late).
SEND_CHUNK_BYTES = 32 * 1024
# A stream whose asker takes nothing of it for this long (no chunk leaves our buffers) is given up
# and its connection closed: the fetchers' own chunk timeout (CheckpointFetcher.chunk_timeout_s).
STREAM_STALL_S = 30.0
# Unsent bytes on an asker's connection past which a refusal is not queued (the request is
# dropped): one that reads nothing must not make us queue an answer to each of its requests.
REFUSAL_BACKLOG_BYTES = 16 * 1024
# File versions whose sha256 is remembered.
MAX_HASHED_FILES = 256


class FetchError(Exception):
    """No holder could deliver the payload."""


def _sha256_of(f) -> bytes:
    h = hashlib.sha256()
    f.seek(0)
    for blk in iter(lambda: f.read(CHUNK_SIZE_BYTES), b""):
        h.update(blk)
    return h.digest()


class CheckpointServer:
    def __init__(self, peer: PeerServices, directory: str | Path):
        self.peer, self.dir = peer, Path(directory)
        self.sent_by_kind: dict[str, int] = {}
        self._hashes: dict[tuple, bytes] = {}  # (inode, size, mtime_ns) -> sha256
        self._hashes_lock = threading.Lock()
        self._active: dict[str, int] = {}  # asker -> streams running
        self._serving: set[tuple] = set()  # (asker, stream id) of the streams we send now (MAX_STREAMS at most)
        self._reset: set[tuple] = set()  # of them, those the asker reset: stop sending
        peer.on(StreamRequest, self.handle)
        peer.on(StreamReset, self._on_reset, inline=True)

    def _on_reset(self, msg: StreamReset, pc, pid):
        """A reset of a stream we send stops it; any other (a stray, or a flood of them) is ignored,
        so what is kept is bounded by the streams we send."""
        if (pid, msg.stream_id) in self._serving:
            self._reset.add((pid, msg.stream_id))

    def path(self, kind: str, name: str) -> Path | None:
        if not (NAME_RE.match(kind) and NAME_RE.match(name)) or name in (".", "..") or kind in (".", ".."):
            return None
        if name.startswith(SHA_PREFIX):
            return self._by_sha(kind, name[len(SHA_PREFIX):])
        return self.dir / kind / f"{name}{SUFFIX}"

    def _by_sha(self, kind: str, hexdigest: str) -> Path | None:
        folder = self.dir / kind
        for p in sorted(folder.glob("*" + SUFFIX)) if folder.is_dir() else []:
            try:
                with open(p, "rb") as f:
                    if self.sha256(f).hex() == hexdigest:
                        return p
            except OSError:
                continue
        return None

    def publish(self, kind: str, name: str, c) -> Path:
        """Write checkpoint ``c`` where it is served as (kind, name), and remember the sha256 of the
        bytes written: a stream's STREAM_OPEN (a probe's whole answer) then costs no read of the
        file, whatever its size."""
        path = self.path(kind, name)
        if path is None:
            raise ValueError(f"bad checkpoint name {kind}/{name}")
        blob = ckpt.encode(c)
        ckpt.write_atomic(path, blob)
        self._remember(os.stat(path), hashlib.sha256(blob).digest())
        return path

    def _remember(self, st, digest: bytes) -> bytes:
        with self._hashes_lock:  # publish and sha256 run in worker threads as well as in the loop
            if len(self._hashes) >= MAX_HASHED_FILES:
                self._hashes.pop(next(iter(self._hashes)))
            self._hashes[(st.st_ino, st.st_size, st.st_mtime_ns)] = digest
        return digest

    def sha256(self, f) -> bytes:
        """The sha256 of open file ``f``: remembered by (inode, size, mtime), else read and hashed."""
        st = os.fstat(f.fileno())
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        digest = self._hashes.get(key)
        return digest if digest is not None else self._remember(st, _sha256_of(f))

    async def handle(self, req: StreamRequest, pc, pid):
        if self._active.get(pid, 0) >= MAX_STREAMS_PER_PEER:
            await refuse(req, pc, "busy: too many streams from this peer at once")
            return
        if sum(self._active.values()) >= MAX_STREAMS:
            await refuse(req, pc, f"busy: serving {MAX_STREAMS} streams already; ask another holder or later")
            return
        if (pid, req.stream_id) in self._serving:
            await refuse(req, pc, "stream id in use: one stream per id")
            return
        self._active[pid] = self._active.get(pid, 0) + 1
        self._reset.discard((pid, req.stream_id))
        self._serving.add((pid, req.stream_id))
        try:
            await self._serve(req, pc, pid)
        finally:
            self._serving.discard((pid, req.stream_id))
            self._reset.discard((pid, req.stream_id))
            self._active[pid] -= 1
            if not self._active[pid]:
                del self._active[pid]

    async def _serve(self, req: StreamRequest, pc, pid):
        path = self.path(req.kind, req.name)
        try:
            f = open(path, "rb") if path is not None else None
        except OSError:
            f = None
        if f is None:
            await refuse(req, pc, "bad name" if path is None and not req.name.startswith(SHA_PREFIX) else "not found")
            return
        try:
            with f:
                digest = await asyncio.to_thread(self.sha256, f)
                size = os.fstat(f.fileno()).st_size
                if req.offset > size:
                    await refuse(req, pc, "offset past the end")
                    return
                await _send(pc, StreamOpen(kind=req.kind, name=req.name, total_size=size, sha256=digest,
                                           offset=req.offset, stream_id=req.stream_id))
                f.seek(req.offset)
                off = req.offset
                while off < size:
                    if (pid, req.stream_id) in self._reset:
                        log.info("stream %s/%s: %s reset it; stopped", req.kind, req.name, pid[:12])
                        return
                    data = f.read(min(SEND_CHUNK_BYTES, size - off))
                    if not data:
                        raise OSError(f"{path} shrank while being sent")
                    await _send(pc, StreamChunk(offset=off, data=data, stream_id=req.stream_id))
                    off += len(data)
                    self.sent_by_kind[req.kind] = self.sent_by_kind.get(req.kind, 0) + len(data)
                await _send(pc, StreamEnd(stream_id=req.stream_id))
                async with asyncio.timeout(STREAM_STALL_S):
                    await flushed(pc)  # our place is kept until the stream has left our buffers
        except TimeoutError:
            log.info("stream %s/%s to %s: nothing taken for %.0f s; closing", req.kind, req.name, pid[:12],
                     STREAM_STALL_S)
            pc.abort_with(ErrorCode.TIMEOUT, "stream not read", CloseCause.TIMEOUT)
        except (ConnectionError, ProtocolError, OSError) as e:
            log.info("stream %s/%s to %s stopped: %s", req.kind, req.name, pid[:12], e)


async def _send(pc, msg) -> None:
    """Queue a frame of a stream we serve; TimeoutError if the asker takes nothing for STREAM_STALL_S."""
    async with asyncio.timeout(STREAM_STALL_S):
        await pc.send(msg, bulk=True)


async def refuse(req: StreamRequest, pc, why: str):
    """Answer a STREAM_REQUEST we will not serve: STREAM_OPEN with meta {"error"}, then STREAM_END;
    nothing to an asker that left REFUSAL_BACKLOG_BYTES of ours unread."""
    if unsent_bytes(pc) > REFUSAL_BACKLOG_BYTES:
        return
    try:
        pc.send_nowait(StreamOpen(kind=req.kind, name=req.name, total_size=0, sha256=bytes(32), offset=0,
                                  meta={"error": why}, stream_id=req.stream_id), bulk=True)
        pc.send_nowait(StreamEnd(stream_id=req.stream_id), bulk=True)
    except (ConnectionError, ProtocolError):
        pass


def refuse_streams(peer: PeerServices):
    """For a peer that serves no checkpoints: every request gets an immediate refusal."""
    async def handler(req, pc, pid):
        await refuse(req, pc, "not served here")
    peer.on(StreamRequest, handler)


class CheckpointFetcher:
    """Receives the streams it asked for; one instance per peer."""

    def __init__(self, peer: PeerServices, chunk_timeout_s: float = 30.0):
        self.peer = peer
        self.chunk_timeout_s = chunk_timeout_s
        self._ids = itertools.count(1 << 20)
        self._inbox: dict[int, tuple] = {}  # stream id -> (the connection asked, its queue)
        self.received_by_kind: dict[str, int] = {}
        for t in (StreamOpen, StreamChunk, StreamEnd, StreamReset):
            peer.on(t, self._route, inline=True)

    def _route(self, msg, pc, pid):
        """A stream message reaches the fetch that asked for it only from the connection the
        request went on: stream ids are predictable, and another key holder must not end or
        feed someone else's fetch."""
        entry = self._inbox.get(msg.stream_id)
        if entry is not None and entry[0] is pc:
            entry[1].put_nowait(msg)

    async def _next(self, q: asyncio.Queue, pc):
        """The next message of a stream; ConnectionError as soon as its connection closes (a holder
        killed mid-stream is left at once, not after the chunk timeout)."""
        if not q.empty():
            return q.get_nowait()
        get = asyncio.ensure_future(q.get())
        try:
            await asyncio.wait({get, pc.closed}, timeout=self.chunk_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():  # a message that came with the close is still read
            return get.result()
        if pc.closed.done():
            raise ConnectionError(f"connection closed mid-stream: {pc.close_reason}")
        raise asyncio.TimeoutError

    async def probe(self, holder: str, kind: str, name: str, size: int) -> tuple[int, bytes] | None:
        """(total_size, sha256) of what ``holder`` holds now, or None if it holds nothing. Asks from
        PROBE_TAIL bytes before the end of our copy (``size``)."""
        sid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        try:
            pc = await self.peer.connection(holder)
            self._inbox[sid] = (pc, q)
            pc.send_nowait(StreamRequest(kind=kind, name=name, offset=max(0, size - PROBE_TAIL), stream_id=sid))
            opened = None
            while True:  # the answer: OPEN, (chunks), END
                m = await self._next(q, pc)
                if isinstance(m, StreamOpen):
                    opened = None if "error" in m.meta else (m.total_size, m.sha256)
                elif isinstance(m, StreamEnd):
                    return opened
        except (asyncio.TimeoutError, ConnectionError, ProtocolError) as e:
            log.info("probe %s/%s at %s failed: %s", kind, name, holder, e)
            return None
        finally:
            self._inbox.pop(sid, None)

    async def fetch(self, holders: list[str], kind: str, name: str, source: list | None = None) -> bytes:
        """The payload (kind, name) from the first of ``holders`` able to finish it, sha256-verified.
        After a holder fails, the next one is asked for the same bytes (by sha256) from where the
        transfer stopped; if it holds other bytes, the transfer starts over with its version.
        ``source``: the holder whose version (sha256) was delivered is appended to it (the one to
        blame if the bytes are not what they should be)."""
        rx = StreamReceiver()
        errors = []
        opener = None
        for holder in holders:
            try:
                if rx.open is not None and rx.resume_offset:
                    try:
                        out = await self._fetch_one(holder, kind, SHA_PREFIX + rx.open.sha256.hex(), rx)
                        if source is not None:
                            source.append(opener)
                        return out
                    except FetchError:  # it holds other bytes: its own version, from the start
                        rx = StreamReceiver()
                opener = holder
                out = await self._fetch_one(holder, kind, name, rx)
                if source is not None:
                    source.append(holder)
                return out
            except (FetchError, asyncio.TimeoutError, ConnectionError, ProtocolError) as e:
                why = "stalled" if isinstance(e, asyncio.TimeoutError) else str(e)
                errors.append(f"{holder}: {why} (have {rx.resume_offset} bytes)")
                log.info("fetch %s/%s from %s failed: %s; trying the next holder", kind, name, holder, why)
        raise FetchError(f"no peer delivered {kind}/{name}: " + "; ".join(errors))

    async def _fetch_one(self, holder: str, kind: str, name: str, rx: StreamReceiver) -> bytes:
        sid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        try:
            pc = await self.peer.connection(holder)
            self._inbox[sid] = (pc, q)
            pc.send_nowait(StreamRequest(kind=kind, name=name, offset=rx.resume_offset, stream_id=sid))
            while True:
                m = await self._next(q, pc)
                try:
                    if isinstance(m, StreamOpen):
                        if "error" in m.meta:
                            raise FetchError(str(m.meta["error"])[:200])
                        rx.on_open(_renamed(m, rx))
                    elif isinstance(m, StreamChunk):
                        rx.on_chunk(m)
                        self.received_by_kind[kind] = self.received_by_kind.get(kind, 0) + len(m.data)
                    elif isinstance(m, StreamReset):
                        rx.on_reset(m)
                    else:
                        return rx.on_end(m)
                except StreamFailed as e:
                    if not e.by_peer:  # tell the holder to stop: this stream is useless to us
                        try:
                            pc.send_nowait(StreamReset(code=int(e.code), reason=str(e)[:200], stream_id=sid))
                        except (ConnectionError, ProtocolError):
                            pass
                    raise
        finally:
            self._inbox.pop(sid, None)


def _renamed(m: StreamOpen, rx: StreamReceiver) -> StreamOpen:
    """A content-addressed answer continues the payload ``rx`` holds (same sha256, other name)."""
    if rx.open is not None and m.sha256 == rx.open.sha256 and m.name != rx.open.name:
        return StreamOpen(kind=m.kind, name=rx.open.name, total_size=m.total_size, sha256=m.sha256, offset=m.offset,
                          meta=m.meta, stream_id=m.stream_id)
    return m
