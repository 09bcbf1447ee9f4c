"""Serving over a chain of peers: outputs equal the in-process models; faults fail clearly."""

import asyncio
from types import SimpleNamespace
import contextlib
import os
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks.model import Block, EndToEnd, ModelConfig
from blocktrain.p2p.node import Peer
from blocktrain.p2p.serving.client import PipelineClient
from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
from blocktrain.p2p.serving.api import PipelineError
from blocktrain.p2p.view import chain

from conftest import crash
from blocktrain.p2p.transport import Timeouts

CFG = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=96, head_layers=1)
FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.3, dead_after_s=3, close_s=1)


@pytest.fixture
def models():
    return make_models()


def make_models():
    """A perturbed 3-block chain and an end-to-end model (the serving tests' models)."""
    torch.manual_seed(0)
    bt = [Block(CFG, k) for k in range(3)]
    for b in bt[1:]:  # identity-started blocks would make the test trivial: perturb them
        for p in b.parameters():
            p.data.add_(torch.randn_like(p) * 0.05)
    return bt, EndToEnd(CFG)


async def start_chain(psk, bt, e2e, extra_block=None, timeouts=FAST):
    peers, servers = [], []
    for k in range(3):
        p = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=(k,), role="serve",
                       timeouts=timeouts).start()
        if peers:
            await p.join("127.0.0.1", peers[0].port)
        servers.append(PipelineServer(p, ServedBlocks({k: bt[k]}, {k: e2e.blocks[k]})))
        peers.append(p)
    return peers, servers


@contextlib.asynccontextmanager
async def served_chain(bt, e2e, route=None, blocks=(0, 1, 2), timeouts=FAST, **client_kw):
    """Three serving peers (with ``timeouts``) and a connected client; everything stopped on the way out."""
    psk = os.urandom(32)
    peers, servers = await start_chain(psk, bt, e2e, timeouts=timeouts)
    addrs = [p.addr for p in peers] if route is None else [peers[i].addr for i in route]
    client = PipelineClient(X25519PrivateKey.generate(), psk, addrs, list(blocks), FAST, **client_kw)
    try:
        await client.connect()
        yield peers, servers, client
    finally:
        await client.close()
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("keepalive_s", [0.25, None])
async def test_a_client_keeps_its_answers_past_the_hops_idle_limit(models, keepalive_s):
    """A hop closes a client it has not heard for ``client_idle_s``; the last hop only answers, so
    without the client's PINGs a session longer than that lost its answers (bt-bench wan died
    after 300 s). With them, requests for 3x the limit all come back."""
    import dataclasses

    bt, e2e = models
    answered = 0
    with contextlib.suppress(PipelineError):
        async with served_chain(bt, e2e, timeouts=dataclasses.replace(FAST, client_idle_s=1.0), timeout_s=3,
                                keepalive_s=keepalive_s) as (_, _, client):
            for _ in range(8):  # a request every 0.4 s or so for about 3 s: the first hop hears each
                await client.generate(b"ab", 1, "autoregressive")
                answered += 1
                await asyncio.sleep(0.4)
    assert answered == 8 if keepalive_s else answered < 8


def in_process(blocks, prompt, n, draft_len=0, sampling=None, width=1, lookup=0, sample_k=0):
    from blocktrain.blocks.decode import Sampling, bf16_round, generate
    out, _ = generate(blocks, prompt, n, draft_len=draft_len, drafter=draft_len > 0,
                      sampling=sampling or Sampling(), between=bf16_round, width=width, lookup=lookup,
                      sample_k=sample_k)
    return out


@pytest.mark.parametrize("prompt", [b"The history of ", b"a", bytes(range(65, 65 + 40))])
async def test_exact_output_is_the_autoregressive_output_byte_for_byte(models, prompt):
    """Greedy exact mode over the network (bf16 hidden states between hops) emits exactly what
    autoregressive decoding emits, over the network and in one process."""
    bt, e2e = models
    async with served_chain(bt, e2e, timeout_s=20) as (peers, servers, client):
        seen = []  # output as it comes: the output so far after every traversal that accepted bytes
        exact, st = await client.generate(prompt, 24, "exact", on_bytes=lambda out, t: seen.append((out, t)))
        ar, st_ar = await client.generate(prompt, 24, "autoregressive")
        assert exact == ar == in_process(bt, prompt, 24) and len(exact) == 24
        assert seen[-1][0] == exact and all(b.startswith(a) and len(b) > len(a) for (a, _), (b, _) in zip(seen, seen[1:]))
        assert [[t, len(out)] for out, t in seen] == st["arrivals"] and st["first_byte_s"] == seen[0][1]
        assert st_ar["traversals"] == 24 and st["traversals"] <= 24
        for _ in range(50):  # the sessions' caches are freed at their end (the last frees travel on)
            if not any(srv.sessions for srv in servers):
                break
            await asyncio.sleep(0.05)
        assert not any(srv.sessions for srv in servers)


