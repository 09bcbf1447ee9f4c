"""``bt-bench faults``: what the silent faults of a real network do to a swarm of ``bt-peer``
processes, one per network namespace on one switch (bench/netns.py).

Rules:
- Every fault is made so that nothing closes a connection, as on a real network: a partition is a
  blackhole route on each side for the other side's addresses (packets vanish, no RST, no ICMP);
  a one-way partition A -> B is the route on B's side only (B's packets to A vanish: A reaches
  B, B does not reach A); a host's link goes down (``ip link set eth0 down``: its process lives on,
  unreachable, and sends no FIN); a flapping link goes down and up in turn; a paused process is
  stopped (SIGSTOP) past ``--dead-after`` and continued. This kernel has no netem and no tc
  actions, so loss is the project's shaper (``bt-peer --link``, LOSS_LINK: every frame sent may be
  held for a retransmission timeout, as TCP does after a loss), on every link for the whole run;
  delay is the lab's relay (``--rtt-ms``).
- One run per fault, each from fresh processes and a fresh lab with the same identities (so the
  same data order), beside a run without faults (``none``): the swarm trains one block (parallel schedule, gradient rounds of one step);
  the fault starts once the 4 peers are one group and applied ``SETTLE_ROUNDS`` rounds, lasts
  ``--hold`` seconds (a host's link down: for good), and the run ends when every process exits
  (bounded by ``--bound``; what is still running then is stopped, by pid, and said so).
- What is measured comes from the peers' own reports (``--report``, every 0.5 s) and final
  states: when the group first shrank after the fault began (detect), when every peer still
  reachable was one group again after it ended (heal), failed rounds, rounds that took longer
  than ``--dead-after``, bytes of state fetched on joins, each peer's final parameters' digest,
  and the top head's CE beside the run without faults. ``summarize`` is pure (tested without
  namespaces).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import netns

FAULTS = ("none", "partition", "one-way", "link-down", "flap", "pause", "loss")
# The "loss" run's links, the project's own shaper (bt-peer --link): 25 ms one way and 2% of frames
# lost once (TCP's retransmission after its RTO, head-of-line), for the whole run.
LOSS_LINK = "delay=25,loss=0.02"
SERVICE_PORT = 7000
SETTLE_ROUNDS = 5  # rounds every peer applies in one group before the fault
FLAP_S = 2.0  # a flapping link: down this long, then up this long, for the fault's hold
TINY = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=2", "--set", "model.n_blocks=2",
        "--set", "batch_size=2", "--set", "seq_len=16", "--set", "warmup=2", "--set", "swarm.eval_windows=4",
        "--set", "swarm.schedule=parallel"]


@dataclass
class RunSpec:
    fault: str
    peers: int = 4
    steps: int = 1500
    hold_s: float = 20.0
    dead_after_s: float = 2.0
    heartbeat_s: float = 0.2
    rtt_ms: float = 0.0
    bound_s: float = 300.0
    round_timeout_s: float = 30.0


@dataclass
class Timeline:
    """What the reports said, polled: (seconds since start, [group size, rounds applied] per peer)."""
    t0: float = field(default_factory=time.monotonic)
    points: list = field(default_factory=list)
    marks: dict = field(default_factory=dict)  # "fault", "heal" -> seconds since start

    def add(self, reports: list[dict]) -> None:
        self.points.append((round(time.monotonic() - self.t0, 2),
                            [[len(r.get("group", [])), r.get("rounds_applied", 0)] for r in reports]))

    def mark(self, what: str) -> None:
        self.marks[what] = round(time.monotonic() - self.t0, 2)


def _route(lab: netns.NetnsLab, host: int, to: int, add: bool) -> None:
    """A blackhole route on ``host`` for ``to``'s address: ``host``'s packets to it vanish."""
    netns._run("ip", "netns", "exec", lab.ns(host), "ip", "route", "add" if add else "del", "blackhole",
               f"{lab.ip(to)}/32", check=add)


def _link(lab: netns.NetnsLab, host: int, up: bool) -> None:
    netns._run("ip", "netns", "exec", lab.ns(host), "ip", "link", "set", "eth0", "up" if up else "down")


class FaultSwarm:
    """``spec.peers`` bt-peer processes in ``lab``, host 0 the bootstrap; their reports read back."""

    def __init__(self, lab: netns.NetnsLab, tmp: Path, spec: RunSpec):
        from blocktrain.p2p.identity import load_or_create_identity, new_swarm_key, peer_id
        self.lab, self.tmp, self.spec = lab, tmp, spec
        new_swarm_key(tmp / "swarm.key")
        (tmp.parent / "keys").mkdir(parents=True, exist_ok=True)  # one set of identities for every run:
        self.keys = [tmp.parent / "keys" / f"key{i}" for i in range(spec.peers)]  # the same data order
        self.ids = [peer_id(load_or_create_identity(k)) for k in self.keys]
        self.procs: list[subprocess.Popen] = []

    def command(self, i: int) -> list[str]:
        s = self.spec
        head = [sys.executable, "-m", "blocktrain.p2p.cli"] + (["join", self.lab.relay_addr(0)] if i else ["start"])
        return head + ["--block", "0", "--listen", f"0.0.0.0:{SERVICE_PORT}", "--advertise", self.lab.relay_addr(i),
                       "--swarm-key", str(self.tmp / "swarm.key"), "--identity", str(self.keys[i]),
                       "--report", str(self.tmp / f"r{i}.json"), "--report-every", "0.5",
                       "--heartbeat", str(s.heartbeat_s), "--dead-after", str(s.dead_after_s), "--quiet",
                       "--work-dir", str(self.tmp / f"w{i}"), "--steps", str(s.steps), "--exit-when-done",
                       "--min-group", str(s.peers), "--set", f"swarm.round_timeout_s={s.round_timeout_s}",
                       "--set", "swarm.join_timeout_s=3", "--set", "swarm.cut_off_ok=true", *TINY] + (
            ["--link", LOSS_LINK] if s.fault == "loss" else [])

    def start(self) -> None:
        for i in range(self.spec.peers):
            self.procs.append(self.lab.spawn(i, self.command(i), stderr=open(self.tmp / f"log{i}", "a")))
            if i == 0:
                time.sleep(2)  # the bootstrap listens first

    def reports(self) -> list[dict]:
        out = []
        for i in range(self.spec.peers):
            try:
                out.append(json.loads((self.tmp / f"r{i}.json").read_text()).get("training", {}))
            except (OSError, ValueError):
                out.append({})
        return out

    def one_group(self, among: list[int]) -> bool:
        want = sorted(self.ids[i] for i in among)
        return all(sorted(r.get("group", [])) == want for j, r in enumerate(self.reports()) if j in among)

    def wait(self, cond, what: str, deadline: float, timeline: Timeline) -> bool:
        """Polls until ``cond()`` (True), or ``deadline`` or every process ended (False); the reports
        go into ``timeline``."""
        while time.monotonic() < deadline:
            timeline.add(self.reports())
            if cond():
                return True
            if all(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.1)
        return False

    def digests(self) -> list[str | None]:
        """Each peer's final parameters (its block's last state), as sha256 of the tensors' bytes."""
        from blocktrain.blocks import checkpoint as ckpt
        out: list[str | None] = []
        for i in range(self.spec.peers):
            f = next(iter(sorted((self.tmp / f"w{i}").rglob("lower-checkpoint/block0.safetensors"))), None)
            if f is None:
                out.append(None)
                continue
            t = ckpt.load(f).tensors
            h = hashlib.sha256()
            for n in sorted(t):
                h.update(n.encode() + t[n].contiguous().numpy().tobytes())
            out.append(h.hexdigest()[:16])
        return out


