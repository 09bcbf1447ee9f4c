"""An outside attack campaign's findings, one regression test each: what an attacker (with or without the swarm key),
a fault, or bad input at the edge could do, and what the peer does now."""

import asyncio
import os
import socket
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktrain.p2p.connections import MAX_PENDING_HANDSHAKES
from blocktrain.p2p.node import Peer

from blocktrain.p2p.tensors import to_wire
from blocktrain.p2p.view import query_status
from blocktrain.p2p.transport import Timeouts
from blocktrain.bench.ports import free_port

from conftest import mesh

FAST = Timeouts(connect_s=5, handshake_s=2, heartbeat_s=0.2, dead_after_s=30, close_s=1)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def peer_process(tmp_path):
    """A bt-peer process (a plain member) on loopback, stopped by pid at the end."""
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "key")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "blocktrain.p2p.cli", "start", "--no-train", "--quiet",
                          "--listen", f"127.0.0.1:{port}", "--swarm-key", str(tmp_path / "key"),
                          "--identity", str(tmp_path / "id")], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and p.poll() is None, "the peer did not start"
            time.sleep(0.1)
    yield p, port, tmp_path / "key"
    p.kill()
    p.wait(10)


def test_idle_sockets_past_the_pending_slots_are_closed_and_fds_come_back(peer_process):
    """Finding 2: 3 x MAX_PENDING silent sockets; each refused one is closed at once (EOF), and
    within the handshake timeout the peer holds no more fds than before."""
    p, port, _ = peer_process
    base = _fds(p.pid)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * MAX_PENDING_HANDSHAKES)]
    try:
        time.sleep(1.0)
        for s in socks[:MAX_PENDING_HANDSHAKES]:  # the oldest were evicted by the newer ones: closed
            s.settimeout(5)
            assert s.recv(1 << 16) is not None  # the plaintext ERROR OVERLOADED, then EOF
        assert _fds(p.pid) <= base + MAX_PENDING_HANDSHAKES + 2
        deadline = time.monotonic() + Timeouts().handshake_s + 10
        while _fds(p.pid) > base + 2:
            assert time.monotonic() < deadline, f"fds {_fds(p.pid)} > baseline {base}"
            time.sleep(0.5)
    finally:
        for s in socks:
            s.close()


async def test_silent_sockets_do_not_lock_out_a_legitimate_caller():
    """Finding 3: with more silent sockets than pending slots, `status` still answers (a new
    handshake evicts the oldest silent one instead of waiting behind it)."""
    psk = os.urandom(32)
    slow = Timeouts(connect_s=5, handshake_s=60, heartbeat_s=1, dead_after_s=60, close_s=1)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=slow).start()
    socks = []
    try:
        for _ in range(MAX_PENDING_HANDSHAKES + 6):
            socks.append(await asyncio.open_connection("127.0.0.1", a.port))
        await asyncio.sleep(0.2)
        st_ = await asyncio.wait_for(query_status("127.0.0.1", a.port, X25519PrivateKey.generate(), psk, FAST), 10)
        assert st_["peer_id"] == a.id  # answered long before the 60 s handshake timeout
    finally:
        for _, w in socks:
            w.close()
        await a.stop()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.integers() | st.text(max_size=8), lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.text(max_size=4), c, max_size=3), max_leaves=6), max_size=4))
def test_any_crafted_checkpoint_bytes_raise_only_checkpoint_error(tail, header):
    """Finding 5: a malformed header or table never escapes as anything but CheckpointError."""
    import json
    import struct

    from blocktrain.blocks import checkpoint as ckpt
    head = json.dumps({**header, "__metadata__": {"format": ckpt.CHECKPOINT_FORMAT}}).encode()
    for blob in (tail, struct.pack("<Q", len(head)) + head + tail):
        try:
            ckpt.decode(blob)
        except ckpt.CheckpointError:
            pass


def test_a_crafted_group_state_is_not_adopted(tmp_path):
    """Finding 5: NaN parameters, wrong shapes, an implausible step or another block: refused."""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec

    class _Peer:  # the trainer's checks need no network
        id = "a" * 64
        def on(self, *a, **k): pass
        def on_membership(self, *a): pass
        def report_section(self, *a): pass

    mc = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)
    tc = TrainConfig(steps=10, batch_size=4, seq_len=32)
    data = as_tensor(read_split("valid"))
    sp = SwarmTrainer(_Peer(), TrainerSpec(1, PeerJob(mc, tc, SwarmConfig()), tmp_path), data, data)
    good = ckpt.Checkpoint(mc.to_dict(), 0, 5, Block(mc, 0).state_dict(), extra={"gstep": 5})
    sp.check.state(good, {})
    nan = {k: torch.full_like(v, float("nan")) for k, v in good.tensors.items()}
    wrong = {**good.tensors, "layers.0.fc.weight": torch.zeros(3, 3)}
    for bad, why in ((ckpt.Checkpoint(mc.to_dict(), 0, 5, nan, extra={"gstep": 5}), "NaN"),
                     (ckpt.Checkpoint(mc.to_dict(), 0, 5, wrong, extra={"gstep": 5}), "shapes"),
                     (ckpt.Checkpoint(mc.to_dict(), 0, 10**15, good.tensors, extra={"gstep": 10**15}), "step"),
                     (ckpt.Checkpoint({**mc.to_dict(), "d_model": 64}, 0, 5, good.tensors), "config")):
        with pytest.raises(ValueError, match=why):
            sp.check.state(bad, {})
    with pytest.raises(ValueError, match="NaN"):
        sp.check.state(good, {0: nan})
    # finite but destroyed: scaled 1000x, zeroed, or noise of the right norm
    big = {k: v * 1e3 for k, v in good.tensors.items()}
    zero = {k: torch.zeros_like(v) for k, v in good.tensors.items()}
    for bad, why in (({**good.tensors}, None), (big, "norm"), (zero, "norm")):
        state = ckpt.Checkpoint(mc.to_dict(), 0, 5, bad, extra={"gstep": 5})
        if why is None:
            sp.check.state(state, {})
        else:
            with pytest.raises(ValueError, match=why):
                sp.check.state(state, {})
    top = Block(mc, 1).state_dict()  # forced logits: byte 0 always, by 20 nats; the norm still plausible
    unit = torch.zeros(mc.d_model)
    unit[0] = 1
    lm = top["head.lm.weight"].clone()
    lm[0] = 10 * unit
    forced = {**top, "head.ln.bias": 2 * unit, "head.lm.weight": lm}
    sp.check.state(ckpt.Checkpoint(mc.to_dict(), 1, 5, top, extra={"gstep": 15}), {0: Block(mc, 0).state_dict()})
    with pytest.raises(ValueError, match="scores CE"):
        sp.check.state(ckpt.Checkpoint(mc.to_dict(), 1, 5, forced, extra={"gstep": 15}), {0: Block(mc, 0).state_dict()})


