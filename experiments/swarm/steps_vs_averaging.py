"""Are two workers averaging every H steps (S/2 steps each) worth one worker with S steps?

Block 0 alone, d 64, 6 layers / 3 blocks, S = 600 steps of 16 x 128 bytes, one process, no
network: the averaging is exactly what a swarm round computes with raw updates. Prints the valid
CE (64 windows). usage: python steps_vs_averaging.py MODE, MODE one of
  single                       one worker, S steps
  half                         one worker, S/2 steps
  avgH_LR_OUTERLR_MOMENTUM     two workers on the two halves of the data, S/2 steps each, the
                               outer step every H steps (inner AdamW lr LR; outer SGD lr
                               OUTERLR, or Nesterov when MOMENTUM > 0)
The figures in steps_vs_averaging.txt: ``avg25`` and ``avg5`` are avg25_0.002_1.0_0 and
avg5_0.002_1.0_0 (plain parameter averaging).
"""

import sys

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain
from blocktrain.p2p.averaging import OuterOptimizer, flatten, unflatten_

S = 600


def main(mode: str):
    torch.set_num_threads(1)
    data, valid = as_tensor(read_split("train")), as_tensor(read_split("valid"))
    mc = ModelConfig(d_model=64, n_head=4, n_layer=6, n_blocks=3)
    if mode in ("single", "half"):
        steps = S if mode == "single" else S // 2
        tr = BlockTrainer(mc, TrainConfig(steps=steps, warmup=30), 0, data)
        for _ in range(steps):
            tr.train_step()
        block = tr.block
    else:
        h, lr, outer_lr, momentum = mode.split("_")
        H = int(h[3:])
        outer = OuterOptimizer(float(outer_lr), float(momentum), float(momentum) > 0)
        tc = TrainConfig(steps=S // 2, warmup=30, lr=float(lr))
        trs = [BlockTrainer(mc, tc, 0, data, shard=i, num_shards=2) for i in range(2)]
        ps = [list(t.block.parameters()) for t in trs]
        start = flatten(ps[0])
        for s in range(S // 2):
            for t in trs:
                t.train_step()
            if (s + 1) % H == 0:
                start = outer.step(start, start - (flatten(ps[0]) + flatten(ps[1])) / 2)
                for p in ps:
                    unflatten_(p, start)
        block = trs[0].block
    print(mode, eval_chain([block], valid, 128, 64)[-1])


if __name__ == "__main__":
    main(sys.argv[1])
