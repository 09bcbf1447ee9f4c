# Block 0 alone, in one process: the equal-total question is decided in block 0 (the gap is made there).
# python block0.py NAME BATCH STEPS LR WARMUP DECAY_FRAC SEED THREADS OUT.json
import json, sys, time
import torch
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain

name, batch, steps, lr, warmup, decay, seed, threads, out = sys.argv[1:10]
torch.set_num_threads(int(threads))
mcfg = ModelConfig()
tcfg = TrainConfig(steps=int(steps), batch_size=int(batch), lr=float(lr), warmup=int(warmup),
                   decay_frac=float(decay), seed=int(seed), draft_frac=0.0)
train = as_tensor(read_split("train", None))
test = as_tensor(read_split("test", None))
t = BlockTrainer(mcfg, tcfg, 0, train)
t0 = time.perf_counter()
curve = []
for s in range(tcfg.steps):
    loss = t.train_step()
    if (s + 1) % 50 == 0:
        curve.append((s + 1, loss))
        print(name, s + 1, round(loss, 4), round(time.perf_counter() - t0), flush=True)
ce = eval_chain([t.block], test, tcfg.seq_len, 300)[0]
r = {"name": name, "train": tcfg.to_dict(), "head0_test_ce": ce, "seconds": time.perf_counter() - t0, "curve": curve}
print(json.dumps({k: r[k] for k in ("name", "head0_test_ce", "seconds")}), flush=True)
open(out, "w").write(json.dumps(r, indent=1))
