"""``bt-bench swarm``: real ``bt-peer`` processes training a model together on loopback.

Rules:
- A run is W ``bt-peer`` processes, worker i holding block i mod K, each with its own identity,
  work directory and report; the first starts the swarm, the others join through it, all with
  ``--min-group W`` so they start together. Nothing is shared but the swarm key. Every run starts
  from fresh work directories unless ``resume``. Worker i's identity is derived from (seed, i):
  a worker's data order follows its peer id (p2p/swarm/trainer.py), so a seed's run repeats, and worker i
  sees the same data in every run of that seed (the runs of a comparison are paired).
- Comparisons, at every seed: ``equal-steps``: every worker takes ``steps`` steps per block
  (adding workers adds data); ``equal-total``: the workers of a run share ``steps x K`` local
  steps per block in all (W workers take steps x K / W each). The runs with K workers are the
  "one worker per block" baseline. An equal-total run has W/K times the batch (the workers average
  their gradients every step) for K/W the optimizer steps: under ``equal_total_lr="sqrt"`` (the
  default) with the learning rate x sqrt(W/K) and the configured warmup, the square-root rule
  derived for Adam (Malladi et al. 2022; their betas and eps are left as they are), at the
  configured learning rate and warmup (``"same"``), or under ``"linear"`` with the learning rate
  x W/K and the warmup x K/W steps (the same samples), the linear scaling rule (Goyal et al.
  2017). Measured at 1000 steps per block, 6 workers against 3 (results/README.md): sqrt was
  better than same at every seed, linear as good as sqrt at one seed and far worse at another.
- The model is assembled from the swarm (``bt-peer assemble``'s code) once every worker reports
  ``done`` and evaluated on test windows: the CE of every head along the chain. Busy fraction:
  each worker's time in training steps over its wall time. Bytes: the peers' own counters
  (sent wire bytes, by kind), read when every one is done. Time to a target CE: the first
  point of the workers' valid-CE curves (the top head of the chain in work) at or below it, in
  training seconds and in steps. On one host the W processes share its cores, so a run with more
  workers gets less compute per worker: its seconds are not what peers on their own machines
  would see; its steps are.
- ``reference``: the in-process sequential run of the same model and steps per block, with the
  data per step of the K-worker run (a batch K times a worker's: the K workers of a block
  average their gradients every step), the result the swarm should reach
  (blocktrain.bench.train_variant).
- Only processes this module started are stopped, by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .average import free_ports


def _initial_ce(model: dict, seed: int, seq_len: int, windows: int, data) -> list[float]:
    import torch

    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.blocks.train import eval_chain

    mc = ModelConfig.from_dict(model)
    blocks = []
    for k in range(mc.n_blocks):  # as BlockTrainer seeds them
        torch.manual_seed(seed * 100 + k)
        blocks.append(Block(mc, k))
    return eval_chain(blocks, data, seq_len, windows or None)


def run(workers: int, steps: int, overrides: dict, out: Path, test_windows: int = 300, link: str | None = None,
        swarm: dict | None = None, seed: int = 0, eval_every: int = 0, resume: bool = False,
        timeout_s: float = 4 * 3600.0, progress=None, log=lambda s: None) -> dict:
    """One swarm of ``workers`` processes, ``steps`` local steps per block each."""
    from blocktrain.blocks.config import apply_overrides
    from blocktrain.p2p.swarm.settings import PeerJob

    swarm = dict(swarm or {})
    sets = {**overrides, "train.steps": steps, "train.seed": seed, "swarm.eval_every": eval_every,
            **{f"swarm.{k}": v for k, v in swarm.items()}}
    job = apply_overrides(PeerJob(), sets)
    K = job.model.n_blocks
    key = _prepare_dir(out, resume, workers, seed)
    ports = free_ports(workers)
    set_args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    procs: list = []
    logs: list = []
    t0 = time.monotonic()
    total = steps * (K if job.swarm.schedule == "relay" else 1)
    try:
        for i in range(workers):
            f = open(out / f"peer{i}.log", "w")
            logs.append(f)
            procs.append(subprocess.Popen(_peer_command(i, ports, K, key, out, workers, set_args, link),
                                          stdout=f, stderr=subprocess.STDOUT))
        final_reps = _wait_done(procs, out, workers * total, t0, timeout_s, progress)
        train_s = time.monotonic() - t0
        log("all workers done; assembling the model from the swarm")
        assembled = _assemble(out, ports[0], key)
    finally:
        stop_peers(procs, logs)
    return _run_result(job, final_reps, assembled, workers, steps, seed, link, test_windows, train_s, out)


def _prepare_dir(out: Path, resume: bool, workers: int, seed: int) -> Path:
    """The run's work directory (fresh unless ``resume``) with the swarm key and every worker's
    identity; the key's path."""
    from blocktrain.p2p.identity import new_swarm_key, write_identity

    if not resume and out.exists():
        shutil.rmtree(out)  # a fresh run: nothing resumed from an earlier one
    out.mkdir(parents=True, exist_ok=True)
    key = out / "swarm.key"
    if not key.exists():
        new_swarm_key(key)
    for i in range(workers):
        if not (out / f"id{i}").exists():
            write_identity(out / f"id{i}", worker_identity(seed, i))
    return key


