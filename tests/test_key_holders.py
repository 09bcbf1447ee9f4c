"""A holder of the swarm key may be an attacker, and identities are free. One test per
finding fixed: what a key holder could do, and what the peer does now."""

import asyncio
import itertools
import os

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocktrain.p2p import node as node_mod
from blocktrain.p2p.ledger import DEPARTED_ROW
from blocktrain.p2p.members import Member
from blocktrain.p2p.node import Peer
from blocktrain.p2p.tensors import to_wire
from blocktrain.p2p.transport import Timeouts, make_connection, open_connection
from blocktrain.protocol import (Announce, BlockUpdate, PeerInfo, PeerList, PipelineForward, PipelineResult, Ping,
                                 ProtocolError, Role, Status, StreamChunk, StreamEnd, StreamOpen, StreamRequest, StreamReset)

FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.2, dead_after_s=30, close_s=1)


# --- finding 1: identity churn --------------------------------------------------------------------

async def _churn(port: int, psk: bytes, n: int, goodbye_every: int = 2):
    """``n`` fresh identities, one after another: handshake as a member, ANNOUNCE, PING, then a
    GOODBYE (every ``goodbye_every``-th one vanishes without it instead)."""
    for i in range(n):
        key = X25519PrivateKey.generate()
        info = {"addr": f"127.0.0.{2 + i % 200}:9", "blocks": [0], "role": "train"}
        pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, key, psk, info=info), FAST)
        from blocktrain.p2p.identity import peer_id
        pc.send_nowait(Announce(peer=PeerInfo(peer_id(key), info["addr"], (0,), "train", 0)))
        pc.send_nowait(Ping(nonce=i + 1))
        if i % goodbye_every:
            await pc.close("bye")
        else:
            await pc.drain()
            pc.abort("vanished")
        await pc.wait_closed()


async def test_churned_identities_leave_bounded_state_and_exact_totals(monkeypatch):
    """Finding 1: 300 identities that join and leave (half with GOODBYE, half vanishing) leave at
    most the bounded number of members, events, traffic rows, remembered ids and redials, while
    the traffic totals still count every frame they sent."""
    for name, value in (("MAX_MEMBERS", 24), ("MAX_EVENTS", 40), ("MAX_TRAFFIC_ROWS", 16), ("MAX_KNOWN_IDS", 50),
                        ("MAX_REDIALS", 8)):
        monkeypatch.setattr(node_mod, name, value)
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    try:
        n = 300
        await asyncio.wait_for(_churn(a.port, psk, n), 120)
        await a.wait_for(lambda: not a.members(), 10)
        kept = a.kept()
        assert kept["members"] <= 24 and len(a.events) <= 40 and a.events_dropped > 0
        # rows: the members still known (suspects, bounded above) and at most 16 others, folded past that
        assert kept["traffic_rows"] <= 16 + kept["members"] + 1 and kept["known"] <= 50 and kept["redials"] <= 8
        rep = a.traffic_report()
        assert rep["peers"][DEPARTED_ROW]["departed_peers"] >= n - 24 - 16
        # each identity sent at least its handshake messages, ANNOUNCE and PING: every one counted
        assert rep["totals"]["received"]["frames"] >= 3 * n
        assert set(a.status()) >= {"members", "traffic"}
    finally:
        await a.stop()


# --- finding 2: inbound handlers and a peer's bad types --------------------------------------------

class FakeConn:
    """What a handler sees of a connection, with nothing behind it: replies are kept, a close is noted."""

    def __init__(self, loop):
        self.sent, self.refused, self.name, self.last_heard = [], None, "fake", 0.0
        self.closed = loop.create_future()
        self.peer_addr = ("127.0.0.1", 9)
        self.transport = None  # no socket behind it: nothing of ours is ever unsent

    def send_nowait(self, msg, bulk=False):
        if self.refused is not None:
            raise ConnectionError("closed")
        self.sent.append(msg)

    async def send(self, msg, bulk=False):
        self.send_nowait(msg)

    async def drain(self):
        pass

    def abort_with(self, code, reason, cause):
        self.refused = (code, reason)

    def abort(self, reason, cause=None):
        self.refused = (None, reason)


KEYS = ("phase", "part", "group", "round_group", "departed", "contributors", "reason", "scope", "peer", "at", "name",
        "why", "size", "sponsor", "step", "digest", "members", "same", "after", "block", "reply_to", "session", "mode",
        "spec", "blocks", "end", "codec", "compute_s", "error", "hop", "fault", "drafter")
PHASES = ("join", "welcome", "admit", "ready", "absent", "excluded", "leave", "status", "reduce", "gather", "split")
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=12), st.sampled_from(PHASES), st.binary(max_size=8))
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=12)
meta = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), value, max_size=8)
uint = st.integers(0, 2**32)
WIRE = [to_wire("x", torch.zeros(3)), to_wire("x", torch.randn(1, 4, 16)), to_wire("logits", torch.zeros(2, 2)),
        to_wire("x", torch.zeros(4, dtype=torch.int16))]
tensors = st.lists(st.integers(0, len(WIRE) - 1).map(WIRE.__getitem__), max_size=2).map(tuple)
text = st.text(max_size=20)
def _valid(cls, **fields):
    """Messages of ``cls`` with these fields, where its constructor accepts them (what a decoder
    can hand a handler: everything the protocol itself refuses never gets that far)."""
    def build(kw):
        try:
            return cls(**kw)
        except ProtocolError:
            return None
    return st.fixed_dictionaries(fields).map(build).filter(lambda m: m is not None)


sid = st.integers(1, 9)
messages = st.one_of(
    _valid(BlockUpdate, block=st.integers(0, 3), round=uint, tensors=tensors, meta=meta),
    _valid(PipelineForward, request_id=uint, route=st.lists(text, max_size=4).map(tuple), hop=st.integers(0, 4),
           tensors=tensors, meta=meta),
    _valid(PipelineResult, request_id=uint, tensors=tensors, meta=meta),
    _valid(Status, status=meta),
    _valid(StreamRequest, stream_id=sid, kind=st.sampled_from(["checkpoint", "update", "x"]), name=text, offset=uint),
    _valid(StreamOpen, stream_id=sid, kind=st.sampled_from(["checkpoint", "update"]), name=text, total_size=uint,
           offset=uint, meta=meta),
    _valid(StreamChunk, stream_id=sid, offset=uint, data=st.binary(max_size=16)),
    _valid(StreamEnd, stream_id=sid),
    _valid(StreamReset, stream_id=sid, reason=text),
    _valid(PeerList, peers=st.lists(st.builds(PeerInfo, peer_id=st.sampled_from(["ab" * 32, "cd" * 32]),
                                              addr=st.sampled_from(["", "127.0.0.1:1"])), max_size=3).map(tuple)),
)