async def test_sessions_of_clients_at_once_are_batched_and_each_writes_what_it_writes_alone(models):
    """Continuous batching: clients at once, greedy exact, autoregressive and sampled; at
    --batch 8 their chunks are computed together at each hop (one forward over the rows of all);
    each output is the one its session writes alone in one process, and the hops did batch."""
    from blocktrain.blocks.decode import Sampling
    from blocktrain.p2p.serving.client import DRAFT_WIDTH, LOOKUP, SAMPLE_K, SAMPLED_DRAFT_LEN
    bt, e2e = models
    sampled = Sampling(temperature=1.0, top_k=0, seed=3)
    jobs = [(b"The history of ", "exact", Sampling()), (b"a", "exact", Sampling()),
            (bytes(range(65, 105)), "autoregressive", Sampling()), (b"sample ", "exact", sampled)]
    async with served_chain(bt, e2e, timeout_s=30) as (peers, servers, first):
        for srv in servers:  # bt-peer serve --batch 8
            srv.set_batch(8)
        others = [PipelineClient(X25519PrivateKey.generate(), first.swarm_key, first.route, [0, 1, 2], FAST,
                                 timeout_s=30) for _ in jobs[1:]]
        try:
            await asyncio.gather(*(c.connect() for c in others))
            got = await asyncio.gather(*(c.generate(prompt, 20, mode, sampling)
                                         for c, (prompt, mode, sampling) in zip([first] + others, jobs)))
            reports = [srv._batcher.report() for srv in servers]
            for srv in servers:  # bt-peer serve --batch 1: one chunk at a time, the same outputs
                srv.set_batch(1)
            again = await asyncio.gather(*(c.generate(prompt, 20, mode, sampling)
                                           for c, (prompt, mode, sampling) in zip([first] + others, jobs)))
            ones = [srv._batcher.report() for srv in servers]
        finally:
            await asyncio.gather(*(c.close() for c in others))
    want = [in_process(bt, b"The history of ", 20), in_process(bt, b"a", 20), in_process(bt, bytes(range(65, 105)), 20),
            in_process(bt, b"sample ", 20, draft_len=SAMPLED_DRAFT_LEN, sampling=sampled, width=DRAFT_WIDTH,
                       lookup=LOOKUP, sample_k=SAMPLE_K)]
    assert [out for out, _ in got] == [out for out, _ in again] == want
    assert all(o["chunks"] - r["chunks"] == o["batches"] - r["batches"] > 0 for o, r in zip(ones, reports))
    assert max(r["largest_batch"] for r in reports) >= 2, reports
    assert all(r["chunks"] > r["batches"] for r in reports), reports  # more chunks than forwards at every hop


async def test_a_two_block_chain_decodes_exactly_too():
    cfg = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64, head_layers=0)
    torch.manual_seed(1)
    bt = [Block(cfg, k) for k in range(2)]
    for p in bt[1].parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    psk = os.urandom(32)
    peers = []
    for k in range(2):
        p = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=(k,), role="serve",
                       timeouts=FAST).start()
        if peers:
            await p.join("127.0.0.1", peers[0].port)
        PipelineServer(p, ServedBlocks({k: bt[k]}))
        peers.append(p)
    await peers[0].wait_for(lambda: len(peers[0].members()) == 1, 10.0)
    client = PipelineClient(X25519PrivateKey.generate(), psk, [p.addr for p in peers], [0, 1], FAST, timeout_s=20)
    try:
        await client.connect()
        for prompt in (b"xy", b"hello, world"):
            out, _ = await client.generate(prompt, 16, "exact", max_seq_len=64)
            assert out == in_process(bt, prompt, 16)
        with pytest.raises(PipelineError, match="without --reference DIR"):  # the cause, and the fix
            await client.generate(b"xy", 4, "reference", max_seq_len=64)
    finally:
        await client.close()
        for p in peers:
            await p.stop()


