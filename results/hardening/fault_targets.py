"""Issue 12's targets 3 and 4, measured with live `bt-peer` processes on loopback.

    .venv/bin/python results/hardening/fault_targets.py --json results/hardening/fault_targets.json

(`--parts 3i,3ii,4`, `--steps3 S`, `--steps4 S`, `--runs4 N` for shorter trials; the defaults are
the measured run.)

Every peer is `bt-peer start|join --block K --min-group N --exit-when-done -v` with the relay
schedule (default), sync grads (default: every round is one step), a tiny model (d 32, 3 layers, 3
blocks, batch 4, seq 32, no draft phase, via --set), its own identity, work dir and report
(--report-every 0.5), and the DEFAULT --heartbeat (1 s) and --dead-after (6 s); every swarm.*
setting is the default (round timeout 120 s, join timeout 10 s).

While a swarm runs, the script reads every report about every 0.3 s and keeps every `rounds`
entry it sees (a report keeps only the last 200 rounds plus anomalies), with the time it first saw
it, so that no round is lost to the report's window. A round's *effective members* are its
`members` minus its `departed`.

Target 3 (3 peers, blocks 0/1/2; peer 2, a joiner, is the victim):
 (i)  peer 2 is stopped (SIGSTOP) for 15 s once every peer is past step STOP_AT (a third of the
      run), then resumed (SIGCONT). 15 s > the default --dead-after (6 s): the others declare it
      dead while it is stopped.
 (ii) peer 2 is killed (SIGKILL) at the same point and restarted at once with the same --work-dir,
      --identity, --listen port and --block (a fresh report file, to keep the two lives apart).
 Reported per part: the survivors' round when the victim stopped / was killed, when they declared
 it dead (membership event "dead", group event "departed"), their round at SIGCONT / restart;
 `rounds_until_whole`: the first round, after SIGCONT / the restart, whose effective members are
 all three peers in every peer's report, counted in the survivors' rounds from SIGCONT / restart
 (and the seconds); beside it, rounds from the victim's admission (`admitted` group event). The
 final parameters: every peer's `serve/lower-checkpoint/block{j}` (j = 0, 1, 2: every peer ends
 holding every final block under relay) compared tensor by tensor with torch.equal and the max
 |diff|. Honesty of the reports: for every round entry of every peer, every effective member other
 than itself must have a round entry with the same number, block and step (any of its lives);
 a claimed member without one is an *unbacked claim* (members or coverage that did not happen).
 Also counted: *one-sided* claims (the claimed member's entry for that round lists the claimer as
 departed or not at all: each side averaged something else), rounds whose coverage is < 1, failed
 rounds, and rounds the victim trained with a group other than the whole one after SIGCONT /
 restart (a split).
 Met: whole within 2 rounds of SIGCONT / the restart, identical final blocks, no unbacked claim.
 (Rounds are single steps here, and a joiner is admitted `margin` = 2 rounds ahead by design,
 so "within two rounds" counted from SIGCONT / the restart is strict; both countings are given.)

Target 4: 10 runs of a 4-peer swarm (blocks 0/1/2/0, --min-group 4) beside three busy processes
(`python -c "while True: pass"`, started before the peers and killed by pid after they exit) on
the 2 cores. Per run: membership events "dead" and "suspect" in every report, group "departed"
events, failed rounds, rounds with a departed member, log lines "peer ... dead", "stalled", exit
codes, final steps, whether every peer's final blocks are identical. Met: no member declared dead
in any run.

Only processes this script starts are stopped, by pid. Everything lives in a temporary directory
(KEEP_TMP=1 keeps it).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.p2p.transport import Timeouts

BT_PEER = str(Path(sys.executable).parent / "bt-peer")
TINY = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=3", "--set", "model.n_blocks=3",
        "--set", "batch_size=4", "--set", "seq_len=32", "--set", "warmup=1", "--set", "swarm.eval_windows=2",
        "--set", "train.draft_frac=0"]
N_BLOCKS = 3
STARTED: list[subprocess.Popen] = []
RESULTS: dict = {"command": "python results/hardening/fault_targets.py --json results/hardening/fault_targets.json",
                 "machine": f"{os.cpu_count()} cores, loopback",
                 "timeouts": {"heartbeat_s": Timeouts().heartbeat_s, "dead_after_s": Timeouts().dead_after_s,
                              "note": "the defaults; no --heartbeat or --dead-after given"}}


def provenance() -> dict:
    """The code measured: HEAD, and the uncommitted changes to the runtime, if any (by hash)."""
    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout  # noqa: E731
    dirty = git("status", "--porcelain", "--", "p2p", "protocol", "blocks").split("\n")
    return {"git_head": git("rev-parse", "HEAD").strip(), "uncommitted_runtime_files": [l[3:] for l in dirty if l],
            "uncommitted_diff_sha256": hashlib.sha256(git("diff", "HEAD", "--", "p2p", "protocol", "blocks").encode())
            .hexdigest()[:16]}


def out(key, value):
    RESULTS[key] = value
    print(json.dumps({key: value}), flush=True)


def free_ports(n) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def stop(p: subprocess.Popen):
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGCONT)  # in case it is stopped
        except ProcessLookupError:
            pass
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# --- a swarm and what its reports say ------------------------------------------------------------
class Swarm:
    """n bt-peer processes (peer i: identity id{i}, work dir w{i}, block blocks[i]); peer 0 starts the
    swarm, the others join through it. Each life of a peer (a restart is a new life) has its own
    report file r{i}.{life}.json and log log{i}.{life}."""

    def __init__(self, tmp: Path, blocks: list[int], steps: int):
        self.tmp, self.blocks, self.steps, self.n = tmp, blocks, steps, len(blocks)
        self.ports = free_ports(self.n)
        self.procs: dict[int, subprocess.Popen] = {}
        self.life = {i: -1 for i in range(self.n)}
        self.lives: list[tuple[int, int]] = []  # (peer, life)
        self.rounds: dict[tuple[int, int], dict[int, dict]] = {}  # (peer, life) -> round -> entry
        self.first_seen: dict[tuple[int, int], dict[int, float]] = {}  # (peer, life) -> round -> time.time()
        self.last: dict[tuple[int, int], dict] = {}  # (peer, life) -> the last report read
        self.t0 = time.time()

    def report_path(self, i, life) -> Path:
        return self.tmp / f"r{i}.{life}.json"

    def log_path(self, i, life) -> Path:
        return self.tmp / f"log{i}.{life}"

    def launch(self, i):
        self.life[i] += 1
        life = self.life[i]
        cmd = [BT_PEER, "join" if i else "start"] + ([f"127.0.0.1:{self.ports[0]}"] if i else [])
        cmd += ["--block", str(self.blocks[i]), "--listen", f"127.0.0.1:{self.ports[i]}",
                "--swarm-key", str(self.tmp / "swarm.key"), "--identity", str(self.tmp / f"id{i}"),
                "--report", str(self.report_path(i, life)), "--report-every", "0.5", "--quiet", "-v",
                "--work-dir", str(self.tmp / f"w{i}"), "--steps", str(self.steps), "--exit-when-done",
                "--min-group", str(self.n), *TINY]
        if i == 0 and life == 0:
            RESULTS.setdefault("peer_command", " ".join(["bt-peer"] + cmd[1:]).replace(str(self.tmp), "TMP"))
        p = subprocess.Popen(cmd, stdout=open(self.log_path(i, life), "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        STARTED.append(p)
        self.procs[i] = p
        self.lives.append((i, life))
        return p

    def start(self):
        for i in range(self.n):
            self.launch(i)

    def poll(self):
        now = time.time()
        for i, life in self.lives:
            try:
                r = json.loads(self.report_path(i, life).read_text())
            except (OSError, ValueError):
                continue
            self.last[(i, life)] = r
            rs = self.rounds.setdefault((i, life), {})
            seen = self.first_seen.setdefault((i, life), {})
            for e in (r.get("training") or {}).get("rounds", []):
                rs.setdefault(e["round"], e)
                seen.setdefault(e["round"], now)

    def training(self, i, life=None) -> dict:
        life = self.life[i] if life is None else life
        return (self.last.get((i, life)) or {}).get("training") or {}

    def peer_id(self, i) -> str | None:
        for (j, life), r in self.last.items():
            if j == i and r.get("peer_id"):
                return r["peer_id"]
        return None

    def latest_round(self, i, life=None) -> int:
        life = self.life[i] if life is None else life
        rs = self.rounds.get((i, life), {})
        return max(rs) if rs else 0

    def wait(self, cond, what, timeout, poll_s=0.3):
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if cond():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out ({timeout} s) waiting for {what}")
            time.sleep(poll_s)

    def wait_exit(self, timeout) -> dict:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.3)
        codes = {}
        for i, p in self.procs.items():
            if p.poll() is None:
                codes[i] = "still running at the deadline (stopped)"
                stop(p)
            else:
                codes[i] = p.returncode
        time.sleep(0.2)
        self.poll()
        return codes

    # --- analysis ---------------------------------------------------------------------------------
    def ids(self) -> dict[int, str]:
        return {i: self.peer_id(i) for i in range(self.n)}

    @staticmethod
    def effective(e) -> set:
        return set(e.get("members", [])) - set(e.get("departed", []))

    def entries_of(self, pid) -> list[tuple[int, int, dict]]:
        """Every round entry of the peer with this id: (peer, life, entry)."""
        idx = {v: k for k, v in self.ids().items()}
        i = idx.get(pid)
        return [(i, life, e) for (j, life), rs in self.rounds.items() if j == i for e in rs.values()]

    def honesty(self) -> dict:
        by_peer_round: dict[str, dict[int, list[dict]]] = {}
        ids = self.ids()
        for (i, life), rs in self.rounds.items():
            for r, e in rs.items():
                by_peer_round.setdefault(ids[i], {}).setdefault(r, []).append(e)
        unbacked, one_sided, low_cov = [], [], []
        claims = 0
        for (i, life), rs in self.rounds.items():
            me = ids[i]
            for r, e in sorted(rs.items()):
                if e.get("coverage", 1.0) < 1.0:
                    low_cov.append({"peer": i, "life": life, "round": r, "coverage": e["coverage"]})
                for m in sorted(self.effective(e) - {me}):
                    claims += 1
                    theirs = [x for x in by_peer_round.get(m, {}).get(r, [])
                              if x.get("block") == e.get("block") and x.get("step") == e.get("step")]
                    j = next((k for k, v in ids.items() if v == m), None)
                    rec = {"peer": i, "life": life, "round": r, "step": e.get("step"), "claims": j,
                           "coverage": e.get("coverage"), "members": len(e.get("members", [])),
                           "departed": [next((k for k, v in ids.items() if v == d), d[:12]) for d in e.get("departed", [])]}
                    if not theirs:
                        unbacked.append(rec)
                    elif not any(me in self.effective(x) for x in theirs):
                        one_sided.append(rec)
        return {"round_entries": sum(len(rs) for rs in self.rounds.values()), "member_claims_checked": claims,
                "unbacked_claims": len(unbacked), "unbacked_examples": unbacked[:10],
                "one_sided_claims": len(one_sided), "one_sided_examples": one_sided[:10],
                "rounds_with_coverage_below_1": len(low_cov), "low_coverage_examples": low_cov[:10]}

    def events(self) -> dict:
        """Membership ('events') and group events, failed rounds, per peer life, and log lines."""
        ids = self.ids()
        name = lambda pid: next((f"peer{k}" for k, v in ids.items() if v == pid), pid[:12] if pid else pid)  # noqa: E731
        res = {}
        for (i, life), r in sorted(self.last.items()):
            tr = r.get("training") or {}
            evs = [{"event": e["event"], "peer": name(e["peer"]), "t": round(e["time"] - self.t0, 2)}
                   for e in r.get("events", []) if e["event"] != "joined"]
            gev = [{**e, "peer": name(e.get("peer"))} if e.get("peer") else e for e in tr.get("group_events", [])]
            log = self.log_path(i, life).read_text(errors="replace") if self.log_path(i, life).exists() else ""
            res[f"peer{i}.{life}"] = {
                "membership_events": evs, "group_events": gev,
                "failed_rounds": [{k: v for k, v in f.items() if k != "silent"} | {"silent": [name(s) for s in f.get("silent", [])]}
                                  for f in tr.get("failed_rounds", [])],
                "joins": [{k: (v if k != "members" else [name(m) for m in v]) for k, v in j.items()
                           if k in ("round", "how", "members", "bytes")} for j in tr.get("joins", [])],
                "state": tr.get("state"), "step": tr.get("step"), "steps": tr.get("steps"),
                "rounds_applied": tr.get("rounds_applied"), "coverage_min": tr.get("coverage_min"),
                "max_round_seconds": max((e.get("seconds", 0) for e in self.rounds.get((i, life), {}).values()), default=None),
                "log_dead_lines": [l for l in log.splitlines() if re.search(r"peer \w+ dead", l)][:10],
                "log_stalled_lines": [l for l in log.splitlines() if "stalled" in l][:10],
                "log_warnings": [l for l in log.splitlines() if "WARNING" in l or "ERROR" in l or "Traceback" in l][:10]}
        return res

    def final_blocks(self) -> dict:
        """Every peer's final blocks (serve/lower-checkpoint/block{j}), compared tensor by tensor."""
        loaded = {}
        for i in range(self.n):
            for j in range(N_BLOCKS):
                p = self.tmp / f"w{i}" / "serve" / "lower-checkpoint" / ckpt.block_file(j)
                try:
                    loaded[(i, j)] = ckpt.load(p)
                except Exception as e:  # noqa: BLE001  (a measurement: record what happened)
                    loaded[(i, j)] = f"{type(e).__name__}: {e}"[:200]
        per_block = {}
        for j in range(N_BLOCKS):
            ref = loaded[(0, j)]
            row = {"sha256": [c.sha256[:12] if isinstance(c, ckpt.Checkpoint) else c
                              for c in (loaded[(i, j)] for i in range(self.n))]}
            diffs, equal = [], True
            for i in range(1, self.n):
                c = loaded[(i, j)]
                if not isinstance(ref, ckpt.Checkpoint) or not isinstance(c, ckpt.Checkpoint) \
                        or set(c.tensors) != set(ref.tensors):
                    diffs.append(None)
                    equal = False
                    continue
                d = max((float((c.tensors[k].float() - ref.tensors[k].float()).abs().max()) if c.tensors[k].numel() else 0.0)
                        for k in ref.tensors)
                equal &= all(torch.equal(c.tensors[k], ref.tensors[k]) for k in ref.tensors)
                diffs.append(d)
            row["max_abs_diff_vs_peer0"] = diffs
            row["identical"] = equal
            per_block[f"block{j}"] = row
        return {"per_block": per_block, "all_identical": all(r["identical"] for r in per_block.values())}

    def first_whole_after(self, after: int) -> int | None:
        """The first round numbered above ``after`` whose effective members are every peer, in the
        reports of every peer (any of its lives)."""
        ids = self.ids()
        everyone = set(ids.values())
        whole: dict[int, set] = {}  # round -> the peers that report it whole
        for (i, life), rs in self.rounds.items():
            for r, e in rs.items():
                if r > after and self.effective(e) == everyone:
                    whole.setdefault(r, set()).add(i)
        full = sorted(r for r, who in whole.items() if len(who) == self.n)
        return full[0] if full else None


