"""A training peer's CE measurements: valid CE of every head along the chain it holds, at the
start, at the schedule's curve marks and at the end, and the seconds they took (not training:
the busy fraction and the curve's wall times leave them out)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import torch

from .schedule import Schedule


class Evaluation:
    def __init__(self, schedule: Schedule, valid: torch.Tensor, seq_len: int, windows: int, curve: list):
        self.schedule, self.valid, self.seq_len, self.windows = schedule, valid, seq_len, windows
        self.curve = curve  # (global step, wall seconds, CE per head), the report's
        self.ce: dict = {}  # start, start_step, end, heads
        self.seconds = 0.0  # spent evaluating, at the curve's marks and after a fetched state
        self._mark = 0  # the CE period's multiple at the last curve point

    def heads(self, tr) -> list[float]:
        """Valid CE of every head along ``tr``'s chain (relay: up to the block in work). The
        trainer's frozen lower blocks are the chain (relay: the final ones): this runs in a worker
        thread, where building fresh blocks would draw from torch's global generator while another
        peer of the process seeds it to build its next block (in-process swarms split on the start
        point of a block, a test seen failing 1 in 8)."""
        from blocktrain.blocks.train import eval_chain
        return eval_chain(list(tr.lower) + [tr.block], self.valid, self.seq_len, self.windows)

    async def start(self, tr, gstep: int, timed: bool) -> None:
        """The CE we start from; ``timed``: once training began (a fetched state), so it counts as
        evaluation time (before training began it counts as nothing)."""
        t = time.monotonic()
        self.ce["start"] = (await asyncio.to_thread(self.heads, tr))[-1]
        self.ce["start_step"] = gstep
        if timed:
            self.seconds += time.monotonic() - t

    async def point(self, tr, gstep: int, wall_seconds: Callable[[], float]) -> None:
        """A curve point, where the schedule marks one."""
        mark = self.schedule.eval_mark(gstep)
        if mark is not None and mark != self._mark:
            self._mark = mark
            t = time.monotonic()
            heads = await asyncio.to_thread(self.heads, tr)
            self.seconds += time.monotonic() - t
            self.curve.append((gstep, round(wall_seconds(), 3), heads))

    async def end(self, tr) -> None:
        heads = await asyncio.to_thread(self.heads, tr)
        self.ce["end"], self.ce["heads"] = heads[-1], heads
