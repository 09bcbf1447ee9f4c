"""Every peer of a training swarm stopped at once (SIGTERM to all three within a
millisecond), how long until each has said goodbye, written its report and exited.

    .venv/bin/python experiments/first_hour/stop_time.py --runs 5 --json results/first_hour/stop_time.json

Each run: three `bt-peer` processes (start + 2 joins, the walkthrough's default model: d 128,
relay, every peer training block 0 together) train until every one has done 5 steps; then all
three get SIGTERM at once. Reported per run: seconds from the signal to each process's exit, its
exit code, and whether its report was written after the signal. Only processes this script
starts are stopped, by pid; everything lives in a temporary directory.
"""
import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ports(n):
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(s.getsockname()[1])
    return out


def report(d: Path, i: int) -> dict:
    try:
        return json.loads((d / f"r{i}.json").read_text())
    except (OSError, ValueError):
        return {}


def one_run(d: Path) -> dict:
    subprocess.run([sys.executable, "-m", "blocktrain.p2p.cli", "keygen", "--out", str(d / "swarm.key")],
                   check=True, capture_output=True)
    ps = ports(3)
    procs = []
    try:
        for i in range(3):
            cmd = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if i else "start"]
            cmd += [f"127.0.0.1:{ps[0]}"] if i else []
            cmd += ["--block", str(i), "--listen", f"127.0.0.1:{ps[i]}", "--swarm-key", str(d / "swarm.key"),
                    "--identity", str(d / f"id{i}"), "--work-dir", str(d / f"w{i}"), "--report", str(d / f"r{i}.json"),
                    "--report-every", "0.5", "--min-group", "3", "--quiet"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(d / f"log{i}", "w")))
        deadline = time.monotonic() + 300
        while not all(report(d, i).get("training", {}).get("step", 0) >= 5 for i in range(3)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the swarm did not train 5 steps within 300 s: see " + str(d))
            time.sleep(0.2)
        t0 = time.monotonic()
        wall0 = time.time()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        exits = [None] * 3
        while any(e is None for e in exits) and time.monotonic() - t0 < 60:
            for i, p in enumerate(procs):
                if exits[i] is None and p.poll() is not None:
                    exits[i] = round(time.monotonic() - t0, 3)
            time.sleep(0.01)
        return {"exit_s": exits, "codes": [p.poll() for p in procs],
                "report_written_after_signal": [report(d, i).get("end_time", 0) >= wall0 for i in range(3)],
                "steps_at_stop": [report(d, i).get("training", {}).get("step") for i in range(3)]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = []
    for r in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            runs.append(one_run(Path(d)))
        print(json.dumps(runs[-1]), flush=True)
    worst = [max(x for x in r["exit_s"] if x is not None) if None not in r["exit_s"] else None for r in runs]
    out = {"command": f"python experiments/first_hour/stop_time.py --runs {a.runs} --json {a.json}",
           "machine": "2 cores, loopback", "runs": runs, "slowest_exit_per_run_s": worst,
           "median_slowest_s": statistics.median(w for w in worst if w is not None) if any(worst) else None,
           "target_s": 3.0, "met": all(w is not None and w <= 3.0 for w in worst)
           and all(c == 0 for r in runs for c in r["codes"]) and all(all(r["report_written_after_signal"]) for r in runs)}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