def keygen(tmp: Path):
    subprocess.run([BT_PEER, "keygen", "--out", str(tmp / "swarm.key")], check=True, capture_output=True)


# --- target 3 ------------------------------------------------------------------------------------
def target3(tmp: Path, part: str, steps: int, stop_s: float) -> dict:
    sw = Swarm(tmp, [0, 1, 2], steps)
    victim, survivors = 2, [0, 1]
    total = steps * N_BLOCKS
    stop_at = total // 3
    t_launch = time.time()
    sw.start()
    sw.wait(lambda: all(sw.training(i).get("step", 0) >= stop_at for i in range(3)), f"every peer past step {stop_at}",
            240)
    t_train = time.time()
    r_stop = {i: sw.latest_round(i) for i in survivors}
    victim_round_at_stop = sw.latest_round(victim)
    ids = sw.ids()
    res = {"part": part, "steps_per_block": steps, "total_steps": total, "fault_at_step": stop_at,
           "seconds_launch_to_fault": round(t_train - t_launch, 1)}
    if part == "3i":
        os.kill(sw.procs[victim].pid, signal.SIGSTOP)
        t_fault = time.time()
        deadline = time.monotonic() + stop_s
        while time.monotonic() < deadline:
            sw.poll()
            time.sleep(0.3)
        sw.poll()
        r_back = {i: sw.latest_round(i) for i in survivors}
        os.kill(sw.procs[victim].pid, signal.SIGCONT)
        t_back = time.time()
        res["stopped_seconds"] = round(t_back - t_fault, 2)
    else:
        os.kill(sw.procs[victim].pid, signal.SIGKILL)
        t_fault = time.time()
        sw.procs[victim].wait(10)
        sw.poll()
        r_back = {i: sw.latest_round(i) for i in survivors}
        sw.launch(victim)  # same identity, work dir, port, block; a fresh report file
        t_back = time.time()
    codes = sw.wait_exit(300)
    t_end = time.time()
    # when the survivors declared the victim dead
    declared = {}
    for i in survivors:
        r = sw.last.get((i, 0), {})
        dead = [e for e in r.get("events", []) if e["peer"] == ids[victim] and e["event"] in ("dead", "suspect", "left")
                and e["time"] >= t_fault - 1]
        dep = [e for e in (r.get("training") or {}).get("group_events", [])
               if e.get("peer") == ids[victim] and e["event"] == "departed"]
        adm = [e for e in (r.get("training") or {}).get("group_events", [])
               if e.get("peer") == ids[victim] and e["event"] == "admitted"]
        declared[f"peer{i}"] = {"membership": [{"event": e["event"], "s_after_fault": round(e["time"] - t_fault, 2)}
                                               for e in dead],
                                "group_departed": dep, "group_admitted": adm}
    first = sw.first_whole_after(max(r_back.values()))
    seen = [sw.first_seen[(i, 0)].get(first) for i in survivors] if first is not None else []
    admitted = [e["from_round"] for d in declared.values() for e in d["group_admitted"]]
    victim_life = sw.life[victim]
    apart = [{"round": r, "step": e.get("step"), "members": len(sw.effective(e))}
             for r, e in sorted(sw.rounds.get((victim, victim_life), {}).items())
             if sw.first_seen[(victim, victim_life)][r] > t_back and sw.effective(e) != set(ids.values())]
    res.update({
        "peer_ids": {f"peer{i}": (v or "")[:12] for i, v in ids.items()}, "victim": f"peer{victim}",
        "survivor_round_at_fault": r_stop, "victim_round_at_fault": victim_round_at_stop,
        "survivor_round_at_resume_or_restart": r_back,
        "declared_by_survivors": declared,
        "first_whole_round_after_resume_or_restart": first,
        "rounds_until_whole": (first - max(r_back.values())) if first is not None else None,
        "seconds_until_whole": round(max(s for s in seen if s) - t_back, 2) if first is not None and all(seen) else None,
        "admitted_from_round": admitted,
        "rounds_from_admission_to_whole": (first - max(admitted)) if first is not None and admitted else None,
        "victim_rounds_apart_after_resume_or_restart": {"count": len(apart), "first": apart[:3], "last": apart[-3:]},
        "exit_codes": codes, "seconds_total": round(t_end - t_launch, 1),
        "final_blocks": sw.final_blocks(), "reports_honest": sw.honesty(), "peers": sw.events()})
    ok_whole = res["rounds_until_whole"] is not None and res["rounds_until_whole"] <= 2
    res["met"] = {"whole_within_2_rounds": ok_whole, "identical_final_blocks": res["final_blocks"]["all_identical"],
                  "no_unbacked_claims": res["reports_honest"]["unbacked_claims"] == 0,
                  "all": ok_whole and res["final_blocks"]["all_identical"] and res["reports_honest"]["unbacked_claims"] == 0}
    return res


