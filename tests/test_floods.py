"""Floods by many identities (each holds the swarm key; identities are free): what a victim holds
for them is bounded in total, whatever their number, and goes back when they leave.

- Checkpoint streams keep their place until their bytes left our buffers: askers that read
  nothing get at most MAX_STREAMS streams between them, and no refusals queued behind what they
  left unread.
"""

import asyncio
import os

import pytest

from blocktrain.p2p import checkpoints
from blocktrain.protocol import StreamOpen, StreamRequest


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
