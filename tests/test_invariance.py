"""Exact decoding on any CPU: rows are batch invariant by the computation's shape (fixed-shape
tiles), checked where a model is served, under kernels unlike this machine's (tests/kernels.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import kernels
from blocktrain.blocks.decode import Session, generate, new_caches, run_chain
from blocktrain.blocks.device import threads
from blocktrain.blocks.invariance import check_block, choose_tile_rows
from blocktrain.bench.ports import free_port
from blocktrain.blocks.model import TILE_ROWS, Block, ModelConfig
from test_decode import prompts, tiny_chain


@pytest.fixture(autouse=True)
def one_thread():
    with threads(1):
        yield


def _logits_one_per_step(blocks, prompt: bytes, ids: list[int]) -> torch.Tensor:
    """The last head's logits after each of ``ids``, one token per traversal (autoregressive)."""
    caches, rows = new_caches(blocks), []
    seq = list(prompt) + ids
    for i in range(len(prompt) - 1, len(seq)):
        new = seq[:len(prompt)] if i == len(prompt) - 1 else [seq[i]]
        start = 0 if i == len(prompt) - 1 else i
        spec = {"base": start, "keep": [], "start": start, "ids": new, "positions": list(range(start, start + len(new))),
                "parents": list(range(-1, len(new) - 1)), "logits": [len(new) - 1], "slots": [], "invariant": True}
        rows.append(run_chain(blocks, caches, spec)["logits"][0, 0])
    return torch.stack(rows)


def _logits_one_traversal(blocks, prompt: bytes, ids: list[int]) -> torch.Tensor:
    """The same logits from a traversal verifying all of ``ids`` at once after the prompt."""
    caches = new_caches(blocks)
    P = len(prompt)
    run_chain(blocks, caches, {"base": 0, "keep": [], "start": 0, "ids": list(prompt), "positions": list(range(P)),
                               "parents": list(range(-1, P - 1)), "logits": [P - 1], "slots": [], "invariant": True})
    first = run_chain(blocks, new_caches(blocks), {"base": 0, "keep": [], "start": 0, "ids": list(prompt),
                                                   "positions": list(range(P)), "parents": list(range(-1, P - 1)),
                                                   "logits": [P - 1], "slots": [], "invariant": True})
    T = len(ids)
    spec = {"base": P, "keep": [], "start": P, "ids": ids, "positions": list(range(P, P + T)),
            "parents": list(range(-1, T - 1)), "logits": list(range(T)), "slots": [], "invariant": True}
    return torch.cat([first["logits"][0], run_chain(blocks, caches, spec)["logits"][0]])


def _kernel_breaks_untiled_rows(kernel) -> bool:
    """The kernel does make a row's bits depend on what shares its call (so the tests can fail)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 32), torch.randn(48, 32), torch.randn(48)
    alone = torch.cat([kernel(x[i:i + 1], w, b) for i in range(4)])
    return not torch.equal(kernel(x, w, b), alone)


@pytest.mark.parametrize("kernel", [kernels.by_shape, kernels.by_place], ids=["by_shape", "by_place"])
def test_exact_rows_equal_one_token_per_step_under_another_machines_kernel(monkeypatch, kernel):
    """Under a linear kernel whose rows follow the call's shape, or their place in it, every
    logit a verifying traversal computes equals bitwise the autoregressive one, once the hop's
    start-up check chose its rows per call (tiles where the shape alone varies, row by row where
    the place does)."""
    assert _kernel_breaks_untiled_rows(kernel)
    kernels.use(monkeypatch, kernel)
    blocks = tiny_chain(3, seed=2)
    chosen = [choose_tile_rows(b) for b in blocks]
    assert all(c.tile_rows == (TILE_ROWS if kernel is kernels.by_shape else 1) for c in chosen), chosen
    prompt, ids = b"any cpu at all", list(b"the same bits, whatever the batch")
    assert torch.equal(_logits_one_traversal(blocks, prompt, ids), _logits_one_per_step(blocks, prompt, ids))
    for p in prompts(3, seed=5):
        ar, _ = generate(blocks, p, 30)
        ex, _ = generate(blocks, p, 30, draft_len=5, slots=4, lookup=3)
        assert ex == ar, p


def test_a_kernel_that_follows_a_rows_place_fails_the_tiles_and_is_served_row_by_row(monkeypatch):
    """The start-up check names what differs at TILE_ROWS rows per call and falls back to one."""
    kernels.use(monkeypatch, kernels.by_place)
    b = tiny_chain(2, seed=1)[1]
    found = check_block(b, TILE_ROWS)
    assert found is not None and "differ" in found
    assert check_block(b, 1) is None
    r = choose_tile_rows(b)
    assert (r.tile_rows, r.finding, b.tile_rows) == (1, found, 1) and "row by row" in r.describe()


def test_a_kernel_nothing_makes_invariant_refuses_exact_decoding(monkeypatch):
    kernels.use(monkeypatch, kernels.ByCall())
    b = tiny_chain(1, seed=3)[0]
    r = choose_tile_rows(b)
    assert r.tile_rows is None and b.tile_rows == TILE_ROWS and "refused" in r.describe()


def test_this_machines_kernels_pass_the_check_at_the_shipped_widths():
    """Not a claim about every machine (a machine whose kernels fail is served row by row, the
    tests above): the start-up check does not refuse exact decoding on the machine the tests
    run on, at the shipped model's widths."""
    cfg = ModelConfig(d_model=192, n_head=6, n_layer=6, n_blocks=3, max_seq_len=64, head_layers=1)
    torch.manual_seed(0)
    b = Block(cfg, 2).eval()
    r = choose_tile_rows(b)
    assert r.tile_rows in (TILE_ROWS, 1), r.describe()


