import sys, torch, time
torch.set_num_threads(1)
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain
from blocktrain.p2p.averaging import flatten, unflatten_
mode = sys.argv[1]
d = as_tensor(read_split("train")); v = as_tensor(read_split("valid"))
mc = ModelConfig(d_model=64, n_head=4, n_layer=6, n_blocks=3)
S = 600
if mode == "single":
    tc = TrainConfig(steps=S, warmup=30); tr = BlockTrainer(mc, tc, 0, d)
    for _ in range(S): tr.train_step()
    print(mode, eval_chain([tr.block], v, 128, 64)[-1])
elif mode == "half":
    tc = TrainConfig(steps=S//2, warmup=30); tr = BlockTrainer(mc, tc, 0, d)
    for _ in range(S//2): tr.train_step()
    print(mode, eval_chain([tr.block], v, 128, 64)[-1])
else:
    parts = mode.split("_")
    H = int(parts[0][3:]); lr = float(parts[1]); olr = float(parts[2]); mom = float(parts[3])
    from blocktrain.p2p.averaging import OuterOptimizer
    outer = OuterOptimizer(olr, mom, mom > 0)
    tc = TrainConfig(steps=S//2, warmup=30, lr=lr)
    trs = [BlockTrainer(mc, tc, 0, d, shard=i, num_shards=2) for i in range(2)]
    ps = [list(t.block.parameters()) for t in trs]
    start = flatten(ps[0])
    for s in range(S//2):
        for t in trs: t.train_step()
        if (s+1) % H == 0:
            pg = start - (flatten(ps[0]) + flatten(ps[1])) / 2
            start = outer.step(start, pg)
            for p in ps: unflatten_(p, start)
    print(mode, eval_chain([trs[0].block], v, 128, 64)[-1])
