"""Decoding: exact mode equals autoregressive output, tree attention, rollback, speculative sampling."""

import math
import random

import numpy as np
import pytest
import torch

import kernels
from blocktrain.blocks.decode import (Sampling, Session, SessionMismatch, bf16_round, draft_distribution, drive,
                                      generate, hop_step, new_caches, run_chain, sample_from)
from blocktrain.blocks.device import threads
from blocktrain.blocks.model import MASK_ID, Assembled, Block, BlockCache, ModelConfig, tree_mask


def tiny_chain(n_blocks: int, seed: int = 0, layers_per_block: int = 1, max_seq_len: int = 128) -> list[Block]:
    """A tiny chain perturbed away from its identity init, so that outputs are non-trivial."""
    cfg = ModelConfig(d_model=32, n_head=2, n_layer=n_blocks * layers_per_block, n_blocks=n_blocks,
                      max_seq_len=max_seq_len, head_layers=1)
    torch.manual_seed(seed)
    blocks = [Block(cfg, k) for k in range(n_blocks)]
    with torch.no_grad():
        for b in blocks:
            for p in b.parameters():
                p.add_(torch.randn_like(p) * 0.3)
            b.eval()
    return blocks


def prompts(n: int, seed: int, max_len: int = 24) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:  # repetitive text, so that prompt lookup drafts get accepted
            out.append((b"abcab" * 10)[:rng.randint(3, max_len)])
        else:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, max_len))))
    return out


