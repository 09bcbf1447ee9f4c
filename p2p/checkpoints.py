"""Checkpoint streaming between peers: serve files from a directory, fetch them resumably.

Rules:
- A peer with a ``CheckpointServer`` answers STREAM_REQUEST(kind, name, offset) with the file
  ``DIR/kind/name.safetensors`` as a chunked stream from ``offset``, on the asker's stream id,
  queued as bulk frames (heartbeats go first) with backpressure. Names are
  ``[A-Za-z0-9_.-]{1,128}``: nothing outside DIR is ever read.
- ``fetch`` asks the members holding a payload in turn; a member that dies or stalls (no chunk
  for ``chunk_timeout_s``) is left for the next one, which continues from the bytes already
  received (STREAM_REQUEST with that offset). The result is verified by sha256 before it is
  returned; a corrupt stream is discarded whole.
- ``probe`` asks from near the end of the copy we hold: the answer's STREAM_OPEN gives the holder's
  size and sha256, so checking whether a checkpoint changed costs a few hundred bytes.
- Bytes are counted by kind (the stream's ``kind``: checkpoint, lower-checkpoint, ...) beside
  the per-type counters of the connections.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from pathlib import Path

from blocktrain.protocol import (ProtocolError, StreamChunk, StreamEnd, StreamOpen, StreamReceiver, StreamRequest,
                                 stream_messages)

log = logging.getLogger("blocktrain.p2p")

PROBE_TAIL = 1024
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class FetchError(Exception):
    """No member could deliver the payload."""


async def _next(q: asyncio.Queue, pc, timeout_s: float):
    """The next message of a stream; ConnectionError as soon as its connection closes (a holder
    killed mid-stream is left at once, not after the chunk timeout)."""
    if not q.empty():
        return q.get_nowait()
    get = asyncio.ensure_future(q.get())
    try:
        await asyncio.wait({get, pc.closed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():  # a message that came with the close is still read
        return get.result()
    if pc.closed.done():
        raise ConnectionError(f"connection closed mid-stream: {pc.close_reason}")
    raise asyncio.TimeoutError


class CheckpointServer:
    def __init__(self, peer, directory: str | Path):
        self.peer, self.dir = peer, Path(directory)
        self.sent_by_kind: dict[str, int] = {}
        peer.on(StreamRequest, self.handle)

    def path(self, kind: str, name: str) -> Path | None:
        if not (NAME_RE.match(kind) and NAME_RE.match(name)) or name in (".", "..") or kind in (".", ".."):
            return None
        return self.dir / kind / f"{name}.safetensors"

    async def handle(self, req: StreamRequest, pc, pid):
        path = self.path(req.kind, req.name)
        try:
            data = path.read_bytes() if path is not None else None
        except OSError:
            data = None
        try:
            if data is None or req.offset > len(data):
                why = "bad name" if path is None else ("not found" if data is None else "offset past the end")
                pc.send_nowait(StreamOpen(kind=req.kind, name=req.name, total_size=0, sha256=bytes(32), offset=0,
                                          meta={"error": why}, stream_id=req.stream_id), bulk=True)
                pc.send_nowait(StreamEnd(stream_id=req.stream_id), bulk=True)
                return
            for m in stream_messages(req.stream_id, req.kind, req.name, data, offset=req.offset):
                await pc.send(m, bulk=True)
                if isinstance(m, StreamChunk):
                    self.sent_by_kind[req.kind] = self.sent_by_kind.get(req.kind, 0) + len(m.data)
        except (ConnectionError, ProtocolError) as e:
            log.info("stream %s/%s to %s stopped: %s", req.kind, req.name, pid[:12], e)


class CheckpointFetcher:
    """Receives the streams it asked for; one instance per peer."""

    def __init__(self, peer, chunk_timeout_s: float = 30.0):
        self.peer = peer
        self.chunk_timeout_s = chunk_timeout_s
        self._ids = itertools.count(1 << 20)
        self._inbox: dict[int, asyncio.Queue] = {}
        self.received_by_kind: dict[str, int] = {}
        for t in (StreamOpen, StreamChunk, StreamEnd):
            peer.on(t, self._route, inline=True)

    def _route(self, msg, pc, pid):
        q = self._inbox.get(msg.stream_id)
        if q is not None:
            q.put_nowait(msg)

    async def probe(self, addr: str, kind: str, name: str, size: int) -> tuple[int, bytes] | None:
        """(total_size, sha256) of what ``addr`` holds now, or None if it holds nothing. Asks from
        PROBE_TAIL bytes before the end of our copy (``size``): a checkpoint's size varies by a few
        header bytes between versions, and an unchanged one moves only that tail."""
        sid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._inbox[sid] = q
        try:
            pc = await self.peer.connection_to(addr)
            pc.send_nowait(StreamRequest(kind=kind, name=name, offset=max(0, size - PROBE_TAIL), stream_id=sid))
            opened = None
            while True:  # the answer: OPEN, (chunks if it grew), END
                m = await _next(q, pc, self.chunk_timeout_s)
                if isinstance(m, StreamOpen):
                    opened = None if "error" in m.meta else (m.total_size, m.sha256)
                elif isinstance(m, StreamEnd):
                    return opened
        except (asyncio.TimeoutError, ConnectionError, ProtocolError) as e:
            log.info("probe %s/%s at %s failed: %s", kind, name, addr, e)
            return None
        finally:
            del self._inbox[sid]

    async def fetch(self, addrs: list[str], kind: str, name: str, receiver: StreamReceiver | None = None) -> bytes:
        """The payload (kind, name) from the first of ``addrs`` able to finish it, sha256-verified."""
        rx = receiver or StreamReceiver()
        errors = []
        for addr in addrs:
            sid = next(self._ids)
            q: asyncio.Queue = asyncio.Queue()
            self._inbox[sid] = q
            try:
                pc = await self.peer.connection_to(addr)
                pc.send_nowait(StreamRequest(kind=kind, name=name, offset=rx.resume_offset, stream_id=sid))
                while True:
                    m = await _next(q, pc, self.chunk_timeout_s)
                    if isinstance(m, StreamOpen):
                        if "error" in m.meta:
                            raise FetchError(f"{addr}: {m.meta['error']}")
                        rx.on_open(m)
                    elif isinstance(m, StreamChunk):
                        rx.on_chunk(m)
                        self.received_by_kind[kind] = self.received_by_kind.get(kind, 0) + len(m.data)
                    else:
                        return rx.on_end(m)
            except (asyncio.TimeoutError, ConnectionError, FetchError, ProtocolError) as e:
                why = "stalled" if isinstance(e, asyncio.TimeoutError) else str(e)
                errors.append(f"{addr}: {why} (have {rx.resume_offset} bytes)")
                log.info("fetch %s/%s from %s failed: %s; trying the next holder", kind, name, addr, why)
            finally:
                del self._inbox[sid]
        raise FetchError(f"no peer delivered {kind}/{name}: " + "; ".join(errors))
