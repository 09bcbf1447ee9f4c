"""Train the last block's draft model of a bt-train run again, everything else untouched.

    python results/ship/retrain_drafter.py RUN OUT [--threads 2]

RUN is a bt-train output folder (results.json, checkpoints/); OUT gets checkpoints/ (blocks 0
and 1 copied byte for byte, block 2 with the new draft model and the trunk and head tensors of
RUN's), results.json (RUN's) and DRAFTER.json (this phase: code version, command, KL curve).

Why (issue 31): a draft phase before 12-04 computed the chain's features at positions
0..seq_len-1 only, also under ``train.position_shift``; the shipped model's draft model then
drafted about 7 bytes a traversal below position 128 and 1.5 past 192. ``DraftPhase`` now shifts
the rows as the blocks trained. This runs the same phase (``BlockTrainer.draft_phase()``: the
run's settings, its batches after the blocks' steps, the draft model's initial weights from the
same seed) on the CPU in float32.
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from blocktrain.bench.provenance import code_version
from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ModelConfig, TrainConfig
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.device import host_state
from blocktrain.blocks.progress import bar
from blocktrain.blocks.train import BlockTrainer

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("run", type=Path)
ap.add_argument("out", type=Path)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
version = code_version()
res = json.loads((a.run / "results.json").read_text())
tcfg = TrainConfig.from_dict(res["job"]["train"])
files = ckpt.block_files(a.run / "checkpoints")
chain = {k: ckpt.load(p) for k, p in files.items()}
K = len(chain)
top = chain[K - 1]
mcfg = ModelConfig.from_dict(top.config)
tr = BlockTrainer(mcfg, tcfg, K - 1, as_tensor(read_split("train")))  # its draft model: bt-train's initial weights
trunk = {n: t for n, t in top.tensors.items() if not n.startswith("drafter.")}
missing, unexpected = tr.block.load_state_dict(trunk, strict=False)
assert not unexpected and missing and all(m.startswith("drafter.") for m in missing), (missing, unexpected)
tr.set_lower([{n: t.float() for n, t in chain[k].tensors.items()} for k in range(K - 1)])
tr.step = tcfg.steps
phase, curve, t0 = tr.draft_phase(), [], time.perf_counter()
with bar("draft phase", tcfg.draft_steps) as pb:
    for i in range(tcfg.draft_steps):
        kls = phase.train_step()
        pb.update(1)
        if (i + 1) % 100 == 0 or i == 0:
            curve.append([i + 1, kls])
            pb.set_postfix_str("KL per unrolled step " + " / ".join(f"{k:.3f}" for k in kls))
drafter = {n: t for n, t in host_state(tr.block).items() if n.startswith("drafter.")}
assert set(drafter) == set(top.tensors) - set(trunk), "the draft model's tensors differ from the run's"
(a.out / "checkpoints").mkdir(parents=True, exist_ok=True)
for k in range(K - 1):
    shutil.copyfile(files[k], a.out / "checkpoints" / ckpt.block_file(k))
note = {"steps": tcfg.draft_steps, "unroll": tcfg.draft_unroll, "position_shift": tcfg.position_shift,
        "device": "cpu (fp32)", "from_run": str(a.run), "code": version, "command": " ".join(sys.argv),
        "seconds": time.perf_counter() - t0, "kl_curve": curve}
ckpt.save(ckpt.Checkpoint(top.config, top.block, top.step, {**trunk, **drafter}, data_position=top.data_position,
                          extra={**top.extra, "draft_phase_again": {k: v for k, v in note.items() if k != "kl_curve"}}),
          a.out / "checkpoints" / ckpt.block_file(K - 1))
shutil.copyfile(a.run / "results.json", a.out / "results.json")
if (a.run / "COMMIT").exists():
    shutil.copyfile(a.run / "COMMIT", a.out / "COMMIT")
(a.out / "DRAFTER.json").write_text(json.dumps(note, indent=1))
print(f"wrote {a.out}/checkpoints (block {K - 1}'s draft model trained again, {note['seconds']:.0f} s)")
