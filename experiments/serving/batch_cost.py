"""What a batch of chunks costs against the same chunks one by one, in process: the shipped
model's block 1 (d 192, 2 layers), 16-token chunks of N sessions after PAST cached tokens each,
at one torch thread (bt-peer serve's), ``decode.step_together`` against ``Traversal.step_alone``
in turn; medians of --repeats.

    python experiments/serving/batch_cost.py --json results/serving/batch_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blocktrain.blocks.decode import CHUNK, Traversal, new_caches, step_together
from blocktrain.p2p.serving.server import load_served
from blocktrain.provenance import code_version


def _spec(start: int, n: int) -> dict:
    return {"base": start, "keep": [], "start": start, "ids": [97] * n, "positions": list(range(start, start + n)),
            "parents": list(range(-1, n - 1)), "logits": [n - 1], "slots": [], "invariant": True}


def sessions(blocks, n: int, past: int) -> list[Traversal]:
    """``n`` sessions at block 1, each holding ``past`` tokens, each with its next chunk ready."""
    b, out = blocks[1], []
    for _ in range(n):
        cache = new_caches(blocks)[1]
        t = Traversal(b, cache, torch.randn(1, past, b.cfg.d_model), _spec(0, past))
        while t.step_alone() is None:
            pass
        out.append(Traversal(b, cache, torch.randn(1, CHUNK, b.cfg.d_model), _spec(past, CHUNK)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    rows = []
    for past in (64, 200):
        for n in (1, 2, 4, 8):
            together, alone = [], []
            for _ in range(a.repeats):
                ts = sessions(blocks, n, past)
                t0 = time.perf_counter()
                step_together(ts)
                together.append(time.perf_counter() - t0)
                ts = sessions(blocks, n, past)
                t0 = time.perf_counter()
                for t in ts:
                    t.step_alone()
                alone.append(time.perf_counter() - t0)
            rows.append({"past": past, "sessions": n, "together_ms": 1e3 * statistics.median(together),
                         "one_by_one_ms": 1e3 * statistics.median(alone)})
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": f"python experiments/serving/batch_cost.py --repeats {a.repeats} --json {a.json}",
                       "code_version": code_version(), "block": 1, "chunk": CHUNK, "threads": 1, "rows": rows,
                       "note": "medians; the two arms alternate within each repeat; a shared 2-core machine"}, f,
                      indent=1)


if __name__ == "__main__":
    main()
