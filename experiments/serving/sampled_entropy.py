"""Why sampled exact mode accepts fewer bytes per traversal the longer the output: the entropy
of the model's next-byte distribution (at the sampling temperature) along its own sampled output,
per 64-byte segment, beside the bytes per traversal of exact mode in that segment.

In process, one torch thread, the client's exact-mode settings, validation prompts (as
bt-bench wan --split valid). Exact mode's output at a temperature is autoregressive sampling's in
distribution; the entropies are read from the logits rows the session accepted bytes from.

    python experiments/serving/sampled_entropy.py --bytes 256 --prompts 10 --json results/serving/sampled_entropy.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from blocktrain.bench.wan import test_prompts
from blocktrain.blocks.decode import Sampling, bf16_round, new_caches, run_chain
from blocktrain.p2p.serving.client import new_session
from blocktrain.p2p.serving.server import load_served
from blocktrain.provenance import code_version


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--segment", type=int, default=64)
    ap.add_argument("--window", type=int, help="a serving-time attention window (experiments/serving/window.py)")
    ap.add_argument("--sink", type=int, default=0, help="with --window: the first N positions stay visible")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.window:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).parent))
        import window  # its monkeypatch of decode
        window.WINDOW[0], window.SINK[0] = a.window, a.sink
    torch.set_num_threads(1)
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    pairs = test_prompts(a.prompts, a.bytes, split="valid")
    nseg = (a.bytes + a.segment - 1) // a.segment
    ent: list[list[float]] = [[] for _ in range(nseg)]
    per_trav: list[list[float]] = [[] for _ in range(nseg)]  # bytes a traversal, by the segment it started in
    for i, (prompt, _) in enumerate(pairs):
        s = new_session(prompt, a.bytes, "exact", Sampling(a.temperature, seed=i), max_seq_len=blocks[0].cfg.max_seq_len)
        caches = new_caches(blocks)
        while s.state != "done":
            before = len(s.tokens) - s.n_prompt
            out = run_chain(blocks, caches, s.next_spec(), between=bf16_round)
            s.feed(out["logits"], out.get("drafts"))
            got = len(s.tokens) - s.n_prompt - before
            if before < a.bytes:
                per_trav[min(before // a.segment, nseg - 1)].append(got)
        for j, row in enumerate(s.rows[:a.bytes]):  # the logits each output byte was sampled from
            p = torch.softmax(row / a.temperature, -1)
            ent[j // a.segment].append(float(-(p * torch.log(p.clamp_min(1e-30))).sum()))
    res = {"command": "python experiments/serving/sampled_entropy.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None),
        "code_version": code_version(), "split": "valid", "prompts": len(pairs), "temperature": a.temperature,
        "segments": [{"bytes": f"{k * a.segment}-{min(a.bytes, (k + 1) * a.segment)}",
                      "entropy_nats_mean": statistics.mean(ent[k]),
                      "bytes_per_traversal": sum(per_trav[k]) / max(1, len(per_trav[k]))} for k in range(nseg)],
        "note": "entropy of the sampling distribution (softmax at the temperature) each output byte was drawn "
                "from; bytes per traversal counted by the segment a traversal started in"}
    print(json.dumps(res["segments"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