async def test_one_traversal_and_reference_modes_equal_in_process_runs(models):
    from blocktrain.blocks.decode import new_caches, one_traversal_spec, run_chain
    bt, e2e = models
    async with served_chain(bt, e2e, codec="raw", timeout_s=20) as (peers, servers, client):
        prompt = bytes(range(65, 65 + 20))
        got, stats = await client.generate_blocktrain(prompt, 12)
        want = run_chain(bt, new_caches(bt), one_traversal_spec(prompt, 12))["logits"][0].argmax(-1)
        assert got == bytes(want.tolist()) and stats["traversals"] == 1
        got, stats = await client.generate(prompt, 10, "reference")
        from blocktrain.blocks.decode import generate
        assert got == generate(list(e2e.blocks), prompt, 10)[0] and stats["traversals"] == 10


async def test_sampled_exact_output_is_reproducible_and_matches_one_process(models):
    from blocktrain.blocks.decode import Sampling
    bt, e2e = models
    sampling = Sampling(temperature=1.0, top_k=0, seed=7)
    async with served_chain(bt, e2e, timeout_s=20) as (_, _, client):
        a, _ = await client.generate(b"sample ", 20, "exact", sampling)
        b, _ = await client.generate(b"sample ", 20, "exact", sampling)
    from blocktrain.p2p.serving.client import DRAFT_WIDTH, LOOKUP, SAMPLE_K, SAMPLED_DRAFT_LEN  # its sampled drafts
    assert a == b == in_process(bt, b"sample ", 20, draft_len=SAMPLED_DRAFT_LEN, sampling=sampling, width=DRAFT_WIDTH,
                                lookup=LOOKUP, sample_k=SAMPLE_K)


async def test_a_hop_that_lost_the_session_gets_it_rebuilt_and_the_output_is_unchanged(models):
    bt, e2e = models
    async with served_chain(bt, e2e, timeout_s=20) as (_, servers, client):
        calls = []
        real = client.answer

        async def forgetful(*a, **kw):  # hop 1 restarts (its caches gone) before the 3rd traversal
            calls.append(1)
            if len(calls) == 3:
                servers[1].sessions.clear()
            return await real(*a, **kw)

        client.answer = forgetful
        out, st = await client.generate(b"The history of ", 30, "autoregressive")
        assert out == in_process(bt, b"The history of ", 30) and len(calls) == 31  # one rebuild


async def test_bad_specs_are_the_requests_fault_and_cost_nothing(models):
    from blocktrain.blocks.decode import one_traversal_spec
    bt, e2e = models
    good = one_traversal_spec(b"hello", 4)
    bad = [{**good, "positions": [0, 1, 2, 3, 10 ** 6, 5, 6, 7]}, {**good, "parents": [-1, 5, 1, 2, 3, 4, 5, 6]},
           {**good, "draft": 10 ** 9}, {**good, "ids": [300] * 8}, {**good, "logits": list(range(500))},
           {**good, "keep": [3, 1], "start": 2}, "not a map", {**good, "base": 1.5}]
    async with served_chain(bt, e2e, timeout_s=10) as (_, servers, client):
        for spec in bad:
            with pytest.raises(PipelineError) as ei:
                await client.traverse(1, "exact", spec)
            assert ei.value.fault == "request" and ei.value.block == 0 and "spec" in str(ei.value)
        assert not any(srv.sessions for srv in servers) and servers[0].served_requests == 0
        out, _ = await client.generate(b"hello", 4, "exact")  # the chain still serves
        assert len(out) == 4


async def test_dead_hop_fails_within_timeout_naming_the_block(models):
    bt, e2e = models
    async with served_chain(bt, e2e, timeout_s=5) as (peers, _, client):
        await peers[1].stop("crash")  # the middle hop is gone
        with pytest.raises(PipelineError, match="block 1|no answer") as ei:
            await asyncio.wait_for(client.generate(b"hello world", 4), 15)
        assert "block" in str(ei.value)


async def test_a_hop_whose_machine_fails_the_invariance_check_refuses_exact_and_says_so(models, monkeypatch):
    """A hop whose kernels no tile shape makes batch invariant (tests/kernels.py) answers exact
    and autoregressive requests with a refusal naming its block and why, never with rows
    computed otherwise under the exact name; its status says so; one-traversal mode still runs."""
    import kernels
    bt, e2e = models
    async with served_chain(bt, e2e, timeout_s=5) as (peers, servers, client):
        with monkeypatch.context() as m:
            kernels.use(m, kernels.ByCall())
            servers[1].served.check_rows()
        assert servers[1].served.exact_refused(bt[1]) is not None
        with pytest.raises(PipelineError, match="exact and autoregressive decoding refused") as ei:
            await client.generate(b"hello", 3)
        assert ei.value.block == 1
        assert "refused" in peers[1].status()["serving"]["exact"]["1"]
        out, _ = await client.generate(b"hello", 3, mode="blocktrain")
        assert len(out) == 3


