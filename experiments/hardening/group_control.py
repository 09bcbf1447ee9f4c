"""Forged group control, measured on live `bt-peer` processes over loopback, before and after r7.

    .venv/bin/python experiments/hardening/group_control.py --json results/hardening/group_control.json

Each commit measured (--before, default c7f01b0, the last one before r7; --after, default HEAD)
is checked out as a detached git worktree of its own, and its peers import `blocktrain` from it:
a folder _pkg/blocktrain holds the worktree's blocktrain_pkg/*.py and links to its protocol, p2p,
blocks and bench, and PYTHONPATH names a sitecustomize.py that drops the editable install's
finders and puts _pkg first (every peer's log starts with the file it imported; the script checks
it). So what is measured is the committed code, whatever the working tree holds.

Every swarm trains block 0 under the parallel schedule (tiny model, `--steps` steps per block,
default 600, round timeout 30 s, 1 torch thread per peer) and is bounded to `--bound` seconds
(default 180), after which every peer still running is stopped by pid. Runs, one at a time:

  baseline    3 honest peers (H0, H1, H2), no attacker (--after only, unless --baseline-both)
  mismatched  H0, H1, H2 and the attacker M start together (--min-group 4); M is an honest peer
              whose every averaging part lists H0 in meta `mismatched`
  departed    the same with meta `departed`
  status      H0, H1, H2 start (--min-group 3); 3 s after they answer, the attacker S joins
              block 0 but never joins their group, and sends each of them a control `status`
              {size 3, sponsor 00...00} with their scope and job digest every 0.5 s
  state       the attacker A starts alone and serves join states whose `step` is 10^15 (its
              global step the true one); the honest J joins through it once A trains

Attackers are real `bt-peer` processes run through forger.py (the CLI, patched). For every honest
peer, from its report file and log: steps reached, state, rounds applied, failed rounds, its
"another group is larger" yields, whether it named the attacker (an event naming it, or the
attacker among its excluded peers) and how, CE at the end, wall time; for `state`, how often the
joiner took a state with step 10^15 and how often it refused one.

Wall times are from whatever machine runs this (the committed results: 2 cores shared with other
work). Only processes this script starts are stopped, by pid; the worktrees and the temporary
folder are removed at the end (KEEP_TMP=1 keeps the folder).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _live import stop  # SIGCONT, SIGTERM, then SIGKILL: the folder's one way to stop a peer

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
CLI = "import sys; from blocktrain.p2p.cli import main; import blocktrain; " \
      "print('blocktrain from', blocktrain.__file__, file=sys.stderr, flush=True); sys.argv[0] = 'bt-peer'; sys.exit(main())"
TINY = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=3", "--set", "model.n_blocks=3",
        "--set", "batch_size=4", "--set", "seq_len=32", "--set", "warmup=1", "--set", "swarm.eval_windows=2",
        "--set", "train.draft_frac=0", "--set", "swarm.round_timeout_s=30"]
ADOPTED = re.compile(r"step 1000000000000000|1000000000000000")
STARTED: list[subprocess.Popen] = []
NAMING = ("named", "rejected update")  # report events that name a peer (a departure or admission does not)


def git(*a) -> str:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def tree(sha: str, tmp: Path) -> Path:
    """A detached worktree of ``sha`` and the site folder whose sitecustomize imports it."""
    wt = Path(tempfile.gettempdir()) / f"bt-gc-{sha[:10]}"
    if not wt.exists():
        git("worktree", "add", "--detach", str(wt), sha)
    pkg = wt / "_pkg" / "blocktrain"
    pkg.mkdir(parents=True, exist_ok=True)
    for f in (wt / "blocktrain_pkg").glob("*.py"):
        shutil.copy(f, pkg / f.name)
    for d in ("protocol", "p2p", "blocks", "bench"):
        if not (pkg / d).exists():
            (pkg / d).symlink_to(wt / d)
    site = wt / "_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in (getattr(f, '__module__', '') or '')]\n"
        f"sys.path.insert(0, {str(wt / '_pkg')!r})\n")
    return wt


def peer_id_of(path: Path) -> str:
    from blocktrain.p2p.identity import load_or_create_identity, peer_id
    return peer_id(load_or_create_identity(path))


class Run:
    def __init__(self, name: str, wt: Path, sha: str, tmp: Path, steps: int):
        self.name, self.wt, self.sha, self.steps = name, wt, sha, steps
        self.dir = tmp / f"{name}-{sha[:7]}"
        self.dir.mkdir()
        subprocess.run([PY, "-c", CLI, "keygen", "--out", str(self.dir / "swarm.key")], check=True,
                       capture_output=True, env=self.env())
        self.procs: dict[str, subprocess.Popen] = {}
        self.t_start: dict[str, float] = {}
        self.t_end: dict[str, float] = {}
        self.ports: dict[str, int] = {}
        self.commands: dict[str, str] = {}

    def env(self, forge: str | None = None) -> dict:
        e = {**os.environ, "PYTHONPATH": str(self.wt / "_site"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        e.pop("BT_FORGE", None)
        if forge:
            e["BT_FORGE"] = forge
        return e

    def id(self, name: str) -> str:
        return peer_id_of(self.dir / f"{name}.id")

    def start(self, name: str, how: list[str], min_group: int, forge: str | None = None, exit_when_done=True):
        from blocktrain.bench.ports import free_port
        port = self.ports[name] = free_port()
        d = self.dir
        argv = [*how, "--block", "0", "--schedule", "parallel", "--steps", str(self.steps), "--min-group",
                str(min_group), *TINY, "--listen", f"127.0.0.1:{port}", "--swarm-key", str(d / "swarm.key"),
                "--identity", str(d / f"{name}.id"), "--work-dir", str(d / f"{name}-work"), "--report",
                str(d / f"{name}.report.json"), "--report-every", "1", "--threads", "1", "--device", "cpu", "-v",
                *(["--exit-when-done"] if exit_when_done else [])]
        cmd = [PY, str(HERE / "forger.py"), *argv] if forge else [PY, "-c", CLI, *argv]
        self.commands[name] = ((f"BT_FORGE={forge} " if forge else "") + "bt-peer " + " ".join(argv))
        log = open(d / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(forge), cwd=d,
                             start_new_session=True)
        STARTED.append(p)
        self.procs[name], self.t_start[name] = p, time.monotonic()
        return p

    def wait_listening(self, name: str, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode}: {self.log(name)[-2000:]}")
            r = subprocess.run([PY, "-c", CLI, "status", f"127.0.0.1:{self.ports[name]}", "--swarm-key",
                                str(self.dir / "swarm.key"), "--identity", str(self.dir / "caller.id"), "--json",
                                "--timeout", "2"], capture_output=True, text=True, env=self.env())
            if r.returncode == 0:
                return json.loads(r.stdout)
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not answer status within {timeout} s")

    def wait_done(self, honest: list[str], bound_s: float, t0: float):
        """Until every honest peer exited, or ``bound_s`` after ``t0``; then every peer is stopped."""
        while time.monotonic() - t0 < bound_s:
            for n in honest:
                if n not in self.t_end and self.procs[n].poll() is not None:
                    self.t_end[n] = time.monotonic()
            if all(n in self.t_end for n in honest):
                break
            time.sleep(0.5)
        for n, p in self.procs.items():
            if p.poll() is None:
                stop(p)
            self.t_end.setdefault(n, time.monotonic())
        time.sleep(1)

    def log(self, name: str) -> str:
        f = self.dir / f"{name}.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def measure(self, name: str, attacker: str | None) -> dict:
        """One honest peer's figures, from its report and log."""
        log = self.log(name)
        f = self.dir / f"{name}.report.json"
        rep = json.loads(f.read_text()) if f.exists() else {}
        t = rep.get("training") or {}
        aid = self.id(attacker) if attacker else None
        events = [e for e in (t.get("group_events") or []) + (t.get("averaging_events") or [])
                  if isinstance(e, dict) and aid and e.get("peer") == aid and e.get("event") in NAMING]
        excluded = (t.get("excluded_peers") or {}).get(aid) if aid else None
        imported = re.search(r"blocktrain from (\S+)", log)
        return {
            "peer": name, "peer_id": self.id(name), "imported": imported and imported.group(1),
            "exit_code": self.procs[name].returncode, "stopped_at_bound": self.procs[name].returncode in (-15, -9),
            "state": t.get("state"), "step": t.get("step"), "steps": t.get("steps"),
            "rounds_applied": t.get("rounds_applied"), "failed_rounds": len(t.get("failed_rounds") or []),
            "failed_round_reasons": sorted({str(fr.get("why", fr.get("reason", "")))[:90]
                                            for fr in (t.get("failed_rounds") or []) if isinstance(fr, dict)})[:6],
            "yields_another_group_is_larger": log.count("another group is larger"),
            "attacker_named": bool(events or excluded),
            "attacker_named_how": [{k: e.get(k) for k in ("event", "round", "reason", "why") if k in e}
                                   for e in events][:4] + ([{"excluded": excluded}] if excluded else []),
            "other_named_or_excluded": sorted(p[:12] for p in (t.get("excluded_peers") or {}) if p != aid),
            "ce_end": t.get("ce_end"), "cut_off": t.get("cut_off"),
            "joins": [j.get("how") for j in (t.get("joins") or [])][:40],
            "n_joins": len(t.get("joins") or []),
            "wall_s": round(self.t_end[name] - self.t_start[name], 1),
            "log_tracebacks": log.count("Traceback"),
        }