async def test_many_stream_requests_cost_a_few_chunks_not_a_file_each(tmp_path):
    """Finding 6: 40 requests for a 12 MiB file at once: at most MAX_STREAMS_PER_PEER run, the rest
    are refused (busy), and the server never holds more than a chunk per stream."""
    from blocktrain.p2p.checkpoints import MAX_STREAMS_PER_PEER, CheckpointServer
    from blocktrain.protocol import StreamOpen, StreamRequest
    a, b = await mesh(2, FAST)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "block0.safetensors").write_bytes(os.urandom(12 << 20))
    CheckpointServer(a, tmp_path)
    opens = []
    b.on(StreamOpen, lambda m, pc, pid: (opens.append(m), b.notify()), inline=True)
    try:
        tracemalloc.start()
        pc = await b.connection(a.id)
        for sid in range(1, 41):
            pc.send_nowait(StreamRequest(kind="checkpoint", name="block0", offset=0, stream_id=sid))
        assert await b.wait_for(lambda: len(opens) == 40, 30)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        busy = [m for m in opens if m.meta.get("error", "").startswith("busy")]
        assert len(busy) >= 40 - MAX_STREAMS_PER_PEER
        assert peak < (MAX_STREAMS_PER_PEER + 8) * (4 << 20) + (16 << 20)  # chunks in flight, not 40 files
    finally:
        await a.stop()
        await b.stop()


async def test_update_parts_from_a_client_or_for_far_rounds_are_not_held():
    """Finding 6: BLOCK_UPDATEs from a client are dropped unread; a member's parts for rounds far
    ahead are not queued."""
    from blocktrain.p2p.averaging import Averager
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.p2p.transport import CLIENT_INFO, make_connection, open_connection
    from blocktrain.protocol import BlockUpdate, Role
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    b = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    av = Averager(a, 0)
    try:
        await b.join("127.0.0.1", a.port)
        await a.wait_for(lambda: len(a.members()) == 1, 10)
        client = await open_connection("127.0.0.1", a.port, make_connection(Role.INITIATOR, X25519PrivateKey.generate(),
                                                                            psk, info=CLIENT_INFO), FAST)
        part = to_wire("part", torch.randn(1 << 18))
        for r in range(1, 20):
            meta = {"phase": "reduce", "part": 0, "group": "x"}
            client.send_nowait(BlockUpdate(block=0, round=r, tensors=(part,), meta=meta))
            (await b.connection(a.id)).send_nowait(BlockUpdate(block=0, round=1000 + r, tensors=(part,), meta=meta))
        await asyncio.sleep(0.5)
        assert av.held().rounds == () and av.held().total == 0
        await client.close()
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("command,extra", [("status", ["--wait", "1"]), ("generate", ["--prompt", "x", "--wait", "1"]),
                                           ("assemble", ["--out", "OUT", "--wait", "1"]), ("assemble", ["--out", "OUT"])])