def ar_reference(blocks, prompt: bytes, n: int) -> bytes:
    """Greedy decoding by full recomputation (no cache at all)."""
    asm = Assembled(blocks) if len(blocks) == blocks[0].cfg.n_blocks else None
    ids = torch.tensor([list(prompt)])
    for _ in range(n):
        nxt = asm(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return bytes(ids[0, len(prompt):].tolist())


def oracle_step(blocks, caches, truth: bytes, session: Session, rng: random.Random, corrupt: float = 0.3):
    """One traversal whose drafts are the true greedy continuation, each byte corrupted with
    probability ``corrupt``: long accepted runs and rejections at every depth."""
    def step(spec):
        out = run_chain(blocks, caches, spec)
        rows = []
        for node in spec["logits"]:
            pos = spec["positions"][node]  # this node's byte sits at pos; its draft starts at pos + 2
            first = pos + 2 - session.n_prompt
            seq = list(truth[max(0, first):first + session.draft_len]) if first >= 0 else []
            rows.append([b if rng.random() > corrupt else (b + 1) % 256 for b in seq])
        width = max((len(r) for r in rows), default=0)
        drafts = torch.full((1, len(rows), width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            drafts[0, i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return {"logits": out["logits"], "drafts": drafts}
    return step


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 4])
@pytest.mark.parametrize("invariant", [True, False])
def test_exact_greedy_equals_autoregressive(n_blocks, invariant):
    blocks = tiny_chain(n_blocks, seed=n_blocks)
    n = 40
    for i, prompt in enumerate(prompts(6, seed=n_blocks)):
        ar, ar_stats = generate(blocks, prompt, n, invariant=invariant)
        assert ar_stats.traversals == n
        if i < 2:
            assert ar == ar_reference(blocks, prompt, n)
        for kw in ({"draft_len": 5, "slots": 5}, {"draft_len": 6, "lookup": 3},
                   {"draft_len": 4, "slots": 4, "lookup": 2}, {"draft_len": 4, "drafter": True, "lookup": 2}):
            out, st = generate(blocks, prompt, n, invariant=invariant, **kw)
            assert out == ar, (prompt, kw)
        # drafts that are mostly right: many accepted bytes per traversal, rollback at every depth
        s = Session(prompt, n, blocks[0].cfg.max_seq_len, draft_len=7, invariant=invariant)
        out = drive(s, oracle_step(blocks, new_caches(blocks), ar, s, random.Random(i)))
        assert out == ar
        assert s.stats.traversals < n / 2 and s.stats.accepted < s.stats.drafted


def test_exact_equals_autoregressive_through_bf16_hops():
    """Both modes round hidden states between hops (the network codec): still identical."""
    blocks = tiny_chain(3, seed=7)
    for i, prompt in enumerate(prompts(4, seed=11)):
        ar, _ = generate(blocks, prompt, 40, between=bf16_round)
        ex, _ = generate(blocks, prompt, 40, draft_len=5, slots=5, lookup=3, between=bf16_round)
        assert ex == ar


def test_tree_attention_equals_separate_causal_forwards():
    blocks = tiny_chain(3, seed=3)
    asm = Assembled(blocks)
    prefix = list(b"tree attention!")
    # a tree below the prefix: two branches sharing a first byte, a third from the prefix, a slot
    ids = [ord("a"), ord("b"), ord("c"), ord("x"), ord("y"), MASK_ID, ord("z")]
    parents = [-1, 0, 1, 0, 3, 4, -1]
    for invariant in (False, True):
        caches = new_caches(blocks)
        pre = {"base": 0, "keep": [], "start": 0, "ids": prefix, "positions": list(range(len(prefix))),
               "parents": list(range(-1, len(prefix) - 1)), "logits": [len(prefix) - 1], "slots": [],
               "invariant": invariant}
        run_chain(blocks, caches, pre)
        depth = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        P = len(prefix)
        spec = {"base": P, "keep": [], "start": P, "ids": ids, "positions": [P + d for d in depth],
                "parents": parents, "logits": list(range(len(ids))), "slots": [], "invariant": invariant}
        got = run_chain(blocks, caches, spec)["logits"][0]
        for i in range(len(ids)):
            path, j = [], i
            while j >= 0:
                path.append(ids[j])
                j = parents[j]
            want = asm(torch.tensor([prefix + path[::-1]]))[0, -1]
            assert torch.allclose(got[i], want, atol=1e-4), (invariant, i)


def test_a_traversal_in_chunks_equals_one_step(monkeypatch):
    """A hop computes a traversal CHUNK tokens at a time (a serving hop hands its compute slot on
    between chunks): a chain, a tree and slot branches after a short cached prefix, in chunks of
    1 to 25 tokens, give the rows of one step: the batch-invariant ones bitwise, the slot
    branches' drafts alike; and the caches hold the same entries up to rounding. Also under a
    linear kernel whose rows follow the call's shape (tests/kernels.py)."""
    from blocktrain.blocks import decode
    blocks = tiny_chain(3, seed=4)
    prefix = list(b"abc")
    chain = list(b"chunks of one traversal, in turn")
    ids = chain + [ord("a"), ord("b"), ord("x"), ord("y"), ord("z"), MASK_ID, MASK_ID, MASK_ID]
    C = len(chain)
    parents = list(range(-1, C - 1)) + [C - 1, C, C - 1, C + 2, -1, C + 1, C + 5, C + 3]
    P, depth = len(prefix), []
    for q in parents:
        depth.append(0 if q < 0 else depth[q] + 1)
    pre = {"base": 0, "keep": [], "start": 0, "ids": prefix, "positions": list(range(P)),
           "parents": list(range(-1, P - 1)), "logits": [P - 1], "slots": [], "invariant": True}
    verified = list(range(C + 5))
    slots = [[] for _ in verified]
    slots[C + 1], slots[C + 3] = [C + 5, C + 6], [C + 7]
    spec = {"base": P, "keep": [], "start": P, "ids": ids, "positions": [P + d for d in depth], "parents": parents,
            "logits": verified, "slots": slots, "invariant": True}

    def run(chunk):
        monkeypatch.setattr(decode, "CHUNK", chunk)
        caches = new_caches(blocks)
        run_chain(blocks, caches, pre)
        out = run_chain(blocks, caches, spec)
        return out, [c.layers[0].k[:, :, :c.length].clone() for c in caches]
    whole, kv = run(10_000)
    for chunk in (1, 5, 12, 16, 25):
        got, kv_got = run(chunk)
        assert torch.equal(got["logits"], whole["logits"]), chunk  # every verified row is batch-invariant
        assert torch.equal(got["drafts"], whole["drafts"]), chunk  # the slots' argmax
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(kv_got, kv)), chunk
    monkeypatch.setattr(decode, "CHUNK", 16)  # a chunked hop yields None between chunks, then the result
    caches = new_caches(blocks)
    run_chain(blocks, caches, pre)
    steps = list(decode.hop_chunks(blocks[0], caches[0], None, spec))
    assert len(steps) == 3 and steps[0] is None and steps[1] is None and steps[2].shape[1] == len(ids)
    kernels.use(monkeypatch, kernels.by_shape)
    whole, _ = run(10_000)
    for chunk in (3, 16):
        assert torch.equal(run(chunk)[0]["logits"], whole["logits"]), chunk


def test_drafter_drafts_equal_a_reference_run():
    """The draft model's drafts from every verified node of a tree equal a from-scratch run:
    features of the node's whole prefix, entries (feature t-1, byte t), then drafting steps."""
    blocks = tiny_chain(2, seed=4)
    last = blocks[-1]
    prefix = list(b"drafting ahead")
    ids, parents = [ord("a"), ord("b"), ord("c"), ord("x")], [-1, 0, 1, 0]
    P, steps = len(prefix), 3
    caches = new_caches(blocks)
    run_chain(blocks, caches, {"base": 0, "keep": [], "start": 0, "ids": prefix, "positions": list(range(P)),
                               "parents": list(range(-1, P - 1)), "logits": [P - 1], "slots": []})
    depth = [0, 1, 2, 1]
    spec = {"base": P, "keep": [], "start": P, "ids": ids, "positions": [P + d for d in depth], "parents": parents,
            "logits": [0, 1, 2, 3], "slots": [], "draft": steps}
    out = run_chain(blocks, caches, spec)
    for v in range(4):
        path, j = [], v
        while j >= 0:
            path.append(ids[j])
            j = parents[j]
        seq = torch.tensor([prefix + path[::-1]])
        h = seq
        for b in blocks:
            h = b.trunk(h)
        f = h  # (1, n, C)
        prev = torch.cat([torch.zeros(1, 1, f.shape[-1]), f[:, :-1]], 1)
        byte = int(last.logits(f)[0, -1].argmax())
        feats, toks, want = prev, seq, []
        cur = f[:, -1:]
        for _ in range(steps):
            feats = torch.cat([feats, cur], 1)
            toks = torch.cat([toks, torch.tensor([[byte]])], 1)
            u = last.drafter(feats, toks)  # causal, no cache
            cur = u[:, -1:]
            byte = int(last.logits(cur)[0, -1].argmax())
            want.append(byte)
        assert out["drafts"][0, v].tolist() == want, v


def test_traversals_stepped_together_give_each_session_what_it_gets_alone():
    """Continuous batching's numerics: sessions of several kinds (autoregressive, greedy
    exact with the draft model, sampled with wide drafts, prompt lookup and slots), prompts of
    different lengths, their chunks computed together (``step_together``, one forward per block over
    the rows of all) at one torch thread as a serving hop runs: each output is byte for byte what the
    session writes alone, and at least one step held several sessions' chunks."""
    from blocktrain.blocks.decode import Traversal, step_together
    from blocktrain.p2p.serving.server import load_served
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    kinds = [{}, {"draft_len": 16, "drafter": True}, {"draft_len": 8, "drafter": True, "width": 3,
                                                        "sampling": Sampling(temperature=0.8, seed=5)},
             {"draft_len": 4, "slots": 4, "lookup": 2}, {"draft_len": 16, "drafter": True, "lookup": 4}]
    texts = [b" The game was released in Japan in 2011 , and the ", b"He", b" = = History = = \n In 1923 the city ",
             b"abcab" * 9, b" the the the "]
    with threads(1):
        alone = [generate(blocks, t, 40, between=bf16_round, **kw)[0] for t, kw in zip(texts, kinds)]
        sessions = [Session(t, 40, blocks[0].cfg.max_seq_len, **kw) for t, kw in zip(texts, kinds)]
        caches = [new_caches(blocks) for _ in sessions]
        widest = 0
        while live := [n for n, s in enumerate(sessions) if s.state != "done"]:
            specs = {n: sessions[n].next_spec() for n in live}
            x: dict = {n: None for n in live}
            for k, b in enumerate(blocks):
                trav = {n: Traversal(b, caches[n][k], x[n], specs[n]) for n in live}
                out: dict = {}
                while left := [n for n in live if n not in out]:
                    widest = max(widest, len(left))
                    for n, o in zip(left, step_together([trav[n] for n in left])):
                        assert not isinstance(o, BaseException), o
                        if o is not None:
                            out[n] = o
                x = {n: out[n] if k == len(blocks) - 1 else bf16_round(out[n]) for n in live}
            for n in live:
                sessions[n].feed(x[n]["logits"], x[n]["drafts"])
    assert [s.output for s in sessions] == alone and widest >= 3


def test_tree_mask_shape_and_errors():
    m = tree_mask([-1, 0, 0, 2], past=2)
    assert m.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1]]
    assert torch.equal(tree_mask([-1, 0, 1], 3), torch.ones(3, 6, dtype=torch.bool).tril(3))
    with pytest.raises(ValueError, match="parent"):
        tree_mask([-1, 1], 0)  # a parent must come first


