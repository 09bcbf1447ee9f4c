"""A malicious member in a 4-peer relay: its gradient sign-flipped and
scaled (flip4: x -4) or scaled (scale8: x 8) every round. The honest peers' final valid CE along
the chain, under robust averaging (the default) and under a plain mean, beside an honest run;
and whether the honest peers name the attacker.

    .venv/bin/python experiments/hardening/attack.py none,flip4,scale8 150 > results/hardening/attack.jsonl
"""
import asyncio, json, sys, time, torch  # noqa: E401
sys.path.insert(0, "tests")
from conftest import mesh
from pathlib import Path
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import TrainConfig
from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
from blocktrain.p2p.transport import Timeouts
from blocktrain.provenance import code_version
torch.set_num_threads(1)
T = Timeouts(connect_s=5, handshake_s=5, heartbeat_s=0.5, dead_after_s=60, close_s=1)
MC = ModelConfig(d_model=64, n_head=2, n_layer=3, n_blocks=3, max_seq_len=128)
TC = TrainConfig(steps=int(sys.argv[2]) if len(sys.argv) > 2 else 100, batch_size=8, seq_len=64, warmup=10,
                 draft_frac=0.0)
DATA, VALID = as_tensor(read_split("train")), as_tensor(read_split("valid"))

async def one(attack: str, aggregate: str, out: Path, n=4):
    import shutil; shutil.rmtree(out, ignore_errors=True)
    peers = await mesh(n, T, blocks=[(i % 3,) for i in range(n)])
    sc = SwarmConfig(min_group=n, eval_windows=32, round_timeout_s=60, join_timeout_s=10, aggregate=aggregate)
    sps = [SwarmTrainer(p, TrainerSpec(i % 3, PeerJob(MC, TC, sc), out / f"w{i}"), DATA, VALID)
           for i, p in enumerate(peers)]
    bad = sps[-1]
    if attack != "none":
        scale = {"flip": -1.0, "flip4": -4.0, "scale8": 8.0}[attack]
        orig = bad._new_trainer
        def evil(b):
            orig(b)
            tr = bad.trainer
            g0 = tr.grads
            tr.grads = lambda: scale * g0()
        bad._new_trainer = evil
    t = time.time()
    reps = await asyncio.gather(*(sp.run() for sp in sps))
    for p in peers:
        await p.stop()
    named = sorted({e["peer"][:8] for r in reps[:-1] for e in r["rejected_updates"]})
    return {"attack": attack, "aggregate": aggregate, "heads": [r["head_ce"] for r in reps[:-1]],
            "ce_end": [round(r["ce_end"], 4) for r in reps[:-1]], "attacker": peers[-1].id[:8], "named": named,
            "seconds": round(time.time() - t, 1)}

async def main():
    res = []
    code = {**code_version(), "command": " ".join(sys.argv)}  # every line says which code made it
    for attack, agg in [(a, g) for a in sys.argv[1].split(",") for g in ("robust", "mean")]:
        r = await one(attack, agg, Path(f"runs/attack/{attack}-{agg}"))
        print(json.dumps({**r, "code_version": code}), flush=True)
        res.append(r)
asyncio.run(main())
