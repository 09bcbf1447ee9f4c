"""Does exact-mode greedy output equal autoregressive greedy output on the trained chain?

For each numerics setting, decode N test prompts x 256 bytes autoregressively (one byte per
traversal) and in exact mode (drafts: slots + prompt lookup, a tree), and count the prompts whose
outputs differ (and where). Settings: fp32 plain (SDPA, every row as torch computes it), fp32
batch-invariant exact rows, fp64 plain, and each with hidden states rounded to bf16 between hops.

    python experiments/exact/numerics.py [--prompts 200] [--bytes 256] [--ckpt DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from common import BASE, load_chain, test_prompts, write_json

from blocktrain.blocks.decode import bf16_round, generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--bytes", type=int, default=256)
    ap.add_argument("--ckpt", default=str(BASE))
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--lookup", type=int, default=4)
    ap.add_argument("--settings", default="fp32,fp32-invariant,fp64,fp32-bf16,fp32-invariant-bf16,fp64-bf16")
    ap.add_argument("--out", default="results/exact/numerics.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    blocks32 = load_chain(a.ckpt)
    blocks64 = [copy.deepcopy(b).double() for b in blocks32]
    prompts = test_prompts(a.prompts, 64, a.bytes)
    result = {"prompts": a.prompts, "bytes": a.bytes, "checkpoint": a.ckpt,
              "exact_drafts": {"draft_len": a.draft_len, "slots": a.slots, "lookup": a.lookup}, "settings": {}}
    ar_outputs = {}
    for name in a.settings.split(","):
        blocks = blocks64 if name.startswith("fp64") else blocks32
        inv = "invariant" in name
        between = bf16_round if name.endswith("bf16") else None
        row = {"invariant": inv, "dtype": "float64" if name.startswith("fp64") else "float32",
               "between_hops": "bf16" if between else "none", "differ": [], "ar_seconds": 0.0, "exact_seconds": 0.0,
               "traversals_exact": 0}
        outs = []
        for i, (prompt, _) in enumerate(prompts):
            t0 = time.perf_counter()
            ar, _ = generate(blocks, prompt, a.bytes, invariant=inv, between=between)
            t1 = time.perf_counter()
            ex, st = generate(blocks, prompt, a.bytes, draft_len=a.draft_len, slots=a.slots, lookup=a.lookup,
                              invariant=inv, between=between)
            t2 = time.perf_counter()
            row["ar_seconds"] += t1 - t0
            row["exact_seconds"] += t2 - t1
            row["traversals_exact"] += st.traversals
            outs.append(ar)
            if ar != ex:
                first = next(j for j in range(a.bytes) if ar[j] != ex[j])
                row["differ"].append({"prompt": i, "first_byte": first})
        row["prompts_differing"] = len(row["differ"])
        row["bytes_per_traversal_exact"] = a.prompts * a.bytes / row["traversals_exact"]
        ar_outputs[name] = outs
        result["settings"][name] = row
        print(name, {k: v for k, v in row.items() if k != "differ"}, flush=True)
    # how often two valid float computations of autoregressive decoding disagree with each other
    names = list(ar_outputs)
    result["ar_vs_ar"] = {f"{x} vs {y}": sum(p != q for p, q in zip(ar_outputs[x], ar_outputs[y]))
                          for i, x in enumerate(names) for y in names[i + 1:]}
    print(result["ar_vs_ar"])
    write_json(a.out, result)


if __name__ == "__main__":
    main()