# --- target 4 ------------------------------------------------------------------------------------
def target4_run(tmp: Path, k: int, steps: int) -> dict:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(3)]
    STARTED.extend(busy)
    try:
        sw = Swarm(tmp, [0, 1, 2, 0], steps)
        t0 = time.time()
        sw.start()
        codes = sw.wait_exit(240)
        secs = round(time.time() - t0, 1)
    finally:
        for b in busy:
            b.kill()
            b.wait(10)
    ev = sw.events()
    ids = sw.ids()
    dead = [{"by": name, **e} for name, p in ev.items() for e in p["membership_events"] if e["event"] == "dead"]
    suspect = [{"by": name, **e} for name, p in ev.items() for e in p["membership_events"] if e["event"] == "suspect"]
    departed = [{"by": name, **e} for name, p in ev.items() for e in p["group_events"] if e.get("event") == "departed"]
    failed = sum(len(p["failed_rounds"]) for p in ev.values())
    with_departed = sum(1 for rs in sw.rounds.values() for e in rs.values() if e.get("departed"))
    trained = {name: (p["step"], p["steps"], p["state"]) for name, p in ev.items()}
    training_s = [round(sw.last[(i, 0)]["training"]["busy"]["wall_s"], 1) for i in range(4)
                  if (sw.last.get((i, 0)) or {}).get("training", {}).get("busy")]
    fb = sw.final_blocks()
    return {"run": k + 1, "seconds": secs, "training_wall_s": training_s, "exit_codes": codes,
            "peer_ids": {f"peer{i}": (v or "")[:12] for i, v in ids.items()},
            "members_declared_dead": len({(d["by"], d["peer"]) for d in dead}), "dead_events": dead,
            "suspect_events": suspect, "group_departed_events": departed, "failed_rounds": failed,
            "rounds_with_departed": with_departed,
            "log_dead_lines": sum(len(p["log_dead_lines"]) for p in ev.values()),
            "log_stalled_lines": sum(len(p["log_stalled_lines"]) for p in ev.values()),
            "warnings": {n: p["log_warnings"] for n, p in ev.items() if p["log_warnings"]},
            "final_step_state": trained, "final_blocks_identical": fb["all_identical"],
            "reports_honest_unbacked_claims": sw.honesty()["unbacked_claims"]}


