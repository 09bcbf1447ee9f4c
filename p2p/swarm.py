"""Swarm training of one block: local steps, and every H steps a DiLoCo-style outer step
averaged with the other peers on the same block.

Rules:
- The pseudo-gradient of a round is (parameters at the round's start) - (parameters now). It is
  averaged over the group (``Averager``), then the outer optimizer moves the round's start point
  (SGD or Nesterov); everyone in the group ends the round with the same parameters.
- A round that fails (coverage below the threshold) changes nothing: the local parameters stay
  as they are and the next round starts from them. It is reported, never hidden.
- The group is every live member announcing the same block (and this peer). Training steps run
  off the event loop, so heartbeats and streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from .averaging import Averager, OuterOptimizer, RoundFailed, flatten, unflatten_

log = logging.getLogger("blocktrain.p2p")


@dataclass
class SwarmReport:
    rounds: list = field(default_factory=list)  # per round: coverage, members, seconds, bytes
    failed: list = field(default_factory=list)  # per failed round: the reason
    losses: list = field(default_factory=list)


class SwarmBlockTrainer:
    def __init__(self, peer, trainer, averager: Averager, every: int = 50, outer: OuterOptimizer | None = None):
        self.peer, self.trainer, self.averager = peer, trainer, averager
        self.every = every
        self.outer = outer or OuterOptimizer()
        self.report = SwarmReport()
        self.params = list(trainer.block.parameters())

    def group(self) -> dict[str, str]:
        k = self.trainer.k
        g = {self.peer.id: self.peer.addr}
        for pid, m in self.peer.members.items():
            if m.state == "alive" and k in m.info.blocks and m.info.role == "train":
                g[pid] = m.info.addr
        return g

    async def run(self, steps: int) -> SwarmReport:
        start = flatten(self.params)
        for _ in range(steps):
            loss = await asyncio.to_thread(self.trainer.train_step)
            self.report.losses.append(loss)
            if self.trainer.step % self.every:
                continue
            rnd = self.trainer.step // self.every
            pseudo_grad = start - flatten(self.params)
            try:
                avg, rep = await self.averager.average(rnd, pseudo_grad, self.group())
            except RoundFailed as e:
                log.warning("%s", e)
                self.report.failed.append({"round": rnd, "reason": str(e)})
                start = flatten(self.params)
                continue
            new = self.outer.step(start, avg)
            unflatten_(self.params, new)
            start = new
            self.report.rounds.append({"round": rnd, "coverage": rep.coverage, "members": len(rep.members),
                                       "seconds": rep.seconds, "bytes_sent": rep.bytes_sent})
        return self.report
