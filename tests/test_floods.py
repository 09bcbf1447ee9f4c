"""Floods by many identities (each holds the swarm key; identities are free): what a victim holds
for them is bounded in total, whatever their number, and goes back when they leave.

- Large frames (averaging parts, far-future or not) draw on one receive pool per event loop:
  its peak is set by its limit and one frame, not by the number of connections; nothing is lost
  (frames past the limit wait, reading paused); the pool is empty once readers took every
  message or the connections closed, and the allocator is then asked to give memory back.
- Checkpoint streams keep their place until their bytes left our buffers: askers that read
  nothing get at most MAX_STREAMS streams between them, and no refusals queued behind what they
  left unread.
"""

import asyncio
import os

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.p2p import checkpoints, flow
from blocktrain.p2p.flow import receive_pool
from blocktrain.p2p.tensors import to_wire
from blocktrain.p2p.transport import PeerConnection, Timeouts, open_connection
from blocktrain.protocol import BlockUpdate, Connection, Role, StreamOpen, StreamRequest

FAST = Timeouts(connect_s=5, handshake_s=5, heartbeat_s=0.2, dead_after_s=10, close_s=0.5)
FRAME_FLOATS = 1 << 18  # 1 MiB parts
LIMIT = 4 << 20  # the pool, shrunk for the test: 4 parts


