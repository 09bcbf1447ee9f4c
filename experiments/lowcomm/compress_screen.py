"""Screen per-step compressed averaging: which compressor keeps every-step CE at ~100x fewer bytes?

W workers train block 0 (d 128, the relay's first block) data-parallel in one process, every
variant from the same weights on the same batches (as ``lowcomm_ce.py``). Every step each worker
compresses its vector (its gradient: ``--target grads``, then the mean of the decoded parts feeds
the AdamW step of every worker; or its own AdamW step's parameter change: ``--target delta``, the
mean moves the shared point by ``--outer-lr``), with error feedback (what was not sent is added to
the next step's vector). The mean is a plain mean (no robust aggregate: this is a screen of
compressors, not of the round).

Bytes are counted, not sent: each worker's compressed vector x (W-1) copies, the all-gather a
robust round makes, at the sizes the encodings below would have on the wire (payload only, no
framing):
- none: float32, 4 bytes a value.
- sign: 1 bit a value + one float32 scale (mean |x|) per chunk of 4096 (EF-signSGD).
- topk: per chunk of 4096 the k = density x 4096 largest as int16 position + int8 value, plus one
  float32 scale (the project's ``encode_topk``, whose decoding is used here).
- powersgd: each 2-D parameter (n x m) as rank-r factors P (n x r), Q (m x r) in bf16 (both
  rounds of PowerSGD: P = M Q averaged and orthonormalised, then Q = M^T P averaged; Q warm-started
  from the last step); 1-D parameters as bf16 with error feedback.

usage: python experiments/lowcomm/compress_screen.py COMPRESSOR [--target grads|delta] [--rank R]
           [--density D] [--outer-lr A] [--every H] [--resign] [--fragments F] [--workers W] [--steps S] [--seed N]
Prints one JSON line: settings, code version, command, valid and test CE of block 0's head (2,000
test windows), bytes per worker, ratio to float32 every step, seconds.
"""

import argparse
import json
import sys
import time

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain
from blocktrain.p2p.averaging import flatten, unflatten_
from blocktrain.p2p.tensors import encode_topk

CHUNK = 4096


def bf16(x):
    return x.to(torch.bfloat16).float()


