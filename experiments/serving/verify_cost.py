"""What `bt-peer generate --verify` costs, against live `bt-peer serve` processes on loopback.

    .venv/bin/python experiments/serving/verify_cost.py --json results/serving/verify_cost.json

Six `bt-peer serve` processes, the shipped model, two per block (honest). The CLI `bt-peer
generate` (64 bytes after a validation-split prompt, exact mode), greedy and sampled (T 0.8),
with and without --verify, alternating, 3 runs each: wall time of the command (its start-up
included), the output (the same with and without), and what --verify reports (the checking
route, the largest distance, traversals). Only processes this script starts are stopped, by pid.
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from _live import BT_PEER, STARTED, stop  # noqa: E402
from live_targets import free_port, start_peer, wait_listening  # noqa: E402

from blocktrain.bench.provenance import code_version  # noqa: E402
from blocktrain.blocks.data import read_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/serving/verify_cost.json")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    made_by = code_version()
    tmp = Path(tempfile.mkdtemp(prefix="bt-verify-cost-"))
    subprocess.run([BT_PEER, "keygen", "--out", str(tmp / "swarm.key")], check=True, capture_output=True)
    text = read_split("valid")
    prompt = bytes(text[len(text) // 3:len(text) // 3 + 64]).decode("utf-8", "replace")
    rows = []
    try:
        ports = [free_port() for _ in range(6)]
        for i, port in enumerate(ports):
            boot = [] if i == 0 else [f"127.0.0.1:{ports[0]}"]
            p = start_peer(tmp, f"serve{i}", ["serve", *boot, "--block", str(i % 3)], port)
            wait_listening(p, port, tmp, f"serve{i}")
        time.sleep(3)  # every member seen by every other (status gossip)
        for temp in (0.0, 0.8):
            for r in range(args.runs):
                for verify in (False, True):
                    cmd = [BT_PEER, "generate", f"127.0.0.1:{ports[0]}", "--swarm-key", str(tmp / "swarm.key"),
                           "--identity", str(tmp / "client.id"), "--prompt", prompt, "--bytes", "64",
                           "--temperature", str(temp), "--seed", str(r)] + (["--verify"] if verify else [])
                    t0 = time.perf_counter()
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    wall = time.perf_counter() - t0
                    rows.append({"temperature": temp, "run": r, "verify": verify, "rc": res.returncode,
                                 "wall_s": round(wall, 3), "output": res.stdout.strip(),
                                 "report": [line for line in res.stderr.splitlines() if line.startswith("[")]})
                    print(json.dumps({k: rows[-1][k] for k in ("temperature", "run", "verify", "rc", "wall_s")}),
                          flush=True)
    finally:
        for p in STARTED:
            stop(p)
    summary = {}
    for temp in (0.0, 0.8):
        a = [x for x in rows if x["temperature"] == temp and not x["verify"]]
        b = [x for x in rows if x["temperature"] == temp and x["verify"]]
        summary[str(temp)] = {"plain_s": statistics.median(x["wall_s"] for x in a),
                              "verify_s": statistics.median(x["wall_s"] for x in b),
                              "ratio": round(statistics.median(x["wall_s"] for x in b)
                                             / statistics.median(x["wall_s"] for x in a), 2),
                              "all_exit_0": all(x["rc"] == 0 for x in a + b),
                              "same_output": all(x["output"] == y["output"] for x, y in zip(a, b))}
    out = {"what": "bt-peer generate with and without --verify, 6 serve processes (2 per block), loopback, "
                   "the shipped model, 64 bytes, exact mode", "machine": "2 cores: 6 peers and the client share them",
           "summary": summary, "runs": rows, "code_version": made_by, "command": shlex.join(["python", *sys.argv])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
