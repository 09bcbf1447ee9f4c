"""The last block's draft phase: after the schedule, the draft model (what exact-mode serving
drafts with) trains on this peer's own data with the chain frozen. Local work, no averaging."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

DRAFT_CHUNK = 25  # draft steps per trip off the event loop


async def train_drafter(trainer, n: int, curve: list, say: Callable[[str], None]) -> float:
    """``n`` draft steps of ``trainer`` (a BlockTrainer of the last block); KLs per chunk into
    ``curve``, progress a few times; the seconds it took."""
    phase = trainer.draft_phase()
    say(f"training the draft model of block {trainer.k} for {n} steps (local, the chain frozen)")
    t0 = time.monotonic()
    while phase.step < n:
        chunk = min(DRAFT_CHUNK, n - phase.step)
        kls = await asyncio.to_thread(lambda: [phase.train_step() for _ in range(chunk)][-1])
        curve.append((phase.step, [round(k, 4) for k in kls]))
        if phase.step % max(1, n // 4) < chunk or phase.step == n:  # also on a terminal: the bar is done
            rate = phase.step / (time.monotonic() - t0)
            say(f"draft step {phase.step}/{n} ({rate:.2f} step/s, {(n - phase.step) / rate:.0f} s left), "
                f"KL per drafted byte {', '.join(f'{k:.3f}' for k in kls)}")
    return time.monotonic() - t0
