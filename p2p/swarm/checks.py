"""What a training peer accepts from others: the group's state and the lower blocks it fetches.

Rules:
- A fetched state is used only if it is one of ours: block of our plan, our model config, the
  model's names and shapes, finite values, and every number it carries in range: the block's step
  in [0, S], the global step inside that block's steps, the round the group said (``at``), the
  optimizer's moments of the parameters' shapes, finite (second moments not negative), their step
  counts in [0, this run's steps], and the outer momentum of the block's size. A crafted step of
  10^15 beside a plausible global step was adopted before (the global step alone was checked).
- Finite is not enough: a state scaled 1000x, zeroed or scrambled is refused by its parameter
  norm against a fresh block's (``STATE_NORM_RATIO``) and, where the whole chain is in hand, by the
  CE it scores on our own validation windows (``MAX_STATE_CE``).
- A lower block (parallel schedule) must be that block of our model, finite, at a plausible step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ModelConfig

from .auto import SyncMode
from .schedule import Schedule
from .store import OUTER_MOMENTUM

# A fetched state's parameter norm, against a fresh block's, must lie in this range: training
# moves it (1.6-2.0x after 1000 steps per block, measured on the shipped model of 12-01), it does not
# zero it or scale it 1000x.
STATE_NORM_RATIO = (0.25, 8.0)
# The top head's CE of a fetched state on the joiner's own validation windows may not exceed this
# (a fresh block scores about ln 256 = 5.55; a state that scores worse than that by 0.5 is broken).
MAX_STATE_CE = math.log(256) + 0.5
STATE_CHECK_WINDOWS = 4
# An optimizer's step count no run reaches (its only use is the moments' bias correction).
MAX_OPTIMIZER_STEPS = 10**9


def check_norm(tensors: dict, fresh: dict, block: int) -> None:
    def norm(ts):
        return math.sqrt(sum(float(t.double().square().sum()) for t in ts.values() if t.is_floating_point()))
    ratio = norm(tensors) / max(norm(fresh), 1e-12)
    lo, hi = STATE_NORM_RATIO
    if not lo <= ratio <= hi:
        raise ValueError(f"block {block}: parameter norm {ratio:.3g}x a fresh block's (plausible: {lo}-{hi}x)")


def _finite(tensors: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


@dataclass
class StateCheck:
    mcfg: ModelConfig
    schedule: Schedule
    valid: torch.Tensor
    seq_len: int

    def _shapes(self, b: int) -> dict:
        from blocktrain.blocks.model import Block
        return {n: t.shape for n, t in Block(self.mcfg, b).state_dict().items()}

    def state(self, c: ckpt.Checkpoint, lowers: dict, at: int | None = None) -> None:
        """The group's state (and, relay, the final blocks below it); ValueError if not one of ours.
        ``at``: the round the group said the state is after (its welcome)."""
        if ModelConfig.from_dict(c.config) != self.mcfg:
            raise ValueError("the group's model config differs from ours")
        if c.block is None or c.block not in self.schedule.plan:
            raise ValueError(f"the group trains block {c.block}, not one of ours {list(self.schedule.plan)}")
        for tensors, b in [(c.tensors, c.block)] + [(t, j) for j, t in lowers.items()]:
            if {n: t.shape for n, t in tensors.items()} != self._shapes(b):
                raise ValueError(f"block {b}: tensors do not match the model (names or shapes)")
            if not _finite(tensors):
                raise ValueError(f"block {b}: NaN or inf in the parameters")
        self._numbers(c, at)
        with torch.random.fork_rng(devices=[]):  # fresh blocks to compare with draw no random number of ours
            self._plausible(c, lowers)

    def _numbers(self, c: ckpt.Checkpoint, at: int | None) -> None:
        """Every number of the state in range (steps, round, optimizer state), before any is used."""
        S = self.schedule.S
        assert c.block is not None  # state() checked it
        if not isinstance(c.step, int) or not 0 <= c.step <= S:
            raise ValueError(f"implausible step {c.step} (a block has {S})")
        g, first = c.extra.get("gstep", c.step), self.schedule.plan.index(c.block) * S
        if not isinstance(g, int) or not first <= g <= first + S:
            raise ValueError(f"implausible step: global step {g} outside block {c.block}'s steps [{first}, {first + S}]")
        mode = c.extra.get("sync_mode", "")
        if mode != "" and SyncMode.parse(mode) is None:  # sync=auto's pick (auto.py)
            raise ValueError(f"implausible sync mode {str(mode)[:40]!r}")
        rnd = c.extra.get("round", at)
        if at is not None and rnd != at:
            raise ValueError(f"implausible round {rnd} (the group said {at})")
        shapes = self._shapes(c.block)
        for name, t in c.optim.items():
            param, _, kind = name.rpartition(".")
            if name == OUTER_MOMENTUM:
                n = sum(math.prod(s) for s in shapes.values())
                if tuple(t.shape) != (n,) or not _finite({name: t}):
                    raise ValueError(f"outer momentum of shape {tuple(t.shape)} (the block has {n} values) or not finite")
            elif param not in shapes or kind not in ("exp_avg", "exp_avg_sq", "step"):
                raise ValueError(f"optimizer state {name!r} is not of this block")
            elif kind == "step":  # AdamW's count runs ahead of the block's step (rounds that failed under
                if t.numel() != 1 or not 0 <= float(t) <= MAX_OPTIMIZER_STEPS:  # sync params keep their steps)
                    raise ValueError(f"implausible optimizer step count in {name!r} (at most {MAX_OPTIMIZER_STEPS})")
            elif t.shape != shapes[param] or not _finite({name: t}) or (kind == "exp_avg_sq" and bool((t < 0).any())):
                raise ValueError(f"optimizer state {name!r}: shape {tuple(t.shape)}, not finite, or a negative moment")

    def _plausible(self, c: ckpt.Checkpoint, lowers: dict) -> None:
        from blocktrain.blocks.model import Block
        assert c.block is not None  # state() checked it
        for tensors, b in [(c.tensors, c.block)] + [(t, j) for j, t in lowers.items()]:
            check_norm(tensors, Block(self.mcfg, b).state_dict(), b)
        if self.schedule.relay or c.block == 0:  # the whole chain is in hand: what it scores on our own windows
            chain = []
            for j in range(c.block + 1):
                blk = Block(self.mcfg, j)
                blk.load_state_dict(c.tensors if j == c.block else lowers[j])
                chain.append(blk)
            from blocktrain.blocks.train import eval_chain
            ce = eval_chain(chain, self.valid, self.seq_len, STATE_CHECK_WINDOWS)[-1]
            if not ce <= MAX_STATE_CE:  # also NaN
                raise ValueError(f"block {c.block}: the state scores CE {ce:.3g} on our validation windows "
                                 f"(a fresh block scores about {math.log(256):.2f}; more than {MAX_STATE_CE} is "
                                 f"not a state any training reached)")

    def lower(self, c: ckpt.Checkpoint, j: int) -> None:
        """A lower block fetched from a holder (parallel schedule)."""
        if c.block != j or ModelConfig.from_dict(c.config) != self.mcfg:
            raise ValueError(f"not block {j} of our model")
        if {n: t.shape for n, t in c.tensors.items()} != self._shapes(j):
            raise ValueError("tensors do not match the model")
        if not _finite(c.tensors):
            raise ValueError("NaN or inf in the parameters")
        if not 0 <= c.step <= self.schedule.S:
            raise ValueError(f"implausible step {c.step}")
