"""Test CE of block 0's head against the bytes each worker sent, for every mode in
results/lowcomm/*.jsonl (one point per run; runs on uncommitted code are left out; [screen]:
compress_screen.py, a plain mean and bytes counted; the others the swarm's robust round, bytes
sent), with the target: within 0.02 of gradients every step (green), 100x fewer bytes (dashed).

usage: python experiments/lowcomm/plot.py [--out results/lowcomm/ce_vs_gb.png]
"""

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "results" / "lowcomm"  # the runs and the plot live there


def _codec(r: dict) -> str:
    return {"topk": f", topk {r['density']:g}", "sign": ", sign (1 bit)"}.get(r["codec"], "")


def label(r: dict) -> str:
    if "compressor" in r:  # compress_screen.py: a compressor of gradients or of parameter changes
        what = "gradients" if r["target"] == "grads" else "params"
        c = {"topk": f"topk {r['density']:g}", "powersgd": f"PowerSGD rank {r['rank']}"}.get(r["compressor"],
                                                                                         r["compressor"])
        s = f"[screen] {what} every {r.get('every', 1)}, {c}" + (", mean re-signed" if r.get("resign") else "")
        s += f", {r['fragments']} fragments" if r.get("fragments", 1) > 1 else ""
        return s + (f", outer lr {r['outer_lr']:g}" if r["target"] == "delta" else "")
    if r["mode"] == "grads":
        return "gradients every step" + _codec(r)
    if r["mode"] == "alone":
        return "one worker alone"
    s = f"params every {r['every']}" + _codec(r)
    if r.get("outer_lr", 1.0) != 1.0:
        s += f", outer lr {r['outer_lr']:g}"
    return s + (", overlapped" if r.get("overlap") else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "ce_vs_gb.png"))
    a = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(line) for f in sorted(HERE.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
    runs = [r for r in runs if not r["code_version"].get("dirty")
            and r.get("attack", "none") == "none" and r.get("workers", 3) == 3]  # attack runs: 4 workers
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, steps in zip(axes, (300, 1000)):
        sel = [r for r in runs if r["steps"] == steps]
        for r in sel:
            gb = max(r["bytes_sent_per_worker"], 1e5) / 1e9  # one worker alone sends nothing: drawn at 100 kB
            ax.scatter(gb, r["test_ce"])
            seed = f" (seed {r['seed']})" if r.get("seed", 0) else ""
            ax.annotate(label(r) + seed, (gb, r["test_ce"]), fontsize=7, xytext=(4, 2), textcoords="offset points")
        base = [r for r in sel if r.get("mode") == "grads" and r.get("codec", "raw") == "raw"]
        if base:  # the target: within 0.02 of gradients every step, at 100x fewer bytes
            ce, gb = base[0]["test_ce"], base[0]["bytes_sent_per_worker"] / 1e9
            ax.axhspan(ce - 0.02, ce + 0.02, color="green", alpha=0.12,
                       label="within 0.02 of gradients every step (seed 0)")
            ax.axvline(gb / 100, color="gray", ls="--", lw=1, label="100x fewer bytes")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("GB sent per worker (log)")
        ax.set_ylabel("test CE of block 0's head (nats/byte)")
        ax.set_title(f"3 workers, d 128, {steps} steps (block 0)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
