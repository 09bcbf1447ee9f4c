# The identity start, A/B: the in-process sequential run (bench/train_variant.py, as bt-bench swarm's reference),
# d 128, STEPS steps per block, a batch of 48 (3 workers' data per step), with the blocktrain package of the
# code to measure installed:  python results/identity-start/ab_init.py STEPS SEED OUT.json THREADS
import json
import subprocess
import sys

from blocktrain.blocks.config import apply_overrides
from blocktrain.p2p.config import PeerJob
steps, seed, out, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
job = apply_overrides(PeerJob(), {"train.draft_frac": "0", "train.steps": steps, "train.seed": seed})
job = apply_overrides(job, {"train.batch_size": job.train.batch_size * 3})
cmd = [sys.executable, "-m", "blocktrain.bench.train_variant", "--name", f"seq-{steps}-s{seed}", "--schedule", "sequential",
       "--model", json.dumps(job.model.to_dict()), "--train", json.dumps(job.train.to_dict()), "--out", out,
       "--threads", threads, "--test-windows", "300"]
subprocess.run(cmd, check=True)