def make_fault(swarm: FaultSwarm, fault: str, timeline: Timeline, deadline: float) -> list[int]:
    """Runs ``fault`` for the spec's hold (a flap: in turns; a pause: dead-after + 3 s), ends it (a
    host's link down stays down) and returns the hosts expected to end in one group."""
    lab, n, s = swarm.lab, swarm.spec.peers, swarm.spec
    half, last = list(range(n // 2, n)), n - 1
    timeline.mark("fault")
    if fault in ("partition", "one-way"):
        for b in half:
            for a in range(n // 2):
                _route(lab, b, a, True)  # b's packets to a vanish
                if fault == "partition":
                    _route(lab, a, b, True)
        swarm.wait(lambda: False, "the hold", min(deadline, time.monotonic() + s.hold_s), timeline)
        for b in half:
            for a in range(n // 2):
                _route(lab, b, a, False)
                if fault == "partition":
                    _route(lab, a, b, False)
    elif fault in ("link-down", "flap"):
        end = time.monotonic() + s.hold_s
        while True:
            _link(lab, last, False)
            if fault == "link-down":
                return list(range(last))
            swarm.wait(lambda: False, "down", min(deadline, time.monotonic() + FLAP_S), timeline)
            _link(lab, last, True)
            if time.monotonic() >= end:
                break
            swarm.wait(lambda: False, "up", min(deadline, time.monotonic() + FLAP_S), timeline)
    elif fault == "pause":
        os.kill(swarm.procs[last].pid, signal.SIGSTOP)
        swarm.wait(lambda: False, "the pause", min(deadline, time.monotonic() + s.dead_after_s + 3), timeline)
        os.kill(swarm.procs[last].pid, signal.SIGCONT)
    timeline.mark("heal")
    return list(range(n))


def run_one(spec: RunSpec, tmp: Path) -> dict:
    """One swarm under one fault, in a lab of its own; the raw figures (``summarize`` reads them)."""
    tmp.mkdir(parents=True, exist_ok=True)
    lab = netns.NetnsLab(spec.peers, rate_mbit=0, delay_ms=spec.rtt_ms / 2).up(SERVICE_PORT)
    timeline, stopped = Timeline(), []
    try:
        swarm = FaultSwarm(lab, tmp, spec)
        swarm.start()
        deadline = time.monotonic() + spec.bound_s
        settled = swarm.wait(lambda: swarm.one_group(list(range(spec.peers))) and all(
            r.get("rounds_applied", 0) >= SETTLE_ROUNDS for r in swarm.reports()), "one group", deadline, timeline)
        final = list(range(spec.peers))
        if settled and spec.fault not in ("none", "loss"):  # loss: on every link from the start
            final = make_fault(swarm, spec.fault, timeline, deadline)
            if swarm.wait(lambda: swarm.one_group(final), "one group again", deadline, timeline):
                timeline.mark("one group")
        swarm.wait(lambda: all(p.poll() is not None for i, p in enumerate(swarm.procs) if i in final),
                   "the end", deadline, timeline)
        stopped = [i for i, p in enumerate(swarm.procs) if p.poll() is None]
        reports, digests = swarm.reports(), swarm.digests()
        codes = [p.poll() for p in swarm.procs]
    finally:
        lab.down()  # our processes (by pid), namespaces and links
    return {"fault": spec.fault, "settled": settled, "final_group": final, "stopped_at_end": stopped,
            "exit_codes": codes, "digests": digests, "marks": timeline.marks, "timeline": timeline.points,
            "reports": [_kept(r) for r in reports], "spec": spec.__dict__, "delay_via": lab.delay_via}


def _kept(r: dict) -> dict:
    """What ``summarize`` needs of a report (the rest stays in the peers' own files)."""
    return {k: r.get(k) for k in ("state", "step", "steps", "group", "rounds_applied", "failed_rounds", "joins",
                                  "cut_off", "ce_end", "head_ce")} | {
        "round_seconds": [x.get("seconds", 0.0) for x in r.get("rounds", [])]}


def _first_after(points: list, since: float | None, cond) -> float | None:
    if since is None:
        return None
    return next((round(t - since, 2) for t, peers in points if t >= since and cond(peers)), None)


def summarize(run: dict, reference: dict | None) -> dict:
    """The figures of one fault run (``run_one``), beside the run without faults (``reference``)."""
    n, final, marks, points = len(run["reports"]), run["final_group"], run["marks"], run["timeline"]
    reps = run["reports"]
    ce = [r.get("ce_end") for r in reps]
    ref_ce = [r.get("ce_end") for r in reference["reports"]] if reference else None
    digests = [run["digests"][i] for i in final]
    dead_after = run["spec"]["dead_after_s"]
    return {
        "fault": run["fault"], "settled": run["settled"],
        "detect_s": _first_after(points, marks.get("fault"), lambda p: any(p[i][0] < n for i in final)),
        "one_group_after_s": (round(marks["one group"] - marks.get("heal", marks["fault"]), 2)
                              if "one group" in marks and "fault" in marks else None),
        "failed_rounds": [len(r.get("failed_rounds") or []) for r in reps],
        "rounds_over_dead_after": [sum(s > dead_after for s in r["round_seconds"]) for r in reps],
        "longest_round_s": [round(max(r["round_seconds"], default=0.0), 2) for r in reps],
        "state_fetched_bytes": [sum(j.get("bytes", 0) for j in r.get("joins") or []) for r in reps],
        "final_group_identical": len(set(digests)) == 1 and None not in digests,
        "done": [r.get("state") == "done" and r.get("step") == r.get("steps") for r in reps],
        "cut_off": [bool(r.get("cut_off")) for r in reps], "stopped_at_end": run["stopped_at_end"],
        "ce_end": ce, "ce_vs_no_faults": ([round(c - rc, 4) if c is not None and rc is not None else None
                                            for c, rc in zip(ce, ref_ce)] if ref_ce else None),
    }


def run(faults: list[str], spec: RunSpec, out: Path, log=print) -> dict:
    """Every fault of ``faults`` (``none`` first, as the reference), one run each."""
    why = netns.available()
    if why:
        raise RuntimeError(f"network namespaces unavailable: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: each lab still comes down (finally)
    runs, rows = {}, []
    for fault in ["none"] + [f for f in faults if f != "none"]:
        log(f"fault {fault}: {spec.peers} peers, {spec.steps} steps, hold {spec.hold_s} s")
        runs[fault] = run_one(RunSpec(**{**spec.__dict__, "fault": fault}), out / fault)
        rows.append(summarize(runs[fault], runs.get("none")))
        log(json.dumps(rows[-1]))
    return {"results": rows, "runs": runs}


def report(rows: list[dict]) -> list[str]:
    """One line per fault: the figures people read."""
    out = [f"{'fault':<10} {'detect s':>8} {'one group s':>11} {'failed':>12} {'identical':>9} {'CE vs none':>24}"]
    for r in rows:
        ce = ",".join("-" if c is None else f"{c:+.3f}" for c in (r["ce_vs_no_faults"] or []))
        out.append(f"{r['fault']:<10} {_s(r['detect_s']):>8} {_s(r['one_group_after_s']):>11} "
                   f"{','.join(map(str, r['failed_rounds'])):>12} {str(r['final_group_identical']):>9} {ce:>24}")
    return out


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"