def test_a_chain_whose_hops_run_different_kernels_decodes_exactly(monkeypatch):
    """A heterogeneous chain in process: the middle hop computes with a kernel whose rows follow
    the call's shape, the others with this machine's; exact output and logits are the
    autoregressive ones on that chain."""
    blocks = tiny_chain(3, seed=6)
    real = F.linear

    def with_kernel(block, kernel):
        extend_many, logits = block.extend_many, block.logits

        def run(fn):
            def call(*a, **k):
                monkeypatch.setattr(F, "linear", kernel)
                try:
                    return fn(*a, **k)
                finally:
                    monkeypatch.setattr(F, "linear", real)
            return call
        monkeypatch.setattr(block, "extend_many", run(extend_many))
        monkeypatch.setattr(block, "logits", run(logits))
    with_kernel(blocks[1], kernels.by_shape)
    for b in blocks:
        assert choose_tile_rows(b).tile_rows is not None
    prompt, ids = b"three hops, two kernels", list(b"one output")
    assert torch.equal(_logits_one_traversal(blocks, prompt, ids), _logits_one_per_step(blocks, prompt, ids))
    for p in prompts(3, seed=8):
        ar, _ = generate(blocks, p, 24)
        s = Session(p, 24, blocks[0].cfg.max_seq_len, draft_len=6, lookup=2)
        assert s.invariant
        ex, _ = generate(blocks, p, 24, draft_len=6, lookup=2)
        assert ex == ar, p


def test_a_chain_of_processes_on_other_math_kernels_serves_exact_output(tmp_path):
    """The shipped model served by three `bt-peer serve` processes, hop 1 on MKL's AVX2 kernels
    and hop 2 on its AVX-512 ones (what other CPUs get; on a CPU without them MKL falls back):
    greedy exact output is the autoregressive output of that chain, byte for byte, and each hop
    logged how it computes exact rows."""
    bin_dir = Path(sys.executable).parent
    peer = str(bin_dir / "bt-peer")
    key = tmp_path / "swarm.key"
    subprocess.run([peer, "keygen", "--out", str(key)], check=True, capture_output=True, timeout=60)
    port = free_port()
    common = ["--swarm-key", str(key)]
    procs = []
    try:
        for k, kernels_env in enumerate((None, "AVX2", "AVX512")):
            env = {**os.environ, **({"MKL_ENABLE_INSTRUCTIONS": kernels_env} if kernels_env else {})}
            where = ["--listen", f"127.0.0.1:{port}"] if k == 0 else [f"127.0.0.1:{port}"]
            with open(tmp_path / f"hop{k}.log", "w") as log:
                procs.append(subprocess.Popen([peer, "serve", *where, "--block", str(k), *common, "--identity",
                                               str(tmp_path / f"id{k}")], stdout=log, stderr=log, env=env))
        outs = {}
        for mode in ("autoregressive", "exact"):
            r = subprocess.run([peer, "generate", f"127.0.0.1:{port}", *common, "--identity", str(tmp_path / "me"),
                                "--prompt", "The history of the", "--bytes", "48", "--mode", mode, "--wait", "60"],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            outs[mode] = r.stdout.rsplit("\n[", 1)[0]  # the output, without the stats line
        assert outs["exact"] == outs["autoregressive"] and len(outs["exact"]) > 0
        # printed as it came (the default) or all at once (--whole): the same text; the first byte's time said
        r = subprocess.run([peer, "generate", f"127.0.0.1:{port}", *common, "--identity", str(tmp_path / "me"),
                            "--prompt", "The history of the", "--bytes", "48", "--whole", "--wait", "60"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.rsplit("\n[", 1)[0] == outs["exact"], r.stderr[-2000:]
        assert "first byte at" in r.stderr
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    for k in range(3):
        log = (tmp_path / f"hop{k}.log").read_text()
        assert f"block {k} (blocktrain): exact" in log, log[-2000:]
