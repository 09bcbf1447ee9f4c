"""Continuous batching at a serving hop (p2p/serving/batching.py, decode.step_together): a session's
failure stays its own, a traversal cancelled while queued is skipped, and a batch's rows are
what each session gets alone."""

import asyncio
import concurrent.futures

import pytest
import torch

import kernels
from blocktrain.blocks.decode import CHUNK, SessionMismatch, Traversal, step_together
from blocktrain.blocks.device import threads
from blocktrain.blocks.model import Block, BlockCache, ModelConfig
from blocktrain.p2p.serving.batching import Batcher

CFG = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=96, head_layers=1)


def _block(k: int) -> Block:
    torch.manual_seed(k)
    b = Block(CFG, k)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return b.eval()


def _spec(ids: list[int], start: int = 0) -> dict:
    T = len(ids)
    return {"base": start, "keep": [], "start": start, "ids": ids, "positions": list(range(start, start + T)),
            "parents": list(range(-1, T - 1)), "logits": [T - 1], "slots": [], "invariant": True}


def _alone(b: Block, prompts: list[list[int]]) -> list[torch.Tensor]:
    outs = []
    for ids in prompts:
        t = Traversal(b, BlockCache(b), None, _spec(ids))
        while (o := t.step_alone()) is None:
            pass
        outs.append(o)
    return outs


@pytest.fixture(autouse=True)
def one_thread():
    """bt-peer serve's thread count, which the rows' invariance is claimed at (model.py's rules)."""
    with threads(1):
        yield


PROMPTS = [list(b"the first session"), list(b"a second, much longer one: three chunks of tokens here"), list(b"3rd")]


async def test_a_session_whose_rollback_fails_fails_alone_and_the_others_finish_as_alone():
    """One traversal of a batch names a start its cache does not hold (SessionMismatch): it alone
    fails; the others' outputs are bitwise what they get alone (a regression test: so it was
    before the review's fixes too)."""
    b = _block(0)
    want = _alone(b, PROMPTS)
    batcher = Batcher(concurrent.futures.ThreadPoolExecutor(1))
    travs = [Traversal(b, BlockCache(b), None, _spec(ids)) for ids in PROMPTS]
    stale = Traversal(b, BlockCache(b), None, _spec(list(b"xy"), start=5))  # a lost session

    async def run(t):
        while (o := await batcher.step(t)) is None:
            pass
        return o
    got = await asyncio.gather(*(run(t) for t in travs + [stale]), return_exceptions=True)
    assert isinstance(got[-1], SessionMismatch)
    assert all(torch.equal(g, w) for g, w in zip(got[:-1], want))
    assert batcher.largest >= 3 and batcher.chunks > batcher.batches


async def test_a_traversal_cancelled_while_queued_is_skipped():
    b = _block(0)
    batcher = Batcher(concurrent.futures.ThreadPoolExecutor(1))
    gone, kept = (Traversal(b, BlockCache(b), None, _spec(ids)) for ids in PROMPTS[:2])
    task = asyncio.ensure_future(batcher.step(gone))
    await asyncio.sleep(0)  # queued, the batch not begun (it waits GATHER passes)
    task.cancel()
    assert await batcher.step(kept) is None  # the next chunk's wait: the long one has three
    assert gone.cache.length == 0 and kept.cache.length == CHUNK
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_when_the_batching_itself_fails_every_waiting_chunk_fails_and_nobody_hangs():
    """The compute thread gone (the hop stopping): the chunks queued fail at once, each with its
    own error, and a later chunk is not left waiting either."""
    b = _block(0)
    threads = concurrent.futures.ThreadPoolExecutor(1)
    threads.shutdown()
    batcher = Batcher(threads)
    travs = [Traversal(b, BlockCache(b), None, _spec(ids)) for ids in PROMPTS]
    got = await asyncio.wait_for(asyncio.gather(*(batcher.step(t) for t in travs), return_exceptions=True), 5)
    assert all(isinstance(g, RuntimeError) and "batching stopped" in str(g) for g in got)
    assert len({id(g) for g in got}) == len(got)
    with pytest.raises(RuntimeError, match="batching stopped"):
        await asyncio.wait_for(batcher.step(travs[0]), 5)


def test_a_step_that_fails_in_a_batch_is_retried_alone_and_fails_alone(monkeypatch):
    """A forward that raises over the whole batch (here: one session's step, after the others'
    keys were written) is undone and each step run alone: the failing one fails, the others get
    what they get alone (the last block's answers), their caches holding each chunk once."""
    b = _block(1)
    torch.manual_seed(5)
    xs = [torch.randn(1, len(ids), CFG.d_model) for ids in PROMPTS]
    want = []
    for x, ids in zip(xs, PROMPTS):
        t = Traversal(b, BlockCache(b), x, _spec(ids))
        while (o := t.step_alone()) is None:
            pass
        want.append(o)
    bad = BlockCache(b)
    real = b.extend_many

    def flaky(steps):
        good = [s for s in steps if s[1] is not bad]
        out = real(good) if good else []  # the good ones' keys are written
        if len(good) < len(steps):
            raise RuntimeError("this step's forward failed")
        return out
    monkeypatch.setattr(b, "extend_many", flaky)
    travs = [Traversal(b, BlockCache(b), x, _spec(ids)) for x, ids in zip(xs, PROMPTS)]
    failing = Traversal(b, bad, torch.randn(1, 4, CFG.d_model), _spec(list(b"abcd")))
    outs: list = [None] * 4
    while any(o is None for o in outs):
        live = [n for n, o in enumerate(outs) if o is None]
        for n, o in zip(live, step_together([(travs + [failing])[n] for n in live])):
            outs[n] = o
    assert isinstance(outs[-1], RuntimeError)
    assert all(o.keys() == w.keys() and all(torch.equal(o[k], w[k]) for k in o) for o, w in zip(outs[:-1], want))
    assert [t.cache.length for t in travs] == [len(ids) for ids in PROMPTS]




def test_a_full_batch_at_serving_widths_gives_each_traversal_its_rows_alone_under_another_kernel(monkeypatch):
    """As many traversals as a hop batches (64, chunks of CHUNK tokens and shorter) at the
    shipped model's widths (d 192), one forward over all their rows: every row bitwise what the
    traversal computes alone, under a linear kernel whose rows follow the call's shape
    (tests/kernels.py), so the claim is not one of this machine's kernels."""
    kernels.use(monkeypatch, kernels.by_shape)
    cfg = ModelConfig(d_model=192, n_head=6, n_layer=2, n_blocks=2, max_seq_len=64, head_layers=1)
    torch.manual_seed(0)
    b = Block(cfg, 1).eval()
    xs = [torch.randn(1, n, 192) for n in [CHUNK] * 60 + [1, 3, 5, 7]]
    alone = [Traversal(b, BlockCache(b), x, _spec(list(range(x.shape[1])))).step_alone() for x in xs]
    together = step_together([Traversal(b, BlockCache(b), x, _spec(list(range(x.shape[1])))) for x in xs])
    assert all(torch.equal(g["logits"], w["logits"]) for g, w in zip(together, alone))
