#!/bin/bash
# run.sh COMMIT LABEL [FLOODS]: every flood against the runtime of COMMIT (exported from git to
# /tmp/snap/COMMIT and put first on PYTHONPATH, so uncommitted edits in the tree are not measured),
# one JSON per flood in results/floods/FLOOD-LABEL.json. FLOOD_ARGS (optional) go to flood.py, e.g.
# FLOOD_ARGS=--victim-verbose (the victim's malloc_trim durations and event loop stalls).
set -e
cd "$(dirname "$0")/../.."
c=$(git rev-parse --short "$1"); label=$2; floods=${3:-streams parts near serving}
d=/tmp/snap/$c
if [ ! -d "$d/py/blocktrain" ]; then
  rm -rf "$d"; mkdir -p "$d/src" "$d/py/blocktrain"
  git archive "$c" | tar -x -C "$d/src"
  cp -r "$d/src/blocktrain_pkg/." "$d/py/blocktrain/"
  for x in protocol p2p blocks bench; do ln -s "$d/src/$x" "$d/py/blocktrain/$x"; done
fi
for f in $floods; do
  FLOOD_RUNTIME_COMMIT=$(git rev-parse "$c") PYTHONPATH="$d/py" \
    timeout 900 .venv/bin/python experiments/floods/flood.py "$f" ${FLOOD_ARGS:-} --json "results/floods/$f-$label.json"
done
