"""Checking served output (``bt-peer generate --verify``): recompute it on other holders, and
name a hop whose answers differ.

Rules:
- What is checked: the rows the client decoded from (``Session.rows``, one next-byte logits row
  per output byte; blocktrain: its one traversal's logits). When the output is done, one more
  traversal recomputes them through a second chain: each block on another live serving holder
  where one exists (blocks with a single holder are ``unchecked``, and said so). Rows within
  ``tol`` of the decoded ones (``decode.row_gap``: the largest total-variation distance between
  two next-byte distributions) pass: one traversal, for an honest swarm.
- Rows that differ start a search for the hop, bounded: the first chain recomputes; then, per
  block where the two chains differ, the first chain with that one hop swapped for the second's.
  A block whose swap moves the rows past ``tol`` is in dispute; up to ``MAX_JUDGES`` holders of
  it each recompute in the first chain, and every holder outside the largest group that agrees
  (within ``tol``, at least 2 strong) is named. Two holders that disagree, with no third to judge:
  ``VerifyError`` naming both. At most 2 + K + K * MAX_JUDGES traversals in all.
- The first chain agreeing with the second now, but not with what it answered while decoding:
  its hops answer differently when asked again (an intermittent liar); every hop of it that has
  an alternative is named. Nothing to name at all: ``VerifyError``.
- The output is good when no hop of the first chain is named (a liar in the second chain only
  cost the search). Otherwise the client avoids the named hops and generates again.
- Not checked: a block with one holder; holders that lie alike (colluding, or one identity
  behind several); a difference within ``tol``. The rows are compared, not the sampling: the
  client samples itself.
- No socket here: ``rows(route)`` (an awaitable supplied by the client) recomputes on a route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from blocktrain.blocks.decode import row_gap

from .serving import PipelineError

DEFAULT_TOL = 0.02  # total-variation distance: far above rounding (1e-8 here), far below a lie
MAX_JUDGES = 3  # holders of a disputed block asked to recompute


class VerifyError(PipelineError):
    """The output could not be checked, or its chain could not be judged: nothing is printed."""

    def __init__(self, msg: str, named: list[str] | None = None):
        super().__init__(msg, fault="request")
        self.named = named or []


@dataclass
class Check:
    ok: bool  # the output's rows agree with a second chain, and no hop of its chain was named
    second: list[str]  # the second chain
    gap: float  # row_gap(decoded, second chain)
    unchecked: list[int]  # blocks with one holder: recomputed by the same hop
    named: list[str] = field(default_factory=list)  # hops whose answers differ from the other holders'
    traversals: int = 1
    why: str = ""

    def as_dict(self) -> dict:
        return {"ok": self.ok, "second_route": self.second, "gap": round(self.gap, 6), "unchecked_blocks": self.unchecked,
                "named": self.named, "traversals": self.traversals, "why": self.why}


async def check_output(decoded: torch.Tensor, first: list[str], holders: dict[int, list[str]],
                       rows: Callable[[list[str]], Awaitable[torch.Tensor]], tol: float = DEFAULT_TOL) -> Check:
    """Check ``decoded`` (what chain ``first`` answered) against other ``holders`` of each block
    (live serving peers, the first chain's included or not); ``rows(route)`` recomputes."""
    K = len(first)
    second = [next((h for h in holders.get(b, []) if h != first[b]), first[b]) for b in range(K)]
    unchecked = [b for b in range(K) if second[b] == first[b]]
    if not [b for b in range(K) if b not in unchecked]:
        raise VerifyError(f"cannot check the output: no block has a second live serving peer (chain {first})")
    n = 1
    ref = await rows(second)
    gap = row_gap(decoded, ref)
    if gap <= tol:
        return Check(True, second, gap, unchecked, traversals=n)
    again = await rows(first)
    n += 1
    if row_gap(again, ref) <= tol:  # the first chain agrees now, not while it decoded
        return Check(False, second, gap, unchecked, [first[b] for b in range(K) if b not in unchecked], n,
                     "the chain answered differently while decoding than when asked again")
    named: list[str] = []
    disputed = []
    for b in range(K):
        if b in unchecked:
            continue
        swapped = await rows(first[:b] + [second[b]] + first[b + 1:])
        n += 1
        if row_gap(swapped, again) > tol:
            disputed.append(b)
    if not disputed:
        raise VerifyError(f"the chains {first} and {second} disagree (gap {gap:.3f}) but no one hop explains it")
    for b in disputed:
        judges = list(dict.fromkeys([first[b], second[b], *holders.get(b, [])]))[:MAX_JUDGES]
        answers = {first[b]: again}
        for h in judges:
            if h not in answers:
                answers[h] = await rows(first[:b] + [h] + first[b + 1:])
                n += 1
        agree = {h: [g for g in judges if row_gap(answers[h], answers[g]) <= tol] for h in judges}
        best = max(judges, key=lambda h: len(agree[h]))
        if len(agree[best]) < 2:
            raise VerifyError(f"block {b}: holders {judges} disagree and no two agree: cannot tell which is wrong "
                              f"(start a third holder, or --allow only peers you trust)", judges)
        named += [h for h in judges if h not in agree[best]]
    ok = not set(named) & set(first)
    return Check(ok, second, gap, unchecked, named, n,
                 "" if ok else "a hop of the chain gave answers the other holders of its block do not")
