"""The shipped model's test CE on both byte variants of WikiText-2's test split.

    .venv/bin/python results/ship/test_variants.py results/ship/test_variants.json
    .venv/bin/python results/ship/test_variants.py results/ship/test_variants-384.json 384

WikiText-2 comes in two variants: ``wiki.test.tokens`` (rare words replaced by ``<unk>``, the one
BlockTrain trains and scores on) and ``wiki.test.raw`` (the original text). The paper's 1.359
nats/byte is on "byte-level WikiText" without saying which variant. This scores the shipped
weights (blocks/data/model/) on the whole of each test split, in 128-byte windows (exactly as
make_shipped_model.py scores the tokens variant) or in SEQ_LEN-byte windows, and writes both
beside the commit it ran on.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.data import as_tensor, read_embedded
from blocktrain.blocks.evaluate import load_chain
from blocktrain.blocks.train import eval_chain

SEQ_LEN = int(sys.argv[2]) if len(sys.argv) > 2 else 128  # default: make_shipped_model.py's scoring window

torch.set_num_threads(2)
made_by = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
blocks, _ = load_chain(ckpt.SHIPPED_MODEL)
out = {"command": "python results/ship/test_variants.py " + " ".join(sys.argv[1:]), "commit": made_by,
       "model": str(ckpt.SHIPPED_MODEL), "seq_len": SEQ_LEN, "windows": "the whole split", "test_ce": {}}
for variant in ("tokens", "raw"):
    t0 = time.time()
    with torch.no_grad():
        heads = eval_chain(blocks, as_tensor(read_embedded("test", variant)), SEQ_LEN, None)
    out["test_ce"][f"wiki.test.{variant}"] = {"head_ce": heads, "seconds": round(time.time() - t0, 1)}
    print(variant, heads, flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
