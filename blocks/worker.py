"""One block's trainer as its own process, exchanging checkpoint files with the others.

Rules:
- Worker k owns ``DIR/block{k}.safetensors``: it writes it atomically every ``ckpt_every``
  steps and at the end (``extra.final``), with its optimizer state and step, so a worker killed
  at any moment restarts from that file and loses at most the steps since it was written.
- Worker k reads ``DIR/block{j}.safetensors`` for j < k (verified, never unpickled) and refreshes
  its frozen copy whenever a newer one appears, checked every ``refresh_every`` steps.
- ``sequential`` waits for block k-1's final checkpoint; other schedules start at once and wait
  only for the first checkpoint of every lower block.
- The network version (``bt-peer``) moves the same files over the protocol; this module knows
  no network.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .checkpoint import block_path
from .data import DataError, load_split
from .device import DeviceError, pick_device, pick_precision
from .lower import LowerInputs
from .model import ModelConfig
from .schedule import make_plans
from .train import BlockTrainer, TrainConfig


class LowerWatcher:
    """Offers the newest lower checkpoints on disk to the trainer's input (blocks/lower.py)."""

    def __init__(self, trainer: BlockTrainer, directory: Path, require_final: bool = False):
        self.trainer, self.dir = trainer, Path(directory)
        self.inputs = LowerInputs(trainer.k, require_final)
        self.errors: list[str] = []

    def _read(self, j: int) -> ckpt.Checkpoint | None:
        p = block_path(self.dir, j)
        if not p.exists():
            return None
        try:
            return ckpt.load(p)
        except ckpt.CheckpointError as e:  # a damaged file is reported and skipped, never loaded
            self.errors.append(str(e))
            return None

    def refresh(self) -> bool:
        """Load newer lower checkpoints; True if the trainer's input changed."""
        for j in range(self.trainer.k):
            g = self._read(j)
            if g is not None:
                self.inputs.offer(j, g.sha256, g.step, g.tensors, bool(g.extra.get("final")))
        return self.inputs.install(self.trainer)

    def ready(self) -> bool:
        return self.inputs.ready()


def run_worker(k: int, mcfg: ModelConfig, tcfg: TrainConfig, schedule: str, directory: Path,
               ckpt_every: int = 25, data: torch.Tensor | None = None, wait_timeout_s: float = 3600.0,
               log=lambda s: None, device: str = "cpu", precision: str = "fp32") -> BlockTrainer:
    directory = Path(directory)
    data = data if data is not None else load_split("train")
    plan = make_plans(schedule, mcfg.n_blocks, tcfg.steps, tcfg.decay_frac)[k]
    tr = BlockTrainer(mcfg, tcfg, k, data, device=device, precision=precision)
    tr.lr_plan = (plan.decay_start, plan.decay_end)
    own = block_path(directory, k)
    if own.exists():
        c = ckpt.load(own)  # a damaged own checkpoint is an error the operator must see
        tr.restore(c)
        log(f"block {k}: resumed from {own} at step {tr.step}")
    watcher = LowerWatcher(tr, directory, require_final=schedule == "sequential")

    def lower_ready() -> bool:
        watcher.refresh()
        return watcher.ready()

    deadline = time.monotonic() + wait_timeout_s
    while not lower_ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"block {k}: lower checkpoints did not appear in {directory} within {wait_timeout_s}s")
        time.sleep(0.2)
    while tr.step < tcfg.steps:
        if tr.step % tcfg.refresh_every == 0 and watcher.refresh():
            log(f"block {k}: step {tr.step}: lower blocks at steps {tr.lower_steps}")
        loss = tr.train_step()
        if tr.step % ckpt_every == 0 or tr.step == tcfg.steps:
            c = tr.checkpoint()
            c.extra["final"] = tr.step == tcfg.steps
            ckpt.save(c, own)
            log(f"block {k}: step {tr.step} loss {loss:.4f} checkpoint written")
    return tr


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train one block as a worker process (see module doc).")
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True, help="directory of block checkpoints")
    ap.add_argument("--schedule", default="staggered")
    ap.add_argument("--model", default="{}", help="JSON overrides of ModelConfig")
    ap.add_argument("--train", default="{}", help="JSON overrides of TrainConfig")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=None, help="bt-train's --data (default: the embedded WikiText-2)")
    ap.add_argument("--device", default="cpu", help="auto, cpu, cuda[:N] or mps")
    ap.add_argument("--precision", default="fp32", help="auto, fp32 or bf16")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    mcfg = ModelConfig.from_dict(json.loads(a.model))
    tcfg = TrainConfig.from_dict(json.loads(a.train))
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.verbose else (lambda s: None)
    try:
        device = pick_device(a.device)
        run_worker(a.block, mcfg, tcfg, a.schedule, a.dir, a.ckpt_every, load_split("train", a.data), log=log,
                   device=device, precision=pick_precision(a.precision, device))
    except (ckpt.CheckpointError, TimeoutError, DataError, DeviceError) as e:
        print(f"block worker {a.block}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
