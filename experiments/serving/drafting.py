"""Exact mode's bytes per traversal on the shipped model, in process, greedy and sampled, with the
draft chains the client asks for (the drafting targets).

    .venv/bin/python experiments/serving/drafting.py --json results/serving/drafting.json
    [--arms greedy_client,client] [--bytes 256] [--split valid|train] [--sample-k 8,16,32,64,256]
    [--draft-len 8,12,16]

The prompts are those of the shipped model's own figures (results/ship/make_shipped_model.py):
N (default 200) 64-byte windows of the validation split at even offsets; 64 bytes each, draft
length 16 (the client's for greedy) unless the arm says. Arms, side by side: greedy (one chain: the argmax is always emitted);
sampled at temperature 0.8 (seed = prompt index) with width 1 (the draft model's one chain after
each node's argmax: r6.7's client), width 4 without runners-up, width 4 (each step's runner-up
a sibling leaf: r6.8), the same with chains of SAMPLED_DRAFT_LEN bytes, and the client's, greedy
and sampled (those drafts plus prompt lookup, LOOKUP bytes; since r10 its drafts drawn among the
draft model's SAMPLE_K most likely bytes), the client's with argmax drafts (r9's: client_argmax)
and with drafts drawn among 16 (client_drawn16). Bytes per traversal depend on the drafts and
the sampled bytes only, not on the machine's speed; beside them each arm's CPU seconds per traversal
(the whole chain's compute on one thread, median over prompts: a machine's figure, and one that
contention inflates). ``--split train``: windows of the training
split, for choosing settings on prompts apart from the validation prompts the figures are quoted on.
``--sample-k K[,K]``: only the client's arm with drafts drawn among K bytes, per K (arms
``client_drawnK``; in process the wire's bound of 16 is lifted, to see what a larger K would buy);
with ``--draft-len N[,N]`` too, per K and N (arms ``client_drawnK_lenN``; chains of N bytes).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import shlex

from blocktrain.bench.provenance import code_version
from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks import decode
from blocktrain.blocks.data import read_split
from blocktrain.blocks.evaluate import load_chain
from blocktrain.p2p.serving.client import DRAFT_LEN, DRAFT_WIDTH, LOOKUP, SAMPLE_K, SAMPLED_DRAFT_LEN


def no_runners_up(session_cls):
    """Session._draft_tree without the wide drafts' runner-up leaves (the width-only arm)."""
    tree = session_cls._draft_tree

    def without(self, budget):
        alt, self.model_alt = self.model_alt, []
        try:
            return tree(self, budget)
        finally:
            self.model_alt = alt
    return without


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="where to write (default results/serving/drafting.json; "
                    "required with --arms)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--bytes", type=int, default=64, help="output bytes per prompt")
    ap.add_argument("--arms", default="all", help="comma list of the arms to run (default all)")
    ap.add_argument("--split", default="valid", choices=("valid", "train"), help="where the prompts come from")
    ap.add_argument("--sample-k", default=None, help="comma list of k: the client's arm with drafts drawn among k")
    ap.add_argument("--draft-len", default=None, help="with --sample-k: comma list of chain lengths")
    args = ap.parse_args()
    if args.json is None:
        if args.arms != "all" or args.sample_k:
            ap.error("--arms, --sample-k: name the file with --json (a subset would replace the full record)")
        args.json = "results/serving/drafting.json"
    made_by = code_version()  # what is measured: taken first (a commit made meanwhile is not it)
    torch.set_num_threads(1)
    blocks, _ = load_chain(ckpt.SHIPPED_MODEL)
    text = read_split(args.split)
    n, span = args.prompts, 64
    step = (len(text) - span - args.bytes) // n  # as make_shipped_model.py: room for the prompt and its continuation
    prompts = [list(text[i * step:i * step + span]) for i in range(n)]
    arms = {"greedy": (0.0, 1, True, DRAFT_LEN), "sampled_t0.8_width1": (0.8, 1, True, DRAFT_LEN),
            "sampled_t0.8_width4_no_runners_up": (0.8, 4, False, DRAFT_LEN),
            "sampled_t0.8_width4": (0.8, 4, True, DRAFT_LEN),
            "sampled_t0.8_width4_draft8": (0.8, DRAFT_WIDTH, True, SAMPLED_DRAFT_LEN),
            "greedy_client": (0.0, 1, True, DRAFT_LEN), "client": (0.8, DRAFT_WIDTH, True, SAMPLED_DRAFT_LEN),
            "client_argmax": (0.8, DRAFT_WIDTH, True, SAMPLED_DRAFT_LEN),
            "client_drawn16": (0.8, DRAFT_WIDTH, True, SAMPLED_DRAFT_LEN)}
    if args.arms != "all":
        unknown = set(args.arms.split(",")) - arms.keys()
        if unknown:
            ap.error(f"--arms: unknown {sorted(unknown)}; expected some of {', '.join(arms)}")
        arms = {k: v for k, v in arms.items() if k in args.arms.split(",")}
    lookups = {"greedy_client": LOOKUP, "client": LOOKUP, "client_argmax": LOOKUP, "client_drawn16": LOOKUP}
    sample_ks = {"client": SAMPLE_K, "client_drawn16": 16}  # drawn drafts (r10); the other arms draft argmax
    if args.sample_k:
        if args.arms != "all":
            ap.error("--sample-k: its own arms, not --arms")
        ks = [int(k) for k in args.sample_k.split(",")]
        decode.MAX_SAMPLE_K = max(ks)  # in process only: the wire bounds k at 16
        lens = [int(n) for n in args.draft_len.split(",")] if args.draft_len else [SAMPLED_DRAFT_LEN]
        name = (lambda k, n: f"client_drawn{k}_len{n}") if args.draft_len else (lambda k, n: f"client_drawn{k}")
        arms = {name(k, n): (0.8, DRAFT_WIDTH, True, n) for k in ks for n in lens}
        lookups = {a: LOOKUP for a in arms}
        sample_ks = {name(k, n): k for k in ks for n in lens}
    elif args.draft_len:
        ap.error("--draft-len: with --sample-k")
    out = {}
    plain = decode.Session._draft_tree
    for name, (temp, width, runners_up, draft_len) in arms.items():
        decode.Session._draft_tree = plain if runners_up else no_runners_up(decode.Session)
        bpt, per_traversal = [], []
        for i, prompt in enumerate(prompts):
            t0 = time.process_time()
            _, st = decode.generate(blocks, prompt, args.bytes, draft_len=draft_len, drafter=True, width=width,
                                    lookup=lookups.get(name, 0), sample_k=sample_ks.get(name, 0),
                                    sampling=decode.Sampling(temperature=temp, seed=i))
            bpt.append(st.bytes_per_traversal(args.bytes))
            per_traversal.append((time.process_time() - t0) / st.traversals)
        out[name] = {"temperature": temp, "width": width, "runners_up": runners_up and width > 1, "draft_len": draft_len,
                     "lookup": lookups.get(name, 0), "sample_k": sample_ks.get(name, 0),
                     "mean": round(sum(bpt) / n, 3), "median": round(statistics.median(bpt), 3),
                     "min": round(min(bpt), 3), "max": round(max(bpt), 3),
                     # the whole chain's compute (every block, the drafting), CPU seconds, one thread
                     "cpu_s_per_traversal": round(statistics.median(per_traversal), 4)}
        print(json.dumps({name: out[name]}), flush=True)
    decode.Session._draft_tree = plain
    result = ({"what": "exact-mode bytes per traversal, in process, shipped model", "prompts": n,
                      "prompt_bytes": span, "output_bytes": args.bytes, "draft_len": DRAFT_LEN, "split": args.split,
                      "arms": out, "target_sampled": 3.5, "target_greedy": 4.0,
                      "sampled_target_met": (out["client"]["mean"] >= 3.5 if "client" in out and args.bytes == 64
                                             else None),
                      "code_version": made_by, "command": shlex.join(["python", *sys.argv])})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