# What a refusal may be: a handler that names what is wrong (a protocol error or a ValueError).
TYPED = {"RemoteProtocolError", "LocalProtocolError", "ProtocolError", "ValueError", "BadUpdate"}


@pytest.fixture
def served_peer(tmp_path):
    """A member with every service a training and serving peer runs: swarm training (its group
    control and averaging), checkpoint streams and serving."""
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec

    loop = asyncio.new_event_loop()
    peer = loop.run_until_complete(Peer(X25519PrivateKey.generate(), os.urandom(32), "127.0.0.1", 0, blocks=(0,),
                                        timeouts=FAST).start())
    mc = ModelConfig(d_model=16, n_head=2, n_layer=2, n_blocks=2, max_seq_len=32)
    data = as_tensor(read_split("valid"))[:4096]
    job = PeerJob(mc, TrainConfig(steps=4, batch_size=2, seq_len=16, warmup=1), SwarmConfig())
    SwarmTrainer(peer, TrainerSpec(0, job, tmp_path / "w"), data, data)
    PipelineServer(peer, ServedBlocks(blocktrain={0: Block(mc, 0).eval()}))
    member = "ee" * 32
    peer._table.by_id[member] = Member(PeerInfo(member, "127.0.0.1:9", (0,), "train", 0), 0.0)
    yield loop, peer, member
    loop.run_until_complete(peer.stop())
    loop.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(msgs=st.lists(messages, min_size=1, max_size=6))
def test_no_message_of_any_shape_kills_a_handler(served_peer, msgs):
    """Finding 2, as a property over the message schema: whatever fields a member's messages hold,
    dispatching them raises nothing; a refusal closes that sender's connection and names what was
    wrong (a typed error, never a TypeError from deep inside); the peer still answers status."""
    loop, peer, member = served_peer

    async def run():
        pc = FakeConn(loop)
        for m in msgs:
            if not peer.dispatch(m, pc, member):
                assert pc.refused is not None
                break
        pending = [t for t in peer._tasks if t.get_name().startswith("handle ")]
        await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
        return pc
    loop.run_until_complete(run())
    assert set(peer.input_failures) <= TYPED, peer.input_failures
    assert peer.status()["peer_id"] == peer.id


async def test_a_handler_that_raises_closes_only_its_senders_connection():
    """Finding 2, through real sockets: a message a handler chokes on closes that connection with
    an Error frame; the peer goes on answering everyone else."""
    from blocktrain.p2p.view import query_status
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    b = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()

    def chokes(msg, pc, pid):
        raise TypeError("unhashable type: 'list'")
    a.on(BlockUpdate, chokes, inline=True)
    try:
        await b.join("127.0.0.1", a.port)
        await a.wait_for(lambda: len(a.members()) == 1, 10)
        (await b.connection(a.id)).send_nowait(BlockUpdate(block=0, round=1, meta={"phase": ["x"]}))
        assert await a.wait_for(lambda: a.input_failures.get("TypeError") == 1, 10)
        st_ = await query_status("127.0.0.1", a.port, X25519PrivateKey.generate(), psk, FAST)
        assert st_["peer_id"] == a.id
    finally:
        await a.stop()
        await b.stop()


# --- finding 7: a forged reply_to -----------------------------------------------------------------

async def test_a_forged_reply_to_reaches_nobody_but_its_sender():
    """Finding 7: a client that names another client in ``reply_to`` is refused on its own
    connection; the named client hears nothing (and its request ids cannot be guessed)."""
    from blocktrain.p2p.serving.client import _request_id
    from blocktrain.p2p.serving.server import refuse_requests
    from blocktrain.p2p.transport import CLIENT_INFO
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    refuse_requests(a)
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
    b = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    PipelineServer(b, ServedBlocks(blocktrain={0: Block(ModelConfig(d_model=16, n_head=2, n_layer=2, n_blocks=2,
                                                                    max_seq_len=32), 0).eval()}))
    keys = [X25519PrivateKey.generate() for _ in range(2)]
    from blocktrain.p2p.identity import peer_id
    try:
        for server in (a, b):  # a peer serving nothing, and a serving hop
            victim, attacker = [await open_connection("127.0.0.1", server.port, make_connection(
                Role.INITIATOR, k, psk, info=CLIENT_INFO), FAST) for k in keys]
            await server.wait_for(lambda: server.client_connection(peer_id(keys[0])) is not None, 10)
            attacker.send_nowait(PipelineForward(request_id=1, route=("x:1", "y:2"), hop=0,
                                                 meta={"mode": "exact", "session": 1, "blocks": [0, 1],
                                                       "reply_to": peer_id(keys[0])}))
            got = await asyncio.wait_for(attacker.recv(), 10)
            assert isinstance(got, PipelineResult) and "error" in got.meta
            victim.send_nowait(Status(status={}))  # the victim's next message is its status answer
            reply = await asyncio.wait_for(victim.recv(), 10)
            assert isinstance(reply, Status), reply
            for pc in (victim, attacker):
                await pc.close("done")
        assert len({_request_id() for _ in range(1000)}) == 1000
    finally:
        await a.stop()
        await b.stop()


# --- finding 3: stream requests from many identities ----------------------------------------------

async def test_stream_requests_from_many_identities_are_bounded_in_all(tmp_path):
    """Finding 3: 12 identities x 4 requests for a 12 MiB file at once: at most MAX_STREAMS run at
    once in all (the others are refused "busy"): what the server holds is a chunk per running
    stream (test_hardening bounds that), so a few chunks in all, not a file per identity."""
    from blocktrain.p2p.checkpoints import MAX_STREAMS, CheckpointServer
    from blocktrain.p2p.transport import CLIENT_INFO
    psk = os.urandom(32)
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "block0.safetensors").write_bytes(os.urandom(12 << 20))
    server = CheckpointServer(a, tmp_path)
    serve, running, refused = server._serve, [0, 0, 0], []

    async def counted(req, pc, pid):  # streams running now, at most at once, started
        running[0] += 1
        running[1] = max(running[:2])
        running[2] += 1
        try:
            await serve(req, pc, pid)
        finally:
            running[0] -= 1
    server._serve = counted
    from blocktrain.p2p import checkpoints
    refuse = checkpoints.refuse

    async def noted(req, pc, why):
        refused.append(why)
        await refuse(req, pc, why)
    checkpoints.refuse = noted
    conns = []
    try:
        for _ in range(12):
            pc = await open_connection("127.0.0.1", a.port, make_connection(
                Role.INITIATOR, X25519PrivateKey.generate(), psk, info=CLIENT_INFO), FAST)
            conns.append(pc)
            for sid in range(1, 5):
                pc.send_nowait(StreamRequest(kind="checkpoint", name="block0", offset=0, stream_id=sid))
        deadline = asyncio.get_running_loop().time() + 60  # generous: 48 requests on a loaded machine
        while running[2] + len(refused) < 48:  # nothing here notifies the peer's waiters: look every 50 ms
            assert asyncio.get_running_loop().time() < deadline, (running, len(refused))
            await asyncio.sleep(0.05)
        assert running[1] <= MAX_STREAMS
        assert all(why.startswith("busy") for why in refused)
    finally:
        checkpoints.refuse = refuse
        for pc in conns:
            pc.abort("done")
        await a.stop()