@pytest.mark.parametrize("invariant", [True, False])
def test_rollback_equals_recomputation(invariant):
    """After traversals with rejected drafts and slots, every hop's cache holds exactly what a
    fresh prefill of the committed bytes computes."""
    blocks = tiny_chain(2, seed=5)
    prompt = b"rollback me, please"
    truth, _ = generate(blocks, prompt, 30, invariant=invariant)
    s = Session(prompt, 30, blocks[0].cfg.max_seq_len, draft_len=6, slots=3, invariant=invariant)
    caches = new_caches(blocks)
    step = oracle_step(blocks, caches, truth, s, random.Random(0), corrupt=0.4)
    for _ in range(5):
        spec = s.next_spec()
        out = step(spec)
        s.feed(out["logits"], out["drafts"])
    # roll back as the next traversal would, then compare with a prefill of the committed bytes
    base, keep = s.base, s.keep
    for c in caches:
        c.rollback(base, keep)
    committed = s.tokens[:s.cached]
    fresh = new_caches(blocks)
    spec = {"base": 0, "keep": [], "start": 0, "ids": committed, "positions": list(range(len(committed))),
            "parents": list(range(-1, len(committed) - 1)), "logits": [0], "slots": [], "invariant": invariant}
    run_chain(blocks, fresh, spec)
    for a, b in zip(caches, fresh):
        assert a.length == b.length == len(committed)
        for la, lb in zip(a.layers, b.layers):
            for x, y in ((la.k, lb.k), (la.v, lb.v)):
                x, y = x[:, :, :la.length], y[:, :, :lb.length]
                if invariant:
                    assert torch.equal(x, y)
                else:
                    assert torch.allclose(x, y, atol=1e-5)


