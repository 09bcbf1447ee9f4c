"""Parallel schedule: the input handoff. Block k trains on the newest checkpoints of blocks
0..k-1, pulled from their holders.

Rules:
- A holder is asked first whether its checkpoint changed (a probe of size and digest); only a
  changed one is fetched. A fetched block is checked (checks.py) before use.
- A holder whose bytes fail the checks is never asked again (``bad``, bounded: addresses are
  free); a failed fetch (a bad link) is not held against it.
- ``refresh(wait=True)``: until every lower block is there, with backoff, up to
  ``lower_timeout_s`` (then ``SwarmError``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Callable

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.lower import LowerInputs

from ..averaging import remember
from ..checkpoints import LOWER, CheckpointFetcher, FetchError
from ..view import holders
from ..services import PeerServices
from .checks import StateCheck

log = logging.getLogger("blocktrain.p2p")


class SwarmError(Exception):
    """Training in the swarm cannot go on (a timeout waiting for blocks or a group)."""


class CutOff(SwarmError):
    """The run ended cut off from its group (report.py ``cut_off``): its parameters are its own."""

    def __init__(self, block: int, why: str, report: dict):
        super().__init__(f"cut off from the group: block {block} {why}; its parameters are this peer's own, "
                         f"not the swarm's (report field cut_off; swarm.cut_off_ok=true accepts this)")
        self.block, self.why, self.report = block, why, report


class LowerFeed:
    def __init__(self, peer: PeerServices, k: int, fetcher: CheckpointFetcher, check: StateCheck,
                 refreshes: list, timeout_s: float, waiting: Callable[[], None]):
        self.peer, self.k, self.fetcher, self.check = peer, k, fetcher, check
        self.refreshes, self.timeout_s, self.waiting = refreshes, timeout_s, waiting
        self.inputs = LowerInputs(k, require_final=False)
        self.cache: dict[int, tuple] = {}  # block -> (checkpoint, size, sha) fetched
        self.bad: dict[str, str] = {}  # holder address -> why its lower block was refused (not asked again)

    async def refresh(self, trainer, wait: bool) -> bool:
        """Install newer checkpoints of blocks 0..k-1 into ``trainer``; ``wait``: until every one is
        there. True if the input changed."""
        if self.k == 0:
            return False
        deadline = time.monotonic() + self.timeout_s
        delay = 1.0
        while True:
            for j in range(self.k):
                await self._offer(j)
            if self.inputs.ready():
                changed = self.inputs.install(trainer)
                if changed:
                    self.refreshes.append({"step": trainer.step, "lower_steps": self.inputs.steps})
                return changed
            if not wait:
                return False
            if time.monotonic() > deadline:
                raise SwarmError(f"block {self.k}: lower blocks not available within {self.timeout_s:.0f} s")
            self.waiting()
            await asyncio.sleep(delay)  # retry with backoff: the lower blocks' peers may still be starting
            delay = min(2 * delay, 10.0)

    async def _offer(self, j: int) -> None:
        have = self.cache.get(j)
        for addr in holders(self.peer.members(), j):
            if addr in self.bad:
                continue
            if have is not None:
                now = await self.fetcher.probe(addr, LOWER, ckpt.block_name(j), have[1])
                if now is None:
                    continue
                if now[1] == have[2]:
                    return
            try:
                blob = await self.fetcher.fetch([addr], LOWER, ckpt.block_name(j))
                c = ckpt.decode(blob, f"lower block {j} from {addr}")
                self.check.lower(c, j)
            except (FetchError, ckpt.CheckpointError, ValueError) as e:
                log.info("block %d: lower block %d from %s: %s", self.k, j, addr, e)
                if not isinstance(e, FetchError):  # bad bytes, not a bad link: not asked again
                    remember(self.bad, addr, f"lower block {j}: {e}")  # bounded: addresses are free
                continue
            self.cache[j] = (c, len(blob), hashlib.sha256(blob).digest())
            self.inputs.offer(j, self.cache[j][2], c.step, c.tensors, bool(c.extra.get("final")))
            return
