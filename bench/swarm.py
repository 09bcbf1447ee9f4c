"""``bt-bench swarm``: real ``bt-peer`` processes training a model together on loopback.

Rules:
- Worker i trains block i mod K on shard i div (W/K) of W/K; the first starts the swarm, the
  others join through it. Every worker is a ``bt-peer`` process with its own identity, work
  directory and transfer report; nothing is shared but the swarm key.
- "The same total steps": every block gets ``steps`` optimizer steps in all, so each of the
  W/K workers of a block takes steps / (W/K) local steps (the data seen per block is equal).
- The assembled model is fetched from the swarm (``bt-peer assemble``'s code) once every
  worker reports ``done``, and evaluated on test windows; the initial CE is the same blocks
  as initialised (every worker of block k starts from the same seeded block).
- Bytes are the peers' own counters (sent wire bytes, summed; by kind), read from their reports
  when every one says ``done`` (the assembly's own fetches are counted apart). Only processes
  this module started are stopped.
- ``link``: every peer's outgoing links go through the in-process link shaper (delay, rate).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
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


def run(workers: int, steps: int, overrides: dict, every: int, out: Path, test_windows: int = 300,
        link: str | None = None, schedule: str = "parallel", codec: str = "raw", outer: tuple = ("sgd", 1.0, 0.0),
        timeout_s: float = 3600.0, progress=None, log=lambda s: None) -> dict:
    from blocktrain.blocks.config import apply_overrides
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.evaluate import evaluate
    from blocktrain.p2p.assemble import assemble_from_swarm
    from blocktrain.p2p.config import PeerJob
    from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key, new_swarm_key

    job = apply_overrides(PeerJob(), overrides)
    K = job.model.n_blocks
    if workers % K:
        raise ValueError(f"{workers} workers do not split evenly over {K} blocks")
    per_block = workers // K
    if steps % per_block:
        raise ValueError(f"{steps} steps per block do not split evenly over {per_block} workers")
    local = steps // per_block
    out.mkdir(parents=True, exist_ok=True)
    key = out / "swarm.key"
    if not key.exists():
        new_swarm_key(key)
    ports = free_ports(workers)
    sets = [x for k, v in {**overrides, "steps": local}.items() for x in ("--set", f"{k}={v}")]
    procs, logs = [], []
    t0 = time.monotonic()

    def cmd(i):
        c = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if i else "start"]
        if i:
            c.append(f"127.0.0.1:{ports[0]}")
        c += ["--block", str(i % K), "--listen", f"127.0.0.1:{ports[i]}", "--swarm-key", str(key),
              "--identity", str(out / f"id{i}"), "--report", str(out / f"report{i}.json"), "--report-every", "2",
              "--work-dir", str(out / f"work{i}"), "--shard", f"{i // K}/{per_block}", "--every", str(every),
              "--schedule", schedule, "--codec", codec, "--outer", outer[0], "--outer-lr", str(outer[1]),
              "--outer-momentum", str(outer[2]), "--threads", "1", "--quiet", "--heartbeat", "1",
              "--dead-after", "30", "--round-timeout", "600", "--min-group", str(per_block), *sets]
        if link:
            c += ["--link", link]
        return c

    def reports():
        out_ = []
        for i in range(workers):
            try:
                out_.append(json.loads((out / f"report{i}.json").read_text()))
            except (OSError, ValueError):
                out_.append({})
        return out_

    try:
        for i in range(workers):
            f = open(out / f"peer{i}.log", "w")
            logs.append(f)
            procs.append(subprocess.Popen(cmd(i), stdout=f, stderr=subprocess.STDOUT))
            if i == 0:
                time.sleep(2.0)  # let the first one listen
        while True:
            reps = reports()
            done = sum(r.get("training", {}).get("state") == "done" for r in reps)
            if progress:
                progress(sum(r.get("training", {}).get("step", 0) for r in reps), workers * local)
            if done == workers:
                break_reps = reps  # the training's bytes, before the assembly moves its own
                break
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited (code {procs[dead[0]].returncode}); see {out}/peer{dead[0]}.log")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"workers not done after {timeout_s:.0f} s; see {out}/peer*.log")
            time.sleep(1.0)
        train_s = time.monotonic() - t0
        log("all workers done; assembling the model from the swarm")
        res = asyncio.run(assemble_from_swarm("127.0.0.1", ports[0], load_or_create_identity(out / "id-assembler"),
                                              load_swarm_key(str(key)), out / "assembled"))
    finally:
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
    ev = evaluate(out / "assembled", None, test_windows)
    test = as_tensor(read_split("test"))
    init = _initial_ce(job.model.to_dict(), job.train.seed, job.train.seq_len, test_windows, test)
    reps = break_reps
    kinds: dict = {}
    for r in reps:
        for k, c in r.get("by_kind", {}).get("sent", {}).items():
            kinds[k] = kinds.get(k, 0) + c["wire_bytes"]
    total = sum(kinds.values())
    rounds = [len(r["training"]["rounds"]) for r in reps]
    failed = [len(r["training"]["failed_rounds"]) for r in reps]
    return {
        "workers": workers, "blocks": K, "workers_per_block": per_block, "steps_per_block": steps,
        "local_steps_per_worker": local, "every": every, "schedule": schedule, "codec": codec,
        "outer": {"optimizer": outer[0], "lr": outer[1], "momentum": outer[2]},
        "link": link or "loopback, unshaped", "link_emulation": "in-process link shaper (p2p/link.py)" if link else None,
        "config": {"model": job.model.to_dict(), "train": {**job.train.to_dict(), "steps": local}},
        "initial_test_ce": init[-1], "final_test_ce": ev["test_ce"], "head_test_ce": ev["head_ce"],
        "test_windows": test_windows, "train_seconds": train_s,
        "bytes_sent_by_kind": kinds, "bytes_moved": total,
        "assembly_bytes": sum(v["bytes"] for v in res["blocks"].values()),
        "ce_improvement_per_gb": (init[-1] - ev["test_ce"]) / (total / 1e9) if total else None,
        "rounds_applied_per_worker": rounds, "rounds_failed_per_worker": failed,
        "assembled_from": {str(k): v for k, v in res["blocks"].items()},
        "pid": os.getpid(), "out": str(out),
    }