def test_session_survives_lost_caches():
    """A hop loses its cache mid-session (a peer replaced): every hop starts afresh from the
    committed bytes, and the output is still the autoregressive one."""
    blocks = tiny_chain(3, seed=8)
    prompt = b"faults happen"
    ar, _ = generate(blocks, prompt, 30)
    s = Session(prompt, 30, blocks[0].cfg.max_seq_len, draft_len=4, slots=4, lookup=2)
    caches = new_caches(blocks)
    for i in range(6):
        spec = s.next_spec()
        if i == 3:  # block 1's peer died after the spec went out: no answer; a fresh peer takes over
            caches[1] = BlockCache(blocks[1])
            with pytest.raises(SessionMismatch):
                run_chain(blocks, caches, spec)
            s.reset_caches()
            for k in (0, 2):  # the others drop theirs too: the next spec rebuilds every hop
                caches[k] = BlockCache(blocks[k])
            spec = s.next_spec()
            assert spec["base"] == 0 and spec["start"] == 0 and len(spec["ids"]) > len(prompt)
        out = run_chain(blocks, caches, spec)
        s.feed(out["logits"], out["drafts"])
    assert drive(s, lambda spec: run_chain(blocks, caches, spec)) == ar


def test_stale_cache_is_detected():
    blocks = tiny_chain(2)
    caches = new_caches(blocks)
    s = Session(b"hello", 5, blocks[0].cfg.max_seq_len, draft_len=2, slots=2)
    spec = s.next_spec()
    out = run_chain(blocks, caches, spec)
    s.feed(out["logits"], out["drafts"])
    spec = s.next_spec()
    with pytest.raises(SessionMismatch) as e:
        hop_step(blocks[1], BlockCache(blocks[1]), torch.zeros(1, len(spec["ids"]), 32), spec)  # a hop that lost it
    assert e.value.block == 1 and e.value.want == spec["start"]


