"""What a job will cost before it runs (``bt-train --dry-run``): per block, its parameters, a
worker's memory and the FLOPs of a training step; built on the meta device (no memory, no time).

Rules:
- Parameters are counted on the real modules (``Block`` built on torch's meta device), never
  from a formula that could drift from the model.
- Memory per worker is parameters, gradients and AdamW's two moments of the block it trains
  (float32: 16 bytes a parameter), the frozen blocks below it (4 bytes a parameter), and an
  activation estimate at the configured batch, labelled as an estimate (the saved tensors of a
  layer's forward: about 34 x batch x seq x d_model floats, plus the attention scores and
  probabilities, 2 x batch x heads x seq^2, per layer; the placeholder branches a row also trains,
  train.slot_branches, are not counted); with ``train.micro_batches`` M a worker holds one slice
  of the batch at a time: batch / M rows.
- FLOPs per step come from the FLOP counts the training figures use (model.py).
"""

from __future__ import annotations

import torch

from .config import Job
from .model import Block, train_flops_per_token

ACT_FLOATS_PER_TOKEN_DIM = 34  # saved activations of one layer, per token and model dimension (estimate)


def dry_run(job: Job) -> dict:
    """The plan of a job (either command's: only its model and train settings count): parameters,
    memory and FLOPs per block."""
    mc, tc = job.model, job.train
    with torch.device("meta"):
        blocks = [Block(mc, k) for k in range(mc.n_blocks)]
    params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    B, T = tc.batch_size, tc.seq_len
    rows_at_once = -(-B // tc.micro_batches)  # the largest slice (tensor_split)
    rows = []
    for k, b in enumerate(blocks):
        layers = mc.layers_per_block + (0 if k == mc.n_blocks - 1 else mc.head_layers)
        Bm = rows_at_once
        act = layers * 4 * (ACT_FLOATS_PER_TOKEN_DIM * Bm * T * mc.d_model + 2 * Bm * mc.n_head * T * T)
        mem = {"trained_bytes": 16 * params[k], "frozen_below_bytes": 4 * sum(params[:k]),
               "activations_bytes_estimate": act}
        rows.append({"block": k, "params": params[k], "memory": {**mem, "total_bytes_estimate": sum(mem.values())},
                     "train_flops_per_step": train_flops_per_token(mc, k, T) * B * T})
    return {"model": mc.to_dict(), "batch": [B, T], "micro_batches": tc.micro_batches, "steps_per_block": tc.steps, "params_total": sum(params),
            "blocks": rows, "reference_flops_per_step": train_flops_per_token(mc, None, T) * B * T,
            "note": "memory: float32 parameters, gradients and AdamW moments counted exactly; activations estimated "
                    "at batch / micro_batches x seq (placeholder branches not counted)"}
