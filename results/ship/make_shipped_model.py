"""Make the small trained model the package ships (blocks/data/model/) from a bt-train run.

    .venv/bin/bt-train --steps 1000 --set model.d_model=192 --set model.n_head=6 \
        --set train.seq_len=320 --set train.batch_size=8 \
        --schedule sequential --no-reference --out runs/ship-d192-s320
    .venv/bin/python results/ship/make_shipped_model.py runs/ship-d192-s320

(The command recorded in model.json is rebuilt from the run's own settings.)

Stores each block in bfloat16 (half the bytes; loaded back as float32), then measures what is
shipped: the test CE of every head along the chain (1000 test windows of 128 bytes) and the
exact-mode bytes per traversal on 200 test prompts; writes blocks/data/model/MODEL.md and
model.json beside the blocks.
"""
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks import decode
from blocktrain.blocks.data import read_split
from blocktrain.blocks.evaluate import evaluate, load_chain

run = Path(sys.argv[1])
out = ckpt.SHIPPED_MODEL
out.mkdir(parents=True, exist_ok=True)
res = json.loads((run / "results.json").read_text())
assert res["blocktrain"]["draft_curve"] if "draft_curve" in res["blocktrain"] else True
for k, path in ckpt.block_files(run / "checkpoints").items():
    c = ckpt.load(path)
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in c.tensors.items()}
    extra = {**c.extra, "stored": "bfloat16", "from_run": str(run)}
    if c.block == len(ckpt.block_files(run / "checkpoints")) - 1 and "drafter_steps" not in extra:
        extra["drafter_steps"] = res["job"]["train"]["steps"] * res["job"]["train"].get("draft_frac", 0.6)
    ckpt.save(ckpt.Checkpoint(c.config, c.block, c.step, tensors, extra=extra), out / ckpt.block_file(k))

ev = evaluate(out, windows=1000, seq_len=128)  # 1000 windows of 128 bytes of the test split (comparable)
ev_train = evaluate(out, windows=1000, seq_len=res["job"]["train"]["seq_len"])  # ... and as it trained
blocks, _ = load_chain(out)
text = read_split("test")
n, span = 200, 64 + 64
step = (len(text) - span) // n
t0 = time.perf_counter()
bpt, same = [], 0
for i in range(n):
    prompt = list(text[i * step:i * step + 64])
    exact, st = decode.generate(blocks, prompt, 64, draft_len=16, drafter=True)
    bpt.append(st.bytes_per_traversal(64))
    if i < 20:  # byte-identity on a subset (autoregressive costs 64 traversals each)
        ar, _ = decode.generate(blocks, prompt, 64)
        same += ar == exact
data_sha = {s: hashlib.sha256(read_split(s)).hexdigest() for s in ("train", "valid", "test")}
from blocktrain.blocks.model import ModelConfig  # noqa: E402
from blocktrain.blocks.train import TrainConfig  # noqa: E402

sets = [f"--set model.{k}={v}" for k, v in res["job"]["model"].items() if ModelConfig().to_dict().get(k) != v]
sets += [f"--set train.{k}={v}" for k, v in res["job"]["train"].items()
         if k != "steps" and TrainConfig().to_dict().get(k) != v]
meta = {"command": f"bt-train --steps {res['job']['train']['steps']} {' '.join(sets)} --schedule sequential "
                   f"--no-reference --out {run}; python results/ship/make_shipped_model.py {run}",
        "model": res["job"]["model"], "train": res["job"]["train"],
        "data": "embedded WikiText-2 (wiki.*.tokens), sha256 of the bytes: " + json.dumps(data_sha),
        "test_ce_heads_shipped_bf16": ev["head_ce"],
        f"test_ce_heads_shipped_bf16_{ev_train['seq_len']}_byte_windows": ev_train["head_ce"], "test_ce_heads_at_training_fp32": res["blocktrain"]["test_ce_heads"],
        "exact_bytes_per_traversal_200_prompts": sum(bpt) / n, "exact_identical_to_autoregressive": f"{same}/20",
        "measure_seconds": time.perf_counter() - t0}
(out / "model.json").write_text(json.dumps(meta, indent=1))
(out / "MODEL.md").write_text(f"""# The shipped model

A small BlockTrain model trained by the project's own `bt-train` on the embedded WikiText-2
bytes (CC BY-SA 3.0, see ../README.md), so that `bt-peer serve` and `bt-bench wan` work on a
fresh clone without training first. d {meta['model']['d_model']}, {meta['model']['n_layer']} layers in
{meta['model']['n_blocks']} blocks, a one-layer draft model on the last block; weights stored bfloat16.

- Made by: `{meta['command']}`
- Test CE of each head along the chain (nats/byte, 1000 test windows of 128 bytes, shipped weights):
  {' / '.join(f'{x:.3f}' for x in ev['head_ce'])} (windows of {ev_train['seq_len']} bytes, as it trained:
  {' / '.join(f'{x:.3f}' for x in ev_train['head_ce'])})
- Exact mode, greedy, 64 bytes after 200 test prompts: {meta['exact_bytes_per_traversal_200_prompts']:.2f} bytes
  per traversal; identical to autoregressive decoding on {same}/20 checked.
- Data: {meta['data']}

model.json holds the full configs and figures.
""")
print(json.dumps(meta, indent=1))