def test_positions_beyond_max_seq_len_raise():
    blocks = tiny_chain(2, max_seq_len=16)
    b0 = blocks[0]
    with pytest.raises(ValueError, match="max_seq_len"):
        b0.embed(torch.zeros(1, 2, dtype=torch.long), torch.tensor([15, 16]))
    with pytest.raises(ValueError, match="max_seq_len"):
        b0.embed(torch.zeros(1, 2, dtype=torch.long), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="max_seq_len"):
        b0.embed(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        Session(b"x" * 10, 8, 16)  # 10 + 8 - 1 positions
    with pytest.raises(ValueError):
        Session(b"", 4, 16)
    spec = {"base": 0, "keep": [], "start": 0, "ids": [1, 2], "positions": [15, 16], "parents": [-1, 0],
            "logits": [1], "slots": []}
    with pytest.raises(ValueError, match="max_seq_len"):
        hop_step(b0, BlockCache(b0), None, spec)
    # the session never asks for a position past the end, even with long drafts and slots
    out, _ = generate(blocks, b"x" * 8, 9, draft_len=8, slots=8, lookup=2)
    assert len(out) == 9


# ---------------------------------------------------------------------------------------------
# Speculative sampling


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class MemoModel:
    """Last-head logits of a chain for a byte prefix, by full recomputation, memoised."""

    def __init__(self, blocks):
        self.asm, self.memo = Assembled(blocks), {}

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.memo:
            self.memo[prefix] = self.asm(torch.tensor([list(prefix)]))[0, -1].double()
        return self.memo[prefix]


def _path(spec: dict, node: int) -> tuple:
    """The bytes of a spec's new tokens from its root to ``node``."""
    path, j = [], node
    while j >= 0:
        path.append(spec["ids"][j])
        j = spec["parents"][j]
    return tuple(path[::-1])


def fake_chain(model: MemoModel, session: Session, draft_len: int):
    """A traversal computed from byte prefixes; drafts after each verified node's argmax: the
    most likely byte, then the second, alternately (deterministic, often right, often wrong).
    With a spec ``width`` W > 1 (the draft model's wide drafts), per node W chains: each of its W
    most likely bytes, then ``spec["draft"]`` such drafts after it, then their runners-up."""
    def drafted(p, n, alternates=False):
        d, alt = [], []
        for k in range(n):
            top = model(p).topk(3).indices.tolist()
            d.append(top[k % 2])
            alt.append(top[2 - k % 2])
            p = p + (d[-1],)
        return d + alt if alternates else d

    def step(spec):
        base = tuple(session.tokens[:spec["start"]])
        logits, drafts = [], []
        W = spec.get("width", 1)
        for node in spec["logits"]:
            prefix = base + _path(spec, node)
            logits.append(model(prefix))
            if W == 1:
                drafts.append(drafted(prefix + (int(model(prefix).argmax()),), draft_len))
            else:
                drafts.append([x for c in model(prefix).topk(W).indices.tolist()
                               for x in [c] + drafted(prefix + (c,), spec["draft"], alternates=True)])
        return {"logits": torch.stack(logits)[None], "drafts": torch.tensor([drafts]).reshape(1, len(drafts), -1)}
    return step


def fake_sampled_chain(model: MemoModel, session: Session):
    """As ``fake_chain``'s wide drafts, but each draft byte drawn (the spec's ``sample`` seed)
    from a draft distribution unlike the target: the model's logits halved, at the spec's
    temperature, among its ``k`` most likely bytes; each step's runner-up the most likely other
    byte; the answer carries those distributions (``q_ids``, ``q``)."""
    def step(spec):
        seed, milli, k = spec.get("sample", (0, 1000, 1))  # none where nothing is drafted
        gen = torch.Generator().manual_seed(seed)
        base = tuple(session.tokens[:spec["start"]])
        logits, drafts, q_ids, q = [], [], [], []
        for node in spec["logits"]:
            prefix = base + _path(spec, node)
            logits.append(model(prefix))
            row, ids_row, q_row = [], [], []
            for c in model(prefix).topk(spec.get("width", 1)).indices.tolist():
                p, d, alt = prefix + (c,), [], []
                for _ in range(spec["draft"]):
                    ids, probs = draft_distribution(model(p) / 2, milli / 1000, k)
                    pick = int(sample_from(probs, torch.rand((), generator=gen, dtype=torch.float64)))
                    d.append(int(ids[pick]))
                    alt.append(int(ids[1 if pick == 0 else 0]))
                    ids_row.append(ids)
                    q_row.append(probs)
                    p = p + (d[-1],)
                row += [c] + d + alt
            drafts.append(row)
            q_ids += [torch.stack(ids_row)] if ids_row else []
            q += [torch.stack(q_row)] if q_row else []
        out = {"logits": torch.stack(logits)[None], "drafts": torch.tensor([drafts])}
        return {**out, "q_ids": torch.stack(q_ids)[None], "q": torch.stack(q)[None]} if q else out
    return step


def _exact_outputs(model: MemoModel, prompt: bytes, samp: Sampling, n_bytes: int) -> dict:
    """Every output of ``n_bytes`` after ``prompt`` under autoregressive sampling, and its probability."""
    exact = {}

    def expand(prefix, prob, depth):
        if depth == n_bytes:
            exact[prefix[len(prompt):]] = prob
            return
        p = samp.probs(model(prefix))
        for b in np.flatnonzero(p):
            expand(prefix + (int(b),), prob * p[b], depth + 1)
    expand(tuple(prompt), 1.0, 0)
    return exact


def test_speculative_sampling_matches_autoregressive_distribution():
    blocks = tiny_chain(2, seed=9)
    model = MemoModel(blocks)
    prompt = b"sample"
    samp = Sampling(temperature=2.0, top_k=3, seed=1234)
    n_bytes, n_samples = 3, 4000
    exact = _exact_outputs(model, prompt, samp, n_bytes)  # of the first 3 bytes, autoregressive sampling
    assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-9
    counts = {"ar": {}, "exact": {}, "wide": {}, "drawn": {}}
    for mode, kw in (("ar", {}), ("exact", {"draft_len": 2}), ("wide", {"draft_len": 2, "drafter": True, "width": 3}),
                     ("drawn", {"draft_len": 2, "drafter": True, "width": 3, "sample_k": 4})):
        accepted = drafted = 0
        for i in range(n_samples):
            first = {"ar": 0, "exact": 10**6, "wide": 2 * 10**6, "drawn": 3 * 10**6}[mode]
            s = Session(prompt, n_bytes, 64, **kw, sampling=Sampling(samp.temperature, samp.top_k, seed=first + i))
            chain = fake_sampled_chain(model, s) if mode == "drawn" else fake_chain(model, s, kw.get("draft_len", 0))
            out = tuple(drive(s, chain))
            counts[mode][out] = counts[mode].get(out, 0) + 1
            accepted += s.stats.accepted
            drafted += s.stats.drafted
        if mode != "ar":  # drafts often accepted, often not
            assert 0.2 * drafted < accepted < 0.8 * drafted, (mode, accepted, drafted)
    for mode in counts:
        assert set(counts[mode]) <= set(exact)
        chi2 = sum((counts[mode].get(k, 0) - n_samples * p) ** 2 / (n_samples * p) for k, p in exact.items())
        assert chi2 < _chi2_critical(len(exact) - 1), (mode, chi2)


def test_drawn_chains_of_two_match_autoregressive_distribution():
    """The test above draws one byte per chain; here chains of 2 drawn bytes, 3 chains per node
    (the session often goes on with a chain other than the first: its distributions are found by
    the chain's place), over 4 bytes: 81 outputs, chi-square against their exact distribution."""
    model = MemoModel(tiny_chain(2, seed=9))
    prompt, samp, n_bytes, n_samples = b"sample", Sampling(temperature=2.0, top_k=3), 4, 3000
    exact = _exact_outputs(model, prompt, samp, n_bytes)
    assert len(exact) == 81
    counts, deep = {}, 0
    for i in range(n_samples):
        s = Session(prompt, n_bytes, 64, draft_len=2, drafter=True, width=3, sample_k=4,
                    sampling=Sampling(samp.temperature, samp.top_k, seed=4 * 10**6 + i))
        out = tuple(drive(s, fake_sampled_chain(model, s)))
        counts[out] = counts.get(out, 0) + 1
        deep += s.stats.accept_hist.get(2, 0)  # both drawn bytes of a chain accepted
    assert deep > 100, deep
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n_samples * p) ** 2 / (n_samples * p) for k, p in exact.items())
    assert chi2 < _chi2_critical(len(exact) - 1), chi2


