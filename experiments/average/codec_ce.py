"""Do lossy codecs cost CE? Two workers train block 0 data-parallel (the swarm's default: gradients
averaged every step), the average computed by the swarm's own round (``AveragingRound``: the
codec's encoding, error feedback and the owners' re-encoded averages, byte for byte what travels),
its messages handed from one round to the other in this process instead of over sockets.

usage: python experiments/average/codec_ce.py CODEC [STEPS] [D_MODEL]   (CODEC: raw, fp16, bf16, int8)
Prints one JSON line: the codec, steps, valid and test CE of block 0's head (256 windows of 128
bytes each), seconds. Every codec starts from the same initial weights and sees the same batches.
"""

import json
import sys
import time

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain
from blocktrain.p2p.averaging import AveragingRound, RoundSpec


def average(ids, vectors, rnd, codec, residuals):
    """One round among len(ids) members, every message delivered in order; the members' results."""
    rounds = [AveragingRound(me, 0, rnd, ids, v, RoundSpec(codec=codec), residual=res)
              for me, v, res in zip(ids, vectors, residuals)]
    by_id = dict(zip(ids, rounds))
    queue = [(me, p) for me, r in zip(ids, rounds) for p in r.start()]
    while queue:
        sender, part = queue.pop(0)
        queue += [(part.peer, p) for p in by_id[part.peer].receive(sender, part.msg)]
    outs = [r.result()[0] for r in rounds]
    return outs, [r.residual for r in rounds]


def main(codec: str, steps: int = 1000, d_model: int = 128):
    torch.set_num_threads(1)
    data, valid, test = (as_tensor(read_split(s)) for s in ("train", "valid", "test"))
    mc = ModelConfig(d_model=d_model)
    tc = TrainConfig(steps=steps)
    trs = [BlockTrainer(mc, tc, 0, data, shard=i, num_shards=2) for i in range(2)]
    ids = ["a" * 64, "b" * 64]
    residuals = [None, None]
    t0 = time.perf_counter()
    for s in range(steps):
        for t in trs:
            t.compute_grads()
        outs, residuals = average(ids, [t.grads() for t in trs], s + 1, codec, residuals)
        assert torch.equal(outs[0], outs[1]), "the members ended the round with different bytes"
        for t, o in zip(trs, outs):
            t.apply_grads(o)
        if (s + 1) % 100 == 0:
            print(f"step {s + 1}/{steps}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    block = trs[0].block
    print(json.dumps({"codec": codec, "steps": steps, "d_model": d_model, "workers": 2,
                      "valid_ce": eval_chain([block], valid, 128, 256)[-1],
                      "test_ce": eval_chain([block], test, 128, 256)[-1],
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
