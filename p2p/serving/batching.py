"""Continuous batching at a serving hop: the chunks of every traversal holding a compute slot
are computed together, one forward over the rows of all (``decode.step_together``).

Rules:
- ``step(traversal)`` queues the traversal's next chunk and returns what ``Traversal.took``
  returns (None while chunks are left, then the result), or raises what its rollback or readout
  raised. Who may queue a chunk is fair.py's business: a traversal queues one only while it holds
  a compute slot, so a batch holds at most as many chunks as the hop has slots.
- One batch at a time, on the hop's one compute thread. A batch takes every chunk queued when it
  starts; chunks queued meanwhile go in the next. Before a batch starts the loop runs what is
  ready (``GATHER`` passes), so the traversals the last batch woke queue their next chunks in it,
  instead of every other batch running half full.
- A session's chunks are in order and one at a time (its traversal waits for each); sessions in
  one batch share nothing but the weights and the projections' rows, which are bitwise those of
  each alone (``Block.extend_many``).
- A traversal whose holder was cancelled while its chunk was queued is skipped; one cancelled
  while its chunk computes finishes that chunk (the hop only cancels at its stop).
- A failure stays with the traversal that raised it (``decode.step_together``); should the
  batching itself fail or be cancelled, every chunk queued or computing is failed with it, so
  no traversal waits for an answer that will not come.
- What it counts (``batches``, ``chunks``, ``largest``) goes in the hop's report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from blocktrain.blocks.decode import Traversal, step_together

GATHER = 2  # loop passes before a batch starts: a woken traversal's task runs, then queues its chunk


class Batcher:
    def __init__(self, threads: concurrent.futures.Executor):
        self._threads = threads
        self._queued: list[tuple[Traversal, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self.batches = self.chunks = self.largest = 0

    async def step(self, traversal: Traversal) -> object:
        """The traversal's next chunk, computed with whatever else is queued (see the rules)."""
        fut = asyncio.get_running_loop().create_future()
        self._queued.append((traversal, fut))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[tuple[Traversal, asyncio.Future]] = []
        try:
            while self._queued:
                for _ in range(GATHER):
                    await asyncio.sleep(0)
                batch = [(t, f) for t, f in self._queued if not f.done()]  # done: cancelled meanwhile
                self._queued = []
                if not batch:
                    continue
                outs = await loop.run_in_executor(self._threads, step_together, [t for t, _ in batch])
                self.batches += 1
                self.chunks += len(batch)
                self.largest = max(self.largest, len(batch))
                for (_, fut), out in zip(batch, outs):
                    if fut.done():
                        continue
                    if isinstance(out, BaseException):
                        fut.set_exception(out)
                    else:
                        fut.set_result(out)
                batch = []
        except BaseException as e:  # noqa: BLE001 - nobody is left waiting (the rules)
            for _, fut in batch + self._queued:
                if not fut.done():  # each its own exception (one object raised in many tasks grows its traceback)
                    err = RuntimeError(f"the hop's batching stopped: {e!r}")
                    err.__cause__ = e
                    fut.set_exception(err)
            self._queued = []
            if isinstance(e, asyncio.CancelledError):
                raise

    def report(self) -> dict:
        return {"batches": self.batches, "chunks": self.chunks, "largest_batch": self.largest}