def test_wide_drafts_continue_the_chain_of_the_byte_emitted():
    """Sampled exact mode asks the draft model for ``width`` chains per verified node, one per
    likely next byte; the session continues the chain whose first byte it emitted (its drafts,
    and each step's runner-up as a sibling leaf), and none when it emitted another byte. Greedy
    sessions ask for one chain (the argmax is always emitted)."""
    assert "width" not in Session(b"ab", 8, 64, draft_len=4, drafter=True, width=3).next_spec()
    for emitted, want, alt in ((7, [70, 71, 72], [170, 171, 172]), (9, [90, 91, 92], [190, 191, 192]), (5, [], [])):
        s = Session(b"ab", 8, 64, draft_len=4, drafter=True, width=3, sampling=Sampling(temperature=1.0, seed=0))
        spec = s.next_spec()
        assert spec["width"] == 3 and spec["draft"] == 4 and spec["logits"] == [1]
        logits = torch.full((1, 256), -1e9)
        logits[0, emitted] = 0.0  # the session samples ``emitted`` for sure
        chains = [[7, 70, 71, 72, -1, 170, 171, 172, -1], [8, 80, 81, 82, 83, 180, 181, 182, 183],
                  [9, 90, 91, 92, -1, 190, 191, 192, -1]]
        assert s.feed(logits, torch.tensor([[sum(chains, [])]])) == [emitted]
        assert s.model_draft == want
        nxt = s.next_spec()  # the next traversal verifies that chain, each runner-up beside its step
        assert nxt["ids"][1:] == want + alt and nxt["parents"][1:] == [0, 1, 2][:len(want)] + [0, 1, 2][:len(alt)]


