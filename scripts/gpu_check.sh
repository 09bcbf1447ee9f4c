#!/usr/bin/env bash
# The GPU check: on a machine with a GPU, from the repository root, after the set-up
# command of README.md:
#     scripts/gpu_check.sh                # DEVICE=cuda; DEVICE=cpu runs the same steps anywhere
# 1. trains a tiny model a few steps on the device, bf16 where the device has it (bt-train);
# 2. two bt-peer processes on the device train block 0..2 together, averaging every step (relay);
# 3. serves step 1's checkpoints (written on the device) and continues a prompt through the chain
#    (serving runs on the CPU);
# 4. bt-bench step on the device (block worker against the plain loop, per FLOP);
# 5. on cuda: the pinned-memory test of tests/test_workloads.py (skipped where CUDA is absent).
# Everything it writes goes to $OUT (default: a new temporary directory); it stops only the
# processes it started, by their ids. Exit code 0: every step passed.
set -euo pipefail
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d -t bt-gpu-check-XXXX)}
BIN=${BIN:-.venv/bin}
PORT=${PORT:-7390}
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
tiny=(--set model.d_model=64 --set model.n_head=4 --set train.batch_size=8 --set train.seq_len=64)
say() { echo "== $*" >&2; }

say "1/5 bt-train on $DEVICE"
"$BIN/bt-train" --device "$DEVICE" --steps 20 --no-reference --out "$OUT/train" "${tiny[@]}" \
    --set train.eval_every=10 --set draft_frac=0 --set test_windows=20
python3 - "$OUT/train/results.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("device", r["job"]["device"], r["job"]["precision"], "test CE per head", [round(c, 3) for c in r["blocktrain"]["test_ce_heads"]])
assert all(0 < c < 6 for c in r["blocktrain"]["test_ce_heads"])
EOF

say "2/5 two bt-peer processes on $DEVICE, averaging every step"
"$BIN/bt-peer" keygen --out "$OUT/swarm.key"
common=(--swarm-key "$OUT/swarm.key" --device "$DEVICE" --steps 10 --min-group 2 --exit-when-done "${tiny[@]}"
        --set train.draft_frac=0)
"$BIN/bt-peer" start --block 0 --listen "127.0.0.1:$PORT" --identity "$OUT/id0" --work-dir "$OUT/w0" \
    --report "$OUT/report0.json" "${common[@]}" 2> "$OUT/peer0.log" &
pids+=($!)
"$BIN/bt-peer" join "127.0.0.1:$PORT" --block 2 --identity "$OUT/id1" --work-dir "$OUT/w1" \
    --report "$OUT/report1.json" "${common[@]}" 2> "$OUT/peer1.log" &
pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
pids=()
python3 - "$OUT/report0.json" "$OUT/report1.json" "$DEVICE" <<'EOF'
import json, sys
for f in sys.argv[1:-1]:
    t = json.load(open(f))["training"]
    print(f, t["config"]["device"], t["config"]["precision"], "rounds", len(t["rounds"]),
          "failed", len(t["failed_rounds"]), "end CE", round(t["ce_end"], 3))
    assert t["rounds"] and not t["failed_rounds"] and t["config"]["device"].startswith(sys.argv[-1])
EOF

say "3/5 serve the blocks step 1 trained on $DEVICE and continue a prompt (serving: CPU)"
S=127.0.0.1:$((PORT + 1))
"$BIN/bt-peer" serve --block 0 --listen "$S" --checkpoints "$OUT/train/checkpoints" --swarm-key "$OUT/swarm.key" \
    --identity "$OUT/s0" 2> "$OUT/serve0.log" &
pids+=($!)
for k in 1 2; do
    "$BIN/bt-peer" serve "$S" --block $k --checkpoints "$OUT/train/checkpoints" --swarm-key "$OUT/swarm.key" \
        --identity "$OUT/s$k" 2> "$OUT/serve$k.log" &
    pids+=($!)
done
"$BIN/bt-peer" generate "127.0.0.1:$((PORT + 1))" --swarm-key "$OUT/swarm.key" --identity "$OUT/me" \
    --prompt "The history of the" --bytes 16 --wait 120

say "4/5 bt-bench step on $DEVICE"
"$BIN/bt-bench" step --device "$DEVICE" --sizes tiny --steps 3 --json "$OUT/step.json"
if [ "$DEVICE" = cuda ]; then
    say "5/5 what a round sends comes off the GPU in pinned memory (the test that is skipped without CUDA)"
    "$BIN/python" -m pytest -q -p no:cacheprovider tests/test_workloads.py -k pinned_host_memory
fi
say "passed; everything is in $OUT"