async def _server(psk, accepted: list):
    loop = asyncio.get_running_loop()

    def factory():
        pc = PeerConnection(Connection(Role.RESPONDER, X25519PrivateKey.generate(), psk), FAST)
        accepted.append(pc)
        return pc
    server = await loop.create_server(factory, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _flood(n: int) -> tuple[int, int, int]:
    """``n`` identities each send 2 large parts to a victim whose readers wait; then the readers
    take everything. Returns (pool peak, most held by the connections at once, parts taken)."""
    psk = os.urandom(32)
    pool = receive_pool(asyncio.get_running_loop())
    pool.limit, pool.peak = LIMIT, 0
    accepted: list = []
    server, port = await _server(psk, accepted)
    part = to_wire("part", torch.randn(FRAME_FLOATS), compress="never")
    attackers, held_max = [], 0
    try:
        for i in range(n):
            pc = await open_connection("127.0.0.1", port, Connection(Role.INITIATOR, X25519PrivateKey.generate(), psk),
                                       FAST)
            attackers.append(pc)
            for k in range(2):
                pc.send_nowait(BlockUpdate(block=0, round=10**9 + k, tensors=(part,), meta={"phase": "reduce"}),
                               bulk=True)
        for _ in range(40):  # every attacker wrote what it could; the victim read what the pool let in
            await asyncio.sleep(0.05)
            held = sum(b.conn.buffered_bytes + sum(4 * FRAME_FLOATS for e in b.inbox.events
                                                   if isinstance(e, BlockUpdate)) for b in accepted)
            held_max = max(held_max, held)
        async def reader(b):  # each connection's reader takes its messages: waiting frames come in turn
            got = 0
            for _ in range(2):
                msg = await asyncio.wait_for(b.recv(), 10)
                got += isinstance(msg, BlockUpdate)
            try:  # a reader goes back for the next message: the one it took is released then
                await asyncio.wait_for(b.recv(), 0.05)
            except asyncio.TimeoutError:
                pass
            return got
        taken = sum(await asyncio.gather(*(reader(b) for b in accepted)))
        await asyncio.sleep(0.05)
        return pool.peak, held_max, taken
    finally:
        for pc in attackers:
            pc.abort("done")
        for b in accepted:
            b.abort("done")
        server.close()
        await asyncio.sleep(0.05)
        assert pool.used == 0, "what the connections held went back to the pool"
        pool.limit = flow.RECEIVE_POOL_BYTES


@pytest.mark.parametrize("n", [6, 18])
async def test_large_frames_share_one_pool_whatever_the_identities(n):
    peak, held, taken = await _flood(n)
    one_frame = 4 * FRAME_FLOATS + 4096
    assert taken == 2 * n, "frames past the pool wait; none is lost"
    assert peak <= LIMIT + one_frame, f"pool peak {peak} past its limit {LIMIT} with {n} identities"
    assert held <= LIMIT + one_frame + n * 64 * 1024, f"held {held} with {n} identities"


async def test_pool_empties_and_memory_is_given_back(monkeypatch):
    trims = []
    monkeypatch.setattr(flow, "release_memory", lambda: trims.append(1) or True)
    pool = flow.ReceivePool(asyncio.get_running_loop(), limit=1 << 20)
    a, b = object(), object()
    pool.charge(a, 16 << 20)
    assert not pool.has_room()
    resumed = []
    pool.wait(b, lambda: resumed.append(b))
    pool.release(a, 16 << 20)  # a's reader took its frame: b may go on, and memory goes back
    await asyncio.sleep(0)
    assert resumed == [b] and pool.used == 0 and trims == [1]
    monkeypatch.setattr(flow, "TRIM_AFTER_CLOSE_S", 0.01)
    for owner in (a, b, object()):  # connections end: their own buffers go back too, once for the burst
        pool.forget(owner)
    await asyncio.sleep(0.1)
    assert trims == [1, 1]


class NonReader:
    """A server-side connection to an asker that reads nothing: every frame queued stays ours."""

    def __init__(self):
        self.sent, self.closed = [], asyncio.get_running_loop().create_future()

    async def send(self, msg, bulk=False):
        self.sent.append(msg)

    def send_nowait(self, msg, bulk=False):
        self.sent.append(msg)

    def unsent(self):
        return sum(len(getattr(m, "data", b"")) + 64 for m in self.sent)

    def abort_with(self, code, reason, cause):
        self.closed.set_result(None)


class FakePeer:
    def __init__(self):
        self.handlers = {}

    def on(self, t, fn, inline=False):
        self.handlers[t] = fn


@pytest.mark.parametrize("askers", [12, 48])
async def test_streams_to_askers_that_read_nothing_are_bounded_in_total(tmp_path, monkeypatch, askers):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "block0.safetensors").write_bytes(os.urandom(700_000))
    monkeypatch.setattr(checkpoints, "unsent_bytes", NonReader.unsent)
    monkeypatch.setattr(checkpoints, "flushed", lambda pc: asyncio.Event().wait())  # it never reads
    server = checkpoints.CheckpointServer(FakePeer(), tmp_path)
    conns = [NonReader() for _ in range(askers)]
    tasks = [asyncio.ensure_future(server.handle(StreamRequest(kind="checkpoint", name="block0", offset=0,
                                                               stream_id=sid), pc, f"{i:064x}"))
             for i, pc in enumerate(conns) for sid in range(1, 5)]
    await asyncio.sleep(0.2)
    try:
        opened = sum(1 for pc in conns for m in pc.sent if isinstance(m, StreamOpen) and not m.meta.get("error"))
        assert opened <= checkpoints.MAX_STREAMS, f"{opened} streams held for askers that read nothing"
        for pc in conns:  # behind a stream it has not read, an asker is sent no refusal
            kinds = [("open" if not m.meta.get("error") else "refused") for m in pc.sent if isinstance(m, StreamOpen)]
            assert "refused" not in kinds[kinds.index("open") + 1:] if "open" in kinds else True
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert sum(server._active.values()) == 0


async def test_a_stream_whose_asker_reads_nothing_is_given_up(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "STREAM_STALL_S", 0.2)
    monkeypatch.setattr(checkpoints, "unsent_bytes", NonReader.unsent)
    monkeypatch.setattr(checkpoints, "flushed", lambda pc: asyncio.Event().wait())  # it never reads
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "block0.safetensors").write_bytes(os.urandom(1000))
    server = checkpoints.CheckpointServer(FakePeer(), tmp_path)
    pc = NonReader()
    await asyncio.wait_for(server.handle(StreamRequest(kind="checkpoint", name="block0", offset=0, stream_id=1),
                                         pc, "a" * 64), 5)
    assert pc.closed.done(), "its connection is closed, which frees what was queued for it"
    assert not server._active
