"""What batch invariance by construction costs a serving hop's compute, in process.

The shipped model's three blocks decode validation prompts (64 bytes each, ``bench.wan``'s
``test_prompts``) as the hops do, at one torch thread: greedy exact (the draft model, 16 bytes),
sampled exact (T 0.8, 8 bytes x 4 chains), autoregressive greedy and sampled, 64 bytes each. A
mode's figure is this process's CPU time for all prompts (``time.process_time``: a busy machine
inflates it far less than wall time), the median of ``--repeats``. Run it under each code version
in turn (``PYTHONPATH`` putting that version's package first) and compare the medians pair by pair.

usage: python invariance_cost.py --prompts 6 --repeats 5 --json OUT
"""

import argparse
import json
import statistics
import sys
import time

import torch

from blocktrain.bench.wan import test_prompts
from blocktrain.blocks.decode import Sampling, generate
from blocktrain.provenance import code_version

try:
    from blocktrain.p2p.serving.server import load_served
except ImportError:  # the code before the serving wing
    from blocktrain.p2p.pipeline import load_served  # type: ignore[no-redef]

MODES = {
    "exact_greedy": {"draft_len": 16, "drafter": True},
    "exact_sampled": {"draft_len": 8, "drafter": True, "width": 4, "sampling": Sampling(temperature=0.8, seed=1)},
    "autoregressive_greedy": {},
    "autoregressive_sampled": {"sampling": Sampling(temperature=0.8, seed=1)},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--bytes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    served = load_served([0, 1, 2])
    blocks = [served.blocktrain[k] for k in range(3)]
    prompts = [p for p, _ in test_prompts(a.prompts, a.bytes, split="valid")]
    out = {"code_version": code_version(), "command": "python " + " ".join(sys.argv),
           "tile_rows": [getattr(b, "tile_rows", None) for b in blocks], "cpu_s": {}, "outputs": {}}
    for mode, kw in MODES.items():
        times = []
        for _ in range(a.repeats):
            t0 = time.process_time()
            texts = [generate(blocks, p, a.bytes, **kw)[0] for p in prompts]
            times.append(time.process_time() - t0)
        out["cpu_s"][mode] = {"median": statistics.median(times), "all": times}
        out["outputs"][mode] = [t.hex() for t in texts]
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({m: round(v["median"], 3) for m, v in out["cpu_s"].items()}))


if __name__ == "__main__":
    main()
