"""One learning-experiment variant -> JSON (used by ``bt-bench train``; runnable alone)."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.run import train_blocktrain, train_e2e
from blocktrain.blocks.train import TrainConfig, eval_chain, eval_continuation, eval_e2e, eval_generation

from .train import code_version


def run_variant(name: str, mcfg: ModelConfig, tcfg: TrainConfig, schedule: str | None, data_dir=None,
                test_windows: int | None = None, progress=None, save_dir: str | None = None) -> dict:
    train = as_tensor(read_split("train", data_dir))
    valid = as_tensor(read_split("valid", data_dir))
    test = as_tensor(read_split("test", data_dir))
    try:
        test_raw = as_tensor(read_split("test", data_dir, "raw"))
    except Exception:
        test_raw = None
    t0 = time.perf_counter()
    if schedule is None:
        res = train_e2e(mcfg, tcfg, train, valid, progress)
        m = res.model
        fwd = lambda ids: m(ids)[0]  # noqa: E731
        heads = [eval_e2e(m, test, tcfg.seq_len, test_windows)]
        heads_raw = [eval_e2e(m, test_raw, tcfg.seq_len, test_windows)] if test_raw is not None else None
    else:
        res = train_blocktrain(mcfg, tcfg, schedule, train, valid, progress)
        from blocktrain.blocks.model import Assembled
        asm = Assembled(res.blocks)
        fwd = asm
        heads = eval_chain(res.blocks, test, tcfg.seq_len, test_windows)
        heads_raw = eval_chain(res.blocks, test_raw, tcfg.seq_len, test_windows) if test_raw is not None else None
    cont = {}
    for n in (16, 64):
        cont[str(n)] = {
            "one_traversal": eval_continuation(fwd, test, 64, n, 64, one_traversal=True),
            "teacher_forced": eval_continuation(fwd, test, 64, n, 64, one_traversal=False),
        }
        if schedule is None:  # the autoregressive baseline: KV-cached greedy decoding, byte by byte
            cont[str(n)]["autoregressive_greedy"] = eval_generation(m.generate, test, 64, n, 64)
    if save_dir:  # the trained weights, for later analysis and serving
        from blocktrain.blocks import checkpoint as ckpt
        blocks = list(m.blocks) if schedule is None else res.blocks
        for k, b in enumerate(blocks):
            ckpt.save(ckpt.Checkpoint(mcfg.to_dict(), None if schedule is None else k, tcfg.steps, b.state_dict(),
                                      extra={"variant": name, "final": True}), f"{save_dir}/block{k}.safetensors")
    return {
        "variant": name, "schedule": schedule or "end-to-end", "model": mcfg.to_dict(), "train": tcfg.to_dict(),
        "test_ce_heads": heads, "test_ce": heads[-1], "test_raw_ce_heads": heads_raw,
        "curve": res.curve, "wall_steps": res.wall_steps, "busy_fraction": res.busy_fraction,
        "workers_per_block": getattr(res, "workers_per_block", 1),
        "train_flops": res.train_flops, "train_seconds": res.seconds, "total_seconds": time.perf_counter() - t0,
        "draft_flops": res.draft_flops, "draft_curve": res.draft_curve, "code": code_version(),
        "trainable_bytes": res.trainable_bytes, "continuation": cont,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--schedule", default=None, help="staggered|parallel|sequential; omit for end-to-end")
    ap.add_argument("--model", default="{}", help="JSON overrides of ModelConfig")
    ap.add_argument("--train", default="{}", help="JSON overrides of TrainConfig")
    ap.add_argument("--test-windows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    mcfg = ModelConfig.from_dict(json.loads(a.model))
    tcfg = TrainConfig.from_dict(json.loads(a.train))

    def progress(t, total, ces):
        if t % 50 == 0 or t == total:
            print(f"{a.name} {t}/{total} {ces}", file=sys.stderr, flush=True)

    out = run_variant(a.name, mcfg, tcfg, a.schedule, None, a.test_windows, progress,
                      save_dir=a.out[:-5] + ".ckpt" if a.out.endswith(".json") else a.out + ".ckpt")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("variant", "test_ce_heads", "train_seconds")}))


if __name__ == "__main__":
    main()