async def test_wrong_block_is_a_clear_error(models):
    bt, e2e = models
    async with served_chain(bt, e2e, route=(0, 2, 2), blocks=(0, 1, 2), timeout_s=5) as (_, _, client):
        with pytest.raises(PipelineError, match="not a live member serving block 1") as ei:  # seen at hop 0
            await client.generate(b"hello", 3)
        assert ei.value.block == 1 and ei.value.hop == 1  # typed: the client knows where, without parsing


async def test_client_retries_through_another_holder_of_the_block(models):
    from blocktrain.p2p.serving.client import generate
    from blocktrain.protocol import PipelineForward
    bt, e2e = models
    psk = os.urandom(32)
    peers, _ = await start_chain(psk, bt, e2e)
    spare = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=(1,), role="serve",
                       timeouts=FAST).start()
    await spare.join("127.0.0.1", peers[0].port)
    PipelineServer(spare, ServedBlocks({1: bt[1]}, {1: e2e.blocks[1]}))
    try:
        for p in peers:
            await p.wait_for(lambda p=p: len(p.members()) == 3, 10.0)
        # the holder of block 2 that the client picks first (smallest peer id) dies mid-request
        victim = min((peers[1], spare), key=lambda p: p.id)
        died = []

        async def die(msg, pc, pid):
            died.append(msg.request_id)
            crash(victim)

        victim.on(PipelineForward, die)
        prompt = b"retry me please"
        out, stats = await generate("127.0.0.1", peers[0].port, X25519PrivateKey.generate(), psk, prompt, 6,
                                    "exact", 3)
        want = in_process(bt, prompt, 6)
        assert died and out == want and victim.addr not in stats["route"]
    finally:
        for p in peers + [spare]:
            await p.stop()


async def test_hop_0_reads_nothing_from_a_client_it_refused_as_busy_for_the_pause_it_owes(models):
    """A client refused as busy at hop 0 should pause before it asks again (client.py: generate
    does, through a new connection); hop 0 holds the refused connection unread for as long
    (server.BUSY_HOLD_S, doubling while refused in a row), so a client that asks again at once on
    it is read only after the hold, and a flood of requests costs the hop nothing meanwhile. A
    computed request ends the doubling."""
    import contextlib
    from blocktrain.p2p.serving import server as server_mod
    from blocktrain.p2p.serving.fair import Saturated
    bt, e2e = models
    psk = os.urandom(32)
    peers, servers = await start_chain(psk, bt, e2e)
    real, calls = servers[0]._compute.hold, []

    @contextlib.asynccontextmanager
    async def busy_twice(who, cost):
        calls.append(time.monotonic())
        if len(calls) in (1, 2):
            raise Saturated("64 requests already wait here")
        async with real(who, cost) as between:
            yield between
    servers[0]._compute.hold = busy_twice
    c = PipelineClient(X25519PrivateKey.generate(), psk, [p.addr for p in peers], [0, 1, 2], FAST)
    try:
        for p in peers:
            await p.wait_for(lambda p=p: len(p.members()) == 2, 10.0)
        await c.connect()
        for _ in range(2):
            with pytest.raises(PipelineError) as e:
                await c.generate(b"held", 2)  # asked again at once
            assert e.value.fault == "busy"
        assert (await c.generate(b"held", 2))[0] == in_process(bt, b"held", 2)
        assert calls[1] - calls[0] >= server_mod.BUSY_HOLD_S * 0.9  # read again after the hold
        assert calls[2] - calls[1] >= 2 * server_mod.BUSY_HOLD_S * 0.9  # refused again: twice as long
        assert not servers[0]._busy_holds  # computed since: the next refusal starts from BUSY_HOLD_S
    finally:
        await c.close()
        for p in peers:
            await p.stop()


