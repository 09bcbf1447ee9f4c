"""Shared by the experiments/exact scripts: the trained chain, the test prompts, JSON output (to results/exact/)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.data import as_tensor, eval_windows, read_split
from blocktrain.blocks.model import Block, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "runs/exact/base/sequential.ckpt"  # bt-bench train's "sequential" variant, d 192, 1000 steps


def load_chain(directory=BASE, n_blocks: int | None = None) -> list[Block]:
    blocks = []
    first = ckpt.load(Path(directory) / "block0.safetensors")
    cfg = ModelConfig.from_dict(first.config)
    for k in range(n_blocks or cfg.n_blocks):
        c = ckpt.load(Path(directory) / f"block{k}.safetensors")
        b = Block(cfg, k)
        b.load_state_dict(c.tensors)
        b.eval()
        b.requires_grad_(False)
        blocks.append(b)
    return blocks


def test_prompts(n: int = 200, prompt_len: int = 64, n_bytes: int = 256) -> list[tuple[bytes, bytes]]:
    """(prompt, true continuation) from the first ``n`` non-overlapping windows of wiki.test.tokens."""
    test = as_tensor(read_split("test"))
    x, _ = eval_windows(test, prompt_len + n_bytes, n)
    x = x.long()
    return [(bytes(r[:prompt_len].tolist()), bytes(r[prompt_len:].tolist())) for r in x]


def write_json(path, obj):
    obj = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), **obj}
    Path(path).write_text(json.dumps(obj, indent=1))
    print(f"wrote {path}", file=sys.stderr)