def test_every_client_waits_for_an_address_by_one_rule_and_says_so(tmp_path, command, extra):
    """Against an address where nothing listens, generate failed after 31-40 s
    and printed nothing while it retried, status after 9 s, assemble after 2 s. Now every client
    asks again for --wait seconds, says so in one line when it begins, and fails naming how long
    it waited; with --wait 0 it fails at once."""
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(str(tmp_path / "key"))
    nobody = free_port()
    extra = [str(tmp_path / "out") if e == "OUT" else e for e in extra]
    r = subprocess.run([sys.executable, "-m", "blocktrain.p2p.cli", command, f"127.0.0.1:{nobody}", *extra,
                        "--swarm-key", str(tmp_path / "key"), "--identity", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120, input="")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    waited = "--wait" in extra
    assert (f"nothing listens at 127.0.0.1:{nobody} yet" in r.stderr) == waited, r.stderr
    assert f"nothing listens at 127.0.0.1:{nobody} (connection refused; asked" in r.stderr, r.stderr
    assert ("asked 1 time(s)" in r.stderr) != waited, r.stderr


async def test_near_round_parts_from_many_identities_share_one_bounded_pool(monkeypatch):
    """64 members (identities are free) each sent two parts for the next
    round: every one of them was held up to one vector's worth (peak +390 MiB). Now the members of
    our last round get that each, and everyone else shares one pool of a quarter of the early
    buffer; the last round's member is still held in full."""
    import blocktrain.p2p.averaging as avm
    from blocktrain.p2p.averaging import early
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.protocol import BlockUpdate
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    av = avm.Averager(a, 0, floats=1 << 16)
    try:
        monkeypatch.setattr(a, "member", lambda pid: object())  # every sender is a member of the swarm
        av._last_ids, av._others = frozenset({a.id, "f" * 64}), 1  # our last round: us and f
        part = to_wire("part", torch.randn(1 << 16))  # 256 KiB, one vector's worth
        meta = {"phase": "reduce", "part": 0, "group": "x"}
        for i in range(64):
            for _ in range(2):
                av._route(BlockUpdate(block=0, round=1, tensors=(part,), meta=meta), None, f"{i:064x}")
        per_sender, strangers = av.held().caps
        held = av.held()
        assert strangers == early.MAX_EARLY_BYTES // 4
        assert held.strangers <= strangers and held.total == held.strangers
        assert held.total <= strangers < 2 * 64 * part.stored_bytes  # half of what came was not held
        for _ in range(2):
            av._route(BlockUpdate(block=0, round=1, tensors=(part,), meta=meta), None, "f" * 64)
        assert av.held().by_member["f" * 64] >= 2 * part.stored_bytes  # the group's own member: held in full
        assert av.held().total <= strangers + per_sender
        # a group's first round (no last round): the members the group expects are held in full too
        av2 = avm.Averager(a, 1, floats=1 << 22)  # 16 MiB vectors: 3 of them are over the shared pool
        big = to_wire("part", torch.randn(1 << 22))
        av2.expect_members(["b" * 64, "c" * 64, "d" * 64, a.id])
        for pid in ("b" * 64, "c" * 64, "d" * 64):
            av2._route(BlockUpdate(block=1, round=1, tensors=(big,), meta=meta), None, pid)
        assert all(av2.held().by_member.get(p, 0) >= big.stored_bytes for p in ("b" * 64, "c" * 64, "d" * 64))
        assert av2.held().strangers == 0
    finally:
        await a.stop()


async def test_a_fetch_resumes_from_a_holder_of_the_same_bytes_under_another_name(tmp_path):
    """Finding 10: holders are content-addressed: the second holder keeps other bytes under the
    requested name, the first one's bytes under another; the fetch continues from where it stopped."""
    from blocktrain.p2p.checkpoints import CheckpointFetcher, CheckpointServer
    from blocktrain.protocol import StreamRequest, stream_messages

    from conftest import crash
    x, y = os.urandom(9 << 20), os.urandom(9 << 20)
    for d, files in (("a", {"block0": x}), ("b", {"block0": y, "block0.r7": x})):
        (tmp_path / d / "checkpoint").mkdir(parents=True)
        for name, blob in files.items():
            (tmp_path / d / "checkpoint" / f"{name}.safetensors").write_bytes(blob)
    a, b, c = await mesh(3, FAST)
    CheckpointServer(b, tmp_path / "b")
    asked = []

    async def dies_after_one_chunk(req, pc, pid):
        msgs = stream_messages(req.stream_id, req.kind, req.name, x, offset=req.offset)
        await pc.send(next(msgs), bulk=True)
        await pc.send(next(msgs), bulk=True)
        await asyncio.sleep(0.2)
        crash(a)

    async def records(req, pc, pid):  # beside b's server: every handler of a type hears it
        asked.append((req.name, req.offset))
    a.on(StreamRequest, dies_after_one_chunk)
    b.on(StreamRequest, records)
    try:
        fetcher = CheckpointFetcher(c, chunk_timeout_s=5)
        got = await asyncio.wait_for(fetcher.fetch([a.id, b.id], "checkpoint", "block0"), 60)
        assert got == x and asked[0][1] == 4 << 20 and asked[0][0].startswith("sha-")
        assert fetcher.received_by_kind["checkpoint"] == len(x)  # not a byte fetched twice
    finally:
        for p in (a, b, c):
            await p.stop()


async def test_a_peer_that_trains_and_serves_nothing_refuses_at_once(tmp_path):
    """Finding 11: streams, joins and pipeline requests sent to a plain member get an answer."""
    from blocktrain.p2p.app import TrainerSetup  # noqa: F401  (the module wires the refusals)
    from blocktrain.p2p.checkpoints import CheckpointFetcher, FetchError, refuse_streams
    from blocktrain.p2p.serving.server import refuse_requests
    from blocktrain.p2p.swarm import refuse_joins
    from blocktrain.protocol import BlockUpdate, PipelineForward, PipelineResult
    a, b = await mesh(2, FAST)
    refuse_streams(a)
    refuse_joins(a)
    refuse_requests(a)
    answers = []
    b.on(BlockUpdate, lambda m, pc, pid: (answers.append((m.meta.get("phase"), m.meta.get("scope"))), b.notify()),
         inline=True)
    try:
        with pytest.raises(FetchError, match="not served here"):
            await asyncio.wait_for(CheckpointFetcher(b).fetch([a.id], "checkpoint", "block0"), 10)
        pc = await b.connection(a.id)
        for bad in ({}, {"scope": None}, {"scope": ["relay"]}, {"scope": "x" * 4000}, {"scope": "block:65536"},
                    {"scope": "block:\u0663"}):  # finding 12: not answered (with scope: nil, as was)
            pc.send_nowait(BlockUpdate(block=0, round=1, meta={"phase": "join", **bad}))  # with scope: nil
        pc.send_nowait(BlockUpdate(block=0, round=1, meta={"phase": "join", "scope": "block:2"}))
        pc.send_nowait(BlockUpdate(block=0, round=1, meta={"phase": "join", "scope": "relay"}))
        assert await b.wait_for(lambda: len(answers) >= 2, 10), answers
        assert answers == [("absent", "block:2"), ("absent", "relay")] and not pc.closed.done()
        results = []  # a request: refused at once, the hop's fault (the client routes around it)
        b.on(PipelineResult, lambda m, pc, pid: (results.append(m), b.notify()), inline=True)
        pc.send_nowait(PipelineForward(request_id=7, route=(a.addr, b.addr), hop=0, meta={"blocks": [0, 1]}))
        assert await b.wait_for(lambda: results, 10)
        (r,) = results
        assert r.request_id == 7 and r.meta["fault"] == "hop" and "serves no blocks" in r.meta["error"]
    finally:
        await a.stop()
        await b.stop()


async def test_concurrent_drainers_all_wake():
    """Finding 12: a second sender waiting for drain no longer orphans the first."""
    from blocktrain.p2p.transport import PeerConnection, make_connection
    from blocktrain.protocol import Role
    pc = PeerConnection(make_connection(Role.INITIATOR, X25519PrivateKey.generate(), os.urandom(32)), FAST)
    pc.pause_writing()
    waiters = [asyncio.ensure_future(pc.drain()) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters)
    pc.resume_writing()
    await asyncio.wait_for(asyncio.gather(*waiters), 2)


def test_a_too_short_model_is_refused_before_training():
    """Finding 14: bt-train with a short max_seq_len fails up front, not after the training."""
    from blocktrain.blocks.config import JobConfig, apply_overrides
    from blocktrain.blocks.job import check_job
    job = apply_overrides(JobConfig(), {"model.max_seq_len": 80, "train.seq_len": 64})
    with pytest.raises(ValueError, match="max_seq_len 80 is too short"):
        check_job(job)


def test_port_in_use_and_a_bootstrap_that_is_not_yet_listening(tmp_path):
    """Finding 15: a clear one-line error for a taken port; join and status wait for a bootstrap
    that starts later, and say so (bounded by --join-timeout, --wait)."""
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "key")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    base = [sys.executable, "-m", "blocktrain.p2p.cli"]
    keys = ["--swarm-key", str(tmp_path / "key"), "--quiet", "--no-train"]
    r = subprocess.run(base + ["start", "--listen", f"127.0.0.1:{port}", "--identity", str(tmp_path / "i0"), *keys],
                       capture_output=True, text=True, timeout=60)
    # at once: not after announcing an address it never listened on
    assert r.returncode == 1 and "already in use" in r.stderr and "Traceback" not in r.stderr
    assert "listening on" not in r.stderr, r.stderr
    r = subprocess.run(base + ["start", "--listen", "127.0.0.1:0", "--http", f"127.0.0.1:{port}",
                               "--identity", str(tmp_path / "i0"), *keys], capture_output=True, text=True, timeout=60)
    busy.close()
    assert r.returncode == 1 and "already in use" in r.stderr and "--http" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    nobody = free_port()
    r = subprocess.run(base + ["join", f"127.0.0.1:{nobody}", "--join-timeout", "1", "--identity",
                               str(tmp_path / "i0"), *keys], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot join" in r.stderr and "--join-timeout" in r.stderr, r.stderr
    assert "] starting: joining through 127.0.0.1:" in r.stderr.splitlines()[0], r.stderr  # said first, at once
    assert "listening on" not in r.stderr and "others join with" not in r.stderr, r.stderr  # never got in
    boot = free_port()
    joiner = subprocess.Popen(base + ["join", f"127.0.0.1:{boot}", "--join-timeout", "300", "--identity",
                                      str(tmp_path / "i1"), *keys], stderr=open(tmp_path / "joiner.log", "w"))
    status = subprocess.Popen(base[:3] + ["status", f"127.0.0.1:{boot}", "--wait", "300", "--swarm-key",
                                          str(tmp_path / "key"), "--identity", str(tmp_path / "c")],
                              stdout=subprocess.PIPE, stderr=open(tmp_path / "status.log", "w"), text=True)
    try:
        # both say that they wait for the bootstrap, and keep trying (bounds: their starts, on a loaded machine)
        _until_line(tmp_path / "joiner.log", "not reachable yet; trying again for up to 300 s", joiner, 120)
        assert "others join with" not in (tmp_path / "joiner.log").read_text()  # not in the swarm yet
        _until_line(tmp_path / "status.log", "nothing listens at", status, 120)
        starter = subprocess.Popen(base + ["start", "--listen", f"127.0.0.1:{boot}", "--identity",
                                           str(tmp_path / "i2"), *keys], stderr=subprocess.DEVNULL)
        try:
            out, _ = status.communicate(timeout=300)
            assert status.returncode == 0 and "peer " in out and "bytes moved" in out, \
                out + (tmp_path / "status.log").read_text()
            from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key
            deadline = time.monotonic() + 60
            while True:
                try:
                    st_ = asyncio.run(query_status("127.0.0.1", boot, load_or_create_identity(tmp_path / "c"),
                                                   load_swarm_key(str(tmp_path / "key")), FAST))
                    if st_["members"]:
                        break
                except (ConnectionError, OSError):
                    pass
                assert time.monotonic() < deadline, "the joiner never joined"
                time.sleep(0.5)
            _until_line(tmp_path / "joiner.log", "others join with", joiner, 120)  # once in, it says how
        finally:
            starter.kill()
            starter.wait(10)
    finally:
        for p in (joiner, status):
            p.kill()
            p.wait(10)


async def test_the_join_timeout_bounds_the_whole_join_a_dial_that_hangs_included():
    """`--join-timeout 5` took 110 s to fail: the bound covered the time between tries, not a try
    whose connection or handshake hung (each had its own 10 s). A bootstrap that accepts TCP and
    never answers the handshake now fails the join at the join timeout."""
    from blocktrain.p2p.app import start_peer
    from blocktrain.p2p.node import JoinError

    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never speaks
    port = silent.sockets[0].getsockname()[1]
    slow = Timeouts(connect_s=300, handshake_s=300, heartbeat_s=0.2, dead_after_s=30, close_s=1)
    peer = Peer(X25519PrivateKey.generate(), os.urandom(32), "127.0.0.1", 0, timeouts=slow)
    try:
        with pytest.raises(JoinError, match="no answer in time") as e:
            async with asyncio.timeout(120):  # a guard: the handshake timeout alone would take 300 s
                await start_peer(peer, ("127.0.0.1", port), join_timeout_s=0.5)
        assert "tried for 0.5 s" in str(e.value) and "--join-timeout" in str(e.value)
    finally:
        silent.close()
        await peer.stop()


def _until_line(path, text: str, proc, bound_s: float):
    """Until ``text`` is in the file ``proc`` writes its stderr to (read again every 0.1 s); fails if
    ``proc`` exits first, or after ``bound_s`` (generous: a Python start with torch under load)."""
    deadline = time.monotonic() + bound_s
    while text not in path.read_text():
        assert proc.poll() is None, f"exited ({proc.returncode}) before saying {text!r}: {path.read_text()}"
        assert time.monotonic() < deadline, f"not said within {bound_s} s: {text!r}: {path.read_text()}"
        time.sleep(0.1)


def test_prompts_a_client_cannot_send_fail_with_the_fix_and_any_bytes_can_be_sent(tmp_path):
    """Finding 14: an empty prompt, or prompt + bytes past the model's positions, is refused before
    anything is sent; a prompt that is not UTF-8 is sent as its bytes (no traceback)."""
    from blocktrain.p2p.serving.client import check_request
    from blocktrain.p2p.identity import new_swarm_key
    from blocktrain.p2p.serving.api import PipelineError
    with pytest.raises(PipelineError, match="empty"):
        check_request(b"", 8, "exact")
    with pytest.raises(PipelineError, match="at most 29 bytes") as e:
        check_request(b"x" * 100, 64, "exact", max_seq_len=128)
    assert e.value.fault == "request"
    check_request(b"\xff\xfe", 8, "exact", max_seq_len=128)
    new_swarm_key(tmp_path / "key")
    nobody = free_port()
    base = [sys.executable, "-m", "blocktrain.p2p.cli", "generate", f"127.0.0.1:{nobody}", "--swarm-key",
            str(tmp_path / "key"), "--identity", str(tmp_path / "id"), "--timeout", "2", "--wait", "1"]
    r = subprocess.run([*base, "--prompt", ""], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "prompt is empty" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*(a.encode() for a in base), b"--prompt", b"caf\xe9 \xff"], capture_output=True, timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1 and "generate via" in err and "Traceback" not in err, err


def test_a_write_killed_midway_leaves_no_tmp_file_behind_for_long(tmp_path):
    """Finding 15: the next save of the same checkpoint removes what a killed writer left, and only
    that (other files in the folder stay)."""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.model import Block, ModelConfig
    mc = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)
    path = tmp_path / "block0.safetensors"
    for i in range(3):  # three writers killed after mkstemp
        (tmp_path / f"block0.safetensors.kill{i}.tmp").write_bytes(b"partial")
    (tmp_path / "block1.safetensors.x.tmp").write_bytes(b"another block's writer, maybe alive")
    ckpt.save(ckpt.Checkpoint(mc.to_dict(), 0, 5, Block(mc, 0).state_dict()), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block0.safetensors", "block1.safetensors.x.tmp"]
    assert ckpt.load(path).step == 5


async def test_a_member_serving_a_bad_state_is_named_and_not_asked_again(tmp_path):
    """Finding 5: members whose join state is NaN: the joiner refuses it, excludes the member it
    fetched it from (named, with the reason, in its report) and never installs the state. (Every
    member tells a joiner READY and it fetches from the first: both members serve the bad state.)"""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import ModelConfig
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    tc = TrainConfig(steps=1000, batch_size=4, seq_len=32, warmup=2)  # long: the test ends it once it has seen
    sc = SwarmConfig(round_timeout_s=20, join_timeout_s=3, eval_windows=2, min_group=2)  # the refusal
    data = as_tensor(read_split("valid"))
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    sps = [SwarmTrainer(p, TrainerSpec(i, PeerJob(mc, tc, sc), tmp_path / f"w{i}"), data, data)
           for i, p in enumerate(peers)]
    def poisoned(rnd, sp):  # what a member gone bad serves to joiners
        c = sp.checkpoint(False)
        c.tensors = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in c.tensors.items()}
        name = sp.store.join_state_name(c.block, rnd)
        ckpt.save(c, sp.dir / "serve" / "checkpoint" / (name + ckpt.SUFFIX))
        return name
    for sp in sps[:2]:  # slow enough that the joiner arrives mid-run
        sp.rounds.save_join_state = lambda rnd, sp=sp: poisoned(rnd, sp)
        orig = sp._new_trainer

        def new_trainer(b, sp=sp, orig=orig):
            orig(b)
            step = sp.trainer.compute_grads
            sp.trainer.compute_grads = lambda *a: (time.sleep(0.02), step(*a))[1]
        sp._new_trainer = new_trainer
    first = [asyncio.ensure_future(sp.run()) for sp in sps[:2]]
    joiner = None
    try:
        deadline = time.monotonic() + 60
        while sps[0].stats.applied < 4:
            assert time.monotonic() < deadline and not any(t.done() for t in first)
            await asyncio.sleep(0.05)
        joiner = asyncio.ensure_future(sps[2].run())
        members = {sp.peer.id for sp in sps[:2]}
        while not members & set(sps[2].averager.banned):
            assert time.monotonic() < deadline + 60, "the joiner never refused the poisoned state"
            assert not joiner.done() or joiner.exception() is None
            await asyncio.sleep(0.05)
        (bad, *_) = members & set(sps[2].averager.banned)
        assert "served a bad state" in sps[2].averager.banned[bad]
        assert "NaN" in sps[2].averager.banned[bad]
        assert bad not in sps[2].membership.candidates()
        assert not any(j["how"] == "fetched the group's state" for j in sps[2].stats.joins)
        assert all(torch.isfinite(t).all() for t in sps[2].params())
        rep = sps[2].training_report()
        assert rep["excluded_peers"][bad].startswith("served a bad state")
    finally:  # the run is long on purpose: end it (bounded: a trainer mid-round may not notice at once)
        tasks = [t for t in [*first, joiner] if t is not None]
        for t in tasks:
            t.cancel()
        for p in peers:
            await p.stop()
        await asyncio.wait(tasks, timeout=30)


