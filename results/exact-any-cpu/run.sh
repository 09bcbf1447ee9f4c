#!/bin/bash
# The figures of results/exact-any-cpu/README.md. OLD and NEW are folders whose blocktrain package is
# one commit's: a git worktree of that commit with _pkg/blocktrain holding its blocktrain_pkg/*.py
# and links to its protocol, p2p, blocks, bench folders, and _site/sitecustomize.py that drops the
# editable install's import finder and puts _pkg first on sys.path (PYTHONPATH=DIR/_site).
# Here OLD = 8b660bd (rows padded to MIN_ROWS); NEW = 4312a0f (fixed-shape tiles) for cpu/ and clients8/,
# f5a993b (the same tiles through nn.Module calls) for avx2/ and wall-loaded/.
# Usage: results/exact-any-cpu/run.sh OLD NEW OUTDIR
set -u
OLD=$1; NEW=$2; OUT=$3; PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"/cpu "$OUT"/clients8 "$OUT"/wall-loaded "$OUT"/avx2
at() { local dir=$1; shift; env PYTHONPATH="$dir/_site" "$@"; }
wan() { $PY -m blocktrain.bench.cli wan --rtt-ms 0 --rate-mbit 0 --split valid --prompts 8 --bytes 64 \
        --mode exact,autoregressive "$@"; }

# 1. A hop's compute, in process: CPU seconds per mode, 5 pairs, old and new in turn.
for rep in 1 2 3 4 5; do
  for v in old new; do
    dir=$OLD; [ $v = new ] && dir=$NEW
    at $dir $PY experiments/exact/invariance_cost.py --prompts 6 --repeats 3 --json "$OUT/cpu/$v-$rep.json"
  done
done
# 2. Eight clients at once through three in-process hops (bt-bench wan --clients 8), the process's
#    CPU seconds (/usr/bin/time), 3 pairs.
for rep in 1 2 3; do
  for v in old new; do
    dir=$OLD; [ $v = new ] && dir=$NEW
    /usr/bin/time -f "%U %S %e" -o "$OUT/clients8/$v-$rep.time" env PYTHONPATH="$dir/_site" \
      $PY -m blocktrain.bench.cli wan --rtt-ms 0 --rate-mbit 0 --split valid --prompts 8 --bytes 64 --clients 8 \
      --mode exact,autoregressive --out "$OUT/runs" --json "$OUT/clients8/clients8-$v-$rep.json"
  done
done
# 3. Under the math kernels of an AVX2 CPU: exact output equals autoregressive output.
MKL_ENABLE_INSTRUCTIONS=AVX2 at $NEW $PY -m blocktrain.bench.cli wan --split valid --prompts 20 --bytes 64 \
  --mode exact,autoregressive --out "$OUT/runs" --json "$OUT/avx2/avx2-valid-20x64.json"
MKL_ENABLE_INSTRUCTIONS=AVX2 at $NEW $PY -m blocktrain.bench.cli wan --split valid --prompts 8 --bytes 64 \
  --temperature 0.8 --mode exact,autoregressive --out "$OUT/runs" --json "$OUT/avx2/avx2-valid-8x64-t08.json"
# (The first try of 1-2, bt-bench wan wall times on unshaped links, 5 + 2 pairs while the machine
#  ran other jobs at load 5-9, is kept in wall-loaded/: its pair ratios spread 0.26x-3.55x.)