def test_a_long_sampled_draft_asks_for_fewer_chains_within_the_hops_bound():
    """The last hop drafts (verified nodes x chains x steps) at most MAX_DRAFTING steps a traversal:
    a session whose tree is large asks for fewer chains rather than be refused."""
    from blocktrain.blocks.decode import MAX_DRAFTING, check_spec
    for lookup in (0, 8):  # with prompt lookup too: the tree is cut to what a hop verifies (runners-up first)
        s = Session(b"abcdefgh" * 4, 100, 300, draft_len=32, drafter=True, width=4, lookup=lookup,
                    sampling=Sampling(temperature=1.0, seed=0))
        V = len(s.next_spec()["logits"])
        logits = torch.full((V, 256), -1e9)
        logits[:, 97] = 0.0  # "a" is drawn: its chain's 32 drafts and 32 runners-up (and a lookup draft)
        chain = [97] + list(range(200, 232)) + list(range(150, 182))
        s.feed(logits, torch.tensor([[chain * 4] * V]))
        spec = s.next_spec()
        assert spec["parents"].count(0) == (3 if lookup else 2)  # the root's children: draft, runner-up (, lookup)
        assert len(spec["logits"]) == 65 and spec["draft"] == 32 and "width" not in spec  # 65 x 1 x 32 = the bound
        assert len(spec["logits"]) * spec["draft"] <= MAX_DRAFTING and check_spec(spec, 300)["width"] == 1


def test_sampling_through_the_chain_is_reproducible_and_valid():
    blocks = tiny_chain(3, seed=2)
    samp = Sampling(temperature=0.8, top_k=5, seed=7)
    a, _ = generate(blocks, b"seeded", 30, draft_len=4, slots=4, lookup=2, sampling=samp)
    b, _ = generate(blocks, b"seeded", 30, draft_len=4, slots=4, lookup=2, sampling=samp)
    assert a == b and len(a) == 30


def test_session_is_a_state_machine():
    s = Session(b"ab", 3, 32)
    with pytest.raises(AssertionError):
        s.feed(torch.zeros(1, 256))
    s.next_spec()
    with pytest.raises(AssertionError):
        s.next_spec()


def test_the_shipped_model_is_served_by_default_and_decodes_exactly_in_few_traversals():
    """The small trained model in the package (blocks/data/model): `bt-peer serve` without
    --checkpoints serves it, its draft model is trained (more than 2 bytes per traversal), its
    exact output is its autoregressive output, and that output is words of the training text, not noise
    (a small model's greedy output repeats itself: "second second second the second ...")."""
    import re

    from blocktrain.blocks.data import read_split
    from blocktrain.blocks.decode import generate
    from blocktrain.p2p.serving.server import load_served
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    assert blocks[-1].drafter is not None
    prompt = b" The game was released in Japan in 2011 , and the "
    exact, st = generate(blocks, prompt, 48, draft_len=16, drafter=True)
    ar, _ = generate(blocks, prompt, 48)
    assert exact == ar and st.bytes_per_traversal(48) > 2
    words = re.findall(rb"[A-Za-z]{3,}", bytes(exact)[:-8])  # the last word may be cut off
    known = set(re.findall(rb"[A-Za-z]{3,}", read_split("train")))
    assert len(words) >= 4 and sum(w in known for w in words) >= 0.8 * len(words), exact