def target4(root: Path, runs: int, steps: int) -> dict:
    rows = []
    for k in range(runs):
        tmp = root / f"t4-{k}"
        tmp.mkdir()
        keygen(tmp)
        row = target4_run(tmp, k, steps)
        rows.append(row)
        print(json.dumps({"target4_run": {x: row[x] for x in ("run", "seconds", "members_declared_dead", "failed_rounds",
                                                              "exit_codes", "final_blocks_identical")}}), flush=True)
    runs_with_dead = sum(1 for r in rows if r["members_declared_dead"])
    return {"runs": rows, "steps_per_block": steps, "busy_processes": 3,
            "members_declared_dead_per_run": [r["members_declared_dead"] for r in rows],
            "runs_with_a_member_declared_dead": runs_with_dead,
            "seconds_per_run": [r["seconds"] for r in rows], "met": runs_with_dead == 0 and len(rows) == runs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/hardening/fault_targets.json")
    ap.add_argument("--parts", default="3i,3ii,4")
    ap.add_argument("--steps3", type=int, default=300, help="steps per block, target 3")
    ap.add_argument("--steps4", type=int, default=60, help="steps per block, target 4")
    ap.add_argument("--runs4", type=int, default=10)
    ap.add_argument("--stop-s", type=float, default=15.0)
    args = ap.parse_args()
    parts = args.parts.split(",")
    root = Path(tempfile.mkdtemp(prefix="bt-fault-targets-"))
    t0 = time.monotonic()
    RESULTS["args"] = vars(args)
    try:
        out("code", provenance())
        for part in ("3i", "3ii"):
            if part in parts:
                tmp = root / part
                tmp.mkdir()
                keygen(tmp)
                out(f"target3_{part}", target3(tmp, part, args.steps3, args.stop_s))
        if "4" in parts:
            out("target4", target4(root, args.runs4, args.steps4))
        summary = {}
        for k in ("target3_3i", "target3_3ii"):
            if k in RESULTS:
                summary[k] = RESULTS[k]["met"]
        if "target4" in RESULTS:
            summary["target4"] = RESULTS["target4"]["met"]
        out("met", summary)
    finally:
        for p in STARTED:
            stop(p)
        RESULTS["seconds"] = round(time.monotonic() - t0, 1)
        Path(args.json).write_text(json.dumps(RESULTS, indent=1) + "\n")
        if os.environ.get("KEEP_TMP"):
            print(f"kept {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
