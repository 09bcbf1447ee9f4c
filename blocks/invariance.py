"""Is exact decoding batch invariant on this machine? The check a serving hop runs at start.

Rules:
- The model computes exact rows on fixed-shape tiles (blocks/model.py's rules), so a row's
  result can depend only on the row and its place within a tile; that last dependence is a
  property of this machine's kernels, which ``check_block`` measures on the served block itself,
  at its widths and with its weights: tokens decoded one per step against the same tokens in one
  step, in steps that put each token at other places of a tile, and behind another session's
  rows; every output row, cached key and value, and the head's logits, bitwise.
- ``choose_tile_rows`` sets a block's ``tile_rows``: ``TILE_ROWS`` where the check passes;
  else 1 (every row alone in its call: a place in a tile no longer exists), the slower path;
  else none: exact decoding is refused on this machine (never served unexact under its name).
- At one torch thread, as bt-peer serve computes (threads split a call by its size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .model import TILE_ROWS, Block, BlockCache


@dataclass(frozen=True)
class RowCheck:
    """What the start-up check found for one block: the rows per call exact decoding uses
    (None: refused), what made the faster tiles fail (None: nothing), and its cost."""
    block: int
    tile_rows: int | None
    finding: str | None
    seconds: float

    def describe(self) -> str:
        if self.tile_rows is None:
            return (f"exact and autoregressive decoding refused: rows differ by what is computed beside them "
                    f"({self.finding})")
        if self.tile_rows == TILE_ROWS:
            return f"exact: batch invariant in tiles of {TILE_ROWS} rows (checked at start, {self.seconds * 1e3:.0f} ms)"
        return (f"exact: row by row, slower ({self.finding}; checked at start, "
                f"{self.seconds * 1e3:.0f} ms)")


def _causal(past: int, T: int) -> torch.Tensor:
    return torch.ones(T, past + T, dtype=torch.bool).tril(diagonal=past)


@torch.no_grad()
def check_block(block: Block, rows: int, seed: int = 0) -> str | None:
    """None if ``block``, at ``rows`` rows per call, computes every exact row bitwise alike at
    every place of a tile (alone in a step, among its own session's rows, behind another
    session's): what the tiles cannot fix by their shape (model.py's rules; the number of keys
    and where masked keys sit are left to the construction); else the first difference found."""
    saved = block.tile_rows
    block.tile_rows = rows
    try:
        return _differences(block, rows, seed)
    finally:
        block.tile_rows = saved


def _differences(block: Block, rows: int, seed: int) -> str | None:
    g = torch.Generator().manual_seed(seed)
    n = min(2 * rows + 3, block.cfg.max_seq_len)  # every place of a tile and a partial one, as the context allows
    behind = min(rows + 1, block.cfg.max_seq_len)  # another session's rows before ours: ours at other places
    C = block.cfg.d_model

    def tokens(k: int) -> torch.Tensor:
        if block.is_first:
            return torch.randint(0, 256, (1, k), generator=g)
        return torch.randn(1, k, C, generator=g)
    x = tokens(n)

    def run(splits: list[int], lead: int) -> tuple[torch.Tensor, BlockCache]:
        """x decoded in steps of ``splits`` tokens, each behind ``lead`` rows of another session."""
        cache, outs, i = BlockCache(block), [], 0
        for size in splits:
            step = (x[:, i:i + size], cache, list(range(i, i + size)), _causal(i, size), size, None)
            other = (tokens(lead), BlockCache(block), list(range(lead)), _causal(0, lead), lead, None)
            outs.append(block.extend_many([other, step] if lead else [step])[-1])
            i += size
        return torch.cat(outs, dim=1), cache

    want, want_cache = run([1] * n, 0)
    cut, two = min(rows + 1, n - 1), min(2, n - 1)
    for splits, lead in (([n], 0), ([cut, n - cut], 0), ([n], min(3, behind)), ([two, n - two], behind)):
        splits = [s for s in splits if s > 0]
        got, cache = run(splits, lead)
        where = f"{n} tokens in steps of {splits}" + (f" behind {lead} rows of another session" if lead else "")
        if not torch.equal(got, want):
            return f"{where}: outputs differ from one token per step"
        for a, b in zip(cache.layers, want_cache.layers):
            if not (torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])):
                return f"{where}: cached keys or values differ from one token per step"
    if block.head is not None and not block.head.layers:  # the last block's readout
        one = torch.cat([block.logits(want[:, i:i + 1], exact=True) for i in range(n)], dim=1)
        if not torch.equal(block.logits(want, exact=True), one):
            return f"the head's logits of {n} rows differ from each row's alone"
    return None


def choose_tile_rows(block: Block) -> RowCheck:
    """Check ``block`` at TILE_ROWS rows per call, then at 1; set its ``tile_rows`` to the first
    that holds (``RowCheck.tile_rows`` None: neither did, and exact decoding is refused)."""
    t0 = time.perf_counter()
    finding = check_block(block, TILE_ROWS)
    chosen: int | None = TILE_ROWS
    if finding is not None:
        chosen = 1 if check_block(block, 1) is None else None
    if chosen is not None:
        block.tile_rows = chosen
    return RowCheck(block.index, chosen, finding, time.perf_counter() - t0)