def test_a_dead_member_is_redialled_with_backoff_for_a_bounded_time():
    """Finding 7: after a member is dropped as dead it is redialled (so a peer that was only stopped
    and comes back is found again), 1, 2, 4, ... s apart up to REDIAL_MAX_S, and not for ever."""
    from blocktrain.p2p.redial import REDIAL_MAX_S, REDIAL_MIN_S
    p = Peer(X25519PrivateKey.generate(), os.urandom(32), "127.0.0.1", 0, timeouts=FAST, redial_for_s=300)
    dials, now = [], [0.0]

    p._quiet_dial = lambda addr: dials.append(now[0])  # the dial itself is not the point here
    p._schedule_redial("127.0.0.1:9", "b" * 64)
    start = p.redials["127.0.0.1:9"].next_at - REDIAL_MIN_S
    for i in range(800):  # 400 s of heartbeats, 0.5 s apart
        now[0] = start + 0.5 * i
        p._redial_due(now[0])
    gaps = [round(b - a) for a, b in zip(dials, dials[1:])]
    assert gaps[:6] == [min(2 ** i, REDIAL_MAX_S) for i in range(6)] and set(gaps[5:]) == {REDIAL_MAX_S}
    assert round(dials[-1] - start, 6) <= 300 and "127.0.0.1:9" not in p.redials  # (float: start is a clock)
    p._schedule_redial("127.0.0.1:9", "b" * 64, soon=True)  # a connection lost just now: at once
    assert p.redials["127.0.0.1:9"].next_at <= time.monotonic()