class Sign:
    """fragments F: each step only the chunks c with c % F == step % F are sent (the others stay in
    the error feedback until their turn: every coordinate is sent every F steps, Streaming
    DiLoCo's fragments, here with every worker kept at the shared point)."""

    def __init__(self, shapes, fragments=1):
        self.n, self.F, self.step = sum(s.numel() for s in shapes), fragments, 0

    def __call__(self, xs):
        out = []
        C = -(-self.n // CHUNK)
        turn = torch.arange(C) % self.F == self.step % self.F
        for x in xs:
            c = x.view(-1)
            pad = torch.zeros(C * CHUNK)
            pad[:c.numel()] = c
            rows = pad.view(-1, CHUNK)
            scale = rows.abs().mean(dim=1, keepdim=True) * turn[:, None]
            out.append((torch.sign(rows) * scale).view(-1)[:c.numel()])
        self.step += 1
        sent = int(turn.sum())
        return out, sent * (CHUNK // 8 + 4)


class TopK:
    def __init__(self, shapes, density):
        self.n, self.k = sum(s.numel() for s in shapes), max(1, round(density * CHUNK))

    def __call__(self, xs):
        out = []
        for x in xs:
            dec = torch.empty(x.numel())
            encode_topk(x.reshape(-1).contiguous(), self.k, dec)
            out.append(dec)
        chunks = -(-self.n // CHUNK)
        return out, chunks * (3 * min(self.k, CHUNK) + 4)


class PowerSGD:
    """Rank-r PowerSGD over the flat vector's 2-D parameters (shapes), 1-D ones as bf16."""

    def __init__(self, shapes, rank, seed):
        self.shapes, self.r = shapes, rank
        g = torch.Generator().manual_seed(seed)
        self.q = {i: torch.randn(s[1], rank, generator=g) for i, s in enumerate(shapes) if len(s) == 2}

    def __call__(self, xs):
        """xs: every worker's flat vector; returns every worker's decoded share (whose mean is the
        aggregate) and the bytes one worker sends per step."""
        W = len(xs)
        outs = [torch.empty_like(x) for x in xs]
        nbytes, pos = 0, 0
        for i, s in enumerate(self.shapes):
            k = s.numel()
            if len(s) == 2:
                ms = [x[pos:pos + k].view(s) for x in xs]
                q = self.q[i]
                ps = [bf16(m @ q) for m in ms]
                p = torch.linalg.qr(sum(ps) / W).Q
                qs = [bf16(m.T @ p) for m in ms]
                self.q[i] = sum(qs) / W
                for o, qi in zip(outs, qs):
                    o[pos:pos + k] = (p @ qi.T).reshape(-1)
                nbytes += 2 * self.r * (s[0] + s[1])
            else:
                for o, x in zip(outs, xs):
                    o[pos:pos + k] = bf16(x[pos:pos + k])
                nbytes += 2 * k
            pos += k
        return outs, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("compressor", choices=["none", "sign", "topk", "powersgd"])
    ap.add_argument("--target", choices=["grads", "delta"], default="grads")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--every", type=int, default=1, help="delta: local steps per round")
    ap.add_argument("--fragments", type=int, default=1, help="sign: a 1/F of the chunks per round, in turn")
    ap.add_argument("--resign", action="store_true",
                    help="sign: the mean is sign-encoded again (no error feedback), as an owner that "
                         "gathers it would send it: bytes per member then (W-1)/W x (2 reduce + 1 gather) parts")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    data, valid, test = (as_tensor(read_split(s)) for s in ("train", "valid", "test"))
    mc, tc, W = ModelConfig(d_model=128), TrainConfig(steps=a.steps, seed=a.seed), a.workers
    trs = [BlockTrainer(mc, tc, 0, data, shard=i, num_shards=W) for i in range(W)]
    for t in trs[1:]:
        t.block.load_state_dict(trs[0].block.state_dict())
    shapes = [p.shape for p in trs[0].block.parameters()]
    n = sum(s.numel() for s in shapes)
    comp = {"none": lambda: None, "sign": lambda: Sign(shapes, a.fragments), "topk": lambda: TopK(shapes, a.density),
            "powersgd": lambda: PowerSGD(shapes, a.rank, a.seed)}[a.compressor]()
    err = [torch.zeros(n) for _ in range(W)]
    sent, t0 = 0, time.perf_counter()
    point = flatten(list(trs[0].block.parameters())).clone()
    for s in range(a.steps):
        if a.target == "grads":
            for t in trs:
                t.compute_grads()
            vecs = [t.grads() for t in trs]
        else:
            for t in trs:
                t.train_step()
            if (s + 1) % a.every and s + 1 < a.steps:
                continue
            vecs = [point - flatten(list(t.block.parameters())) for t in trs]
        if comp is None:
            dec, nbytes = vecs, 4 * n
        else:
            xs = [v + e for v, e in zip(vecs, err)]
            dec, nbytes = comp(xs)
            err = [x - d for x, d in zip(xs, dec)]
        avg = sum(dec) / W
        if a.resign:
            avg = comp([avg])[0][0]
            sent += 3 * (W - 1) / W * nbytes
        else:
            sent += (W - 1) * nbytes
        if a.target == "grads":
            for t in trs:
                t.apply_grads(avg)
        else:
            point = point - a.outer_lr * avg
            for t in trs:
                unflatten_(list(t.block.parameters()), point)
        if (s + 1) % 100 == 0:
            print(f"step {s + 1}/{a.steps}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    from blocktrain.bench.provenance import code_version
    block = trs[0].block
    dense = (W - 1) * 4 * n * a.steps  # float32 gradients every step
    print(json.dumps({**vars(a), "code_version": code_version(),
                      "command": "python experiments/lowcomm/compress_screen.py " + " ".join(sys.argv[1:]),
                      "valid_ce": eval_chain([block], valid, 128)[-1], "test_ce": eval_chain([block], test, 128, 2000)[-1],
                      "bytes_sent_per_worker": sent, "fewer_bytes_than_dense": dense / sent,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