def _peer_command(i: int, ports: list[int], K: int, key: Path, out: Path, workers: int, set_args: list[str],
                  link: str | None) -> list[str]:
    """Worker ``i``'s ``bt-peer`` command: the first starts the swarm, the others join it."""
    c = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if i else "start"]
    if i:
        c.append(f"127.0.0.1:{ports[0]}")
    c += ["--block", str(i % K), "--listen", f"127.0.0.1:{ports[i]}", "--swarm-key", str(key),
          "--identity", str(out / f"id{i}"), "--report", str(out / f"report{i}.json"), "--report-every", "2",
          "--work-dir", str(out / f"work{i}"), "--threads", "1", "--quiet", "--heartbeat", "1",
          "--dead-after", "60", "--min-group", str(workers), "--set", "swarm.round_timeout_s=600",
          "--set", "swarm.join_timeout_s=30", *set_args]
    if link:
        c += ["--link", link]
    return c


def _reports(out: Path, workers: int) -> list[dict]:
    """Every worker's last report (empty where none is readable yet)."""
    got = []
    for i in range(workers):
        try:
            got.append(json.loads((out / f"report{i}.json").read_text()))
        except (OSError, ValueError):
            got.append({})
    return got


def _wait_done(procs: list, out: Path, total: int, t0: float, timeout_s: float, progress) -> list[dict]:
    """The workers' reports once every one is ``done`` (the training's bytes, before the assembly
    moves its own); ``progress(steps, total)`` each second. Raises RuntimeError when a worker
    exits first, TimeoutError past ``timeout_s`` from ``t0``."""
    while True:
        reps = _reports(out, len(procs))
        if progress:
            progress(sum(r.get("training", {}).get("step", 0) for r in reps), total)
        if all(r.get("training", {}).get("state") == "done" for r in reps):
            return reps
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"worker(s) {dead} exited (code {procs[dead[0]].returncode}); see {out}/peer{dead[0]}.log")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"workers not done after {timeout_s:.0f} s; see {out}/peer*.log")
        time.sleep(1.0)


def _assemble(out: Path, port: int, key: Path) -> dict:
    """The model assembled from the swarm (``bt-peer assemble``'s code) into ``out``/assembled."""
    from blocktrain.p2p.assemble import assemble_from_swarm
    from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key

    return asyncio.run(assemble_from_swarm("127.0.0.1", port, load_or_create_identity(out / "id-assembler"),
                                           load_swarm_key(str(key)), out / "assembled"))