class _FakeNode:
    """What a SwarmTrainer asks of its node, for driving its control messages by hand: ``known``
    members are alive, ``suspect`` ones in the table with their connection being redialled."""
    known: tuple = ()
    suspect: tuple = ()

    def __init__(self, pid):
        from blocktrain.p2p.waiters import Waiters
        self.id = pid
        self._waiters = Waiters(lambda: False)

    def members(self, alive=True, **k):
        from types import SimpleNamespace
        return [SimpleNamespace(peer_id=q, addr=q[:4]) for q in self.known + (() if alive else self.suspect)
                if q != self.id]

    def on(self, *a, **k): pass
    def on_membership(self, *a): pass
    def report_section(self, *a): pass

    def notify(self):
        self._waiters.notify()

    async def wait_for(self, predicate, timeout=None):
        return await self._waiters.wait_for(predicate, timeout)


def _swarm_trainer(node, tmp_path):
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import ModelConfig
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec

    mc = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)
    data = as_tensor(read_split("valid"))
    job = PeerJob(mc, TrainConfig(steps=10, batch_size=4, seq_len=32), SwarmConfig())
    return SwarmTrainer(node, TrainerSpec(0, job, tmp_path / node.id[:4]), data, data)


def test_a_lower_ranked_group_hears_our_status_at_once_so_a_split_heals_in_a_round(tmp_path):
    """Finding 8 (seen again with live peers): two members that dropped a dead third at different
    rounds each end up alone; the first one's STATUS reached the other while it still counted the
    first in, and the split lasted 5 s. Now a STATUS that ranks below ours is answered at once
    (and at most every STATUS_REPLY_S), so the lower group yields in the next exchange."""
    from blocktrain.p2p.group import Phase, State
    from blocktrain.protocol import BlockUpdate

    def trainer(pid):
        node = _FakeNode(pid)
        node.known = ("a" * 64, "b" * 64)
        sp = _swarm_trainer(node, tmp_path)
        sp.group.state, sp.group.round = State.TRAINING, 816
        sp.sent = []
        sp.membership.send = sp.sent.extend
        return sp
    a, b = trainer("a" * 64), trainer("b" * 64)  # a's group ranks higher (same size, smaller sponsor)

    def deliver(src, dst):
        (s,) = src.sent
        src.sent.clear()
        assert s.peer == dst.peer.id and s.meta["phase"] == Phase.STATUS.value
        dst.membership.on_control(BlockUpdate(block=0, round=s.round, meta={**s.meta, "scope": dst.scope}), None, src.peer.id)
    b.group.joined[a.peer.id] = 1  # b still counts a in: a's STATUS is ignored
    a.membership.send([a.group.status_for(b.peer.id)])
    deliver(a, b)
    assert b.group.state is State.TRAINING and not b.sent
    del b.group.joined[a.peer.id]  # b drops a too, and tells it its status
    b.membership.send([b.group.status_for(a.peer.id)])
    deliver(b, a)  # a ranks higher: it answers at once
    assert a.group.state is State.TRAINING
    deliver(a, b)  # and b yields: it leaves its group of one and joins a's
    assert b.group.state is State.IDLE and b.membership.rejoin
    b.group.state = State.TRAINING  # a second STATUS from b within STATUS_REPLY_S is not answered
    b.membership.send([b.group.status_for(a.peer.id)])
    deliver(b, a)
    assert not a.sent
    a.membership.outsiders.status_replied.clear()  # a STATUS of equal rank, a size no group here can have, or from an
    for meta in ({"size": 1, "sponsor": "a" * 64}, {"size": 10**6, "sponsor": "0" * 64}):  # excluded peer: no answer
        a.membership.on_control(BlockUpdate(block=0, round=1, meta={"phase": "status", "scope": a.scope, **meta}), None, b.peer.id)
        assert not a.sent and a.group.state is State.TRAINING
    a.averager.banned[b.peer.id] = "test"
    a.membership.on_control(BlockUpdate(block=0, round=1, meta={"phase": "status", "scope": a.scope, "size": 1,
                                                   "sponsor": b.peer.id}), None, b.peer.id)
    assert not a.sent