def _drawn_session(seed: int) -> Session:
    """A sampling session that drew 7 and holds the drawn chain [71, 80] (71 of weight 0.25)."""
    s = Session(b"ab", 8, 64, draft_len=2, drafter=True, sample_k=4, sampling=Sampling(temperature=1.0, seed=seed))
    s.next_spec()
    logits = torch.full((1, 256), -1e9)
    logits[0, 7] = 0.0  # the session draws 7 for sure
    q_ids = torch.tensor([[[[70, 71, 72, 73], [80, 81, 82, 83]]]])  # (1, nodes, chains x steps, k)
    q = torch.tensor([[[[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]]]]).half()
    assert s.feed(logits, torch.tensor([[[71, 80]]]), q_ids, q) == [7]
    return s


def test_drawn_drafts_are_verified_against_the_distribution_they_were_drawn_from():
    """r10: a sampling session asks the last hop to draw its drafts (spec ``sample``: seed,
    temperature x 1000, k) and verifies a drawn byte d with min(1, p(d) / q(d)): here p(71) = 0.5
    and q(71) = 0.25, so 71 is always accepted, where an argmax draft (no distributions in the
    answer: a hop of r9) is accepted with p(71), about half the time."""
    from blocktrain.blocks.decode import check_spec
    s = Session(b"ab", 8, 64, draft_len=2, drafter=True, sample_k=4, sampling=Sampling(temperature=1.0, seed=0))
    spec = s.next_spec()
    assert spec["sample"][1:] == [1000, 4] and check_spec(spec, 64)["sample"] == spec["sample"]
    assert "sample" not in Session(b"ab", 8, 64, draft_len=2, drafter=True, sample_k=4).next_spec()  # greedy
    p = torch.full((256,), -1e9)
    p[71], p[72] = 0.0, 0.0  # p(71) = p(72) = 0.5
    taken = {"drawn": 0, "argmax": 0}
    for seed in range(40):
        for kind in taken:
            s = _drawn_session(seed)
            assert s.model_q[0][71] == 0.25 and s.model_q[1][80] == 1.0
            if kind == "argmax":
                s.model_q = []  # as a hop of r9 answers: its drafts verified as deterministic
            spec = s.next_spec()
            assert spec["ids"][1:3] == [71, 80]
            rows = torch.stack([p, p, p, p])[:len(spec["logits"])]
            taken[kind] += s.feed(rows[None])[0] == 71
    assert taken["drawn"] == 40 and 8 < taken["argmax"] < 32, taken


def test_a_drawn_draft_outside_its_distribution_is_refused_and_nothing_of_the_answer_is_kept():
    """An answer whose drawn byte has weight 0 in its distribution, or with more drawn bytes than
    asked, is refused (ValueError) before the session commits anything: a retry elsewhere starts
    from the bytes and drafts it had, never verifying the refused byte against a weight of 0."""
    logits = torch.full((1, 256), -1e9)
    logits[0, 7] = 0.0
    q_ids = torch.tensor([[[[70, 71, 72, 73], [80, 81, 82, 83]]]])
    q = torch.tensor([[[[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]]]]).half()
    for drafts, why in (([73, 80], "outside the distribution"), ([71, 80, 81], "where 2 were asked")):
        s = Session(b"ab", 8, 64, draft_len=2, drafter=True, sample_k=4, sampling=Sampling(temperature=1.0, seed=0))
        s.next_spec()
        with pytest.raises(ValueError, match=why):
            s.feed(logits, torch.tensor([[drafts]]), q_ids, q)
        assert s.output == b"" and s.model_draft == [] and s.model_q == [] and s.cached == 0
        s.reset_caches()  # the client's retry on another chain
        assert s.next_spec()["ids"] == list(b"ab")