def _run_result(job, final_reps: list[dict], assembled: dict, workers: int, steps: int, seed: int, link: str | None,
                test_windows: int, train_s: float, out: Path) -> dict:
    """One run's figures: the assembled model's CE per head, the workers' busy fractions, bytes by
    kind, memory, rounds and curves."""
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.evaluate import evaluate

    K = job.model.n_blocks
    ev = evaluate(out / "assembled", None, test_windows)
    test = as_tensor(read_split("test"))
    init = _initial_ce(job.model.to_dict(), seed, job.train.seq_len, test_windows, test)
    trs = [r["training"] for r in final_reps]
    kinds: dict = {}
    for r in final_reps:
        for k, c in r.get("by_kind", {}).get("sent", {}).items():
            kinds[k] = kinds.get(k, 0) + c["wire_bytes"]
    moved = sum(kinds.values())
    busy = [t["busy"]["fraction"] for t in trs]
    walls = [t["busy"]["wall_s"] for t in trs]
    return {
        "workers": workers, "blocks": K, "steps_per_block_per_worker": steps, "seed": seed,
        "schedule": job.swarm.schedule, "sync": job.swarm.sync, "steps_per_round": job.swarm.steps_per_round,
        "codec": job.swarm.codec, "link": link or "loopback, unshaped",
        "link_emulation": "in-process link shaper (p2p/link.py)" if link else None,
        "config": {"model": job.model.to_dict(), "train": job.train.to_dict(), "swarm": job.swarm.__dict__},
        "initial_test_ce": init[-1], "head_test_ce": ev["head_ce"], "final_test_ce": ev["test_ce"],
        "verdicts": ev["verdicts"], "test_windows": test_windows, "train_seconds": train_s,
        "busy_fraction": {"per_worker": busy, "min": min(busy)},
        "comm_share": {"per_worker": [round(t["averaging_seconds"] / w, 4) if w else None
                                      for t, w in zip(trs, walls)]},
        "peak_rss_mib": [t["memory"]["peak_rss_mib"] for t in trs],
        "grad_optimizer_bytes": [t["memory"]["grad_optimizer_bytes"] for t in trs],
        "bytes_sent_by_kind": kinds, "bytes_moved": moved, "bytes_per_worker": moved / workers,
        "bytes_sent_per_worker": moved / workers, "bytes_per_step": moved / workers / (K * steps),
        # start CE to the top head's final CE, over all workers' bytes (the paper's 0.248 per GB)
        "ce_per_gb": (init[-1] - ev["test_ce"]) / (moved / 1e9) if moved else None,
        "comm_fraction": {"per_worker": [1 - b for b in busy], "min": 1 - max(busy), "max": 1 - min(busy)},
        "rounds_applied": [t["rounds_applied"] for t in trs], "rounds_failed": [len(t["failed_rounds"]) for t in trs],
        "sync_choices": [t.get("sync_choices", []) for t in trs],  # sync=auto: each block's pick and its figures
        "curves": [t["curve"] for t in trs],
        "assembled_from": {str(k): v for k, v in assembled["blocks"].items()}, "out": str(out),
    }