async def test_a_held_inbox_resumes_reading_only_when_neither_the_hold_nor_its_own_backlog_keeps_it():
    """Inbox.hold beside the inbox's own pause (HIGH_WATER_EVENTS): reading resumes once both let go,
    whichever ends first; a hold renewed meanwhile lasts to its later end."""
    from blocktrain.p2p import transport as tr

    class Fake:
        def __init__(self):
            self.reading, self.closing = True, False

        def pause_reading(self):
            self.reading = False

        def resume_reading(self):
            self.reading = True

        def is_closing(self):
            return self.closing
    t, inbox = Fake(), tr.Inbox(asyncio.get_running_loop())
    inbox.hold(t, 0.1)
    for i in range(tr.HIGH_WATER_EVENTS):
        inbox.push(i, t)
    while len(inbox):
        inbox.pop(t)  # the backlog drained: still held
    assert not t.reading
    await asyncio.sleep(0.15)
    assert t.reading  # the hold over
    inbox.hold(t, 0.05)
    for i in range(tr.HIGH_WATER_EVENTS):
        inbox.push(i, t)
    inbox.hold(t, 0.1)  # renewed: to the later end
    await asyncio.sleep(0.15)
    assert not t.reading  # the hold over, the backlog not yet
    while len(inbox):
        inbox.pop(t)
    assert t.reading


async def test_a_saturated_only_holder_is_tried_again_not_given_up(models, monkeypatch):
    """A hop whose waiting traversals are at their bound refuses as "busy"; where it is the only
    holder of its block the client tries it again after a pause, the session going on from its
    committed bytes (it failed the generate: "no live peer serves block 2" after avoiding the
    only holder; then it started again from the prompt)."""
    import contextlib
    from blocktrain.p2p.serving import client as client_mod
    from blocktrain.p2p.serving.client import generate
    from blocktrain.p2p.serving.fair import Saturated
    monkeypatch.setattr(client_mod, "BUSY_PAUSE_S", 0.05, raising=False)
    bt, e2e = models
    psk = os.urandom(32)
    peers, servers = await start_chain(psk, bt, e2e)
    real, calls, specs = servers[2]._compute.hold, [], []

    @contextlib.asynccontextmanager
    async def saturated_third_and_fourth(who, cost):
        calls.append(who)
        if len(calls) in (3, 4):  # the third traversal, twice: after two bytes were committed
            raise Saturated("64 requests already wait here")
        async with real(who, cost) as between:
            yield between
    servers[2]._compute.hold = saturated_third_and_fourth
    real_run = servers[2]._run_block

    async def run_block(msg, plan, key, traversal, sender=None, via=None):
        specs.append((plan.spec["start"], len(plan.spec["ids"])))
        return await real_run(msg, plan, key, traversal, sender, via)
    servers[2]._run_block = run_block
    try:
        for p in peers:
            await p.wait_for(lambda p=p: len(p.members()) == 2, 10.0)
        prompt = b"busy, not broken"
        logs: list[str] = []
        out, stats = await generate("127.0.0.1", peers[0].port, X25519PrivateKey.generate(), psk, prompt, 6,
                                    "autoregressive", 5, log=logs.append)
        assert out == in_process(bt, prompt, 6)
        assert stats["busy_retries"] == 2 and stats["attempts"] == 1 and peers[2].addr in stats["route"]
        assert sum("is saturated" in line for line in logs) == 2
        assert specs[:2] == [(0, len(prompt)), (len(prompt), 1)]
        assert specs[4] == (0, len(prompt) + 2)  # the caches rebuilt from the committed bytes, not the prompt
    finally:
        for p in peers:
            await p.stop()


def test_a_busy_hop_is_gone_around_where_its_block_has_another_holder_and_only_then():
    """The next chain leaves a busy hop out where another live holder of its block is not
    avoided, with no pause; a chain that would lose a block keeps the busy hop."""
    from blocktrain.p2p.serving.client import _Busy

    def member(pid, port, block):
        return {"peer_id": pid, "addr": f"127.0.0.1:{port}", "blocks": [block], "role": "serve", "state": "alive"}
    st = {"peer_id": "a", "addr": "127.0.0.1:7000", "blocks": [0], "role": "serve", "serving": {"n_blocks": 3},
          "members": [member("b", 7001, 1), member("c", 7002, 2), member("d", 7003, 1)]}
    route = chain(st)
    assert route == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    busy = _Busy()
    busy.hops = {"127.0.0.1:7001", "127.0.0.1:7002"}  # 7001 has another holder of block 1, 7002 none
    assert busy.route(st, set(), route) == ["127.0.0.1:7000", "127.0.0.1:7003", "127.0.0.1:7002"]
    no_n = {k: v for k, v in st.items() if k != "serving"}  # a non-serving peer's view: n from the blocks seen
    assert busy.route(no_n, set(), chain(no_n)) == ["127.0.0.1:7000", "127.0.0.1:7003", "127.0.0.1:7002"]


