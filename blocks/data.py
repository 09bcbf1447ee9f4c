"""Byte-level WikiText data: the embedded default, a user's directory, deterministic batches.

Rules:
- A split is a flat uint8 tensor of the file's bytes (vocabulary 256).
- The embedded default is WikiText-2 (CC BY-SA 3.0, see data/README.md), xz-compressed in the
  package and verified by sha256 when it is opened.
- A user's directory holds the standard WikiText file names: ``wiki.{train,valid,test}.tokens``
  (WikiText-2/-103 tokenized) or ``wiki.{train,valid,test}.raw`` (the raw variants).
- Batches are a pure function of (seed, step, shard): a restarted trainer that knows its step
  reads exactly the batches it would have read, and each of ``num_shards`` workers reads its own
  disjoint slice of the training bytes.
"""

from __future__ import annotations

import hashlib
import lzma
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

SPLITS = ("train", "valid", "test")
VARIANTS = ("tokens", "raw")

# sha256 of the uncompressed embedded files; a mismatch means a damaged install.
EMBEDDED_SHA256 = {
    "wiki.train.tokens": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
    "wiki.valid.tokens": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "wiki.test.tokens": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
}


class DataError(Exception):
    """A data file is missing, damaged or unusable."""


def _file_name(split: str, variant: str) -> str:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    if variant not in VARIANTS:
        raise DataError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    return f"wiki.{split}.{variant}"


def read_embedded(split: str, variant: str = "tokens") -> bytes:
    """The bytes of one embedded WikiText-2 split, verified by sha256."""
    name = _file_name(split, variant)
    if name not in EMBEDDED_SHA256:
        raise DataError(f"{name} is not embedded (the raw train split is not shipped); "
                        "pass --data DIR with your own copy")
    blob = resources.files("blocktrain.blocks").joinpath("data", name + ".xz").read_bytes()
    data = lzma.decompress(blob)
    digest = hashlib.sha256(data).hexdigest()
    if digest != EMBEDDED_SHA256[name]:
        raise DataError(f"embedded {name} is damaged: sha256 {digest} != {EMBEDDED_SHA256[name]}")
    return data


def read_split(split: str, data_dir: str | Path | None = None, variant: str = "tokens") -> bytes:
    """One split's bytes from ``data_dir`` (standard WikiText names), or the embedded default."""
    if data_dir is None:
        return read_embedded(split, variant)
    path = Path(data_dir) / _file_name(split, variant)
    if not path.is_file():
        found = sorted(p.name for p in Path(data_dir).glob("wiki.*")) if Path(data_dir).is_dir() else []
        raise DataError(f"{path} not found (directory holds: {found or 'no wiki.* files'}); "
                        "expected the standard WikiText names wiki.{train,valid,test}.{tokens,raw}")
    data = path.read_bytes()
    if len(data) < 2:
        raise DataError(f"{path} is empty")
    return data


def as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a flat uint8 tensor (a copy: the tensor owns its memory)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class ByteBatches:
    """Deterministic random windows over a byte tensor.

    ``batch(step)`` returns ``(x, y)``, each ``(batch_size, seq_len)`` int64, ``y`` shifted by one
    byte. Shard ``shard`` of ``num_shards`` draws windows only from its own contiguous slice.
    """

    data: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int = 0
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self):
        assert self.data.dtype == torch.uint8 and self.data.dim() == 1, "data must be flat uint8"
        assert 0 <= self.shard < self.num_shards, f"shard {self.shard} not in [0, {self.num_shards})"
        lo, hi = self.bounds()
        if hi - lo < self.seq_len + 2:
            raise DataError(f"shard {self.shard}/{self.num_shards} holds {hi - lo} bytes, "
                            f"fewer than one window of {self.seq_len + 1}")

    def bounds(self) -> tuple[int, int]:
        n = self.data.numel()
        per = n // self.num_shards
        return self.shard * per, (self.shard + 1) * per

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.bounds()
        g = torch.Generator().manual_seed(_mix(self.seed, self.shard, step))
        starts = torch.randint(lo, hi - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.data[idx].long()
        return w[:, :-1], w[:, 1:]


def _mix(*values: int) -> int:
    """A stable 62-bit seed from small integers (Python's hash() is not a contract)."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = ((h ^ (v & 0xFFFF_FFFF_FFFF)) * 0x100000001B3) % (1 << 62)
    return h


def eval_windows(data: torch.Tensor, seq_len: int, max_windows: int | None = None):
    """Non-overlapping ``(x, y)`` windows covering ``data`` in order (for test CE)."""
    n = (data.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    w = data[: n * seq_len + 1].long()
    x = w[:-1].view(n, seq_len)
    y = w[1:].view(n, seq_len)
    return x, y