def stop_peers(procs, logs=()) -> None:
    """SIGTERM to every peer process still running, 30 s each to exit (then SIGKILL); logs closed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for f in logs:
        f.close()


def worker_identity(seed: int, i: int) -> bytes:
    """Worker ``i``'s private key in the runs of ``seed`` (see Rules): derived from public values,
    so anyone can be these peers; for benchmarks on loopback only."""
    return hashlib.sha256(f"bt-bench swarm: seed {seed}, worker {i}".encode()).digest()


def reach(curves: list, target: float) -> tuple[float | None, int | None]:
    """(seconds, step): the first point, over the workers' valid-CE curves, where the top head of
    the chain in work (relay: blocks 0..b, b the block in work; a model that serves) reached
    ``target``; its training seconds (evaluations excluded) and its global step. (None, None)
    when no worker got there."""
    best = (None, None)
    for curve in curves:
        for gstep, seconds, heads in curve:
            if heads and heads[-1] <= target:
                if best[0] is None or seconds < best[0]:
                    best = (seconds, gstep)
                break
    return best


def reference(steps: int, overrides: dict, out: Path, seed: int, test_windows: int, workers: int = 1,
              threads: int = 1) -> dict:
    """The in-process sequential run of the same model and steps per block (one process), with
    the data per step of ``workers`` workers averaging their gradients: a batch ``workers`` times
    a worker's."""
    from blocktrain.blocks.config import apply_overrides
    from blocktrain.p2p.swarm.settings import PeerJob

    job = apply_overrides(PeerJob(), {**overrides, "train.steps": steps, "train.seed": seed})
    job = apply_overrides(job, {"train.batch_size": job.train.batch_size * workers})
    out.mkdir(parents=True, exist_ok=True)
    name = f"sequential-b{job.train.batch_size}-seed{seed}"
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "blocktrain.bench.train_variant", "--name", name,
           "--schedule", "sequential", "--model", json.dumps(job.model.to_dict()),
           "--train", json.dumps(job.train.to_dict()), "--out", str(path), "--threads", str(threads),
           "--test-windows", str(test_windows)]
    with open(out / f"{name}.log", "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    r = json.loads(path.read_text())
    return {"seed": seed, "batch_size": job.train.batch_size, "head_test_ce": r["test_ce_heads"],
            "final_test_ce": r["test_ce"], "train_seconds": r["train_seconds"]}


def mean_sd(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "values": xs}


def summarise(runs: list[dict], K: int) -> dict:
    """Per (comparison, workers): mean and spread over seeds of the head CEs, busy, bytes."""
    out = {}
    for comp in sorted({r["comparison"] for r in runs}):
        for w in sorted({r["workers"] for r in runs if r["comparison"] == comp}):
            sel = [r for r in runs if r["comparison"] == comp and r["workers"] == w]
            heads = [mean_sd([r["head_test_ce"][k] for r in sel]) for k in range(K)]
            out[f"{comp}/{w}"] = {
                "comparison": comp, "workers": w, "seeds": [r["seed"] for r in sel],
                "head_test_ce": [h["mean"] for h in heads], "head_test_ce_sd": [h["sd"] for h in heads],
                "final_test_ce": mean_sd([r["final_test_ce"] for r in sel]),
                "busy_fraction": {"per_worker": [b for r in sel for b in r["busy_fraction"]["per_worker"]],
                                  "min": min(r["busy_fraction"]["min"] for r in sel)},
                "train_seconds": mean_sd([r["train_seconds"] for r in sel]),
                "bytes_per_worker": mean_sd([r["bytes_per_worker"] for r in sel]),
                "time_to_target_s": [r.get("time_to_target_s") for r in sel],
                "steps_to_target": [r.get("steps_to_target") for r in sel],
            }
    return out


# --compare sync: every-step averaging beside the chosen mode, on the same settings, data and seeds.
SYNC_BASE, SYNC_MODE = "sync-every-step", "sync-mode"
COMPARISONS = ("equal-steps", "equal-total", "sync")


def compare_sync(summary: dict, mode: dict) -> dict:
    """Per worker count with both runs: their summaries, ``bytes_ratio`` (every-step bytes per
    worker / the mode's) and ``ce_gap`` (the mode's top-head test CE - every-step's; > 0: worse)."""
    out = {}
    for key, base in summary.items():
        if base["comparison"] != SYNC_BASE or f"{SYNC_MODE}/{base['workers']}" not in summary:
            continue
        m = summary[f"{SYNC_MODE}/{base['workers']}"]
        b_bytes, m_bytes = base["bytes_per_worker"]["mean"], m["bytes_per_worker"]["mean"]
        out[str(base["workers"])] = {
            "mode": mode, "every_step": base, "low_comm": m,
            "bytes_ratio": b_bytes / m_bytes if m_bytes else None,
            "ce_gap": m["head_test_ce"][-1] - base["head_test_ce"][-1]}
    return out


def plot_ce_vs_gb(result: dict, path: Path) -> None:
    """A PNG of every run's top-head test CE against the bytes each of its workers sent (log
    scale), one point per run, labelled with its comparison, averaging mode and seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["runs"]:
        gb, ce = r.get("bytes_sent_per_worker", r["bytes_per_worker"]) / 1e9, r["head_test_ce"][-1]
        sync = r.get("sync", "grads")
        mode = sync + (f" every {r.get('steps_per_round')}" if sync == "params" else "") + f", {r.get('codec', 'raw')}"
        ax.scatter(gb, ce)
        ax.annotate(f"{r.get('comparison', '')} ({mode}), {r['workers']} workers, seed {r['seed']}", (gb, ce),
                    fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("GB sent per worker (log)")
    ax.set_ylabel("top head's test CE (nats/byte)")
    ax.set_title(f"bt-bench swarm, {result['steps']} steps per block")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class BenchError(Exception):
    """A run of the bench failed (its name first); the runs before it are in the last ``save``."""


LR_RULES = ("sqrt", "same", "linear")  # the learning rate of an equal-total run (see Rules)


@dataclass
class Bench:
    """One ``bt-bench swarm``: a run per (seed, comparison, worker count), then the in-process
    references; the figures of every finished run are saved as each ends (``complete`` false
    until the last), so a failure in hours of runs loses only the one in progress."""

    workers: list[int]
    steps: int
    seeds: list[int]
    compare: list[str]
    overrides: dict = field(default_factory=dict)
    out: Path = Path("runs/bench-swarm")
    swarm: dict = field(default_factory=dict)
    test_windows: int = 300
    link: str | None = None
    eval_every: int = 0
    resume: bool = False
    target_ce: float | None = None
    reference: bool = True
    equal_total_lr: str = "sqrt"  # or "same" or "linear" (see Rules)

    def __post_init__(self):
        from blocktrain.blocks.config import apply_overrides
        from blocktrain.p2p.swarm.settings import PeerJob

        if set(self.compare) - set(COMPARISONS):
            raise ValueError(f"unknown comparison(s) {sorted(set(self.compare) - set(COMPARISONS))}; "
                             f"expected {', '.join(COMPARISONS)}")
        if "sync" in self.compare and not self.swarm:
            raise ValueError("--compare sync runs every-step averaging beside the mode that --sync/--every/--codec/"
                             "--density/--outer-lr choose: choose one")
        if not (self.workers and self.seeds and self.compare):
            raise ValueError("at least one worker count, seed and comparison")
        if min(self.workers) < 1 or min(self.seeds) < 0:
            raise ValueError(f"worker counts are >= 1 and seeds >= 0 (got {self.workers} and {self.seeds})")
        if self.target_ce is not None and not (self.eval_every > 0 and self.target_ce > 0):
            raise ValueError(f"a target CE (got {self.target_ce}) is > 0 and needs a curve: eval_every > 0 "
                             f"(got {self.eval_every})")
        if self.equal_total_lr not in LR_RULES:
            raise ValueError(f"equal_total_lr is one of {', '.join(LR_RULES)}, not {self.equal_total_lr!r}")
        job = apply_overrides(PeerJob(), {**self.overrides, **{f"swarm.{k}": v for k, v in self.swarm.items()}})
        self.K, self._train = job.model.n_blocks, job.train  # (--sync and --set swarm.gossip checked together)

    def overrides_for(self, comp: str, w: int) -> dict:
        """One run's config: ours, and for an equal-total run under the linear rule the learning
        rate x W/K and the warmup x K/W, under the square-root rule the learning rate x sqrt(W/K)
        (see Rules)."""
        if comp != "equal-total" or self.equal_total_lr == "same" or w == self.K:
            return self.overrides
        if self.equal_total_lr == "sqrt":
            return {**self.overrides, "train.lr": float(f"{self._train.lr * (w / self.K) ** 0.5:.6g}")}
        return {**self.overrides, "train.lr": float(f"{self._train.lr * w / self.K:.6g}"),
                "train.warmup": round(self._train.warmup * self.K / w)}

    def plan(self) -> list[tuple]:
        """(comparison, workers, seed, local steps per block) of every run, in order. ``sync`` is two
        runs on the same peers' settings, data and seed: every-step averaging (SYNC_BASE) and the
        chosen mode (SYNC_MODE), side by side."""
        out = []
        for seed in self.seeds:
            for comp in self.compare:
                for w in self.workers:
                    if comp == "equal-total" and w == self.K and "equal-steps" in self.compare:
                        continue  # the same run as equal-steps with K workers
                    if comp == "sync":
                        out += [(SYNC_BASE, w, seed, self.steps), (SYNC_MODE, w, seed, self.steps)]
                    else:
                        out.append((comp, w, seed, self.steps if comp == "equal-steps" else self.steps * self.K // w))
        return out

    def swarm_for(self, comp: str) -> dict:
        """A run's swarm settings: every-step averaging (the defaults) for SYNC_BASE, else ours."""
        return {} if comp == SYNC_BASE else self.swarm

    def execute(self, save=None, bar=None, log=lambda s: None) -> dict:
        """Every run of the plan, then the references; ``save(result)`` after each run and at the
        end; ``bar(desc, total, unit)``: a progress display per run, in worker-steps
        (blocks/progress.py). Raises BenchError."""
        from blocktrain.blocks.config import ConfigError

        runs, refs = [], []
        for comp, w, seed, local in self.plan():
            name = f"{comp}-w{w}-seed{seed}"
            ov = self.overrides_for(comp, w)
            log(f"{name}: {w} bt-peer processes, {local} steps per block each"
                + (f", learning rate {ov['train.lr']:g} and warmup {ov.get('train.warmup', self._train.warmup)} "
                   f"steps ({self.equal_total_lr} rule)" if ov is not self.overrides else "")
                + (f", links {self.link}" if self.link else "") + f" (logs and reports in {self.out}/{name})")
            with contextlib.ExitStack() as shown:
                try:
                    r = run(w, local, ov, self.out / name, self.test_windows, self.link, self.swarm_for(comp), seed,
                            self.eval_every, self.resume, progress=_display(shown, bar, name) if bar else None)
                except (ValueError, RuntimeError, TimeoutError, ConfigError) as e:
                    raise BenchError(f"{name}: {e}") from e
            r["comparison"] = comp
            if self.target_ce is not None:
                r["time_to_target_s"], r["steps_to_target"] = reach(r["curves"], self.target_ce)
            runs.append(r)
            log(f"{name}: test CE {r['initial_test_ce']:.3f} -> heads " + " / ".join(f"{c:.4f}" for c in r["head_test_ce"])
                + f" in {r['train_seconds']:.0f} s; busy min {r['busy_fraction']['min']:.0%}; "
                f"{r['bytes_per_worker'] / 1e6:.1f} MB per worker")
            if comp == "equal-steps" and w == self.K:
                for v in r["verdicts"]:
                    log(f"  {v}")
            if save:
                save(self.result(runs, [], complete=False))
        if self.reference:
            for seed in self.seeds:
                log(f"in-process sequential reference, seed {seed} ({self.steps} steps per block, the data per step "
                    f"of {self.K} workers)...")
                try:
                    refs.append(reference(self.steps, self.overrides, self.out / "reference", seed, self.test_windows,
                                          workers=self.K, threads=2))
                except subprocess.CalledProcessError as e:
                    raise BenchError(f"in-process reference, seed {seed}: exited with code {e.returncode}; see "
                                     f"{self.out / 'reference'}/*.log (the swarm runs are saved)") from e
        result = self.result(runs, refs, complete=True)
        if save:
            save(result)
        return result

    def result(self, runs: list, refs: list, complete: bool) -> dict:
        """``bt-bench swarm``'s JSON: every run, their summary by comparison and worker count, and the
        in-process reference; ``complete`` false while runs are still to come."""
        K, summary = self.K, summarise(runs, self.K)
        out = {"benchmark": "swarm", "complete": complete, "seeds": self.seeds, "steps": self.steps,
               "workers": self.workers, "compare": self.compare, "target_ce": self.target_ce, "runs": runs,
               "summary": summary}
        key_k = f"equal-steps/{K}" if f"equal-steps/{K}" in summary else next(iter(summary))
        wide = max(self.workers)
        key_w = f"equal-steps/{wide}" if f"equal-steps/{wide}" in summary else key_k
        out["swarm"] = summary[key_w]
        out["one_per_block"] = summary[key_k]
        if refs:
            heads = [mean_sd([r["head_test_ce"][k] for r in refs])["mean"] for k in range(K)]
            gap = out["one_per_block"]["head_test_ce"][-1] - heads[-1]
            out["in_process_sequential"] = {
                "head_test_ce": heads, "batch_size": refs[0]["batch_size"], "runs": refs,
                "one_per_block_gap": gap, "one_per_block_within_0_02": gap <= 0.02}
        out["equal_total_lr"] = self.equal_total_lr
        if "sync" in self.compare:
            out["sync_comparison"] = compare_sync(summary, self.swarm)
        return out


def swarm_settings(schedule: str | None = None, sync: str | None = None, every: int | None = None,
                   codec: str | None = None, density: float | None = None, outer_lr: float | None = None,
                   overlap: bool | None = None) -> dict:
    """A Bench's ``swarm`` settings from ``bt-bench swarm``'s options: those given; ``every`` or
    ``overlap`` without ``sync`` mean sync params."""
    sw = {k: v for k, v in (("schedule", schedule), ("sync", sync), ("every", every), ("codec", codec),
                            ("density", density), ("outer_lr", outer_lr), ("overlap", overlap or None)) if v is not None}
    if (every or overlap) and not sync:
        sw["sync"] = "params"
    return sw


def with_plot(bench: Bench, result: dict, save=None) -> dict:
    """``result`` with, when the bench compared sync modes, its PNG of test CE against GB sent
    for every run (``plot``: its path, beside the runs), ``save``d again."""
    if "sync" in bench.compare:  # test CE against GB sent, for every run
        result["plot"] = str(bench.out / "ce_vs_gb.png")
        plot_ce_vs_gb(result, Path(result["plot"]))
        if save:
            save(result)
    return result


def table(result: dict, K: int) -> list[str]:
    """``bt-bench swarm``'s report of a Bench's result: a row per comparison and worker count, the
    in-process reference, the sync comparison and the time to the target CE."""
    lines = [f"{'run':<18} {'seeds':>5} " + " ".join(f"{'head ' + str(k):>14}" for k in range(K))
             + f" {'busy min':>8} {'wall s':>8} {'MB/worker':>9}"]
    for key, s in result["summary"].items():
        lines.append(f"{key:<18} {len(s['seeds']):>5} " + " ".join(
            f"{m:>7.4f}+-{sd:<5.3f}" for m, sd in zip(s["head_test_ce"], s["head_test_ce_sd"]))
            + f" {s['busy_fraction']['min']:>8.0%} {s['train_seconds']['mean']:>8.0f} "
            f"{s['bytes_per_worker']['mean'] / 1e6:>9.1f}")
    return lines + _reference_lines(result) + _sync_lines(result) + _target_lines(result)


def _reference_lines(result: dict) -> list[str]:
    if "in_process_sequential" not in result:
        return []
    ref = result["in_process_sequential"]
    return [f"{'in-process seq.':<18} {len(result['seeds']):>5} " + " ".join(
                f"{c:>14.4f}" for c in ref["head_test_ce"]) + f"  (batch {ref['batch_size']})",
            f"one worker per block against it: top head {ref['one_per_block_gap']:+.4f} "
            f"({'within' if ref['one_per_block_within_0_02'] else 'not within'} 0.02)"]


def _sync_lines(result: dict) -> list[str]:
    return [f"{w} workers, {c['mode']} against every-step averaging: "
            + (f"{c['bytes_ratio']:.0f}x fewer bytes per worker" if c["bytes_ratio"] else "no bytes")
            + f", top-head test CE {c['ce_gap']:+.4f}"
            for w, c in (result.get("sync_comparison") or {}).items()]


def _target_lines(result: dict) -> list[str]:
    if result["target_ce"] is None:
        return []
    lines = [f"to valid CE {result['target_ce']:g} (training seconds / global step, per seed; '-': not reached):"]
    for key, s in result["summary"].items():
        lines.append(f"  {key:<16} " + ", ".join(
            "-" if t is None else f"{t:.0f} s / step {n}" for t, n in zip(s["time_to_target_s"], s["steps_to_target"])))
    return lines


def _display(stack: contextlib.ExitStack, bar, name: str):
    """``progress(done, total)`` for ``run``: a ``bar`` made at the first report, when the run's
    total is known, and closed with ``stack``."""
    shown: list = []

    def progress(done, total):
        if not shown:
            shown.append(stack.enter_context(bar(name, total, unit="worker-step")))
        shown[0].update(done - shown[0].n)
    return progress
