"""Evaluating an assembled model: load block checkpoints from a directory, test CE along the chain.

Rules:
- ``load_chain`` reads ``block{k}.safetensors`` for k = 0..K-1 (verified, never unpickled); every
  block must have the same model config, and none may be missing.
- ``head_ce`` is the test CE of every block's head along the chain: block k's head on blocks
  0..k. ``verdicts`` says plainly where an upper block does not improve on the one below.
"""

from __future__ import annotations

from pathlib import Path

from . import checkpoint as ckpt
from .data import load_split
from .model import Block, ModelConfig
from .train import eval_chain

# An upper block must beat the one below by at least this (nats/byte) to count as improving it.
MIN_GAIN = 0.02


def load_chain(directory: str | Path, digests: dict | None = None) -> tuple[list[Block], dict]:
    """The blocks in ``directory`` in order, and the extra metadata of the last one (``digests``:
    filled with each block's sha256)."""
    files = ckpt.block_files(directory)
    if not files:
        raise ckpt.CheckpointError(f"{directory}: no block*.safetensors checkpoints")
    blocks, config, extra = [], None, {}
    for k, path in files.items():
        c = ckpt.load(path)
        if c.block != k:
            raise ckpt.CheckpointError(f"{path} holds block {c.block}, not {k}")
        if config is None:
            config = c.config
        elif c.config != config:
            raise ckpt.CheckpointError(f"{path}: another model config than block 0's")
        b = Block(ModelConfig.from_dict(c.config), k)
        b.load_state_dict(c.tensors)
        b.eval()
        if digests is not None:
            digests[k] = c.sha256
        blocks.append(b)
        extra = c.extra
    n = blocks[0].cfg.n_blocks
    missing = [k for k in range(n) if k not in files]
    if missing:
        raise ckpt.CheckpointError(f"{directory}: block(s) {missing} of {n} missing")
    return blocks, extra


def evaluate(directory: str | Path, data: str | None = None, windows: int = 300, seq_len: int | None = None) -> dict:
    """Test CE of every head along the chain of the blocks in ``directory``."""
    blocks, extra = load_chain(directory)
    seq_len = seq_len or extra.get("train", {}).get("seq_len") or 128
    test = load_split("test", data)
    heads = eval_chain(blocks, test, seq_len, windows or None)
    return {"test_ce": heads[-1], "head_ce": heads, "verdicts": verdicts(heads), "test_windows": windows,
            "seq_len": seq_len, "data": data or "embedded WikiText-2"}


def verdicts(heads: list[float], min_gain: float = MIN_GAIN) -> list[str]:
    """One line per upper block: how much it improves on the block below, said plainly."""
    out = []
    for k in range(1, len(heads)):
        gain = heads[k - 1] - heads[k]
        if gain >= min_gain:
            out.append(f"block {k} improves on block {k - 1} by {gain:.3f} nats/byte")
        else:
            out.append(f"block {k} does NOT improve on block {k - 1} ({gain:+.3f} nats/byte, less than {min_gain}): "
                       f"the chain is no better than its first {k} block(s)")
    return out
