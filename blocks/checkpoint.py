"""Checkpoint files: safetensors plus a metadata header, verified on load, written atomically.

Rules:
- A checkpoint is one safetensors file. Its string metadata holds ``format`` (CHECKPOINT_FORMAT),
  ``config`` (model config JSON), ``block`` (index, or "e2e"), ``step``, ``data_position``,
  ``extra`` (JSON) and ``sha256`` of the tensor data section.
- Optimizer state travels in the same file under the ``optim.`` prefix, so a restarted trainer
  resumes exactly where the checkpoint was taken.
- Loading never unpickles: safetensors parses a JSON header and raw bytes. A truncated file,
  a flipped byte or a foreign file raises ``CheckpointError`` and nothing is loaded.
- Writes go to a temporary file in the same directory, are fsynced, then renamed over the
  target: a crash at any moment leaves either the old checkpoint or the new one, never half.
  Leftover temporary files of a killed writer are removed by the next ``save`` there.
- Block k's checkpoint is named ``block_name(k)`` ("block{k}"), in a file ``block_file(k)``; this
  is the one place that spells it (directories, streams and the serving code all use it).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

CHECKPOINT_FORMAT = "blocktrain-checkpoint-1"
OPTIM_PREFIX = "optim."
# A header larger than this is not one of ours (ours are a few KiB); refuse before reading it.
MAX_HEADER_BYTES = 16 * 1024 * 1024


SUFFIX = ".safetensors"
# The small trained model the package ships (see its MODEL.md): the default of `bt-peer serve` and
# `bt-bench wan`, so that a fresh clone can demo and measure without training first.
SHIPPED_MODEL = Path(__file__).parent / "data" / "model"


class CheckpointError(Exception):
    """A checkpoint file is truncated, corrupted or not a BlockTrain checkpoint."""


def block_name(k: int) -> str:
    """The name of block k's checkpoint (a stream name, and a file name without its suffix)."""
    return f"block{int(k)}"


def block_file(k: int) -> str:
    return block_name(k) + SUFFIX


def block_path(directory: str | Path, k: int) -> Path:
    return Path(directory) / block_file(k)


def block_of(path: str | Path) -> int | None:
    """The block index of a ``block{k}.safetensors`` file name, or None."""
    name = Path(path).name
    if not (name.startswith("block") and name.endswith(SUFFIX)):
        return None
    digits = name[len("block"):-len(SUFFIX)]
    return int(digits) if digits.isdigit() else None


def block_files(directory: str | Path) -> dict[int, Path]:
    """Block index -> file, for every ``block{k}.safetensors`` in ``directory``."""
    out = {}
    for p in Path(directory).glob("block*" + SUFFIX):
        k = block_of(p)
        if k is not None:
            out[k] = p
    return dict(sorted(out.items()))


@dataclass
class Checkpoint:
    config: dict
    block: int | None  # None for the end-to-end reference
    step: int
    tensors: dict[str, torch.Tensor]  # model state
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    data_position: int = 0
    extra: dict = field(default_factory=dict)
    sha256: str = ""


def _data_section(blob: bytes) -> tuple[dict, memoryview]:
    if len(blob) < 8:
        raise CheckpointError(f"file of {len(blob)} bytes is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise CheckpointError(f"header length {n} does not fit a file of {len(blob)} bytes (truncated?)")
    try:
        header = json.loads(bytes(blob[8:8 + n]))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"header is not valid JSON: {e}") from None
    return header, memoryview(blob)[8 + n:]


def encode(ck: Checkpoint) -> bytes:
    """The checkpoint as safetensors bytes (sha256 of the data section in the metadata)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in ck.tensors.items()}
    for k, v in ck.optim.items():
        tensors[OPTIM_PREFIX + k] = v.detach().contiguous().cpu()
    # Pass 1 to learn the data bytes' digest; safetensors orders tensors deterministically,
    # and the data section does not depend on the metadata.
    meta = {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(ck.config, sort_keys=True),
        "block": "e2e" if ck.block is None else str(ck.block),
        "step": str(ck.step),
        "data_position": str(ck.data_position),
        "extra": json.dumps(ck.extra, sort_keys=True),
    }
    _, data = _data_section(st_save(tensors, metadata=meta))
    meta["sha256"] = hashlib.sha256(data).hexdigest()
    ck.sha256 = meta["sha256"]
    return st_save(tensors, metadata=meta)


def decode(blob: bytes, source: str = "checkpoint") -> Checkpoint:
    """Parse and verify checkpoint bytes; raises CheckpointError on any damage, never anything else
    (the bytes may come from a peer: every field is checked before use)."""
    header, data = _data_section(blob)
    if not isinstance(header, dict):
        raise CheckpointError(f"{source}: header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{source}: not a BlockTrain checkpoint")
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError):
        raise CheckpointError(f"{source}: malformed tensor table in the header") from None
    if max(ends, default=0) != len(data):
        raise CheckpointError(f"{source}: data section is {len(data)} bytes, header says {max(ends, default=0)} (truncated?)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta.get("sha256"):
        raise CheckpointError(f"{source}: sha256 mismatch: corrupted")
    try:
        tensors = st_load(bytes(blob))
        config = json.loads(meta["config"])
        block = None if meta["block"] == "e2e" else int(meta["block"])
        step, pos = int(meta["step"]), int(meta["data_position"])
        extra = json.loads(meta.get("extra", "{}"))
    except (SafetensorError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: malformed checkpoint: {e}") from None
    if not isinstance(config, dict) or not isinstance(extra, dict) or (block is not None and block < 0) \
            or step < 0 or pos < 0:
        raise CheckpointError(f"{source}: malformed checkpoint metadata")
    model = {k: v for k, v in tensors.items() if not k.startswith(OPTIM_PREFIX)}
    optim = {k[len(OPTIM_PREFIX):]: v for k, v in tensors.items() if k.startswith(OPTIM_PREFIX)}
    return Checkpoint(config, block, step, model, optim, pos, extra, digest)


def save(ck: Checkpoint, path: str | Path) -> str:
    """Atomically write ``ck`` to ``path``; returns the sha256 of its data section."""
    write_atomic(path, encode(ck))
    return ck.sha256


def write_atomic(path: str | Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` so that a reader sees the old file or the new one, never a part
    (a temporary file, fsynced, then renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(path.name + ".*.tmp"):  # a writer killed mid-write left it
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    return decode(blob, str(path))


def optimizer_state(opt: torch.optim.Optimizer, names: dict) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors; ``names`` maps parameter -> name."""
    out = {}
    for p, st in opt.state.items():
        n = names[p]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{key}"] = st[key]
        out[f"{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(1)
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, named_params: dict, state: dict[str, torch.Tensor]):
    for n, p in named_params.items():
        if f"{n}.exp_avg" not in state:
            continue
        opt.state[p] = {
            "exp_avg": state[f"{n}.exp_avg"].to(p.device, copy=True),  # the parameter's device
            "exp_avg_sq": state[f"{n}.exp_avg_sq"].to(p.device, copy=True),
            "step": torch.tensor(float(state[f"{n}.step"].item())),
        }
