"""How low can one traversal's CE go on this chain? The chain's own marginal of byte j ahead.

For each test prompt, draw ``--samples`` continuations of 16 bytes by ancestral sampling
(temperature 1) from the chain and estimate, per offset j, the marginal distribution of byte j
(counts + ``--alpha`` x uniform). Its CE against the true byte is what slots that had learned
this chain's marginals exactly would score (up to the estimate's noise, which only adds CE).

    python experiments/exact/marginal_floor.py [--prompts 200] [--samples 512] [--ckpt DIR]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from common import BASE, ROOT, load_chain, test_prompts, write_json

from blocktrain.blocks.decode import new_caches, run_chain


@torch.no_grad()
def sample_continuations(blocks, prompt: bytes, n: int, m: int, g: torch.Generator) -> torch.Tensor:
    caches = new_caches(blocks)
    P = len(prompt)
    ids = torch.tensor([list(prompt)]).expand(m, P)
    spec = {"base": 0, "keep": [], "start": 0, "ids": list(prompt), "positions": list(range(P)),
            "parents": list(range(-1, P - 1)), "logits": [P - 1], "slots": []}
    out = []
    for t in range(n):
        logits = run_chain(blocks, caches, spec, ids=ids)["logits"][:, -1]
        nxt = torch.multinomial(torch.softmax(logits.double(), -1), 1, generator=g)  # (m, 1)
        out.append(nxt)
        pos = P + t
        spec = {"base": pos, "keep": [], "start": pos, "ids": [0], "positions": [pos], "parents": [-1],
                "logits": [0], "slots": []}
        ids = nxt
    return torch.cat(out, 1)  # (m, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--ckpt", default=str(BASE))
    ap.add_argument("--name", default="base")
    a = ap.parse_args()
    torch.set_num_threads(1)
    blocks = load_chain(a.ckpt)
    g = torch.Generator().manual_seed(0)
    n = 16
    ce = torch.zeros(n)
    t0 = time.perf_counter()
    for prompt, truth in test_prompts(a.prompts, 64, n):
        s = sample_continuations(blocks, prompt, n, a.samples, g)
        for j in range(n):
            counts = torch.bincount(s[:, j], minlength=256).double()
            p = (counts + a.alpha / 256) / (a.samples + a.alpha)
            ce[j] += -math.log(p[truth[j]].item())
    ce /= a.prompts
    res = {"prompts": a.prompts, "samples": a.samples, "alpha": a.alpha, "checkpoint": a.ckpt,
           "ce_mean_16": ce.mean().item(), "ce_offsets_2_16": ce[1:].mean().item(),
           "ce_per_offset": {j + 1: ce[j].item() for j in range(n)}, "seconds": time.perf_counter() - t0}
    print(res)
    write_json(ROOT / f"results/exact/marginal_floor_{a.name}.json", res)


if __name__ == "__main__":
    main()
