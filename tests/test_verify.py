"""Served output is checked. ``--verify`` recomputes the output on other
holders and names a hop whose answers differ; a hop that hands on a wrong shape is named and
rerouted around. The search itself (verify.check_output) is tested without a network, the whole
path with live serving peers, a liar among them."""

import copy
import os

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks.decode import Sampling, recompute_spec, row_gap
from blocktrain.p2p.serving.client import generate
from blocktrain.p2p.identity import peer_id
from blocktrain.p2p.node import Peer
from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks
from blocktrain.p2p.serving.verify import MAX_JUDGES, VerifyError, check_output

from test_pipeline import FAST, in_process, make_models

@pytest.fixture
def models():
    return make_models()


BASE = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))


def fake_swarm(liars: dict[str, float], flaky: frozenset = frozenset()):
    """Rows a route answers: the true rows, moved by each lying hop on it (its own direction, so
    two liars never agree); ``flaky`` hops lie only the first time they are asked (while decoding)."""
    asked: list[list[str]] = []

    def lie(h):
        g = torch.Generator().manual_seed(sum(map(ord, h)))
        return liars[h] * torch.randn(BASE.shape, generator=g)

    def answer(route, first=False):
        out = BASE.clone()
        for h in route:
            if h in liars or (first and h in flaky):
                out += lie(h) if h in liars else 3 * torch.randn(BASE.shape, generator=torch.Generator().manual_seed(9))
        return out

    async def rows(route):
        asked.append(list(route))
        return answer(route)
    return answer, rows, asked


HOLDERS = {0: ["a0", "b0"], 1: ["a1", "b1", "c1"], 2: ["a2", "b2", "c2"]}
FIRST = ["a0", "a1", "a2"]


async def test_an_honest_output_costs_one_traversal():
    answer, rows, asked = fake_swarm({})
    c = await check_output(answer(FIRST), FIRST, HOLDERS, rows)
    assert c.ok and c.named == [] and c.second == ["b0", "b1", "b2"] and asked == [c.second] and c.traversals == 1


@pytest.mark.parametrize("liar", ["a1", "a2", "a0"])
async def test_a_liar_in_the_decoding_chain_is_named_by_the_other_holders(liar):
    answer, rows, asked = fake_swarm({liar: 4.0})
    if liar == "a0":  # block 0 has two holders: a disagreement with no third to judge names both
        with pytest.raises(VerifyError) as ei:
            await check_output(answer(FIRST), FIRST, HOLDERS, rows)
        assert sorted(ei.value.holders) == ["a0", "b0"]
        return
    c = await check_output(answer(FIRST), FIRST, HOLDERS, rows)
    assert not c.ok and c.named == [liar] and c.suspects == [] and c.traversals == len(asked) <= 2 + 3 + 6 * (MAX_JUDGES - 1)


async def test_a_liar_in_the_checking_chain_is_named_and_the_output_stands():
    answer, rows, _ = fake_swarm({"b1": 4.0})
    c = await check_output(answer(FIRST), FIRST, HOLDERS, rows)
    assert c.ok and c.named == ["b1"]
    # ... unless the first chain itself answered otherwise while it decoded
    answer, rows, _ = fake_swarm({"b1": 4.0}, flaky=frozenset({"a2"}))
    c = await check_output(answer(FIRST, first=True), FIRST, HOLDERS, rows)
    assert not c.ok and c.named == ["b1"] and set(c.suspects) == set(FIRST)


async def test_a_chain_that_lied_only_while_decoding_is_avoided_whole_and_nobody_named():
    answer, rows, _ = fake_swarm({}, flaky=frozenset({"a1"}))
    c = await check_output(answer(FIRST, first=True), FIRST, HOLDERS, rows)
    assert not c.ok and c.named == [] and c.suspects == FIRST and "differently" in c.why


async def test_a_liar_that_lies_only_beside_an_honest_peer_gets_it_avoided_never_named():
    """Every hop sees the route: a liar may lie only when a peer it wants out of the swarm is on
    the chain, so that the other holders of that peer's block outvote it. Judged beside both
    chains, the honest peer is only a suspect (avoided this once), never named; so is the liar
    (it answered honestly beside the second chain); and with a block unchecked nobody is named."""
    holders = {0: ["L", "b0", "c0"], 1: ["X", "b1", "c1"], 2: ["a2", "b2"]}
    first = ["L", "X", "a2"]

    def answer(route):
        out = BASE.clone()
        if route[0] == "L" and route[1] == "X":
            out += 4 * torch.randn(BASE.shape, generator=torch.Generator().manual_seed(5))
        return out

    async def rows(route):
        return answer(route)
    c = await check_output(answer(first), first, holders, rows)
    assert not c.ok and c.named == [] and sorted(c.suspects) == ["L", "X"]
    c = await check_output(answer(first), first, {**holders, 0: ["L"]}, rows)  # block 0 unchecked
    assert not c.ok and c.named == [] and "X" in c.suspects
    # one peer serving two blocks sits in both chains: the liar X (blocks 1 and 2) lies whenever A
    # is on the route; beside either chain A looks wrong, but A is not named, only avoided
    holders = {0: ["A", "C", "D"], 1: ["X", "Q", "R"], 2: ["P", "X", "S"]}

    def answer2(route):
        out = BASE.clone()
        if "X" in route and "A" in route:
            out += 4 * torch.randn(BASE.shape, generator=torch.Generator().manual_seed(6))
        return out

    async def rows2(route):
        return answer2(route)
    c = await check_output(answer2(["A", "X", "P"]), ["A", "X", "P"], holders, rows2)
    assert not c.ok and c.named == [] and "A" in c.suspects