def run_one(kind: str, label: str, sha: str, wt: Path, tmp: Path, steps: int, bound: float) -> dict:
    r = Run(kind, wt, sha, tmp, steps)
    honest = ["H0", "H1", "H2"]
    attacker = None
    t0 = time.monotonic()
    if kind in ("baseline", "mismatched", "departed"):
        n = 3 if kind == "baseline" else 4
        r.start("H0", ["start"], n)
        r.wait_listening("H0")
        boot = f"127.0.0.1:{r.ports['H0']}"
        t0 = r.t_start["H0"]
        for h in honest[1:]:
            r.start(h, ["join", boot], n)
        if kind != "baseline":
            attacker = "M"
            r.start("M", ["join", boot], n, forge=f"{kind}:{r.id('H0')}")
    elif kind == "status":
        r.start("H0", ["start"], 3)
        r.wait_listening("H0")
        boot = f"127.0.0.1:{r.ports['H0']}"
        t0 = r.t_start["H0"]
        for h in honest[1:]:
            r.start(h, ["join", boot], 3)
        for h in honest[1:]:
            r.wait_listening(h)
        time.sleep(3)
        attacker = "S"
        r.start("S", ["join", boot], 1, forge="status", exit_when_done=False)
    elif kind == "state":
        attacker, honest = "A", ["J"]
        r.start("A", ["start"], 1, forge="state", exit_when_done=False)
        r.wait_listening("A")
        t0 = r.t_start["A"]
        deadline = time.monotonic() + 60
        while "step " not in r.log("A") and time.monotonic() < deadline:  # A trains: it has a group to join
            time.sleep(0.2)
        r.start("J", ["join", f"127.0.0.1:{r.ports['A']}"], 1)
    r.wait_done(honest, bound, t0)
    peers = [r.measure(h, attacker) for h in honest]
    res = {"attack": kind, "code": label, "commit": sha, "steps_per_block": steps, "bound_s": bound,
           "seconds": round(time.monotonic() - t0, 1), "attacker": attacker and {
               "name": attacker, "peer_id": r.id(attacker), "command": r.commands[attacker],
               "imported": (re.search(r"blocktrain from (\S+)", r.log(attacker)) or [None, None])[1]},
           "honest_commands": {h: r.commands[h] for h in honest}, "honest": peers}
    alog = r.log(attacker) if attacker else ""
    if kind == "status":
        sent = re.findall(r"forger: (\d+) status frames sent", alog)
        res["attacker"]["status_frames_sent_at_least"] = int(sent[-1]) if sent else 0
    if kind == "state":
        jlog = r.log("J")
        res["attacker"]["join_states_forged"] = alog.count("written with step 10^15")
        # A is the only holder of the group's state: every state the joiner fetched is one it forged
        res["joiner_took_forged_state"] = len(re.findall(r"in a group of \d+ from round \d+ \(the group's state", jlog))
        res["joiner_refused_a_state"] = jlog.count("could not take the group's state")
        res["joiner_refusals"] = sorted({m[:160] for m in re.findall(r"could not take the group's state: (.*)", jlog)})[:3]
        res["joiner_log_lines_with_1e15"] = len([ln for ln in jlog.splitlines() if "1000000000000000" in ln])
    for p in peers:
        want = str(wt)
        p["imported_from_measured_tree"] = bool(p["imported"]) and p["imported"].startswith(want)
    if attacker:
        res["attacker"]["imported_from_measured_tree"] = str(res["attacker"]["imported"] or "").startswith(str(wt))
    print(json.dumps({k: v for k, v in res.items() if k not in ("honest_commands",)}), flush=True)
    if os.environ.get("KEEP_TMP") is None:
        shutil.rmtree(r.dir, ignore_errors=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/hardening/group_control.json")
    ap.add_argument("--before", default="c7f01b0")
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--bound", type=float, default=180)
    ap.add_argument("--only", default="baseline,mismatched,departed,status,state")
    ap.add_argument("--codes", default="before,after")
    args = ap.parse_args()
    shas = {"before": git("rev-parse", args.before), "after": git("rev-parse", args.after)}
    tmp = Path(tempfile.mkdtemp(prefix="bt-group-control-"))
    out = {"command": "python experiments/hardening/group_control.py " + " ".join(sys.argv[1:]),
           "measured_commits": shas, "script_commit": git("rev-parse", "HEAD"),
           "machine": f"{os.cpu_count()} cores, loopback; wall times from a machine whose cores are shared "
                      "with other work (1 torch thread per peer)",
           "settings": {"schedule": "parallel", "block": 0, "steps_per_block": args.steps, "round_timeout_s": 30,
                        "bound_s": args.bound, "model": "tiny (d_model 32, 3 layers, batch 4, seq 32)"},
           "runs": []}
    wts = {}
    try:
        for label in args.codes.split(","):
            wts[label] = tree(shas[label], tmp)
        for kind in args.only.split(","):
            for label in args.codes.split(","):
                if kind == "baseline" and label == "before" and "after" in args.codes:
                    continue
                out["runs"].append(run_one(kind, label, shas[label], wts[label], tmp, args.steps, args.bound))
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    finally:
        for p in STARTED:
            stop(p)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)
            for wt in wts.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