def _status_trainer(tmp_path, pid, known, rnd=466):
    from blocktrain.p2p.group import State
    node = _FakeNode(pid)
    node.known = known
    sp = _swarm_trainer(node, tmp_path)
    sp.group.state, sp.group.round = State.TRAINING, rnd
    sp.sent = []
    sp.membership.send = sp.sent.extend
    return sp


def _one_departs(tmp_path, ids, me, gone, why, before=lambda c: None):
    """``me``'s trainer in a group with ``gone``, which departs it (``before``: what ``me`` knew of
    it first), its status bookkeeping run before and after, as at the rounds' ends."""
    c = _status_trainer(tmp_path, me, ids)
    c.group.joined[gone] = 1
    c.membership.tell_outsiders()
    before(c)
    c.group.depart(gone, why)
    c.membership.tell_outsiders()
    return c


def _statuses(sp):
    from blocktrain.p2p.group import Phase
    out = [s for s in sp.sent if s.meta["phase"] == Phase.STATUS.value]
    sp.sent.clear()
    return out


def test_a_member_that_just_left_our_group_hears_our_status_at_once(tmp_path):
    """PROTOCOL r6.22: a split heals in a round trip even where the two sides told each other
    their status in an earlier split less than STATUS_EVERY_S ago (the stopped-peer test: a member
    split off again trained its block's last rounds alone, in milliseconds, and ended apart). One
    that is not a live candidate when it leaves is owed it until it is one."""
    from blocktrain.p2p.swarm.membership import STATUS_KEPT

    a, b, c = "a" * 64, "b" * 64, "c" * 64
    sp = _status_trainer(tmp_path, a, (a, b, c))
    sp.group.joined[b] = 1
    sp.membership.tell_outsiders()  # c is outside: told; b is a member: not
    assert [s.peer for s in _statuses(sp)] == [c]
    sp.membership.outsiders.status_sent[b] = time.monotonic()  # told in an earlier split, a moment ago
    sp.membership.tell_outsiders()
    assert not _statuses(sp)  # c was told a moment ago
    sp.group.depart(b, "sees another group")  # split again
    sp.membership.tell_outsiders()
    (st,) = _statuses(sp)
    assert st.peer == b and st.meta["size"] == 1
    sp.membership.tell_outsiders()  # once: then every STATUS_EVERY_S again
    assert not _statuses(sp)
    for i in range(4 * STATUS_KEPT):  # when we told peers no longer in scope is not kept for ever
        sp.membership.outsiders.status_sent[f"{i:064x}"] = 0.0
    sp.membership.tell_outsiders()
    assert set(sp.membership.outsiders.status_sent) == {b, c}

    sp = _status_trainer(tmp_path, a, (a, b, c))  # b leaves while it is no live candidate (dead a while)
    sp.group.joined[b] = 1
    sp.membership.tell_outsiders()
    sp.membership.outsiders.status_sent[b] = time.monotonic()
    _statuses(sp)
    sp.peer.known = (a, c)
    sp.group.depart(b, "silent in round 466")
    sp.membership.tell_outsiders()
    assert not _statuses(sp)  # b is not live; c was told a moment ago
    sp.peer.known = (a, b, c)  # back: owed our status at once
    sp.membership.tell_outsiders()
    assert [s.peer for s in _statuses(sp)] == [b]


def test_our_status_at_a_split_does_not_stop_us_answering_the_other_side(tmp_path):
    """Review of r6.22: a drops b and tells it its status at once; b still counts a in and ignores
    it, then drops a and tells a its own. a answers (it ranks higher), so b yields: the answer's
    limit (STATUS_REPLY_S) is not spent by the STATUS a sent b at the split."""
    from blocktrain.p2p.group import State
    from blocktrain.protocol import BlockUpdate

    ids = ("a" * 64, "b" * 64, "c" * 64)
    a, b = (_status_trainer(tmp_path, pid, ids) for pid in ids[:2])
    a.group.joined.update({ids[1]: 1, ids[2]: 1})
    b.group.joined.update({ids[0]: 1})
    a.membership.tell_outsiders(), b.membership.tell_outsiders()
    _statuses(a), _statuses(b)

    def deliver(src, dst):
        for s in _statuses(src):
            if s.peer == dst.peer.id:
                dst.membership.on_control(BlockUpdate(block=0, round=s.round, meta={**s.meta, "scope": dst.scope}),
                                          None, src.peer.id)
    a.group.depart(ids[1], "sees another group")  # a's group: a and c
    a.membership.tell_outsiders()
    deliver(a, b)  # b still counts a in: ignored
    assert b.group.state is State.TRAINING and not b.membership.rejoin
    b.group.depart(ids[0], "sees another group")  # b alone
    b.membership.tell_outsiders()
    deliver(b, a)  # a answers at once
    deliver(a, b)
    assert b.group.state is State.IDLE and b.membership.rejoin