async def test_rounding_passes_and_one_holder_per_block_cannot_be_checked():
    answer, rows, _ = fake_swarm({})
    c = await check_output(answer(FIRST) + 1e-4 * torch.randn(BASE.shape), FIRST, {0: ["a0"], 1: ["a1", "b1"],
                                                                                    2: ["a2"]}, rows)
    assert c.ok and c.unchecked == [0, 2] and 0 < c.gap < 1e-3
    with pytest.raises(VerifyError, match="no block has a second"):
        await check_output(answer(FIRST), FIRST, {0: ["a0"], 1: ["a1"], 2: ["a2"]}, rows)


def test_the_recompute_spec_gives_the_rows_decoding_chose_from(models):
    """What --verify compares: every mode's recorded rows against one recomputing traversal, at
    rounding distance (greedy and sampled, with and without drafts)."""
    from blocktrain.blocks.decode import Session, bf16_round, drive, new_caches, run_chain
    bt, _ = models
    assert bt[-1].drafter is not None
    for temp, draft, wide in ((0.0, 0, False), (0.0, 8, False), (0.9, 8, False), (0.9, 8, True), (0.0, 8, True)):
        kw = {"drafter": True, "width": 4} if wide else {"slots": draft}  # wide: the client's sampled drafts
        s = Session(b"check me", 30, 96, draft_len=draft, sampling=Sampling(temperature=temp, seed=1), **kw)
        caches = new_caches(bt)
        drive(s, lambda spec: run_chain(bt, caches, spec, between=bf16_round))
        again = run_chain(bt, new_caches(bt), recompute_spec(s.tokens, s.n_prompt), between=bf16_round)["logits"][0]
        assert len(s.rows) == 30 and row_gap(torch.stack(s.rows), again) < 1e-6


# --- live peers ------------------------------------------------------------------------------------

def _lying(block, how: str):
    """A copy of ``block`` that lies: ``permute`` hands on its hidden states with the channels
    permuted (a middle hop), ``force`` answers logits that always pick byte 0 (the last hop),
    ``shape`` hands on one position too few."""
    liar = copy.deepcopy(block)
    extend_many, logits = liar.extend_many, liar.logits  # what a serving hop computes with
    perm = torch.randperm(block.cfg.d_model, generator=torch.Generator().manual_seed(1))
    if how == "permute":
        liar.extend_many = lambda steps: [h[..., perm] for h in extend_many(steps)]
    elif how == "shape":
        liar.extend_many = lambda steps: [h[:, 1:] for h in extend_many(steps)]
    else:
        def forced(h, **kw):
            out = logits(h, **kw)
            out[..., 0] += 20.0
            return out
        liar.logits = forced
    return liar


async def _swarm(bt, e2e, psk, liar_block: int, how: str):
    """Holders 0 and 2 once, ``liar_block`` three times; its liar has the smallest peer id (the
    client's first choice)."""
    keys = sorted((X25519PrivateKey.generate() for _ in range(3)), key=peer_id)
    peers = []
    for k in range(3):
        for j, key in enumerate(keys if k == liar_block else [X25519PrivateKey.generate()]):
            p = await Peer(key, psk, "127.0.0.1", 0, blocks=(k,), role="serve", timeouts=FAST).start()
            if peers:
                await p.join("127.0.0.1", peers[0].port)
            served = _lying(bt[k], how) if k == liar_block and j == 0 else bt[k]
            PipelineServer(p, ServedBlocks({k: served}, {k: e2e.blocks[k]}))
            peers.append(p)
    for p in peers:
        await p.wait_for(lambda p=p: len(p.members()) == len(peers) - 1, 10.0)
    return peers, peers[liar_block]


@pytest.mark.parametrize("liar_block,how", [(1, "permute"), (2, "force")])
async def test_verify_names_a_lying_hop_reroutes_and_prints_the_true_output(models, liar_block, how):
    """A middle hop permuting its hidden states, or a last hop forcing its logits, sits in the
    client's first chain: without --verify its output is printed (exit 0); with it the liar is
    named, avoided, and the output is what honest peers write."""
    bt, e2e = models
    psk = os.urandom(32)
    peers, liar = await _swarm(bt, e2e, psk, liar_block, how)
    try:
        prompt = b"check this output"
        want = in_process(bt, prompt, 12)
        out, st = await generate("127.0.0.1", peers[0].port, X25519PrivateKey.generate(), psk, prompt, 12, "exact", 10)
        assert liar.addr in st["route"] and out != want  # unchecked, the lie is printed
        out, st = await generate("127.0.0.1", peers[0].port, X25519PrivateKey.generate(), psk, prompt, 12, "exact", 10,
                                 verify=True)
        assert out == want and liar.addr not in st["route"] and st["attempts"] == 2
        assert st["verify"]["ok"] and st["verify"]["unchecked_blocks"] == [b for b in range(3) if b != liar_block]
    finally:
        for p in peers:
            await p.stop()


async def test_a_hop_that_hands_on_a_wrong_shape_is_named_and_rerouted(models):
    """The next hop refuses the wrong shape as the hop below's fault (not the request's): the
    client avoids that hop and the output is right."""
    bt, e2e = models
    psk = os.urandom(32)
    peers, liar = await _swarm(bt, e2e, psk, 1, "shape")
    try:
        prompt = b"shape shifter"
        out, st = await generate("127.0.0.1", peers[0].port, X25519PrivateKey.generate(), psk, prompt, 8, "exact", 10)
        assert out == in_process(bt, prompt, 8) and liar.addr not in st["route"] and st["attempts"] == 2
    finally:
        for p in peers:
            await p.stop()