def test_the_share_of_an_address_is_its_ipv4_address_or_ipv6_prefix():
    from blocktrain.p2p.serving.shares import address_share
    assert address_share(("10.0.0.5", 7000)) == "10.0.0.5"
    assert address_share(("::ffff:10.0.0.5", 7000, 0, 0)) == "10.0.0.5"
    assert address_share(("2001:db8:1:2:3:4:5:6", 7000, 0, 0)) == "2001:db8:1:2::/64"
    assert address_share(("2001:db8:1:2:ffff::9", 1, 0, 0)) == "2001:db8:1:2::/64"  # one home's prefix
    assert address_share(("fe80::1%eth0", 1, 0, 2)) == "fe80::/64"
    assert address_share(None) is None and address_share(("not an ip", 1)) is None and address_share(()) is None


def test_an_address_has_a_few_shares_and_its_further_identities_one():
    """shares.py: the first PER_ADDRESS identities of an address a share each, the rest of it one;
    a client whose address is not known its own; at most MAX_ADDRESSES addresses remembered."""
    from blocktrain.p2p.serving.shares import Shares
    s = Shares(per_address=2, max_addresses=3)
    assert [s.of(c, "10.0.0.1") for c in ("a", "b", "c", "d", "a")] == ["a", "b"] + ["address 10.0.0.1"] * 2 + ["a"]
    assert s.of("c", "10.0.0.2") == "c" and s.of("x", None) == "x"
    s.of("e", "10.0.0.3")
    s.of("f", "10.0.0.4")  # a fourth address: the least recently seen (10.0.0.1) is forgotten
    assert s.of("c", "10.0.0.1") == "c" and len(s._ids) == 3


async def test_a_hops_compute_share_is_counted_by_the_address_a_client_connects_from(models):
    """Identities are free, addresses are not: at a hop holding the client's connection (hop 0,
    the last hop) identities of one address past its first PER_ADDRESS (1 here) take one share of
    the compute slots; a middle hop, which sees only the hop below, counts by the address hop 0
    passed on (r12: ``client_addr``, as the member that forwarded it says)."""
    from blocktrain.p2p.serving.shares import Shares
    bt, e2e = models
    psk = os.urandom(32)
    peers, servers = await start_chain(psk, bt, e2e)
    route = [p.addr for p in peers]
    clients = [PipelineClient(X25519PrivateKey.generate(), psk, route, [0, 1, 2], FAST, bind=b)
               for b in ("127.0.0.1", "127.0.0.2", "127.0.0.2")]
    try:
        for p in peers:
            await p.wait_for(lambda p=p: len(p.members()) == 2, 10.0)
        try:
            for c in clients:
                await c.connect()
        except PipelineError as e:
            pytest.skip(f"cannot connect from 127.0.0.2 here: {e}")
        held: list[list] = [[], [], []]  # whose share each hop's compute slots were asked for
        for k, server in enumerate(servers):
            server.shares = Shares(per_address=1)

            def hold(who, cost, real=server._compute.hold, k=k):
                held[k].append(who)
                return real(who, cost)
            server._compute.hold = hold
        for c in clients:
            assert (await c.generate(b"hello", 2))[0] == in_process(bt, b"hello", 2)
        by_address = [clients[0].id, clients[1].id, "address 127.0.0.2"]
        for k in (0, 2):
            assert [servers[k]._share(c.id) for c in clients] == by_address
            assert set(held[k]) == set(by_address)
        via = peers[0].id[:16]
        assert set(held[1]) == {clients[0].id, clients[1].id, f"address 127.0.0.2 via {via}"}
        # at hop 0 the connection a request came on counts, a member's too (no client connection)
        member = SimpleNamespace(peer_addr=("10.1.2.3", 7000))
        assert [servers[0]._share(pid, member) for pid in ("m1", "m2")] == ["m1", "address 10.1.2.3"]
    finally:
        for c in clients:
            await c.close()
        for p in peers:
            await p.stop()


