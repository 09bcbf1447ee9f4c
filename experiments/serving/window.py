"""Does a sliding attention window at serving time (each token sees the last W positions, as in
training's 128-byte windows) keep exact mode's acceptance past the model's training length?

In process (no network), one torch thread, the client's exact-mode settings (p2p/serving/client.py
new_session), prompts from the validation split (bench/wan.py test_prompts): bytes per traversal,
greedy and sampled, and the fraction of continuations repeating a 16-gram, with the window and
without. The window is applied by masking keys older than W positions in each hop's mask (a
monkeypatch of decode.Traversal and decode.drafter_step, this script only; ``--trunk-only``: the
blocks only, not the draft model).

    python experiments/serving/window.py --bytes 256 --prompts 20 --json results/serving/window.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blocktrain.bench.wan import repeats_16gram, test_prompts
from blocktrain.blocks import decode
from blocktrain.blocks.decode import Sampling, bf16_round, drive, new_caches, run_chain
from blocktrain.p2p.serving.client import new_session
from blocktrain.p2p.serving.server import load_served
from blocktrain.provenance import code_version

WINDOW: list[int | None] = [None]
SINK = [0]  # the first SINK positions stay visible to every token (attention sinks, StreamingLLM)
_begin = decode.Traversal._begin


def _windowed_begin(self):
    _begin(self)
    w = WINDOW[0]
    if w is None:
        return
    pos = torch.tensor(self.spec["positions"])  # the new tokens'; cached entry j sits at position j
    keys = torch.cat([torch.arange(self.past), pos])
    self.mask = self.mask & (((pos[:, None] - keys[None, :]) < w) | (keys[None, :] < SINK[0]))


decode.Traversal._begin = _windowed_begin
_drafter_step, _tree_mask = decode.drafter_step, decode.tree_mask
DRAFTER = [True]  # the draft model's attention windowed too (it was trained on the same windows)


def _windowed_drafter_step(block, cache, f, spec, logits, steps, width=1):
    w = WINDOW[0]
    if w is None or not DRAFTER[0]:
        return _drafter_step(block, cache, f, spec, logits, steps, width)
    n = f.shape[1]

    def windowed(parents, start):
        m = _tree_mask(parents, start)
        pos = torch.tensor(spec["positions"][:n])
        keys = torch.cat([torch.arange(start), pos])
        return m & (((pos[:, None] - keys[None, :]) < w) | (keys[None, :] < SINK[0]))
    decode.tree_mask = windowed
    try:
        return _drafter_step(block, cache, f, spec, logits, steps, width)
    finally:
        decode.tree_mask = _tree_mask


decode.drafter_step = _windowed_drafter_step


def one(blocks, prompt: bytes, n: int, temperature: float, seed: int, mode: str = "exact"):
    s = new_session(prompt, n, mode, Sampling(temperature, seed=seed), max_seq_len=blocks[0].cfg.max_seq_len)
    caches = new_caches(blocks)
    drive(s, lambda spec: run_chain(blocks, caches, spec, between=bf16_round))
    return s.output, s.stats.traversals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--windows", default="none,128")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--sink", type=int, default=0, help="the first N positions stay visible (attention sinks)")
    ap.add_argument("--trunk-only", action="store_true", help="window the blocks' attention, not the draft model's")
    ap.add_argument("--json")
    a = ap.parse_args()
    DRAFTER[0] = not a.trunk_only
    SINK[0] = a.sink
    torch.set_num_threads(1)
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    pairs = test_prompts(a.prompts, a.bytes, split="valid")
    out = {"command": "python experiments/serving/window.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None),
        "code_version": code_version(), "bytes": a.bytes, "prompts": len(pairs), "split": "valid", "runs": {}}
    for t in (float(x) for x in a.temperatures.split(",")):
        for w in a.windows.split(","):
            WINDOW[0] = None if w == "none" else int(w)
            t0 = time.perf_counter()
            bpt, rep, outs = [], 0, []
            for i, (prompt, _) in enumerate(pairs):
                text, trav = one(blocks, prompt, a.bytes, t, i)
                bpt.append(a.bytes / trav)
                rep += repeats_16gram(bytes(text))
                outs.append(bytes(text))
            ar_same = None
            if t == 0:  # the window keeps exact output autoregressive's
                ar_same = sum(one(blocks, p, a.bytes, 0, 0, "autoregressive")[0] == o
                              for (p, _), o in list(zip(pairs, outs))[:3])
            r = {"temperature": t, "window": WINDOW[0], "bytes_per_traversal_median": statistics.median(bpt),
                 "bytes_per_traversal_mean": statistics.mean(bpt), "min": min(bpt), "max": max(bpt),
                 "repeating_16gram": f"{rep}/{len(pairs)}", "identical_to_autoregressive_first_3": ar_same,
                 "sample": outs[0].decode("utf-8", "replace"), "seconds": time.perf_counter() - t0}
            out["runs"][f"T{t}-W{w}"] = r
            print(json.dumps({k: v for k, v in r.items() if k != "sample"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
