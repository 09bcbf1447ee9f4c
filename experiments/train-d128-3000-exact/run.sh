#!/bin/bash
# The sequential variant of train-d128-3000-fair/ again, with the exact identity start (7c8e9aa), from the
# repository root with the package installed: the same model and training settings as that run's
# sequential.json, except draft_frac 0 (the draft model, which only serving uses, leaves the CE as it is).
# Ran on 0e2eb01's package, 1 thread, beside one-thread runs of results/equal-total-block0/: 2,317 s of training.
export OMP_NUM_THREADS=1
exec python -m blocktrain.bench.train_variant --name sequential --schedule sequential \
  --model '{"d_model": 128, "n_head": 4, "n_layer": 6, "n_blocks": 3, "max_seq_len": 512, "mlp_ratio": 4, "head_layers": 1, "identity_init": true, "draft_layers": 1, "slot_offsets": 16}' \
  --train '{"steps": 3000, "batch_size": 16, "seq_len": 128, "lr": 0.002, "weight_decay": 0.1, "warmup": 50, "decay_frac": 0.2, "lr_floor": 0.05, "slot_branches": 4, "slot_len": 15, "slot_weight": 0.2, "mask_frac": 0.25, "position_shift": false, "refresh_every": 25, "seed": 0, "eval_every": 300, "eval_windows": 32, "grad_clip": 1.0, "draft_frac": 0.0, "draft_unroll": 3}' \
  --out "${1:-results/train-d128-3000-exact/sequential.json}" --threads 1