async def test_forged_senders_foreign_routes_and_unknown_sessions_cost_a_hop_nothing(models):
    """Hardening for serving: hop 0 serves only the client that sent the request (reply_to is the
    sender); a hop forwards only to a live member serving the next block, never to an address a
    request names; a session a hop does not hold takes no slot; one traversal per session at once."""
    from blocktrain.blocks.decode import one_traversal_spec
    from blocktrain.protocol import PipelineForward
    bt, e2e = models
    async with served_chain(bt, e2e, timeout_s=5) as (peers, servers, client):
        spec = one_traversal_spec(b"hello", 4)
        base = {"mode": "exact", "session": 5, "blocks": [0, 1, 2], "codec": "bf16", "spec": spec}
        # a forged reply_to: refused at hop 0, nothing computed, no cache kept
        client.conns[client.route[0]].send_nowait(PipelineForward(
            request_id=99, route=client.route, hop=0, meta={**base, "reply_to": "ab" * 32}))
        # a route whose next hop is not a member: refused at hop 0, nothing dialled
        with pytest.raises(PipelineError, match="not a live member serving block 1"):
            await _raw(client, {**base, "session": 6}, ["127.0.0.1:9", client.route[2]])
        # an unknown session that claims cached tokens: a "session" fault, no slot taken
        with pytest.raises(PipelineError) as ei:
            await client.traverse(7, "exact", {**spec, "base": 3, "keep": [0], "start": 4})
        assert ei.value.fault == "session"
        await asyncio.sleep(0.3)
        assert servers[0].served_requests == 0 and not any(srv.sessions for srv in servers)


async def _raw(client, meta, tail):
    """A request whose route after hop 0 is ``tail`` (the client dials hop 0 and the last hop)."""
    route = client.route
    client.route = [route[0], *tail]
    try:
        return await client._request(meta)
    finally:
        client.route = route


def test_a_chain_waits_for_every_block_of_the_model_not_only_those_seen():
    """A serving peer says how many blocks its model has; until a peer for every one has joined,
    there is no chain (the client asks again) rather than a chain cut short that hop 0 refuses."""
    from blocktrain.p2p.view import NoChain, chain

    def member(i, b):
        return {"peer_id": f"{i}" * 64, "addr": f"127.0.0.1:{7000 + i}", "blocks": [b], "role": "serve",
                "state": "alive"}
    st = {**member(0, 0), "members": [member(1, 1)], "serving": {"n_blocks": 3, "max_seq_len": 512}}
    with pytest.raises(NoChain, match="block 2"):
        chain(st)
    st["members"].append(member(2, 2))
    assert chain(st) == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    st["serving"]["n_blocks"] = 10**9  # a number from a peer is bounded before use
    assert chain({**st, "members": st["members"]}) == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]


def test_the_streamed_output_prints_the_text_the_whole_output_prints(capsys, monkeypatch):
    """bt-peer generate's printer: bytes split mid-character print as decoding the whole output
    does; a chain that took over and wrote other bytes is said, and its output printed whole; a
    reader that went away stops the request without a retry (not a hop's fault)."""
    import click
    from blocktrain.p2p.serving.output import OutputPrinter, StdoutClosed

    def printer():  # as bt-peer generate makes it
        return OutputPrinter(lambda text, nl: click.echo(text, nl=nl), lambda line: click.echo(line, err=True))
    whole = "The \u00e9t\u00e9 \x1b[31mred\x1b[0m \ufffd".encode() + b"\xff"
    s = printer()
    for cut in (1, 6, 9, len(whole)):
        s(whole[:cut], 0.0, final=cut == len(whole))
    out = capsys.readouterr().out
    click.echo(whole.decode("utf-8", "replace"))
    assert out == capsys.readouterr().out  # the same text, escapes handled alike
    s = printer()
    s(b"abc", 0.0)
    s(b"abXdef", 0.0, final=True)
    cap = capsys.readouterr()
    assert "other bytes from byte 2" in cap.err and cap.out == "abcabXdef\n"

    def closed(*a, **k):
        raise BrokenPipeError()
    monkeypatch.setattr(click, "echo", closed)
    with pytest.raises(StdoutClosed):
        printer()(b"x", 0.0)
    assert not issubclass(StdoutClosed, ConnectionError)  # the client retries on ConnectionError


