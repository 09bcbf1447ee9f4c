"""The training peer's checkpoints: what it saves, publishes for others, and finds after a restart.

Rules:
- ``serve/checkpoint/block{b}``: the block in work's full state (parameters, optimizer state, the
  outer optimizer's buffer, the swarm position): for resume, joiners and assembly. Relay: once a
  block is final only the peer's own block keeps its full state.
- ``serve/lower-checkpoint/block{b}``: the block's parameters as a lower block (the handoff to the
  blocks above), marked ``final`` at the block's last step.
- ``serve/checkpoint/block{b}.r{at}``: the group's state after round ``at``, for the joiners
  admitted at it (the same bytes on every member under ``grads``, so a fetch resumes across
  them); those more than ``50 * margin`` rounds old are deleted.
- After a restart (``find_own``): parallel, our block's checkpoint; relay, the run of final lower
  blocks from block 0 and the full state of the block after them if it is not final.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blocktrain.blocks import checkpoint as ckpt

from ..checkpoints import CHECKPOINT, LOWER, CheckpointServer
from .schedule import Schedule

OUTER_MOMENTUM = "outer.momentum"  # the outer optimizer's buffer, in the checkpoint's optimizer state
# Seconds between checkpoints of the block in training (and at every block's end).
SAVE_EVERY_S = 30.0


@dataclass
class Found:
    """What a restarted peer finds in its work directory."""
    finals: dict = field(default_factory=dict)  # relay: block -> final parameters, from block 0 on
    state: ckpt.Checkpoint | None = None  # the block in work's full state, if not final
    path: str = ""


class CheckpointStore:
    def __init__(self, server: CheckpointServer, workdir: Path, mcfg, tcfg, scfg, schedule: Schedule):
        self.server, self.dir = server, workdir
        self.mcfg, self.tcfg, self.scfg, self.schedule = mcfg, tcfg, scfg, schedule
        self.last_save = time.monotonic()

    @property
    def _own(self) -> Path:
        return self.dir / "serve" / CHECKPOINT / ckpt.block_file(self.schedule.k)

    def checkpoint(self, trainer, rounds, final: bool, gstep: int, rnd: int, block: int) -> ckpt.Checkpoint:
        """``rounds`` (rounds.py): the outer step's momentum, and what they keep beside (sync=auto:
        the block's pick, ``sync_mode``)."""
        c = trainer.checkpoint()
        outer_buf = rounds.outer._buf
        if outer_buf is not None:
            c.optim[OUTER_MOMENTUM] = outer_buf
        c.extra.update(final=final, gstep=gstep, round=rnd, block_in_work=block,
                       schedule=self.scfg.schedule, swarm=asdict(self.scfg), **rounds.checkpoint_extra())
        return c

    def due(self) -> bool:
        return time.monotonic() - self.last_save > SAVE_EVERY_S

    def save(self, c: ckpt.Checkpoint) -> None:
        """The block in work: its full checkpoint ``c``, and its parameters as a lower block."""
        b, final = _block(c), bool(c.extra.get("final"))
        self.server.publish(CHECKPOINT, ckpt.block_name(b), c)
        extra = {"final": final, "round": c.extra["round"], "gstep": c.extra["gstep"]}
        self.server.publish(LOWER, ckpt.block_name(b), ckpt.Checkpoint(c.config, c.block, c.step, c.tensors, extra=extra))
        if final and self.schedule.relay and b != self.schedule.k:  # only the own block's full state is kept once final
            (self.dir / "serve" / CHECKPOINT / ckpt.block_file(b)).unlink(missing_ok=True)
        self.last_save = time.monotonic()

    def save_final_params(self, j: int, tensors: dict) -> None:
        """A final block taken from the group: its parameters as our lower block (for joiners), and,
        for our own block, as our checkpoint (for serving and assembly)."""
        c = ckpt.Checkpoint(self.mcfg.to_dict(), j, self.schedule.S, tensors,
                            extra={"final": True, "gstep": self.schedule.final_step(j), "train": self.tcfg.to_dict()})
        self.server.publish(LOWER, ckpt.block_name(j), c)
        if j == self.schedule.k:
            self.server.publish(CHECKPOINT, ckpt.block_name(j), c)

    @staticmethod
    def join_state_name(block: int, rnd: int) -> str:
        return f"{ckpt.block_name(block)}.r{rnd}"

    def save_join_state(self, c: ckpt.Checkpoint, rnd: int) -> str:
        """The group's state ``c`` at the end of round ``rnd``, for its joiners; its name."""
        name = self.join_state_name(_block(c), rnd)
        c.extra["round"] = rnd
        self.server.publish(CHECKPOINT, name, c)
        for old in (self.dir / "serve" / CHECKPOINT).glob(f"block*.r*{ckpt.SUFFIX}"):
            r = old.name[:-len(ckpt.SUFFIX)].rpartition(".r")[2]
            if r.isdigit() and int(r) < rnd - 50 * self.scfg.margin:
                old.unlink(missing_ok=True)
        return name

    def publish_own(self, c: ckpt.Checkpoint) -> None:
        self.server.publish(CHECKPOINT, ckpt.block_name(_block(c)), c)

    def load_own(self) -> ckpt.Checkpoint:
        return ckpt.load(self._own)

    def own_has_drafter(self) -> bool:
        return self._own.exists() and bool(ckpt.load(self._own).extra.get("drafter_steps"))

    def find_own(self) -> Found | None:
        """After a restart: our newest state in the work directory, if any. A damaged own
        checkpoint stops us (CheckpointError): the operator must see it."""
        serve = self.dir / "serve"
        if not self.schedule.relay:
            return Found(state=ckpt.load(self._own), path=str(self._own)) if self._own.exists() else None
        finals = {}
        for j in self.schedule.plan:  # the blocks already final, in order
            path = serve / LOWER / ckpt.block_file(j)
            if not path.exists():
                break
            c = ckpt.load(path)
            if not (c.extra.get("final") and int(c.extra.get("gstep", -1)) == self.schedule.final_step(j)):
                break
            finals[j] = c.tensors
        path = serve / CHECKPOINT / ckpt.block_file(len(finals))
        if len(finals) < self.schedule.n_blocks and path.exists():
            c = ckpt.load(path)
            if c.block == len(finals) and not c.extra.get("final"):
                return Found(finals, c, str(path))
        return Found(finals) if finals else None


def _block(c: ckpt.Checkpoint) -> int:
    """A block checkpoint's index (the trainer's own checkpoints are never end-to-end)."""
    if c.block is None:
        raise ckpt.CheckpointError("an end-to-end checkpoint where a block's was expected")
    return c.block
