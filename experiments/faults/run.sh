#!/bin/bash
# run.sh COMMIT JSON [bt-bench faults options...]: `bt-bench faults` on the runtime of COMMIT, exported
# from git to /tmp/snap/COMMIT and put first on PYTHONPATH (its bt-peer processes inherit it), so
# uncommitted edits in the tree are not measured; the JSON records the commit (runtime_commit) and
# this command (run_sh). Needs root (network namespaces).
set -e
cmd="$0 $*"
cd "$(dirname "$0")/../.."
c=$(git rev-parse "$1"); out=$2; shift 2
d=/tmp/snap/${c:0:12}
if [ ! -d "$d/py/blocktrain" ]; then
  rm -rf "$d"; mkdir -p "$d/src" "$d/py/blocktrain"
  git archive "$c" | tar -x -C "$d/src"
  cp -r "$d/src/blocktrain_pkg/." "$d/py/blocktrain/"
  for x in protocol p2p blocks bench; do ln -s "$d/src/$x" "$d/py/blocktrain/$x"; done
fi
PYTHONPATH="$d/py" .venv/bin/python -c "import blocktrain.p2p as p, sys; sys.exit(0 if p.__file__.startswith('$d') else 'not the snapshot: ' + p.__file__)"
PYTHONPATH="$d/py" .venv/bin/python -m blocktrain.bench.cli faults --json "$out" "$@"
.venv/bin/python - "$out" "$c" "$cmd" <<'PY'
import json, sys
path, commit, cmd = sys.argv[1:4]
d = json.load(open(path))
d["runtime_commit"], d["run_sh"] = commit, cmd
open(path, "w").write(json.dumps(d, indent=1) + "\n")
PY
