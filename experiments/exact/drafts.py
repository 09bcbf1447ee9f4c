"""What a chain's drafts are worth: one-traversal quality per offset and exact-mode acceptance.

For ``--prompts`` WikiText-2 test prompts of 64 bytes:
- one traversal (prompt + 15 placeholders): CE against the true bytes and top-1 agreement with
  the chain's own greedy continuation, per offset 1..16 (offset 1 is the next-byte prediction);
- the draft model, when the last block has one: its drafts after the prompt (offsets 2..16),
  top-1 agreement with the greedy continuation;
- exact mode over ``--bytes`` bytes for each draft configuration: bytes per traversal (counting
  the model's own byte), accepted drafts by source, and whether the output equals greedy
  autoregressive decoding of the same chain (run here, batch-invariant numerics);
- optionally next-byte test CE of every head (``--next-byte-windows``, 0: whole split).

    python experiments/exact/drafts.py --ckpt DIR --name NAME [--configs drafter:16,lookup:16,drafter:16+lookup]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
from torch.nn import functional as F

from common import BASE, ROOT, load_chain, test_prompts, write_json

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.decode import Sampling, generate, new_caches, run_chain
from blocktrain.blocks.model import MASK_ID
from blocktrain.blocks.train import eval_chain

OFFSETS = (1, 2, 4, 8, 16)


def trunk_hash(blocks) -> str:
    h = hashlib.sha256()
    for b in blocks:
        for k, v in sorted(b.state_dict().items()):
            if not k.startswith("drafter."):
                h.update(k.encode())
                h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def ar_outputs(blocks, prompts, n_bytes) -> list[bytes]:
    """Greedy autoregressive outputs, cached per trunk (the draft model does not change them)."""
    path = ROOT / "runs/exact/ar_cache" / f"{trunk_hash(blocks)}_{len(prompts)}_{n_bytes}.json"
    if path.exists():
        return [bytes.fromhex(x) for x in json.loads(path.read_text())]
    t0 = time.perf_counter()
    outs = [generate(blocks, p, n_bytes)[0] for p, _ in prompts]
    print(f"autoregressive reference: {time.perf_counter() - t0:.0f} s", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([o.hex() for o in outs]))
    return outs


@torch.no_grad()
def one_traversal(blocks, prompts, greedy, n=16) -> dict:
    ids = torch.tensor([list(p) + [MASK_ID] * (n - 1) for p, _ in prompts])
    P = len(prompts[0][0])
    h = ids
    for b in blocks:
        h = b.trunk(h)
    logits = blocks[-1].logits(h)[:, P - 1:]  # (N, n, 256)
    truth = torch.tensor([list(t[:n]) for _, t in prompts])
    g = torch.tensor([list(o[:n]) for o in greedy])
    ce = F.cross_entropy(logits.transpose(1, 2), truth, reduction="none").mean(0)  # per offset
    agree = (logits.argmax(-1) == g).float().mean(0)
    space = (logits.argmax(-1)[:, 1:] == ord(" ")).float().mean().item()
    return {"ce_mean": ce.mean().item(), "ce_offsets_2_16": ce[1:].mean().item(),
            "ce_per_offset": {j: ce[j - 1].item() for j in range(1, n + 1)},
            "greedy_agreement_per_offset": {j: agree[j - 1].item() for j in range(1, n + 1)},
            "true_byte_accuracy_per_offset": {j: (logits.argmax(-1) == truth).float().mean(0)[j - 1].item()
                                              for j in range(1, n + 1)},
            "share_of_spaces_offsets_2_16": space}


@torch.no_grad()
def drafter_agreement(blocks, prompts, greedy, n=16) -> dict:
    """Draft model's drafts after the prompt (the next byte is the head's argmax): agreement
    with the greedy continuation at offsets 2..n, and how long the agreeing prefix is."""
    hits = torch.zeros(n - 1)
    run = []
    for (p, _), g in zip(prompts, greedy):
        spec = {"base": 0, "keep": [], "start": 0, "ids": list(p), "positions": list(range(len(p))),
                "parents": list(range(-1, len(p) - 1)), "logits": [len(p) - 1], "slots": [], "draft": n - 1}
        d = run_chain(blocks, new_caches(blocks), spec)["drafts"][0, 0].tolist()
        ok = [int(a == b) for a, b in zip(d, g[1:n])]
        hits += torch.tensor(ok, dtype=torch.float)
        r = 0
        while r < len(ok) and ok[r]:
            r += 1
        run.append(r)
    agree = hits / len(prompts)
    return {"greedy_agreement_per_offset": {j: agree[j - 2].item() for j in range(2, n + 1)},
            "mean_agreeing_prefix": sum(run) / len(run)}


def parse_config(c: str) -> dict:
    kw = {"draft_len": 0}
    for part in c.split("+"):
        name, _, n = part.partition(":")
        n = int(n) if n else 0
        if name == "drafter":
            kw.update(drafter=True, draft_len=max(kw["draft_len"], n or 16))
        elif name == "slots":
            kw.update(slots=n or 8, draft_len=max(kw["draft_len"], n or 8))
        elif name == "lookup":
            kw.update(lookup=4, draft_len=max(kw["draft_len"], n or 16))
        elif name.startswith("T"):  # sampling: T0.8 (temperature), with top-k from a "k" part
            kw["temperature"] = float(name[1:])
        elif name.startswith("k"):
            kw["top_k"] = int(name[1:])
        else:
            raise ValueError(f"unknown draft source {name!r}")
    return kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=str(BASE))
    ap.add_argument("--name", required=True)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--bytes", type=int, default=256)
    ap.add_argument("--configs", default="drafter:16,lookup:16,drafter:16+lookup")
    ap.add_argument("--next-byte-windows", type=int, default=-1, help="-1: skip; 0: the whole test split")
    a = ap.parse_args()
    torch.set_num_threads(1)
    blocks = load_chain(a.ckpt)
    prompts = test_prompts(a.prompts, 64, a.bytes)
    greedy = ar_outputs(blocks, prompts, a.bytes)
    res = {"name": a.name, "checkpoint": a.ckpt, "model": blocks[0].cfg.to_dict(), "prompts": a.prompts,
           "bytes": a.bytes, "one_traversal_16": one_traversal(blocks, prompts, greedy)}
    print("one traversal:", {k: v for k, v in res["one_traversal_16"].items() if "per_offset" not in k}, flush=True)
    if blocks[-1].drafter is not None:
        res["drafter_after_prompt"] = drafter_agreement(blocks, prompts, greedy)
        print("drafter:", res["drafter_after_prompt"], flush=True)
    if a.next_byte_windows >= 0:
        test = as_tensor(read_split("test"))
        res["next_byte_test_ce_heads"] = eval_chain(blocks, test, 128, a.next_byte_windows or None)
        res["next_byte_windows"] = a.next_byte_windows or "whole test split"
        print("next-byte CE:", res["next_byte_test_ce_heads"], flush=True)
    res["exact"] = {}
    for c in a.configs.split(","):
        kw = parse_config(c)
        temp, top_k = kw.pop("temperature", 0.0), kw.pop("top_k", 0)
        t0 = time.perf_counter()
        tot_trav, same, acc_src, drf_src, hist = 0, 0, {}, {}, {}
        for i, ((p, _), g) in enumerate(zip(prompts, greedy)):
            out, st = generate(blocks, p, a.bytes, sampling=Sampling(temp, top_k, seed=i), **kw)
            same += out == g
            tot_trav += st.traversals
            for src, v in st.accepted_by_source.items():
                acc_src[src] = acc_src.get(src, 0) + v
            for src, v in st.drafted_by_source.items():
                drf_src[src] = drf_src.get(src, 0) + v
            for k, v in st.accept_hist.items():
                hist[k] = hist.get(k, 0) + v
        row = {"settings": {**kw, "temperature": temp, "top_k": top_k},
               "bytes_per_traversal": a.prompts * a.bytes / tot_trav, "traversals": tot_trav,
               "identical_to_autoregressive": same if temp == 0 else None, "of": a.prompts, "accepted_by_source": acc_src,
               "drafted_by_source": drf_src, "accept_hist": dict(sorted(hist.items())),
               "seconds": time.perf_counter() - t0}
        res["exact"][c] = row
        print(c, {k: v for k, v in row.items() if k != "accept_hist"}, flush=True)
    write_json(ROOT / f"results/exact/drafts_{a.name}.json", res)


if __name__ == "__main__":
    main()
