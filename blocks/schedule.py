"""Schedules: when each block trains and how its learning rate decays, in wall steps.

Rules:
- Every schedule gives every block ``steps`` optimizer steps (the same as the end-to-end
  reference); schedules differ only in *when* those steps happen and in the LR plan.
- A block's lower blocks are the checkpoints published at the last refresh (every
  ``refresh_every`` wall steps, and whenever the block starts). ``run_lockstep`` simulates
  K parallel workers in one process, tick by tick; ``blocktrain.blocks.workers`` runs the same
  plans as real processes exchanging checkpoint files.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("relay", "staggered", "parallel", "sequential")


@dataclass(frozen=True)
class BlockPlan:
    start: int  # first wall step at which the block trains
    decay_start: int  # block-local step where the LR decay begins
    decay_end: int  # block-local step where it reaches the floor

    def end(self, steps: int) -> int:
        return self.start + steps


def make_plans(name: str, n_blocks: int, steps: int, decay_frac: float) -> list[BlockPlan]:
    """Per-block plans for schedule ``name``.

    - ``parallel``: all blocks train from step 0, each with the same warmup-stable-decay plan.
    - ``sequential``: block k trains after block k-1 has finished (K x the wall time; idle workers).
    - ``relay``: sequential, but all K workers train the current block together, each on its own
      1/K of every batch, gradients averaged every step (same-block averaging): the same
      optimization as ``sequential``, with every worker busy and 1/K of its wall time per block.
    - ``staggered``: all blocks train from step 0 (every worker busy); block k's decay window is
      the k-th of K consecutive windows of ``decay_frac * steps`` ending at the last step, so each
      block decays while the blocks below it sit at their LR floor.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")
    D = max(1, int(round(decay_frac * steps)))  # as train.wsd_plan
    plans = []
    for k in range(n_blocks):
        if name == "parallel":
            plans.append(BlockPlan(0, steps - D, steps))
        elif name in ("sequential", "relay"):
            plans.append(BlockPlan(k * steps, steps - D, steps))
        else:
            end = steps - (n_blocks - 1 - k) * D
            if end - D < 0:
                raise ValueError(f"staggered: {n_blocks} decay windows of {D} steps do not fit in {steps}")
            plans.append(BlockPlan(0, end - D, end))
    return plans


def work_segments(plans: list[BlockPlan], steps: int, block_costs: list[float]) -> list[tuple[int, float]]:
    """The wall steps of ``plans`` as runs of equal cost, in order: (wall steps, the cost of each),
    where a wall step costs the sum of ``block_costs`` over the blocks training at it."""
    wall = max(p.end(steps) for p in plans)
    edges = sorted({0, wall} | {p.start for p in plans} | {p.end(steps) for p in plans})
    out: list[tuple[int, float]] = []
    for a, b in zip(edges, edges[1:]):
        cost = float(sum(c for p, c in zip(plans, block_costs) if p.start <= a < p.end(steps)))
        if out and out[-1][1] == cost:
            out[-1] = (out[-1][0] + b - a, cost)
        else:
            out.append((b - a, cost))
    return out