def test_draft_distributions_that_are_not_distributions_are_the_last_hops_fault():
    """r10: the answer's q_ids / q are checked (shapes, dtypes, k distinct bytes, weights finite,
    >= 0, not all 0), and every drawn byte of every chain against its step's distribution, before
    a session reads them; a bad one is the last hop's fault."""
    from blocktrain.p2p.serving.client import _drawn_from
    from blocktrain.p2p.tensors import to_wire
    spec = {"logits": [0, 1], "width": 2, "draft": 3, "sample": [1, 800, 4]}
    ids = torch.arange(4, dtype=torch.uint8).expand(1, 2, 6, 4).clone()
    q = torch.full((1, 2, 6, 4), 0.25).half()
    chain = [9, 1, 2, 3, 5, 5, 5]  # first byte, 3 drawn bytes, 3 runners-up (not checked)
    drafts = torch.tensor([chain * 2, chain[:3] + [-1] * 4 + chain])  # node 1's first chain ends early
    got_ids, got_q = _drawn_from(to_wire("q_ids", ids), to_wire("q", q), drafts, spec, 2)
    assert got_ids.shape == (2, 6, 4) and got_ids.dtype == torch.long and got_q.dtype == torch.float16
    dup = ids.clone()
    dup[0, 1, 5, 3] = 0
    neg, zero, nan, unweighted = q.clone(), q.clone(), q.clone(), q.clone()
    neg[0, 0, 0, 0] = -0.25
    zero[0, 1, 2] = 0.0
    nan[0, 0, 3, 1] = float("nan")
    unweighted[0, 1, 5, 3] = 0.0  # node 1, chain 1, step 3 drew 3: its weight 0
    outside, huge = drafts.clone(), drafts.clone()
    outside[0, 9] = 0 + 7  # node 0, chain 1, step 2 drew 7: not among its bytes
    huge[1, 2] = 300
    bad = ((ids.long(), q, drafts), (ids, q.float(), drafts), (ids[:, :1], q[:, :1], drafts),
           (ids[..., :3], q[..., :3], drafts), (dup, q, drafts), (ids, neg, drafts), (ids, zero, drafts),
           (ids, nan, drafts), (ids, unweighted, drafts), (ids, q, outside), (ids, q, huge), (ids, q, drafts[:, :13]))
    for bad_ids, bad_q, bad_drafts in bad:
        with pytest.raises(PipelineError) as ei:
            _drawn_from(to_wire("q_ids", bad_ids), to_wire("q", bad_q), bad_drafts, spec, 2)
        assert ei.value.fault == "hop" and ei.value.hop == 2
    one = {"logits": [0], "draft": 2, "sample": [1, 800, 4]}  # one chain (no width): its drawn bytes only
    ids1, q1 = ids[:, :1, :2], q[:, :1, :2].clone()
    _drawn_from(to_wire("q_ids", ids1), to_wire("q", q1), torch.tensor([[3, -1]]), one, 2)
    q1[0, 0, 0, 3] = 0.0
    for bad_drafts in (torch.tensor([[3, -1]]), torch.tensor([[1, 2, 3]])):
        with pytest.raises(PipelineError):
            _drawn_from(to_wire("q_ids", ids1), to_wire("q", q1), bad_drafts, one, 2)


async def test_a_last_hop_that_answers_float_drafts_or_unasked_distributions_is_at_fault():
    """r10: what the last hop answers is checked before the session reads it: drafts must be of an
    integer type (a float entry such as -0.5 would read as byte 0), the two distribution tensors
    come only where the spec asked for drawn drafts, and a hop that ignores ``sample`` (r9) may
    answer without them."""
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.protocol import PipelineResult
    client = PipelineClient(X25519PrivateKey.generate(), os.urandom(32), ["a:1", "b:2", "c:3"], [0, 1, 2])
    asked = {"logits": [0], "draft": 2, "sample": [1, 800, 4]}

    async def answer(spec, *tensors):
        async def request(meta, x=None):
            return PipelineResult(request_id=1, meta={}, tensors=tensors)
        client._request = request
        return await client.answer(1, "exact", spec)

    logits = to_wire("logits", torch.zeros(1, 1, 256))
    drafts = to_wire("drafts", torch.tensor([[[3, -1]]], dtype=torch.int16))
    dist = (to_wire("q_ids", torch.arange(4, dtype=torch.uint8).expand(1, 1, 2, 4).clone()),
            to_wire("q", torch.full((1, 1, 2, 4), 0.25).half()))
    assert (await answer(asked, logits, drafts, *dist)).q is not None
    assert (await answer(asked, logits, drafts)).q is None  # a hop of r9: argmax drafts
    for spec, tensors in ((asked, (logits, to_wire("drafts", torch.tensor([[[3.0, -0.5]]])), *dist)),
                          ({"logits": [0], "draft": 2}, (logits, drafts, *dist))):
        with pytest.raises(PipelineError) as ei:
            await answer(spec, *tensors)
        assert ei.value.fault == "hop" and ei.value.hop == 2