async def test_a_member_split_off_alone_waits_for_the_other_sides_status(tmp_path):
    """r6.22: a member left alone by members that trained with it and departed its rounds alive
    waits, before its next round, until each has told it where it stands (SPLIT_WAIT_S at most):
    alone it trains a round in milliseconds and would finish its block apart. The wait ends on a
    larger group's STATUS (we yield), a lower one's (it will yield to us), a JOIN, or a death; an
    ADMIT (it still counts us in) does not end it. A LEAVE is no split; nor is a departure that
    leaves others with us, or a joiner that never trained with us."""
    from blocktrain.p2p.group import Phase, State
    from blocktrain.protocol import BlockUpdate

    ids = ("a" * 64, "b" * 64, "c" * 64)

    def hear(sp, pid, phase, **meta):
        sp.membership.on_control(BlockUpdate(block=0, round=470, meta={"phase": phase, "scope": sp.scope, **meta}),
                                 None, pid)

    async def split(me, others, why="sees another group"):
        sp = _status_trainer(tmp_path, me, ids)
        sp.group.joined.update({p: 1 for p in others})
        sp.membership.tell_outsiders()
        for p in others:
            sp.group.depart(p, why)
            sp.membership.tell_outsiders()
        return sp

    b = await split(ids[1], ids[0:1] + ids[2:])
    assert b.membership.split_pending()
    waiting = asyncio.ensure_future(b.membership.after_split())
    await asyncio.sleep(0.05)
    hear(b, ids[0], Phase.ADMIT.value, peer=ids[2], at=471)  # a still counts b in: no answer yet
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the next round waits
    hear(b, ids[0], Phase.STATUS.value, size=2, sponsor=ids[0], round=470)  # a's group of two: b yields
    await asyncio.wait_for(waiting, 1)
    assert b.membership.rejoin and b.group.state is State.IDLE

    a = await split(ids[0], ids[1:2])  # a alone, split from b
    waiting = asyncio.ensure_future(a.membership.after_split())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    hear(a, ids[1], Phase.STATUS.value, size=1, sponsor=ids[1], round=470)  # lower than a's: b will yield
    await asyncio.wait_for(waiting, 1)
    assert not a.membership.rejoin and a.group.state is State.TRAINING and not a.membership.split_pending()

    c = await split(ids[2], ids[1:2], "silent in round 466")
    waiting = asyncio.ensure_future(c.membership.after_split())
    await asyncio.sleep(0.05)
    hear(c, ids[1], Phase.JOIN.value, step=10, digest="0" * 16)  # b asks to join c: it stands alone
    await asyncio.wait_for(waiting, 1)

    c = await split(ids[2], ids[1:2], "silent in round 466")
    waiting = asyncio.ensure_future(c.membership.after_split())
    await asyncio.sleep(0.05)
    c.peer.known = (ids[0], ids[2])  # b declared dead: gone from the swarm's table
    c.peer.notify()
    await asyncio.wait_for(waiting, 1)

    c = await split(ids[2], ids[0:2])  # one left, then the other: alone only after the second
    assert c.membership.split_pending()
    c = _status_trainer(tmp_path, ids[2], ids)  # a departure that leaves another with us: no wait
    c.group.joined.update({ids[0]: 1, ids[1]: 1})
    c.membership.tell_outsiders()
    c.group.depart(ids[0], "sees another group")
    c.membership.tell_outsiders()
    assert not c.membership.split_pending()
    c = _one_departs(tmp_path, ids, ids[2], ids[1], "left",  # it said LEAVE: no split
                     lambda c: c.membership.left.update({ids[1]: "left the group (left)"}))
    assert not c.membership.split_pending()
    c = _one_departs(tmp_path, ids, ids[2], ids[1], "left",  # it left once by LEAVE, came back, then split:
                     lambda c: c.membership.left.update({ids[1]: "left the group (left)"}))
    c.group.joined[ids[1]] = 466  # admitted again (a gossip round never reads ``left``: tell_outsiders forgets it)
    c.membership.tell_outsiders()
    assert ids[1] not in c.membership.left
    c.group.depart(ids[1], "sees another group")
    c.membership.tell_outsiders()
    assert c.membership.split_pending()  # this split is waited for
    c = _status_trainer(tmp_path, ids[2], ids)  # a joiner admitted for a later round, gone before it
    c.group.joined[ids[1]] = 500  # pending: it never trained with us
    c.membership.tell_outsiders()
    c.group.depart(ids[1], "gave up its admission")
    c.membership.tell_outsiders()
    assert not c.membership.split_pending()


async def test_a_member_waiting_after_a_split_tells_one_that_counts_it_in_that_it_is_not_in_its_round(tmp_path):
    """At a partition, a member left alone waited out SPLIT_WAIT_S for its side-partner's
    STATUS while that partner, still counting it in, waited as long for its part. A part of a
    round ahead from a member it waits for is answered ABSENT at once (the partner departs it,
    then tells its STATUS); one from a member it does not wait for, or once the wait is over, is not."""
    from blocktrain.protocol import BlockUpdate

    ids = ("a" * 64, "b" * 64, "c" * 64)
    def part(rnd):
        return BlockUpdate(block=0, round=rnd, codec="raw", tensors=[to_wire("part", torch.zeros(4))],
                           meta={"phase": "reduce", "part": 0, "group": "0123456789abcdef"})

    b = _status_trainer(tmp_path, ids[1], ids)
    b.group.joined[ids[0]] = 1
    b.membership.tell_outsiders()
    b.group.depart(ids[0], "sees another group")  # b alone, split from a
    b.membership.tell_outsiders()
    told = []
    b.averager.tell_absent = lambda pid, rnd: told.append((pid, rnd))
    b.averager.current = 466
    assert b.membership.split_pending()
    b.membership._on_block_update(part(467), None, ids[2])  # c: not waited for
    b.membership._on_block_update(part(466), None, ids[0])  # a round behind ours: the averager's
    assert told == []
    b.membership._on_block_update(part(467), None, ids[0])
    assert told == [(ids[0], 467)] and b.membership.split_pending()  # we still wait for its STATUS
    b.membership.outsiders.split_from.clear()
    b.membership._on_block_update(part(468), None, ids[0])
    assert told == [(ids[0], 467)]


async def test_a_split_wait_ends_at_its_bound_tells_a_returning_peer_and_skips_excluded_ones(tmp_path, monkeypatch):
    """Review of r6.22: the wait after a split ends at SPLIT_WAIT_S whatever the other side does;
    a split peer that comes back (its connection redialled) during it hears our owed STATUS at
    once; a member we excluded is not waited for (it will not tell us where it stands). Another
    scope's JOIN is answered ABSENT in the joiner's scope (it takes answers of its own only)."""
    from blocktrain.p2p.group import Phase
    from types import SimpleNamespace

    from blocktrain.p2p.swarm import membership
    from blocktrain.protocol import BlockUpdate

    monkeypatch.setattr(membership, "SPLIT_WAIT_S", 1.0)
    ids = ("a" * 64, "b" * 64, "c" * 64)
    c = _status_trainer(tmp_path, ids[2], ids)
    c.group.joined[ids[1]] = 1
    c.membership.tell_outsiders()
    c.peer.known, c.peer.suspect = (ids[0], ids[2]), (ids[1],)  # b's connection closed: in the table, not live
    c.group.depart(ids[1], "silent in round 466")
    c.membership.tell_outsiders()
    assert c.membership.split_pending() and not [s for s in _statuses(c) if s.peer == ids[1]]
    t0 = time.monotonic()
    waiting = asyncio.ensure_future(c.membership.after_split())
    await asyncio.sleep(0.05)
    c.peer.known, c.peer.suspect = ids, ()  # b is back: told our status now, and we wait on for its answer
    c.peer.notify()
    await asyncio.sleep(0.05)
    assert [s.peer for s in _statuses(c)] == [ids[1]] and not waiting.done()
    await asyncio.wait_for(waiting, 2)  # no answer: the bound ends the wait
    assert 0.9 < time.monotonic() - t0 < 4 and not c.membership.split_pending()

    c = _one_departs(tmp_path, ids, ids[2], ids[1], "excluded",  # we excluded it: no split
                     lambda c: c.averager.banned.update({ids[1]: "its update was NaN"}))
    assert not c.membership.split_pending()

    c.sent.clear()
    c.membership.on_control(BlockUpdate(block=3, round=1, meta={"phase": "join", "scope": "block:3", "step": 0,
                                                                "digest": "0" * 16}), None, ids[0])
    (absent,) = c.sent
    assert absent.peer == ids[0] and absent.meta == {"phase": Phase.ABSENT.value, "scope": "block:3"}
    wire = []  # and on the wire: Membership.send keeps that scope (ours is only the default) and adds our job
    c.membership.job = "0123456789abcdef.0123456789abcdef"
    c.peer.live_connection = lambda pid: SimpleNamespace(send_nowait=wire.append)
    type(c.membership).send(c.membership, [absent])
    (msg,) = wire
    assert msg.meta == {"phase": "absent", "scope": "block:3", "job": c.membership.job}


