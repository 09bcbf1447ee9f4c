"""The draft phase on a trained chain: the last block's draft model learns, everything else frozen.

Loads the chain (a checkpoint directory, e.g. the base model trained before draft models
existed), gives its last block a draft model of ``--draft-layers``, runs ``BlockTrainer.draft_phase()``
(the same code ``train_blocktrain`` runs after the schedule) and writes the chain to ``--out``.

    python experiments/exact/train_draft.py --name NAME [--steps 600] [--unroll 3] [--draft-layers 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from common import BASE, ROOT, load_chain, write_json

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import Block
from blocktrain.blocks.train import BlockTrainer, TrainConfig, snapshot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--ckpt", default=str(BASE))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--base-steps", type=int, default=1000, help="steps of the base run (the draft phase reads the batches after them)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    chain = load_chain(a.ckpt)
    cfg = dataclasses.replace(chain[0].cfg, draft_layers=a.draft_layers)
    K = cfg.n_blocks
    tc = TrainConfig(steps=a.base_steps, decay_frac=0.2, warmup=50, lr=a.lr, draft_frac=a.steps / a.base_steps, draft_unroll=a.unroll)
    tr = BlockTrainer(cfg, tc, K - 1, as_tensor(read_split("train")))
    missing, unexpected = tr.block.load_state_dict(chain[-1].state_dict(), strict=False)
    assert not unexpected and all(m.startswith("drafter.") for m in missing), (missing, unexpected)
    tr.step = a.base_steps
    if K > 1:
        tr.set_lower([snapshot(b) for b in chain[:-1]])
    curve, t0 = [], time.perf_counter()
    phase = tr.draft_phase()
    for i in range(a.steps):
        kls = phase.train_step()
        if (i + 1) % 50 == 0 or i == 0:
            curve.append((i + 1, kls))
            print(i + 1, [round(k, 4) for k in kls], f"{time.perf_counter() - t0:.0f}s", flush=True)
    out = ROOT / "runs/exact" / a.name
    for k in range(K):
        b = tr.block if k == K - 1 else Block(cfg, k)
        if k < K - 1:
            b.load_state_dict(chain[k].state_dict())
        ckpt.save(ckpt.Checkpoint(cfg.to_dict(), k, a.base_steps, b.state_dict(),
                                  extra={"draft_phase": {"steps": a.steps, "unroll": a.unroll, "from": a.ckpt}}),
                  out / f"block{k}.safetensors")
    write_json(ROOT / f"results/exact/train_draft_{a.name}.json",
               {"name": a.name, "checkpoint_out": str(out), "train": tc.to_dict(), "draft_layers": a.draft_layers,
                "seconds": time.perf_counter() - t0, "kl_curve": curve})


if __name__ == "__main__":
    main()
