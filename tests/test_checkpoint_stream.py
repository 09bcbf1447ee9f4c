"""Checkpoint streaming between peers: fetch, resume with another holder, refusals."""

import asyncio
import os

import pytest

from blocktrain.p2p.checkpoints import CheckpointFetcher, CheckpointServer, FetchError
from blocktrain.p2p.transport import Timeouts

from conftest import crash, mesh
from blocktrain.protocol import StreamChunk, StreamRequest, stream_messages

FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.3, dead_after_s=3, close_s=1)


async def swarm(tmp_path, n=3):
    return await mesh(n, FAST)


def put(directory, kind, name, data):
    (directory / kind).mkdir(parents=True, exist_ok=True)
    (directory / kind / f"{name}.safetensors").write_bytes(data)


async def test_fetch_resumes_with_another_holder_after_a_death(tmp_path):
    data = os.urandom(9 * 1024 * 1024 + 123)  # three 4 MiB chunks
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    put(a_dir, "checkpoint", "block1", data)
    put(b_dir, "checkpoint", "block1", data)
    a, b, c = await swarm(tmp_path)
    try:
        CheckpointServer(b, b_dir)  # a only sends one chunk and dies (its handler below)
        asked = []

        async def dies_after_one_chunk(req, pc, pid):  # a sends the open and one chunk, then dies
            msgs = stream_messages(req.stream_id, req.kind, req.name, data, offset=req.offset)
            await pc.send(next(msgs), bulk=True)
            await pc.send(next(msgs), bulk=True)
            await asyncio.sleep(0.2)
            crash(a)

        async def records(req, pc, pid):  # beside b's server: every handler of a type hears it
            asked.append(req.offset)

        a.on(StreamRequest, dies_after_one_chunk)
        b.on(StreamRequest, records)
        fetcher = CheckpointFetcher(c, chunk_timeout_s=2)
        got = await asyncio.wait_for(fetcher.fetch([a.addr, b.addr], "checkpoint", "block1"), 60)
        assert got == data
        assert asked == [4 * 1024 * 1024]  # b continued where a stopped
        assert fetcher.received_by_kind["checkpoint"] == len(data)
    finally:
        for p in (a, b, c):
            await p.stop()


async def test_missing_and_unsafe_names_are_refused(tmp_path):
    put(tmp_path / "a", "checkpoint", "block1", b"x" * 100)
    (tmp_path / "secret.safetensors").write_bytes(b"secret")
    a, c = await swarm(tmp_path, 2)
    try:
        CheckpointServer(a, tmp_path / "a")
        fetcher = CheckpointFetcher(c, chunk_timeout_s=2)
        assert await fetcher.fetch([a.addr], "checkpoint", "block1") == b"x" * 100
        with pytest.raises(FetchError, match="not found"):
            await fetcher.fetch([a.addr], "checkpoint", "block9")
        with pytest.raises(FetchError, match="bad name"):
            await fetcher.fetch([a.addr], "..", "secret")
        # the connection survives refusals
        assert await fetcher.fetch([a.addr], "checkpoint", "block1") == b"x" * 100
    finally:
        for p in (a, c):
            await p.stop()


async def test_corrupt_stream_is_discarded_and_fetched_elsewhere(tmp_path):
    data = os.urandom(300_000)
    put(tmp_path / "b", "checkpoint", "block1", data)
    a, b, c = await swarm(tmp_path)
    try:
        CheckpointServer(b, tmp_path / "b")

        async def lies(req, pc, pid):  # announces the right sha256, sends other bytes
            for m in stream_messages(req.stream_id, req.kind, req.name, data, offset=req.offset):
                if isinstance(m, StreamChunk):
                    m = StreamChunk(offset=m.offset, data=bytes(len(m.data)), stream_id=m.stream_id)
                await pc.send(m, bulk=True)

        a.on(StreamRequest, lies)
        fetcher = CheckpointFetcher(c, chunk_timeout_s=2)
        assert await fetcher.fetch([a.addr, b.addr], "checkpoint", "block1") == data
    finally:
        for p in (a, b, c):
            await p.stop()


async def test_stream_bytes_are_counted_under_their_kind(tmp_path):
    peers = await mesh(2, FAST)
    try:
        blob = os.urandom(300_000)
        (tmp_path / "lower-checkpoint").mkdir()
        (tmp_path / "lower-checkpoint" / "block0.safetensors").write_bytes(blob)
        CheckpointServer(peers[0], tmp_path)
        fetcher = CheckpointFetcher(peers[1])
        assert await fetcher.fetch([peers[0].addr], "lower-checkpoint", "block0") == blob
        got = peers[1].traffic_report()["by_kind"]["received"]
        sent = peers[0].traffic_report()["by_kind"]["sent"]
        assert got["lower-checkpoint"]["payload_bytes"] >= len(blob)
        assert sent["lower-checkpoint"]["wire_bytes"] >= got["lower-checkpoint"]["payload_bytes"]
        assert "checkpoint" not in got and "update" not in got
    finally:
        for p in peers:
            await p.stop()


