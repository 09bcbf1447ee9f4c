# The identity start, A/B: bt-bench swarm's in-process sequential reference (bench.swarm.reference), d 128,
# STEPS steps per block, a batch of 48 (3 workers' data per step), with the blocktrain package of the code to
# measure installed:  python experiments/identity-start/ab_init.py STEPS SEED OUT_DIR THREADS
# (writes OUT_DIR/sequential-b48-seedSEED.json and its log)
import json
import sys
from pathlib import Path

from blocktrain.bench.swarm import reference

steps, seed, out, threads = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
print(json.dumps(reference(steps, {"train.draft_frac": "0"}, out, seed, test_windows=300, workers=3, threads=threads)))
