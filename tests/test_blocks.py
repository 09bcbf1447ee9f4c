"""The block model and its training: shapes, isolation of blocks, checkpoints, generation."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.data import ByteBatches, DataError, as_tensor, read_split
from blocktrain.blocks.model import MASK_ID, Assembled, Block, EndToEnd, ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain, mask_tail, slot_batch, snapshot
from blocktrain.blocks.worker import LowerWatcher, block_path

TINY = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64, head_layers=1)
TCFG = TrainConfig(steps=30, batch_size=4, seq_len=32, lr=3e-3, warmup=3, eval_every=10, eval_windows=4)


@pytest.fixture(scope="module")
def valid():
    return as_tensor(read_split("valid"))


def test_embedded_data_is_wikitext2(valid):
    assert valid.numel() == 1_121_681
    assert bytes(valid[:40].tolist()).startswith(b" \n = Homarus gammarus = \n")


def test_user_directory_and_missing_file(tmp_path):
    (tmp_path / "wiki.valid.tokens").write_bytes(b"hello world " * 100)
    assert read_split("valid", tmp_path) == b"hello world " * 100
    with pytest.raises(DataError, match="wiki.test.tokens"):
        read_split("test", tmp_path)


def test_batches_deterministic_and_sharded(valid):
    a = ByteBatches(valid, 4, 16, seed=1, shard=0, num_shards=2)
    b = ByteBatches(valid, 4, 16, seed=1, shard=1, num_shards=2)
    x1, y1 = a.batch(7)
    x2, _ = a.batch(7)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    lo, hi = b.bounds()
    assert a.bounds()[1] == lo and hi <= valid.numel()


def test_shapes():
    x = torch.randint(0, 256, (2, 16))
    b0, b1 = Block(TINY, 0), Block(TINY, 1)
    h, loss = b0(x, x)
    assert h.shape == (2, 16, 32) and loss.dim() == 0
    h1, _ = b1(h)
    assert h1.shape == h.shape
    assert Assembled([b0, b1, Block(TINY, 2)])(x).shape == (2, 16, 256)
    assert EndToEnd(TINY)(x)[0].shape == (2, 16, 256)


def test_identity_start_blocks_pass_input_through():
    b = Block(TINY, 1)
    h = torch.randn(2, 8, 32)
    assert torch.allclose(b.trunk(h), h)


def test_an_upper_block_starts_where_the_block_below_ended(valid):
    """Identity start: block k's head, before its first step, gives the logits the head of block
    k-1 gave, for a middle block (a head with a layer, as below) and for the top block (a head
    without layers: the layer below moves into the block). Before, only the LayerNorm and output
    were copied and both started worse."""
    torch.manual_seed(0)
    chain = [Block(TINY, 0)]
    x, _ = ByteBatches(valid, 2, 16, seed=0).batch(0)
    for k in (1, 2):
        for p in chain[-1].parameters():  # a trained block below: no zero outputs left
            p.data.add_(0.05 * torch.randn_like(p))
        t = BlockTrainer(TINY, TCFG, k, valid)
        t.init_from_below(chain[-1])
        h = x
        for b in chain:
            h = b.trunk(h)
        assert torch.allclose(t.block.logits(t.block.trunk(h)), chain[-1].logits(h), atol=1e-5), k
        chain.append(t.block)
    assert len(chain[1].head.layers) == 1 and len(chain[2].head.layers) == 0
    with pytest.raises(ValueError, match="head_layers 2 is more than a block's 1 layers"):
        ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, head_layers=2)


def test_assembled_has_same_parameters_as_end_to_end():
    blocks = [Block(TINY, k) for k in range(3)]
    assembled = sum(b.param_count(include_head=(b.index == 2)) for b in blocks)
    assert assembled == EndToEnd(TINY).param_count()


def test_no_gradient_crosses_blocks(valid):
    t = BlockTrainer(TINY, TCFG, 2, valid)
    lower = [Block(TINY, 0), Block(TINY, 1)]
    t.set_lower([snapshot(b) for b in lower])
    before = [snapshot(b) for b in t.lower]
    t.train_step()
    for b, sd in zip(t.lower, before):
        for n, p in b.named_parameters():
            assert not p.requires_grad and p.grad is None, n
            assert torch.equal(p, sd[n]), f"lower parameter {n} changed"
    x, _ = t.batches.batch(0)
    assert not t.lower_hidden(x).requires_grad
    # the optimizer holds this block's parameters and nothing else
    owned = {id(p) for p in t.block.parameters()}
    in_opt = {id(p) for g in t.opt.param_groups for p in g["params"]}
    assert in_opt == owned
    assert all(id(p) in owned for p in t.opt.state)


def test_relay_workers_average_to_the_single_worker_step(valid):
    """K workers on one block, each on its rows of the batch, gradients averaged: the same step."""
    tc = TrainConfig(**{**TCFG.to_dict(), "batch_size": 7})  # uneven shards: 3, 2, 2 rows
    one, three = BlockTrainer(TINY, tc, 1, valid), BlockTrainer(TINY, tc, 1, valid)
    lower = [snapshot(Block(TINY, 0))]
    one.set_lower(lower)
    three.set_lower(lower)
    for _ in range(3):
        a, b = one.train_step(replicas=1), three.train_step(replicas=3)
        assert a == pytest.approx(b, abs=1e-5)
    for (n, p), q in zip(one.block.named_parameters(), three.block.parameters()):
        assert torch.allclose(p, q, atol=1e-5), n


def test_tiny_training_lowers_ce(valid):
    t = BlockTrainer(TINY, TrainConfig(**{**TCFG.to_dict(), "steps": 40, "mask_frac": 0.0}), 0, valid)
    before = eval_chain([t.block], valid, 32, 8)[0]
    for _ in range(40):
        t.train_step()
    after = eval_chain([t.block], valid, 32, 8)[0]
    assert after < before - 0.5, (before, after)


def test_one_traversal_generation_returns_n_bytes():
    asm = Assembled([Block(TINY, k) for k in range(3)])
    prompt = torch.randint(0, 256, (2, 10))
    out = asm.generate_one_traversal(prompt, 17)
    assert out.shape == (2, 17) and out.max() < 256
    n_trunk = []
    orig = Block.trunk
    Block.trunk = lambda self, x, caches=None: (n_trunk.append(self.index), orig(self, x, caches))[1]
    try:
        asm.generate_one_traversal(prompt, 17)
    finally:
        Block.trunk = orig
    assert n_trunk == [0, 1, 2]  # one pass through each block, whatever N
    with pytest.raises(ValueError):
        asm.generate_one_traversal(prompt, 60)  # past max_seq_len


def test_draft_phase_trains_the_draft_model_only(valid):
    tc = TrainConfig(**{**TCFG.to_dict(), "draft_frac": 25 / TCFG.steps, "draft_unroll": 2})
    t = BlockTrainer(TINY, tc, 2, valid)
    t.set_lower([snapshot(Block(TINY, 0)), snapshot(Block(TINY, 1))])
    for _ in range(10):
        t.train_step()
    before = {n: p.detach().clone() for n, p in t.block.named_parameters() if not n.startswith("drafter.")}
    phase = t.draft_phase()
    first = phase.train_step()
    for _ in range(24):
        kls = phase.train_step()
    assert len(kls) == 2 and kls[0] < first[0] * 0.7, (first, kls)
    for n, p in t.block.named_parameters():
        if not n.startswith("drafter."):
            assert torch.equal(p, before[n]), f"{n} changed in the draft phase"


def test_configs_saved_before_draft_models_still_load():
    old = {k: v for k, v in TINY.to_dict().items() if k not in ("draft_layers", "slot_offsets")}  # a checkpoint's complete config
    assert ModelConfig.from_dict(old).draft_layers == 0 and ModelConfig.from_dict(old).slot_offsets == 0
    assert Block(ModelConfig.from_dict(old), 2).drafter is None
    assert ModelConfig.from_dict({"d_model": 64, "n_head": 2}).draft_layers == ModelConfig().draft_layers


def test_slot_branches_compute_what_one_traversal_serves():
    """A placeholder branch in training sees what prompt + placeholders see in serving: its
    logits equal one traversal's on the row's bytes up to the anchor."""
    torch.manual_seed(0)
    blocks = [Block(TINY, k) for k in range(3)]
    with torch.no_grad():
        for b in blocks:
            for p in b.parameters():
                p.add_(torch.randn_like(p) * 0.2)
    asm = Assembled(blocks)
    tc = TrainConfig(**{**TCFG.to_dict(), "slot_branches": 2, "slot_len": 5})
    x = torch.randint(0, 256, (3, 20))
    y = torch.roll(x, -1, 1)
    ids, targets, layout, weights = slot_batch(x, y, tc, step=4)
    assert ids.shape == targets.shape == weights.shape == (3, 30)
    h = ids
    for b in blocks:
        h = b.trunk(h, **layout)
    logits = blocks[-1].logits(h)
    assert torch.allclose(logits[:, :20], asm(x), atol=1e-5)  # the bytes never see placeholders
    for r in range(3):
        for br in range(2):
            cols = list(range(20 + 5 * br, 25 + 5 * br))
            a = int(layout["positions"][r, cols[0]]) - 1
            prompt = x[r:r + 1, :a + 1]
            want = asm(torch.cat([prompt, torch.full((1, 5), MASK_ID)], 1))[0, a + 1:]
            assert torch.allclose(logits[r, cols], want, atol=1e-5), (r, br)
            for j, c in enumerate(cols, start=1):
                assert targets[r, c] == (y[r, a + j] if a + j < 20 else -100)
    assert weights[:, :20].sum() == pytest.approx(1.0) and weights[:, 20:].sum() == pytest.approx(tc.slot_weight)
    # shifted rows: the same tokens and branches, positions moved, all inside the embedding
    shifted = TrainConfig(**{**tc.to_dict(), "position_shift": True})
    ids2, targets2, layout2, _ = slot_batch(x, y, shifted, step=4, max_seq_len=TINY.max_seq_len)
    assert torch.equal(ids2, ids) and torch.equal(targets2, targets)
    d = layout2["positions"] - layout["positions"]
    assert (d == d[:, :1]).all() and int(layout2["positions"].max()) < TINY.max_seq_len and d.any()


def test_mask_tail_keeps_targets_and_marks_suffix():
    x = torch.randint(0, 256, (64, 20))
    m = mask_tail(x, 1.0, 3, 0)
    for row, orig in zip(m, x):
        k = int((row == MASK_ID).sum())
        assert k >= 1 and (row[-k:] == MASK_ID).all() and torch.equal(row[:-k], orig[:-k])


def test_kv_cached_generation_equals_recompute():
    torch.manual_seed(0)
    m = EndToEnd(TINY)
    prompt = torch.randint(0, 256, (1, 8))
    fast = m.generate(prompt, 12)
    ids = prompt
    for _ in range(12):
        nxt = m(ids)[0][:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    assert torch.equal(fast, ids[:, 8:])


def test_checkpoint_round_trip_and_optimizer(tmp_path, valid):
    t = BlockTrainer(TINY, TCFG, 0, valid)
    for _ in range(3):
        t.train_step()
    p = tmp_path / "b0.safetensors"
    ckpt.save(t.checkpoint(), p)
    u = BlockTrainer(TINY, TCFG, 0, valid)
    u.restore(ckpt.load(p))
    assert u.step == 3
    for (n, a), b in zip(t.block.state_dict().items(), u.block.state_dict().values()):
        assert torch.equal(a, b), n
    # identical next steps: the same batch, the same optimizer state
    assert t.train_step() == pytest.approx(u.train_step(), abs=1e-6)


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty", "foreign"])
def test_damaged_checkpoint_detected(tmp_path, damage):
    p = tmp_path / "b.safetensors"
    ckpt.save(ckpt.Checkpoint(TINY.to_dict(), 0, 5, Block(TINY, 0).state_dict()), p)
    blob = bytearray(p.read_bytes())
    if damage == "truncate":
        blob = blob[:-100]
    elif damage == "flip":
        blob[-10] ^= 1
    elif damage == "header":
        blob[12] ^= 0x20
    elif damage == "empty":
        blob = b""
    else:
        from safetensors.torch import save
        blob = save({"w": torch.zeros(2)})
    p.write_bytes(bytes(blob))
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(p)


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_loading_never_unpickles(tmp_path):
    marker = tmp_path / "unpickled"
    p = tmp_path / "evil.safetensors"
    torch.save({"w": _Boom(str(marker))}, p)  # a pickle-based file where a checkpoint should be
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(p)
    assert not marker.exists()


def test_stale_lower_checkpoint_is_refreshed(tmp_path, valid):
    t = BlockTrainer(TINY, TCFG, 1, valid)
    w = LowerWatcher(t, tmp_path)
    assert not w.refresh()  # nothing yet
    b0 = Block(TINY, 0)
    ckpt.save(ckpt.Checkpoint(TINY.to_dict(), 0, 5, b0.state_dict()), block_path(tmp_path, 0))
    assert w.refresh() and t.lower_steps == [5]
    assert not w.refresh()  # unchanged file: no reload
    with torch.no_grad():
        b0.layers[0].fc.weight.add_(1.0)
    ckpt.save(ckpt.Checkpoint(TINY.to_dict(), 0, 10, b0.state_dict()), block_path(tmp_path, 0))
    assert w.refresh() and t.lower_steps == [10]
    assert torch.equal(t.lower[0].layers[0].fc.weight, b0.layers[0].fc.weight)
    # a corrupted newer file is reported and the trainer keeps its last good input
    block_path(tmp_path, 0).write_bytes(b"garbage")
    assert not w.refresh() and t.lower_steps == [10] and w.errors


def _worker_cmd(tmp_path, steps):
    return [sys.executable, "-m", "blocktrain.blocks.worker", "--block", "0", "--dir", str(tmp_path),
            "--model", json.dumps(TINY.to_dict()), "--ckpt-every", "5",
            "--train", json.dumps({**TCFG.to_dict(), "steps": steps}), "-v"]


def test_killed_worker_resumes_from_its_checkpoint(tmp_path):
    steps = 400
    proc = subprocess.Popen(_worker_cmd(tmp_path, steps), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not block_path(tmp_path, 0).exists():
            assert time.monotonic() < deadline, "worker wrote no checkpoint"
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)  # crash at an arbitrary moment
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = ckpt.load(block_path(tmp_path, 0)).step
    assert 0 < saved < steps
    out = subprocess.run(_worker_cmd(tmp_path, steps), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {block_path(tmp_path, 0)} at step {saved}" in out.stderr
    final = ckpt.load(block_path(tmp_path, 0))
    assert final.step == steps and final.extra["final"]


def test_progress_lines_give_the_total_rate_and_time_left_and_bench_train_reads_its_variants(tmp_path, monkeypatch):
    """Not on a terminal, a long job prints plain lines: done/total, the rate, the time left, and
    a final line; bt-bench train reads each running variant's steps from its log."""
    import io

    from blocktrain.bench.train import _log_progress
    from blocktrain.blocks.progress import LineProgress
    out = io.StringIO()
    with LineProgress("job", 10, unit="step", every_s=0.0, stream=out) as p:
        p.set_postfix_str("loss 1.234")
        p.update(4)
    first, last = out.getvalue().splitlines()
    assert first.startswith("job: 4/10 steps in") and "s left" in first and "step/s" in first
    assert first.endswith("loss 1.234")
    assert last.startswith("job: done, 4/10 steps") and "left" not in last
    out = io.StringIO()  # a job that slowed down: the time left comes from the recent rate; a starved process
    with LineProgress("slow", 100, every_s=1e9, stream=out, threads=2) as p:  # says the machine is busy
        p.t0 -= 10.0
        p.last -= 2.0
        p.n, p.last_n = 60, 50  # 50 steps in the first 8 s, 10 in the last 2: 5/s now
        line = p.line()
    assert "(6.00 step/s, now 5.00, 8 s left; machine busy: this process got" in line and "asks for 2" in line
    import os  # a job whose work runs in other processes (bt-bench swarm) judges by the load average
    for load, busy in ((9.0, True), (0.5, False)):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        with LineProgress("orchestrator", 100, every_s=1e9, stream=io.StringIO(), threads=0) as p:
            p.last -= 2.0
            line = p.line()
        assert "of a core" not in line and ("machine busy: load 9.0 on 2 cores" in line) == busy
    log = tmp_path / "relay.log"
    log.write_text("relay 50/3000 {}\nsome warning\nrelay 100/3000 {0: 2.1}\nanother line\n")
    assert _log_progress(log) == "100/3000"
    assert _log_progress(tmp_path / "missing.log") is None


def test_the_progress_line_shows_a_head_only_once_it_was_measured_after_its_block_began():
    """At a block change the line showed the next, untrained block's CE
    (5.608 beside 2.291) until the next evaluation, which read as a blow-up."""
    from blocktrain.blocks.job import progress_for

    class Bar:
        def update(self, n):
            pass

        def set_postfix_str(self, s):
            self.shown = s

    bar = Bar()
    cb = progress_for(bar, starts=[0, 10])
    first = [2.291, 5.608]  # measured at step 10: block 1 had not trained yet
    for t in range(10, 20):
        cb(t, 40, first)
        assert bar.shown == "valid CE 2.291"
    cb(20, 40, [2.2, 2.261])  # the first point taken after block 1 began
    assert bar.shown == "valid CE 2.200 / 2.261"
    cb = progress_for(bar)  # no starts (one end-to-end model): every head is shown
    cb(1, 40, [3.0])
    assert bar.shown == "valid CE 3.000"