# --- finding 8: serving floods from many identities -----------------------------------------------

async def test_compute_slots_go_fairly_by_client_and_a_flood_gives_way():
    """Finding 8: a client with many traversals waiting does not delay another by its queue: the
    flooder already holds the slot, so the other goes next, then the flood's; past
    ``max_waiting`` the flooding client's newest waiter gives way, and the flooder itself is
    refused at once."""
    from blocktrain.p2p.serving.fair import FairSlots, Saturated
    slots, order = FairSlots(1, max_waiting=4, newcomer_tokens=0), []
    await slots.acquire("flood")  # the one slot is busy

    async def job(who, tag):
        await slots.acquire(who)
        order.append(tag)
    flood = [asyncio.ensure_future(job("flood", f"f{i}")) for i in range(4)]
    await asyncio.sleep(0)
    mine = asyncio.ensure_future(job("me", "me"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert flood[-1].done() and isinstance(flood[-1].exception(), Saturated)  # the newest gave way
    with pytest.raises(Saturated):
        await slots.acquire("flood")  # it holds the most waiting: refused at once
    for holder in ["flood", "me", "flood", "flood"]:
        slots.release(holder)
        await asyncio.sleep(0)
    assert order == ["me", "f0", "f1", "f2"] and mine.done()
    late = asyncio.ensure_future(slots.acquire("x"))
    await asyncio.sleep(0)
    late.cancel()  # a waiter cancelled leaves no trace; the slot still goes round
    slots.release("flood")
    await asyncio.sleep(0)
    assert slots.waiting() == 0 and slots.free == 1


async def test_a_flows_own_queue_never_makes_its_waiters_overdue_ahead_of_others():
    """A flood from one address is one flow with many waiting parts, served in turn. Its own
    parts served meanwhile do not make its waiters overdue (MAX_BYPASS): a client arriving while
    it waits goes at the next part, not after every flood part that waited long (it went after
    all the overdue ones, 30 here)."""
    from blocktrain.p2p.serving.fair import MAX_BYPASS, FairSlots
    slots, order = FairSlots(1, max_waiting=200, newcomer_tokens=0), []
    await slots.acquire("flood", 16)

    async def job(who, tag):
        await slots.acquire(who, 16 if who == "flood" else 1)
        order.append(tag)
    flood = [asyncio.ensure_future(job("flood", "f")) for _ in range(MAX_BYPASS + 30)]
    await asyncio.sleep(0)
    for _ in range(MAX_BYPASS + 1):  # the flood's own parts, one after another
        slots.release("flood")
        await asyncio.sleep(0)
    order.clear()
    mine = asyncio.ensure_future(job("me", "me"))
    await asyncio.sleep(0)
    slots.release("flood")
    await asyncio.sleep(0)
    assert order == ["me"] and mine.done()
    slots.release("me")
    for _ in range(len(flood)):
        await asyncio.sleep(0)
        if slots.waiting() == 0:
            break
        slots.release("flood")
    for f in flood:
        f.cancel()


async def test_a_flood_served_out_of_turn_once_does_not_go_first_again_at_once():
    """MAX_BYPASS counts per flow, from the flow's last part served: a flood's waiters that waited
    long behind their own flow, while another flow was served in turn beside them, are not each
    overdue when they reach the head of the flood's queue. Counted per waiter, they went first one
    after another, and a client arriving then waited behind them."""
    from blocktrain.p2p.serving.fair import MAX_BYPASS, FairSlots
    slots, order = FairSlots(1, max_waiting=400, newcomer_tokens=0), []
    await slots.acquire("flood", 16)

    async def job(who, cost):
        await slots.acquire(who, cost)
        order.append(who)
    flood = [asyncio.ensure_future(job("flood", 16)) for _ in range(2 * MAX_BYPASS + 40)]
    other = [asyncio.ensure_future(job("other", 16))]
    await asyncio.sleep(0)
    holder = "flood"
    for _ in range(2 * MAX_BYPASS + 16):  # flood and other take turns; the flood's later waiters age
        slots.release(holder)
        await asyncio.sleep(0)
        holder = order[-1]
        if holder == "other":
            other.append(asyncio.ensure_future(job("other", 16)))
            await asyncio.sleep(0)
    n = len(order)
    mine = asyncio.ensure_future(job("me", 1))
    await asyncio.sleep(0)
    for _ in range(3):
        slots.release(holder)
        await asyncio.sleep(0)
        holder = order[-1]
        if holder == "me":
            break
        if holder == "other":
            other.append(asyncio.ensure_future(job("other", 16)))
            await asyncio.sleep(0)
    assert mine.done(), order[n:]
    for f in flood + other:
        f.cancel()
    await asyncio.gather(*flood, *other, return_exceptions=True)


async def test_a_flows_waiters_start_after_its_parts_served_so_the_queue_keeps_its_order():
    """A flow's waiting parts start after the parts it was served meanwhile, each after the one
    before (only the first moved on before: its later waiters kept the tags they came with, far
    behind the flow's time). With the queue full, the flow's newest request is then the one
    refused, not its oldest waiter, and a client of another flow is not taken for the last."""
    from blocktrain.p2p.serving.fair import FairSlots, Saturated
    slots = FairSlots(1, max_waiting=4, newcomer_tokens=0)
    await slots.acquire("me", 64)
    slots.release("me")  # known, its time 64
    go, done = asyncio.Event(), asyncio.Event()

    async def long_request():
        async with slots.hold("flood", 16) as between:
            await go.wait()
            for _ in range(20):  # computed part after part: the flood's time moves on to 400
                await between(16)
            await done.wait()
    holder = asyncio.ensure_future(long_request())
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(slots.acquire("flood", 16)) for _ in range(3)]
    await asyncio.sleep(0)
    go.set()
    for _ in range(3):
        await asyncio.sleep(0)
    mine = asyncio.ensure_future(slots.acquire("me", 1))  # starts at 400 - 256: before the flood's waiters, not last
    await asyncio.sleep(0)
    late = asyncio.ensure_future(slots.acquire("flood", 16))  # the queue is full
    await asyncio.sleep(0)
    assert late.done() and isinstance(late.exception(), Saturated)
    assert not any(q.done() for q in queued) and not mine.done()  # nobody waiting lost its place
    for w in queued + [mine]:
        w.cancel()
    done.set()
    await holder
    assert slots.waiting() == 0 and slots.free == 1


async def test_compute_slots_are_fair_over_tokens_not_traversals():
    """Finding 8, live: 8 identities kept 8 traversals of 200 tokens each in flight, and a client
    of ~20-token traversals waited its turn behind every identity's (49x slower than alone). Fair
    over tokens, a client that comes back after a round trip goes next; clients asking alike
    still alternate."""
    from blocktrain.p2p.serving.fair import FairSlots
    slots, order = FairSlots(1, max_waiting=64, newcomer_tokens=0), []
    await slots.acquire("legit", 20)  # the client's earlier traversal: the hop knows it
    slots.release("legit")

    async def job(who, cost):
        await slots.acquire(who, cost)
        order.append(who)
    await slots.acquire("busy", 1)  # the slot is taken: everyone below waits
    floods = [asyncio.ensure_future(job(f"flood{i}", 200)) for i in range(8) for _ in range(2)]
    await asyncio.sleep(0)
    for _ in range(9):  # each flooder served once (and one twice): each is 200 tokens or more ahead
        slots.release(order[-1] if order else "busy")
        await asyncio.sleep(0)
    legit = asyncio.ensure_future(job("legit", 20))
    await asyncio.sleep(0)
    slots.release(order[-1])
    await asyncio.sleep(0)
    assert order[-1] == "legit" and legit.done()  # served next, ahead of 7 waiting flood traversals
    assert sorted(order[:8]) == [f"flood{i}" for i in range(8)]  # alike: one each before anyone's second
    for f in floods:
        f.cancel()
    await asyncio.gather(*floods, return_exceptions=True)


async def _request(slots, who: str, parts: int, log: list, cost: int = 16):
    """A request computed in ``parts`` parts of ``cost`` (a traversal in chunks); each part is
    logged, then yields to the loop as compute off the loop would."""
    async with slots.hold(who, cost) as between:
        for i in range(parts):
            log.append((who, i))
            await asyncio.sleep(0)
            if i + 1 < parts:
                await between(cost)


async def test_fresh_identities_share_one_flow_until_each_was_served_its_newcomer_tokens():
    """Identities are free: a hop shares its compute per flow, and every client it does not know
    yet is one flow, the newcomers'. 24 fresh identities each with a 4-chunk request take turns
    with one known client's 24 one-chunk requests as one flow: the client waits for at most one
    of their chunks at a time (with a flow per identity it waited for up to 24). A newcomer becomes a
    flow of its own once served NEWCOMER_TOKENS, for its next request, not in the middle of one;
    what is kept of newcomers is bounded."""
    from blocktrain.p2p.serving import fair
    slots, log = fair.FairSlots(1, max_waiting=64), []
    await _request(slots, "legit", fair.NEWCOMER_TOKENS // 16, [])  # served enough: a flow of its own
    assert slots.flow("legit") == "legit" and slots.flow("fresh0") == fair.NEWCOMERS
    await slots.acquire("hog", 16)  # the slot is taken: everyone below waits
    fresh = [asyncio.ensure_future(_request(slots, f"fresh{i}", 4, log)) for i in range(24)]
    await asyncio.sleep(0)
    mine = [asyncio.ensure_future(_request(slots, "legit", 1, log)) for _ in range(24)]
    await asyncio.sleep(0)
    slots.release("hog")
    await asyncio.gather(*fresh, *mine)
    served = [who for who, _ in log]
    gaps = [len(list(run)) for k, run in itertools.groupby(served, key=lambda w: w == "legit") if not k]
    assert served.count("legit") == 24 and max(gaps[:-1] or [0]) <= 1, served  # one flow against one

    slots, limit, fair.MAX_CLIENTS = fair.FairSlots(1, max_waiting=64), fair.MAX_CLIENTS, 8
    try:
        async with slots.hold("new", fair.NEWCOMER_TOKENS) as between:
            await between(16)  # served its newcomer tokens meanwhile: still a newcomer in this request
            assert slots.flow("new") == fair.NEWCOMERS
        assert slots.flow("new") == "new"  # its next request is its own flow
        for i in range(20):  # newcomers served a little each: what is kept of them is bounded
            await _request(slots, f"brief{i}", 1, [])
        assert len(slots._trial) <= 8 and slots.flow("brief19") == fair.NEWCOMERS
    finally:
        fair.MAX_CLIENTS = limit


async def test_newcomers_take_turns_and_are_made_known_by_what_was_computed():
    """A review of the newcomers' flow: inside it a newcomer's long request kept the slot against
    every other newcomer (one waited 200 parts); a part cut short counted toward being made known
    (a request refused at its first chunk bought an identity its tokens); a slot taken with
    ``acquire`` was given back in the client's new flow once it was made known meanwhile (the
    newcomers' slot was lost); and a client just made known was the first the hop forgot."""
    from blocktrain.p2p.serving import fair
    slots, log = fair.FairSlots(1, max_waiting=64), []
    long = asyncio.ensure_future(_request(slots, "long", 40, log))
    await asyncio.sleep(0)
    short = asyncio.ensure_future(_request(slots, "short", 1, log))
    await asyncio.gather(long, short)
    assert [w for w, _ in log].index("short") <= 2, log  # its turn after one part of the long one

    slots = fair.FairSlots(1, max_waiting=64)
    with pytest.raises(RuntimeError):
        async with slots.hold("cut", fair.NEWCOMER_TOKENS):
            raise RuntimeError("the chunk failed")  # nothing computed
    assert slots.flow("cut") == fair.NEWCOMERS
    async with slots.hold("cut", fair.NEWCOMER_TOKENS):
        pass
    assert slots.flow("cut") == "cut"

    slots = fair.FairSlots(2, max_waiting=64)
    await slots.acquire("x", fair.NEWCOMER_TOKENS)
    await slots.acquire("x", fair.NEWCOMER_TOKENS)
    slots.release("x")  # computed: "x" is made known while it holds a newcomers' slot
    assert slots.flow("x") == "x"
    slots.release("x")  # the newcomers' slot it took, given back there
    assert slots.free == 2 and not slots._held

    slots, limit, fair.MAX_CLIENTS = fair.FairSlots(1, max_waiting=64), fair.MAX_CLIENTS, 4
    try:
        for i in range(3):
            await _request(slots, f"once{i}", 1, [], cost=1)  # made known at once: one part each
            slots._trial[f"once{i}"] = (fair.NEWCOMER_TOKENS, 1)
            slots._graduate(f"once{i}")
        await _request(slots, "known", fair.NEWCOMER_TOKENS // 16, [])  # 16 parts as a newcomer
        assert slots.flow("known") == "known"
        for i in range(3):
            await _request(slots, f"once{i}", 1, [], cost=1)
        assert slots.flow("known") == "known"  # the one served 16 parts is kept, not the newest
    finally:
        fair.MAX_CLIENTS = limit


async def test_a_newcomer_between_parts_keeps_its_place_and_turns_reach_every_newcomer():
    """A third review: a newcomer's request waiting between its parts behind other newcomers was
    taken for the newest waiter and refused when a known client needed room (its computed chunks
    lost); and a newcomer with two requests in flight kept the slot for the whole first one while
    another newcomer waited behind its second (151 parts)."""
    from blocktrain.p2p.serving import fair
    slots = fair.FairSlots(1, max_waiting=3)
    await _request(slots, "K", fair.NEWCOMER_TOKENS // 16, [])  # known
    async with slots.hold("A", 16) as between:
        b, c, d = (asyncio.ensure_future(slots.acquire(w, 16)) for w in "BCD")
        await asyncio.sleep(0)
        a_next = asyncio.ensure_future(between(16))  # A's next part goes behind B, C and D; B computes
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert b.done() and slots.waiting() == 3  # C, D, A (started): full
        k = asyncio.ensure_future(slots.acquire("K", 16))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert isinstance(d.exception(), fair.Saturated) and not a_next.done()  # the newest request gave way
        for t in (c, k, a_next):
            t.cancel()
        await asyncio.gather(c, k, a_next, return_exceptions=True)
        slots.release("B")
    assert slots.free == 1

    slots, log = fair.FairSlots(1, max_waiting=64), []
    r1 = asyncio.ensure_future(_request(slots, "X", 20, log))
    await asyncio.sleep(0)
    r2 = asyncio.ensure_future(_request(slots, "X", 20, log))
    await asyncio.sleep(0)
    c = asyncio.ensure_future(_request(slots, "C", 1, log))
    await asyncio.gather(r1, r2, c)
    assert [w for w, _ in log].index("C") <= 4, log  # within a part or two of coming


async def test_a_long_traversal_hands_its_slot_on_between_chunks():
    """A 200-token traversal no longer holds its slot throughout: a client coming back takes it at
    the next chunk boundary and finishes its short traversal; then the long one goes on, before
    its own client's next traversal (a client's traversals finish in turn)."""
    from blocktrain.p2p.serving.fair import FairSlots
    slots, log = FairSlots(1, max_waiting=64, newcomer_tokens=0), []
    await _request(slots, "legit", 1, [])  # its earlier traversal: the hop knows it
    long = asyncio.ensure_future(_request(slots, "flood", 13, log))
    await asyncio.sleep(0)
    nxt = asyncio.ensure_future(_request(slots, "flood", 13, log))
    for _ in range(6):
        await asyncio.sleep(0)
    at = len(log)  # the long one is at its part at - 1
    legit = asyncio.ensure_future(_request(slots, "legit", 2, log))
    await asyncio.gather(long, nxt, legit)
    whose = [w for w, _ in log]
    first = whose.index("legit")
    assert 0 < at <= first <= at + 1 < 13 and whose[first:first + 2] == ["legit", "legit"], (at, whose)  # next boundary
    assert log[:first + 2 + 13 - first] == [("flood", i) for i in range(first)] + [("legit", 0), ("legit", 1)] + \
        [("flood", i) for i in range(first, 13)]  # then the long one, to its end
    assert log[-13:] == [("flood", i) for i in range(13)] and slots.free == 1 and slots.waiting() == 0


async def test_an_idle_client_banks_a_bounded_credit():
    """A client the hop knows, back from idle, starts IDLE_CREDIT tokens before the hop's time, no
    earlier: with more chunks to do it goes first for IDLE_CREDIT / 16 of them, then alternates
    with the client that kept the hop busy. Without the bound it would bank its whole absence;
    a client the hop does not know (identities are free) banks nothing."""
    from blocktrain.p2p.serving.fair import IDLE_CREDIT, FairSlots
    slots, order = FairSlots(1, max_waiting=64, newcomer_tokens=0), []
    await slots.acquire("back", 16)  # known: served once, long ago
    slots.release("back")
    n = IDLE_CREDIT // 16 + 8
    await slots.acquire("busy", 16)
    for _ in range(4 * n):  # the hop's time moves on while "busy" works alone
        slots.release("busy")
        await slots.acquire("busy", 16)

    async def job(who):
        await slots.acquire(who, 16)
        order.append(who)
        slots.release(who)
    busy = [asyncio.ensure_future(job("busy")) for _ in range(n)]
    await asyncio.sleep(0)
    back = [asyncio.ensure_future(job("back")) for _ in range(n)]
    new = [asyncio.ensure_future(job("new")) for _ in range(2)]
    await asyncio.sleep(0)
    slots.release("busy")
    await asyncio.gather(*busy, *back, *new)
    ahead = IDLE_CREDIT // 16
    assert order[:ahead + 1] == ["back"] * ahead + ["new"], order  # a fresh one starts at the hop's time
    assert order[ahead + 1:ahead + 4] == ["busy", "back", "busy"], order  # then in turn


async def test_fresh_identities_queue_at_the_hops_time_and_cannot_starve_anyone():
    """Identities are free. A fresh one starts at the hop's time and moves it on, so a client
    waiting behind its own running request is served after one of them, not after a stream of
    them (a first version gave every fresh identity the idle credit: 200 of their chunks went
    before one of a known client's). And when tags would keep a waiter back for ever (here a
    hundred known clients, each back with a credit made boundless), it goes first after
    MAX_BYPASS parts."""
    from blocktrain.p2p.serving import fair
    slots = fair.FairSlots(2, max_waiting=256, newcomer_tokens=0)
    await slots.acquire("hog", 16)  # one slot: held throughout
    await slots.acquire("big", 16)  # the other: big's first request; its next waits behind it
    big = asyncio.ensure_future(slots.acquire("big", 16))
    await asyncio.sleep(0)
    holder, n = "big", 0
    while not big.done() and n < 8:
        fresh = asyncio.ensure_future(slots.acquire(f"fresh{n}", 16))
        await asyncio.sleep(0)
        slots.release(holder)
        await asyncio.sleep(0)
        holder = "big" if big.done() else f"fresh{n}"
        n += 1
    assert big.done() and n <= 2, n
    fresh.cancel()  # it waits behind the hog and big
    await asyncio.gather(fresh, return_exceptions=True)

    slots = fair.FairSlots(1, max_waiting=256, newcomer_tokens=0)
    for i in range(100):
        await slots.acquire(f"known{i}", 16)
        slots.release(f"known{i}")
    await slots.acquire("busy", 16)
    for _ in range(200):
        slots.release("busy")
        await slots.acquire("busy", 16)
    fair.IDLE_CREDIT, credit = 10 ** 9, fair.IDLE_CREDIT
    try:
        waiter = asyncio.ensure_future(slots.acquire("waiter", 16))
        await asyncio.sleep(0)
        holder, passed = "busy", 0
        while not waiter.done() and passed < 4 * fair.MAX_BYPASS:
            back = asyncio.ensure_future(slots.acquire(f"known{passed % 100}", 16))
            await asyncio.sleep(0)
            slots.release(holder)
            await asyncio.sleep(0)
            if not waiter.done():
                holder, passed = f"known{passed % 100}", passed + 1
                await back
        assert waiter.done() and passed == fair.MAX_BYPASS, passed
    finally:
        fair.IDLE_CREDIT = credit


async def test_slots_survive_cancellation_and_refusal_at_every_wait():
    """A request cancelled while it waits between chunks holds no slot; a waiter cancelled in the
    same turn as the holder's chunk boundary does not take the slot with it (a first version
    handed the slot to the dead waiter and the hop served nobody again); a waiter told to give
    way (Saturated) that is cancelled at once hands on no slot it never held; and a known client
    makes room in a queue filled by fresh identities, one waiting each, while a fresh newcomer is
    refused."""
    from blocktrain.p2p.serving.fair import FairSlots, Saturated
    log = []
    slots = FairSlots(1, max_waiting=8, newcomer_tokens=0)
    first = asyncio.ensure_future(_request(slots, "a", 5, log))
    await asyncio.sleep(0)
    other = asyncio.ensure_future(_request(slots, "b", 1, log))  # comes first at a's next boundary
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    first.cancel()  # a, waiting between its chunks, is cancelled
    await asyncio.gather(first, other, return_exceptions=True)
    assert slots.free == 1 and slots.waiting() == 0 and log[-1] == ("b", 0)

    slots = FairSlots(1, max_waiting=8, newcomer_tokens=0)
    async with slots.hold("a", 16) as between:
        dead = asyncio.ensure_future(slots.acquire("b", 16))
        await asyncio.sleep(0)
        dead.cancel()  # cancelled, but its task has not run yet: its waiter is still queued
        async with asyncio.timeout(1):  # (not wait_for: a new task would run a turn later)
            await between(16)  # in the same turn: nobody takes the slot, so a keeps it
    await asyncio.gather(dead, return_exceptions=True)
    assert slots.free == 1 and slots.waiting() == 0
    await asyncio.wait_for(slots.acquire("c", 16), 1)  # the hop still serves
    slots.release("c")

    from blocktrain.p2p.serving import fair  # a client that hands its slot on between chunks may be forgotten meanwhile
    slots, limit, fair.MAX_CLIENTS = FairSlots(1, max_waiting=8, newcomer_tokens=0), fair.MAX_CLIENTS, 1
    try:
        await _request(slots, "x", 1, [])  # x is known, then idle
        await slots.acquire("filler", 16)
        for _ in range(40):  # the hop's time moves on: x has its credit
            slots.release("filler")
            await slots.acquire("filler", 16)
        slots.release("filler")
        log = []
        a = asyncio.ensure_future(_request(slots, "a", 3, log))
        await asyncio.sleep(0)
        await _request(slots, "x", 1, log)  # takes a's slot at a chunk boundary; a is forgotten meanwhile
        await asyncio.wait_for(a, 1)
        assert log[1] == ("x", 0) and log[-1] == ("a", 2) and slots.free == 1
    finally:
        fair.MAX_CLIENTS = limit

    slots = FairSlots(1, max_waiting=2, newcomer_tokens=0)  # Saturated, then cancelled before it ran: no slot handed on
    await slots.acquire("a", 1)
    w = [asyncio.ensure_future(slots.acquire("flood", 1)) for _ in range(2)]
    await asyncio.sleep(0)
    late = asyncio.ensure_future(slots.acquire("b", 1))  # makes room: flood's newest gets Saturated
    await asyncio.sleep(0)
    w[1].cancel()
    await asyncio.gather(w[1], return_exceptions=True)
    assert slots.free == 0 and not late.done() and slots.waiting() == 2
    for t in (w[0], late):
        t.cancel()
    await asyncio.gather(w[0], late, return_exceptions=True)

    slots = FairSlots(1, max_waiting=4, newcomer_tokens=0)
    await slots.acquire("known", 16)
    slots.release("known")
    await slots.acquire("hog", 16)
    for _ in range(40):  # the hop's time moves on
        slots.release("hog")
        await slots.acquire("hog", 16)
    fresh = [asyncio.ensure_future(slots.acquire(f"fresh{i}", 16)) for i in range(4)]
    await asyncio.sleep(0)
    with pytest.raises(Saturated):
        await slots.acquire("fresh4", 16)  # a fresh newcomer would go last: refused at once
    mine = asyncio.ensure_future(slots.acquire("known", 16))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert isinstance(fresh[-1].exception(), Saturated) and not mine.done()  # the last in line gave way
    slots.release("hog")
    await asyncio.sleep(0)
    assert mine.done()
    for t in fresh[:3]:
        t.cancel()
    await asyncio.gather(*fresh[:3], return_exceptions=True)


async def test_a_queue_full_of_traversals_between_chunks_still_takes_a_client_back_with_credit():
    """Traversals handed over between chunks wait too, and count against max_waiting: a queue full
    of them refused everyone (a second review found it at 65 traversals in progress). A client
    back with credit now takes the place of the one that would go last, which is refused whole
    and holds no slot. And what the hop forgets first, past MAX_CLIENTS, is the identities served
    the fewest parts, not the client it has served for long (it forgot the latest virtual time:
    a client that had just finished a long traversal)."""
    from blocktrain.p2p.serving import fair
    slots, log = fair.FairSlots(1, max_waiting=2, newcomer_tokens=0), []
    await _request(slots, "known", 1, [])
    await slots.acquire("hog", 16)
    for _ in range(40):  # the hop's time moves on: "known" has its credit
        slots.release("hog")
        await slots.acquire("hog", 16)
    slots.release("hog")
    floods = [asyncio.ensure_future(_request(slots, f"f{i}", 5, log)) for i in range(3)]
    for _ in range(4):
        await asyncio.sleep(0)
    assert slots.waiting() == 2  # two traversals wait between their chunks, one computes
    mine = asyncio.ensure_future(_request(slots, "known", 1, log))
    ended = await asyncio.gather(mine, *floods, return_exceptions=True)
    assert ended[0] is None and ("known", 0) in log, ended  # taken in, not refused
    assert sum(isinstance(e, fair.Saturated) for e in ended[1:]) == 1  # the last in line, refused whole
    assert slots.free == 1 and slots.waiting() == 0

    slots, limit, fair.MAX_CLIENTS = fair.FairSlots(1, max_waiting=8, newcomer_tokens=0), fair.MAX_CLIENTS, 16
    try:
        for i in range(15):
            await _request(slots, f"early{i}", 1, [])
        await _request(slots, "long", 40, [])  # served for long, and last: the latest virtual time
        for i in range(40):  # fresh identities, one part each: the table overflows
            await _request(slots, f"fresh{i}", 1, [])
        assert "long" in slots._vtime and len(slots._vtime) <= 16
    finally:
        fair.MAX_CLIENTS = limit


class _Clock:
    """A hop's clock, moved by hand (the session table reads time only from it)."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_flood_of_sessions_from_many_identities_keeps_a_clients_one_session():
    """Finding 8: when the hop holds more than MAX_SESSIONS, the session that goes is the least
    recently used of the client holding the most, never the one session of a quiet client; a
    session used within RECENT_S stays while the hop holds up to twice MAX_SESSIONS; past it a
    recent one of a client holding several goes, and if every client holds one, a new session
    is refused instead of pushing one out."""
    from blocktrain.p2p.serving.sessions import (MAX_SESSIONS, MAX_SESSIONS_PER_CLIENT, RECENT_S, SessionsFull,
                                                 SessionTable)
    clock = _Clock()
    table = SessionTable(clock)
    table.get(("me", 1), object, 0)
    for i in range(4 * MAX_SESSIONS):  # identities are free: 8 sessions each, round after round
        table.get((f"flood{i // MAX_SESSIONS_PER_CLIENT}", i), object, 0)
    assert ("me", 1) in table and len(table) == 2 * MAX_SESSIONS  # all recent
    clock.t += RECENT_S + 1
    table.get(("late", 0), object, 0)
    assert ("me", 1) in table and len(table) == MAX_SESSIONS

    table = SessionTable(clock)
    table.get(("me", 1), object, 0)
    table.get(("two", 1), object, 0)  # between traversals, while its other one runs here
    table.get(("two", 2), object, 0)
    table.begin(("two", 2))
    for i in range(2 * MAX_SESSIONS - 3):  # a fresh identity per session, all recent
        table.get((f"one{i}", i), object, 0)
    with pytest.raises(SessionsFull, match="each a client's one"):
        table.get(("one-more", 0), object, 0)
    assert ("me", 1) in table and ("two", 1) in table and len(table) == 2 * MAX_SESSIONS
    assert ("one-more", 0) not in table


def test_a_flood_of_fresh_identities_with_traversals_running_keeps_a_clients_session():
    """Finding 8, a fresh identity per traversal: with every other session's traversal running at
    the hop, a newcomer does not push out a client's session between its traversals (it did: the
    client rebuilt its caches); the hop holds more than MAX_SESSIONS meanwhile, those in use."""
    from blocktrain.p2p.serving.sessions import MAX_SESSIONS, RECENT_S, SessionTable
    clock = _Clock()
    table = SessionTable(clock)
    mine = ("me", 1)
    table.get(mine, object, 0)  # between two traversals
    for i in range(MAX_SESSIONS + 8):  # fresh identities, each with its traversal running here
        table.get((f"fresh{i}", i), object, 0)
        table.begin((f"fresh{i}", i))
    assert mine in table and len(table) == MAX_SESSIONS + 9
    clock.t += RECENT_S + 1  # the client went quiet: its session may go now
    table.get(("fresh-new", 0), object, 0)
    assert mine not in table


def test_a_sessions_recent_time_starts_when_its_traversal_ends_and_expiry_spares_one_in_use():
    """A review: a session's RECENT_S counted from when its traversal came, so one that waited long
    in the queue was pushed out as soon as it ended. And a session idle past SESSION_IDLE_S goes,
    unless a traversal of it is running; one that names no session held is refused at no cost."""
    from blocktrain.p2p.serving.sessions import (MAX_SESSIONS, RECENT_S, SESSION_IDLE_S, SessionTable,
                                                 UnknownSession)
    clock = _Clock()
    table = SessionTable(clock)
    key = ("me", 1)
    table.get(key, object, 0)
    table.begin(key)
    clock.t += 100  # its traversal came long ago, and waited
    table.end(key)
    for i in range(MAX_SESSIONS):  # others come just after it ended: it is recent, it stays
        table.get((f"other{i}", i), object, 0)
    assert key in table
    table.begin(key)
    clock.t += SESSION_IDLE_S + 1
    table.expire()
    assert key in table and len(table) == 1  # in use: kept; the others idle: gone
    table.end(key)
    clock.t += SESSION_IDLE_S + 1
    table.expire()
    assert not table
    with pytest.raises(UnknownSession):
        table.get(("lost", 3), object, 5)
    assert not table and RECENT_S < SESSION_IDLE_S


async def test_a_new_session_whose_first_traversal_the_queue_refuses_keeps_nothing():
    """A review: a new session whose first traversal the queue refused stayed in the table, empty
    (a flood of refused requests filled it at no compute)."""
    import contextlib
    from types import SimpleNamespace

    from blocktrain.blocks.decode import Traversal
    from blocktrain.blocks.model import Block, BlockCache, ModelConfig
    from blocktrain.p2p.serving import fair
    from blocktrain.p2p.serving.api import PipelineError
    from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
    peer = await Peer(X25519PrivateKey.generate(), os.urandom(32), "127.0.0.1", 0, timeouts=FAST).start()
    b = Block(ModelConfig(d_model=16, n_head=2, n_layer=2, n_blocks=2, max_seq_len=32), 0).eval()
    server = PipelineServer(peer, ServedBlocks(blocktrain={0: b}))
    msg = SimpleNamespace(hop=0)
    try:
        key = ("me", 1, False, 0)
        spec = {"base": 0, "keep": [], "start": 0, "ids": [97, 98], "positions": [0, 1], "parents": [-1, 0],
                "logits": [1], "slots": [[]], "invariant": True}
        cache = server.sessions.get(key, lambda: BlockCache(b), 0)
        plan = SimpleNamespace(client="me", block=0, spec=spec, meta={})
        out = await server._run_block(msg, plan, key, Traversal(b, cache, None, spec))
        assert out.shape == (1, 2, 16) and key in server.sessions and not server.sessions.is_busy(key)

        @contextlib.asynccontextmanager
        async def saturated(who, cost):
            raise fair.Saturated("64 requests already wait here")
            yield
        server._compute.hold = saturated
        new = ("fresh", 2, False, 0)
        cache = server.sessions.get(new, lambda: BlockCache(b), 0)
        with pytest.raises(PipelineError) as ei:
            await server._run_block(msg, SimpleNamespace(client="fresh", block=0, spec={"ids": "ab", "start": 0},
                                                          meta={}), new, Traversal(b, cache, None, spec))
        assert new not in server.sessions and key in server.sessions
        assert ei.value.fault == "busy"  # sound but saturated: the client tries it again, not another
    finally:
        await peer.stop()


async def test_a_bad_hidden_state_codec_is_the_requests_fault_before_any_compute():
    """Finding 12: an unknown ``codec`` is refused before compute, as the request's fault (it
    blamed the hop after computing)."""
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
    from blocktrain.p2p.transport import CLIENT_INFO
    psk = os.urandom(32)
    peer = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST).start()
    b = Block(ModelConfig(d_model=16, n_head=2, n_layer=2, n_blocks=2, max_seq_len=32), 0).eval()
    server = PipelineServer(peer, ServedBlocks(blocktrain={0: b}))
    key = X25519PrivateKey.generate()
    from blocktrain.p2p.identity import peer_id
    pc = await open_connection("127.0.0.1", peer.port, make_connection(Role.INITIATOR, key, psk, info=CLIENT_INFO), FAST)
    try:
        pc.send_nowait(PipelineForward(request_id=7, route=("a:1", "b:2"), hop=0, meta={
            "mode": "exact", "session": 1, "blocks": [0, 1], "reply_to": peer_id(key), "codec": "zip",
            "spec": {}}))
        got = await asyncio.wait_for(pc.recv(), 10)
        assert got.request_id == 7 and got.meta["fault"] == "request" and "codec" in got.meta["error"]
        assert server.served_requests == 0
    finally:
        await pc.close("done")
        await peer.stop()


# --- finding 4: a PEER_LIST as a dial amplifier ---------------------------------------------------

async def test_a_peer_list_of_thousands_dials_at_most_a_few_and_not_again_soon():
    """Finding 4: a member's PEER_LIST of 4,096 records makes the peer dial at most MAX_DIALS at
    once; addresses that failed are not dialled again from gossip before the cool-down."""
    from blocktrain.p2p.connections import MAX_DIALS
    peer = await Peer(X25519PrivateKey.generate(), os.urandom(32), "127.0.0.1", 0, timeouts=FAST).start()
    member = "ee" * 32
    peer._table.by_id[member] = Member(PeerInfo(member, "127.0.0.1:9", (0,), "train", 0), 0.0)
    closed = []
    for _ in range(3):  # ports nobody listens on: each dial fails at once
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed.append(s.getsockname()[1])
    records = tuple(PeerInfo(f"{i:064x}", f"127.0.0.{1 + i % 3}:{closed[i % 3]}", (0,), "train", 0)
                    for i in range(1, 4097))
    try:
        pc = FakeConn(asyncio.get_running_loop())
        assert peer.dispatch(PeerList(peers=records), pc, member)
        assert peer.kept()["dials"] == 3  # 3 distinct addresses, each dialled once
        await peer.wait_for(lambda: not peer.kept()["dials"], 10)
        many = tuple(PeerInfo(f"{i:064x}", f"127.0.0.{1 + i % 200}:{closed[0]}", (0,), "train", 0)
                     for i in range(1, 4097))
        assert peer.dispatch(PeerList(peers=many), pc, member)
        assert peer.kept()["dials"] <= MAX_DIALS
        await peer.wait_for(lambda: not peer.kept()["dials"], 10)
        assert peer.dispatch(PeerList(peers=records), pc, member)
        assert not peer.kept()["dials"]  # failed a moment ago: cooling down
    finally:
        await peer.stop()


async def test_what_is_kept_of_named_identities_and_stray_stream_messages_is_bounded(tmp_path):
    """The spec-gap review: exclusions, 'excluded by' and averaging and
    group events grew by one per identity; 1,024 bogus STREAM_RESETs filled the server's reset
    set for good (real resets were ignored after); a fetch took stream messages for its id from
    any connection (ids are predictable: another key holder could end or feed it)."""
    from blocktrain.p2p.averaging import Averager
    from blocktrain.p2p.averaging.driver import MAX_NAMED
    from blocktrain.p2p.checkpoints import CheckpointFetcher, CheckpointServer
    from blocktrain.p2p.group import MAX_EVENTS, Group
    from blocktrain.p2p.node import Peer
    from blocktrain.protocol import StreamEnd, StreamReset
    psk = os.urandom(32)
    a = Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0)
    av = Averager(a, 0)
    for i in range(MAX_NAMED + 500):
        av.reject(f"{i:064x}", "test", 1)
        av.excluded_by(f"{i:064x}", 1, "test")
    assert len(av.banned) == len(av.shunned) == MAX_NAMED and len(av.events) <= MAX_NAMED
    assert f"{MAX_NAMED + 499:064x}" in av.banned and f"{0:064x}" not in av.banned  # the oldest went
    g = Group("me" * 32)
    for i in range(MAX_EVENTS + 10):
        g._event({"event": "departed", "peer": str(i)})
    assert len(g.events) == MAX_EVENTS and g.events[-1]["peer"] == str(MAX_EVENTS + 9)

    server = CheckpointServer(a, tmp_path / "serve")
    for sid in range(2000):  # resets of streams it never sent
        server._on_reset(StreamReset(stream_id=sid + 1, code=1, reason="x"), None, "e" * 64)
    assert not server._reset
    server._serving.add(("e" * 64, 7))
    server._on_reset(StreamReset(stream_id=7, code=1, reason="x"), None, "e" * 64)
    assert server._reset == {("e" * 64, 7)}  # a reset of a stream it sends still stops it

    fetcher = CheckpointFetcher(a)
    asked, other = object(), object()
    q = asyncio.Queue()
    fetcher._inbox[5] = (asked, q)
    fetcher._route(StreamEnd(stream_id=5), other, "f" * 64)
    assert q.empty()  # the same id from another connection reaches nothing
    fetcher._route(StreamEnd(stream_id=5), asked, "a" * 64)
    assert q.qsize() == 1