async def test_holder_process_killed_mid_stream_is_resumed_from_another(tmp_path):
    """A holder process is killed by pid mid-stream; the fetch goes on from the bytes it has with
    the next holder (another process), verified by sha256."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from blocktrain.p2p.identity import load_swarm_key, new_swarm_key
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from blocktrain.p2p.node import Peer

    new_swarm_key(tmp_path / "key")
    data = os.urandom(6 * 1024 * 1024 + 7)
    procs = []
    try:
        for name, rate in (("a", 40.0), ("b", 0.0)):  # a: 40 Mbit/s, ~1.3 s for the whole file
            put(tmp_path / name, "checkpoint", "block1", data)
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).parent / "holder.py"),
                                           str(tmp_path / "key"), str(tmp_path / name), str(rate),
                                           str(tmp_path / f"{name}.addr")]))
        for _ in range(300):  # bounded: 30 s for both to listen
            if all((tmp_path / f"{n}.addr").exists() for n in "ab"):
                break
            assert all(p.poll() is None for p in procs)
            await asyncio.sleep(0.1)
        a_addr, b_addr = ((tmp_path / f"{n}.addr").read_text() for n in "ab")
        me = await Peer(X25519PrivateKey.generate(), load_swarm_key(str(tmp_path / "key")), "127.0.0.1", 0,
                        timeouts=FAST).start()
        fetcher = CheckpointFetcher(me, chunk_timeout_s=20)
        task = asyncio.ensure_future(fetcher.fetch([a_addr, b_addr], "checkpoint", "block1"))
        for _ in range(300):
            if fetcher.received_by_kind.get("checkpoint", 0) >= 4 * 1024 * 1024:  # one chunk in
                break
            assert not task.done()
            await asyncio.sleep(0.01)
        assert not task.done()  # a has not sent everything
        os.kill(procs[0].pid, signal.SIGKILL)
        got = await asyncio.wait_for(task, 30)
        assert got == data
        # resumed, not restarted: the chunk from a is not fetched again
        assert fetcher.received_by_kind["checkpoint"] == len(data)
        await me.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


async def test_stream_of_many_chunks_over_a_shaped_link(tmp_path):
    """The shaped writer wakes senders waiting on backpressure (a stream of more frames than the
    bulk queue holds once stalled here)."""
    from blocktrain.p2p.link import LinkSpec

    data = os.urandom(5 * 4 * 1024 * 1024 + 99)  # many chunks
    assert await _fetched_over(tmp_path, LinkSpec(delay_ms=2, rate_mbit=800), data, both_ways=True) == data


async def _fetched_over(tmp_path, link, data: bytes, both_ways: bool = False) -> bytes:
    """``data`` served by a holder whose links are ``link`` (``both_ways``: the fetcher's too) and
    fetched from it."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from blocktrain.p2p.node import Peer

    psk = os.urandom(32)
    links = {"default": link, "links": {}}
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST, links=links).start()
    b = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST,
                   links=links if both_ways else None).start()
    try:
        await b.join("127.0.0.1", a.port)
        put(tmp_path, "checkpoint", "block0", data)
        CheckpointServer(a, tmp_path)
        return await asyncio.wait_for(CheckpointFetcher(b, chunk_timeout_s=10).fetch([a.addr], "checkpoint", "block0"),
                                      60)
    finally:
        for p in (a, b):
            await p.stop()


async def test_a_probe_costs_the_holder_a_tail_read_whatever_the_checkpoint_size(tmp_path, monkeypatch):
    """A published checkpoint's sha256 is remembered from the bytes written: probing it (the
    lower-block check of every round) reads the last KiB, never the whole file. A file put there
    another way is hashed once, on its first request, then remembered."""
    import hashlib

    import torch

    import blocktrain.p2p.checkpoints as cp
    from blocktrain.blocks import checkpoint as ckpt
    hashed = []
    real = cp._sha256_of
    monkeypatch.setattr(cp, "_sha256_of", lambda f: hashed.append(f.name) or real(f))
    a, b = await swarm(tmp_path, 2)
    try:
        server = CheckpointServer(a, tmp_path / "a")
        c = ckpt.Checkpoint({"d_model": 8}, 0, 5, {"w": torch.randn(5 << 20)})  # a 20 MiB checkpoint
        path = server.publish("lower-checkpoint", "block0", c)
        put(tmp_path / "a", "checkpoint", "block1", os.urandom(3 << 20))
        fetcher = CheckpointFetcher(b)
        for _ in range(3):
            assert await fetcher.probe(a.addr, "lower-checkpoint", "block0", path.stat().st_size) == \
                (path.stat().st_size, hashlib.sha256(path.read_bytes()).digest())
        assert hashed == []  # answered from what was remembered at write time
        assert fetcher.received_by_kind.get("lower-checkpoint", 0) <= cp.PROBE_TAIL
        for _ in range(3):
            await fetcher.probe(a.addr, "checkpoint", "block1", 3 << 20)
        assert len(hashed) == 1
        c2 = ckpt.Checkpoint({"d_model": 8}, 0, 6, {"w": torch.randn(5 << 20)})  # a new version
        server.publish("lower-checkpoint", "block0", c2)
        got = await fetcher.probe(a.addr, "lower-checkpoint", "block0", path.stat().st_size)
        assert got[1] == hashlib.sha256(path.read_bytes()).digest() and len(hashed) == 1
    finally:
        for p in (a, b):
            await p.stop()


async def test_a_stream_longer_than_the_stall_bound_on_a_slow_link_arrives(tmp_path, monkeypatch):
    """On a slow link a stream takes longer than the stall bound, but each chunk far less: it is
    not given up (with chunks of 4 MiB, one chunk outlasted the bound and the holder closed the
    connection: no checkpoint crossed a 1 Mbit/s home link)."""
    import blocktrain.p2p.checkpoints as cp
    from blocktrain.p2p.link import LinkSpec

    monkeypatch.setattr(cp, "STREAM_STALL_S", 3.0)
    data = os.urandom(4 * 1024 * 1024)  # 4.2 s at 8 Mbit/s; a chunk of it 0.03 s
    assert await _fetched_over(tmp_path, LinkSpec(delay_ms=5, rate_mbit=8), data) == data