@pytest.mark.parametrize("sync", ["grads", "params"])
async def test_a_round_trained_alone_answers_the_parts_of_a_member_that_still_counts_us_in(tmp_path, sync):
    """Review of r6.22: every lone round (not only under overlap) moves the averager's round on,
    so parts of it that a member still counting us in sent are answered ABSENT at once."""
    from blocktrain.p2p.group import State
    node = _FakeNode("a" * 64)
    node.known = ("a" * 64,)
    sp = _swarm_trainer(node, tmp_path)
    sp.scfg.sync = sync
    sp.prepare()
    sp.group.state, sp.group.round, sp.pos.rnd = State.TRAINING, 4, 4
    told = []
    sp.averager.tell_absent = lambda pid, rnd: told.append((pid, rnd))
    sp.averager.expect_members(["b" * 64])
    sp.averager._hold(5, "b" * 64, _held_part())
    await sp.rounds.step()
    assert sp.averager.current == 5 and told == [("b" * 64, 5)]


def _held_part():
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.protocol import BlockUpdate
    return BlockUpdate(block=0, round=5, tensors=(to_wire("part", torch.randn(7)),),
                       meta={"phase": "reduce", "part": 0, "group": "0" * 16})


def test_a_joiner_named_in_an_admit_is_never_dialled_as_an_address(tmp_path):
    """A member passes a new admission on to the joiners pending (group.py rule 2). A keyed member
    could name an address as the joiner ("10.9.9.9:22"): the node dials a peer id it does not know
    as an address, so the swarm would have dialled it, and every host it named. An ADMIT names a
    peer id (64 hex characters) or is dropped, and control messages go only to live connections and
    members we know."""
    from types import SimpleNamespace

    from blocktrain.p2p.group import State
    from blocktrain.protocol import BlockUpdate

    dialled = []

    class _Node(_FakeNode):
        known = ("b" * 64, "j" * 64)
        def member(self, pid):
            return SimpleNamespace(peer_id=pid) if pid in self.known else None
        def live_connection(self, pid): return None
        def spawn(self, coro, what):
            dialled.append(coro.cr_frame.f_locals["pid"])
            coro.close()
    sp = _swarm_trainer(_Node("a" * 64), tmp_path)
    g = sp.group
    g.state, g.round, g.joined = State.TRAINING, 5, {"b" * 64: 1, "j" * 64: 8}  # j pending
    for joiner in ("10.9.9.9:22", "e" * 64):
        sp.membership.on_control(BlockUpdate(block=0, round=5, meta={"phase": "admit", "peer": joiner, "at": 7,
                                                        "scope": sp.scope}), None, "b" * 64)
    assert "10.9.9.9:22" not in g.joined  # not a peer id: not taken
    assert g.joined["e" * 64] == 8 and set(dialled) == {"j" * 64}  # e is no member we know: not dialled


def test_a_member_flooding_ready_cannot_push_out_another_members(tmp_path):
    """A joiner keeps the READYs of its join attempt (at most 16, the oldest round dropped first):
    a keyed member sending READYs for later and later rounds pushed out the honest member's READY
    for the joiner's round, and the joiner waited for its timeout. Now one member holds at most 2."""
    from blocktrain.protocol import BlockUpdate

    sp = _swarm_trainer(_FakeNode("a" * 64), tmp_path)
    sp.membership.joining = True

    def ready(pid, at):
        sp.membership.on_control(BlockUpdate(block=0, round=at, meta={"phase": "ready", "at": at, "name": f"block0.r{at}",
                                                         "scope": sp.scope}), None, pid)
    ready("b" * 64, 7)
    for at in range(8, 200):
        ready("f" * 64, at)
    assert sp.membership.readies.named[(7, "b" * 64)] == "block0.r7"
    assert sorted(sp.membership.readies.named) == [(7, "b" * 64), (198, "f" * 64), (199, "f" * 64)]


@pytest.mark.parametrize("steps", [True, False])
async def test_the_pair_window_judges_optimizer_steps_only(steps):
    """The sign flipper, the driver: a member whose sign parts point against the others' while
    it still agrees with the median is excluded by the pair window (r6.20) where the parts are
    optimizer steps (``steps``: sync params), and not where they are per-step gradients, whose
    cosines late in a deeper block are too noisy to judge by."""
    import blocktrain.p2p.averaging as avm
    from blocktrain.p2p.averaging import driver, robust
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    av = avm.Averager(a, 0, codec="sign", steps=steps)
    try:
        ids = [a.id, "b" * 64, "c" * 64, "d" * 64]
        torch.manual_seed(4)
        for rnd in range(1, robust.PAIR_MIN_ROUNDS + driver.SUSPECT_ROUNDS):
            g = 0.5 * torch.randn(20_000)
            xs = [g + torch.randn(20_000) for _ in range(3)] + [-(g + torch.randn(20_000))]
            spec = avm.RoundSpec(aggregate="robust", codec="sign")
            rs = {p: avm.AveragingRound(p, 0, rnd, ids, x, spec) for p, x in zip(ids, xs)}
            queue = [(p, part) for p, r in rs.items() for part in r.start()]
            while queue:
                src, part = queue.pop(0)
                queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
            assert not rs[a.id].opposed() and not rs[a.id].suspects  # the median and the distances miss it
            av._suspicions(rs[a.id], rnd)
        assert set(av.banned) == ({"d" * 64} if steps else set())
    finally:
        await a.stop()


async def test_a_member_whose_updates_point_against_the_median_is_excluded_after_its_streak():
    """The sign flipper, the driver: a member reported opposed SUSPECT_ROUNDS rounds in a row is
    excluded and named with the reason (before, only distance counted and it was never named)."""
    import blocktrain.p2p.averaging as avm
    from blocktrain.p2p.averaging import driver
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    av = avm.Averager(a, 0)
    try:
        ids = [a.id, "b" * 64, "c" * 64, "d" * 64]
        torch.manual_seed(4)
        for rnd in range(1, driver.SUSPECT_ROUNDS + 1):
            g = torch.randn(5000)
            xs = [g + 0.5 * torch.randn(5000) for _ in range(3)] + [-(g + 0.5 * torch.randn(5000))]
            rs = {p: avm.AveragingRound(p, 0, rnd, ids, x, avm.RoundSpec(aggregate="robust")) for p, x in zip(ids, xs)}
            queue = [(p, part) for p, r in rs.items() for part in r.start()]
            while queue:
                src, part = queue.pop(0)
                queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
            assert "d" * 64 in rs[a.id].opposed() and not rs[a.id].suspects  # no distance outlier
            av._suspicions(rs[a.id], rnd)
            assert ("d" * 64 in av.banned) == (rnd == driver.SUSPECT_ROUNDS)
        assert "pointing against the others' updates or their median" in av.banned["d" * 64]
        assert not {"b" * 64, "c" * 64} & set(av.banned)
    finally:
        await a.stop()
