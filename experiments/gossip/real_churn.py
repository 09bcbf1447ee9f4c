"""Gossip among real `bt-peer` processes with churn: 12 peers on loopback, the tiny model
and settings of results/gossip/r6.12/real12-gossip.json (relay: every peer trains block 0, then 1,
then 2, and ends holding block i mod 3; params every 5 steps, gossip 4), 300 steps per block; in the churn run two peers are
killed (SIGKILL) once every peer reported step 150 (of 900: block 0) and two new ones start once
every live peer reported step 400 (block 1). Measured from the peers' own logs and
reports:

- when each surviving peer took a killed one out of its block's group (its connection closed:
  "left the group") and when it dropped it from the swarm (its heartbeat timeout: ``--dead-after``
  6 s), from the kill; the rounds from which the survivors' groups departed it and admitted a
  joiner (one round for all: views that agree), when the swarm's members learnt of a joiner
  (from its listening), and how long a joiner took to start: what the simulator
  (bench/gossip.py) draws instead (a crash known 5 s + U(0, 1 s) after it, a join counted up to
  2 s after the joiner took its state, each member at its own moment);
- every round's duration, the rounds with a departure, failed rounds, exclusions;
- the top head's test CE of the model assembled from the swarm at the end, against the same run
  without churn.

    python experiments/gossip/real_churn.py --json results/gossip/r6.15/real-churn.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from blocktrain.bench.average import free_ports
from blocktrain.bench.provenance import code_version
from blocktrain.bench.swarm import stop_peers, worker_identity

SETS = {"swarm.sync": "params", "swarm.every": 5, "model.d_model": 32, "model.n_head": 2, "train.batch_size": 4,
        "train.seq_len": 32, "train.draft_frac": 0, "swarm.gossip": 4}
DEAD_AFTER = 6.0
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (.*)$")


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _events(log: Path) -> list[tuple[float, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            out.append((_stamp(m.group(1)), m.group(2)))
    return out


def run(out: Path, workers: int, steps: int, churn: bool, kill_at: int, join_at: int, kill: int,
        timeout_s: float, log=print) -> dict:
    from blocktrain.blocks.evaluate import evaluate
    from blocktrain.p2p.assemble import assemble_from_swarm
    from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key, new_swarm_key, write_identity

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    key = out / "swarm.key"
    new_swarm_key(key)
    total = workers + (kill if churn else 0)
    for i in range(total):
        write_identity(out / f"id{i}", worker_identity(0, i))
    ports = free_ports(total)
    sets = {**SETS, "train.steps": steps, "train.seed": 0}
    set_args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]

    def cmd(i: int) -> list[str]:
        c = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if i else "start"]
        if i:
            c.append(f"127.0.0.1:{ports[0]}")
        return c + ["--block", str(i % 3), "--listen", f"127.0.0.1:{ports[i]}", "--swarm-key", str(key),
                    "--identity", str(out / f"id{i}"), "--report", str(out / f"report{i}.json"), "--report-every", "2",
                    "--work-dir", str(out / f"work{i}"), "--threads", "1", "--quiet", "-v", "--heartbeat", "1",
                    "--dead-after", str(DEAD_AFTER), "--min-group", str(workers), "--set", "swarm.round_timeout_s=600",
                    "--set", "swarm.join_timeout_s=30", *set_args]

    procs: dict[int, subprocess.Popen] = {}
    files = []
    started: dict[int, float] = {}
    killed: dict[int, float] = {}

    def launch(i: int):
        f = open(out / f"peer{i}.log", "w")
        files.append(f)
        started[i] = time.time()
        procs[i] = subprocess.Popen(cmd(i), stdout=f, stderr=subprocess.STDOUT)

    def report(i: int) -> dict:
        try:
            return json.loads((out / f"report{i}.json").read_text())
        except (OSError, ValueError):
            return {}

    t0 = time.time()
    at_kill: dict = {}
    at_join: dict = {}
    try:
        for i in range(workers):
            launch(i)
        training_began = None
        while True:
            now = time.time()
            live = [i for i in procs if i not in killed]
            reps = {i: report(i) for i in live}
            steps_now = {i: r.get("training", {}).get("step", 0) for i, r in reps.items()}
            if training_began is None and any(steps_now.values()):
                training_began = now
                log(f"training began {now - t0:.1f} s after launch")
            if churn and training_began is not None:  # by the steps the reports show (every 2 s)
                if not killed and min(steps_now.values()) >= kill_at:
                    for i in range(workers - kill, workers):  # never the bootstrap peer
                        procs[i].send_signal(signal.SIGKILL)
                        killed[i] = time.time()
                    at_kill = dict(steps_now)
                    log(f"killed {sorted(killed)} at {now - training_began:.1f} s (steps {steps_now})")
                if killed and len(procs) == workers and min(steps_now.values()) >= join_at:
                    for i in range(workers, workers + kill):
                        launch(i)
                    at_join = dict(steps_now)
                    log(f"started joiners {list(range(workers, workers + kill))} at {now - training_began:.1f} s")
            if (not churn or len(procs) == total) and all(
                    report(i).get("training", {}).get("state") == "done" for i in procs if i not in killed):
                break
            dead = [i for i, p in procs.items() if i not in killed and p.poll() is not None]
            if dead:
                raise RuntimeError(f"peer(s) {dead} exited (code {procs[dead[0]].returncode}); see {out}/peer{dead[0]}.log")
            if now - t0 > timeout_s:
                raise TimeoutError(f"not done after {timeout_s:.0f} s; see {out}/peer*.log")
            time.sleep(0.5)
        train_s = time.time() - (training_began or t0)
        log(f"done in {train_s:.1f} s of training; assembling")
        res = asyncio.run(assemble_from_swarm("127.0.0.1", ports[0], load_or_create_identity(out / "id-assembler"),
                                              load_swarm_key(str(key)), out / "assembled"))
    finally:
        stop_peers(list(procs.values()), files)
    ev = evaluate(out / "assembled", None, 300)

    ids = {}
    events = {}
    for i in procs:
        events[i] = _events(out / f"peer{i}.log")
        for _, msg in events[i]:
            m = re.match(r"peer (\w{12}) listening", msg)
            if m:
                ids[i] = m.group(1)
    survivors = [i for i in procs if i not in killed]
    lags: dict = {"crash": [], "group": [], "join": []}
    departed_round: dict = {}  # killed peer -> the rounds the survivors' groups departed it from
    admitted_round: dict = {}  # joiner -> the rounds the members' groups admitted it from
    for i in (i for i in survivors if i < workers):  # the joiners never knew the killed peers
        for k, at in killed.items():
            seen = [t for t, msg in events[i] if t >= at and msg.startswith(f"peer {ids.get(k)} dead")]
            lags["crash"].append(round(seen[0] - at, 3) if seen else None)
            seen = [t for t, msg in events[i] if t >= at and msg.startswith(f"{ids.get(k)} left the group")]
            lags["group"].append(round(seen[0] - at, 3) if seen else None)
        for j in (j for j in survivors if j >= workers):
            listening = [t for t, msg in events[j] if msg.startswith(f"peer {ids.get(j)} listening")]
            seen = [t for t, msg in events[i] if msg.startswith(f"peer {ids.get(j)} joined")]
            lags["join"].append(round(seen[0] - listening[0], 3) if seen and listening else None)
    for i in survivors:
        for e in report(i).get("training", {}).get("group_events", []):
            who = next((k for k in procs if ids.get(k) and e.get("peer", "").startswith(ids[k])), None)
            if e.get("event") == "departed" and who in killed:
                departed_round.setdefault(who, set()).add(e["round"])
            if e.get("event") == "admitted" and who is not None and who >= workers:
                admitted_round.setdefault(who, set()).add(e["from_round"])
    startup = {j: round(next((t for t, msg in events[j] if msg.startswith(f"peer {ids.get(j)} listening")),
                             float("nan")) - started[j], 3) for j in survivors if j >= workers}
    rounds, departures, failed, excluded = [], [], 0, 0
    for i in survivors:
        tr = report(i).get("training", {})
        for r in tr.get("rounds", []):
            rounds.append(r["seconds"])
            if r.get("departed"):
                departures.append({"peer": i, "round": r["round"], "block": r["block"], "seconds": r["seconds"],
                                   "why": sorted(set(r.get("why", {}).values()))})
        failed += len(tr.get("failed_rounds", []))
        excluded += len(tr.get("excluded_peers", {}))

    def spread(v):
        v = [x for x in v if x is not None]
        return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)} if v else {"n": 0}
    return {"churn": churn, "workers": workers, "steps_per_block": steps, "killed": sorted(killed),
            "joiners": list(range(workers, total)) if churn else [], "kill_at_step": kill_at, "join_at_step": join_at,
            "steps_at_kill": at_kill, "steps_at_join": at_join,
            "dead_after_s": DEAD_AFTER, "train_seconds": train_s,
            "crash_known_after_s": spread(lags["crash"]), "crash_never_known": lags["crash"].count(None),
            "left_the_group_after_s": spread(lags["group"]), "never_left_the_group": lags["group"].count(None),
            "departed_from_rounds": {str(k): sorted(v) for k, v in departed_round.items()},
            "join_known_to_the_swarm_after_s": spread(lags["join"]), "join_never_known": lags["join"].count(None),
            "admitted_from_rounds": {str(k): sorted(v) for k, v in admitted_round.items()},
            "joiner_startup_s": startup,
            "round_seconds": spread(rounds), "rounds_with_a_departure": departures,
            "longest_round_with_a_departure_s": max((d["seconds"] for d in departures), default=None),
            "failed_rounds": failed, "exclusions": excluded,
            "head_test_ce": ev["head_ce"], "final_test_ce": ev["test_ce"],
            "assembled_from": {str(k): v for k, v in res["blocks"].items()}, "out": str(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=150, help="kill once every peer reported this step (of 3 x steps)")
    ap.add_argument("--join-at", type=int, default=400, help="start the joiners once every live peer reported this step")
    ap.add_argument("--out", default="runs/real-churn")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    runs = {}
    for churn in (False, True):
        runs["churn" if churn else "none"] = run(Path(args.out) / ("churn" if churn else "none"), args.workers,
                                                 args.steps, churn, args.kill_at, args.join_at, args.kill,
                                                 args.timeout)
        print(json.dumps({k: v for k, v in runs["churn" if churn else "none"].items()
                          if k != "rounds_with_a_departure"}, indent=1), flush=True)
    result = {"benchmark": "gossip-real-churn", "runs": runs,
              "ce_gap": runs["churn"]["final_test_ce"] - runs["none"]["final_test_ce"]}
    if args.json:
        command = " ".join(["python", "experiments/gossip/real_churn.py", *(sys.argv[1:] if argv is None else argv)])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**result, "code_version": code_version(), "command": command}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
