"""Which block a training peer works on, and what falls due, at each global step: pure, no torch.

Rules:
- ``relay`` (the default): the plan is every block, lowest first. Global steps count across blocks:
  block ``plan[i]`` is trained over global steps ``i*S .. (i+1)*S``; at ``(i+1)*S`` it is final
  (kept frozen as a lower block) and the next one starts. The peer ends holding every block.
- ``parallel``: the plan is the peer's own block ``k``; global steps are that block's steps, and
  the lower blocks are pulled from their holders every ``max(H, refresh_every)`` steps.
- A round is ``H`` steps; ``S`` splits into whole rounds, so a round never spans two blocks. Under
  ``sync=auto`` (auto.py) ``H`` changes inside a block (``pick``): a round is then ``H`` steps or
  what is left of the block, whichever is fewer (``round_steps``).
- A block's last round ends at a multiple of ``S``: the group waits for it in full (relay handoff).
- Valid-CE points of the curve: whenever ``gstep`` passes a multiple of ``eval_every`` (-1: about
  ``EVAL_POINTS`` over the run; 0: none).
- Reports and progress lines: about 20 over the run.
"""

from __future__ import annotations

from dataclasses import dataclass

EVAL_POINTS = 20  # valid-CE points over a run when swarm.eval_every is -1 (the default)
REPORTS = 20  # report writes and progress lines over a run


@dataclass
class Schedule:
    k: int  # the block this peer holds and serves
    n_blocks: int
    S: int  # steps per block
    H: int  # steps per round
    relay: bool = True
    eval_every: int = -1
    refresh_every: int = 0  # parallel: steps between lower-block refreshes (at least H)
    picked: bool = False  # H was picked inside a block (sync=auto): rounds end off its multiples

    def __post_init__(self):
        if self.S % self.H:
            raise ValueError(f"{self.S} steps per block do not split into rounds of {self.H} steps")

    def pick(self, h: int) -> None:
        """Rounds of ``h`` steps from now on (sync=auto's pick, not a divisor of S: the block's last
        round is what is left of it)."""
        if h < 1:
            raise ValueError(f"rounds of {h} steps")
        self.picked = self.picked or h != self.H
        self.H = h

    def round_steps(self, gstep: int) -> int:
        """The steps of the round starting after ``gstep`` steps."""
        return min(self.H, self.S - gstep % self.S)

    def set_steps(self, steps: int) -> None:
        """Another number of steps per block (before training starts; every room shares this object)."""
        if steps % self.H:
            raise ValueError(f"{steps} steps do not split into rounds of {self.H}")
        self.S = steps

    @property
    def plan(self) -> tuple[int, ...]:
        """The blocks this peer trains, in order."""
        return tuple(range(self.n_blocks)) if self.relay else (self.k,)

    @property
    def total_steps(self) -> int:
        return self.S * len(self.plan)

    def block_at(self, gstep: int) -> int:
        """The block in work at global step ``gstep`` (the last one's once all are done)."""
        return self.plan[min(gstep // self.S, len(self.plan) - 1)] if self.relay else self.k

    def final_step(self, block: int) -> int:
        """The global step at which ``block`` is final."""
        return (self.plan.index(block) + 1) * self.S

    def ends_block(self, gstep: int, block: int) -> bool:
        """Relay: ``gstep`` (steps done) ends ``block``, the block in work, which becomes final. A
        failed first round of a block leaves gstep at the block's start: that ends nothing (the
        old test, gstep a multiple of S, published the untrained block as final then)."""
        return self.relay and gstep == self.final_step(block)

    def last_round(self, gstep: int) -> bool:
        """The round starting after ``gstep`` steps is its block's last."""
        return gstep % self.S + self.H >= self.S

    def refresh_due(self, gstep: int) -> bool:
        """Parallel: time to pull newer lower blocks before the next round."""
        return not self.relay and self.k > 0 and gstep > 0 and self._passed(gstep, max(self.H, self.refresh_every))

    def _passed(self, gstep: int, every: int) -> bool:
        """Rounds of one H from the block's start: ``gstep`` is a multiple of ``every``, as always.
        Rounds picked inside a block (auto's, after its probe rounds) end anywhere: the round that
        ended at ``gstep`` passed one (a change of H may make one come twice, never skip one)."""
        if not self.picked:
            return gstep % every == 0
        return gstep % every == 0 or gstep // every > max(0, gstep - self.H) // every

    @property
    def eval_period(self) -> int:
        """Steps between valid-CE points (0: none)."""
        return self.eval_every if self.eval_every >= 0 else max(1, self.total_steps // EVAL_POINTS)

    def eval_mark(self, gstep: int) -> int | None:
        """Which multiple of the CE period ``gstep`` has passed; a point is due when it changes."""
        every = self.eval_period
        return gstep // every if every else None

    def report_due(self, gstep: int) -> bool:
        return self._passed(gstep, max(1, self.total_steps // REPORTS))


@dataclass
class Position:
    """Where the run is, shared by the rooms: the block in work, global steps done (relay: across
    blocks), and the last round attempted (a failed round still uses up its number)."""
    block: int
    gstep: int = 0
    rnd: int = 0
