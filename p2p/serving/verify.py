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
  it each recompute beside the first chain's other hops, and again beside the second's. A holder
  outside the largest group that agrees (within ``tol``, at least 2 strong) beside both is
  *named*; outside it beside one only, or when a peer sits in both chains' other hops (a block
  with one holder, or a peer serving several blocks), it is a *suspect*
  (avoided for the next try, not named): every hop sees the route, so a liar may lie only beside
  a peer it wants avoided, and one context cannot tell them apart. Two holders that disagree,
  with no third to judge: ``VerifyError`` naming both. At most 2 + K + 2K (MAX_JUDGES - 1)
  traversals in all.
- The first chain agreeing with the second now, but not with what it answered while decoding
  (an intermittent liar), or no one swap explaining the difference: every checked hop of the
  first chain is a suspect; nobody is named.
- The output is good when no hop of the first chain is named or suspect (a liar in the second
  chain only cost the search). Otherwise the client avoids the named hops and the suspects and
  generates again (a bounded number of tries).
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

from .api import VERIFY_TOL, PipelineError

DEFAULT_TOL = VERIFY_TOL  # total-variation distance (api.py: the client and the CLI share it)
MAX_JUDGES = 3  # holders of a disputed block asked to recompute: the fewest that can outvote one liar


class VerifyError(PipelineError):
    """The output could not be checked, or its chain could not be judged: nothing is printed
    (``holders``: the disagreeing holders, when that is why)."""

    def __init__(self, msg: str, holders: list[str] | None = None):
        super().__init__(msg, fault="request")
        self.holders = holders or []


class OutputRejected(PipelineError):
    """The output failed its check: its chain had a named or suspect hop (``avoid``); try again
    through another chain."""

    def __init__(self, msg: str, avoid: list[str]):
        super().__init__(msg)
        self.avoid = avoid


class CheckFailed(PipelineError):
    """A recomputing chain failed (not the output's): ``addr`` is its failed hop, when known."""

    def __init__(self, msg: str, addr: str | None):
        super().__init__(msg)
        self.addr = addr


@dataclass
class Check:
    ok: bool  # the output's rows agree with a second chain, and no hop of its chain was named
    second: list[str]  # the second chain
    gap: float  # row_gap(decoded, second chain)
    unchecked: list[int]  # blocks with one holder: recomputed by the same hop
    named: list[str] = field(default_factory=list)  # hops whose answers differ from the other holders'
    traversals: int = 1
    why: str = ""
    suspects: list[str] = field(default_factory=list)  # avoided for the next try, not named: unresolved

    def as_dict(self) -> dict:
        return {"ok": self.ok, "second_route": self.second, "gap": round(self.gap, 6), "unchecked_blocks": self.unchecked,
                "named": self.named, "suspects": self.suspects, "traversals": self.traversals, "why": self.why}


def _minority(answers: dict[str, torch.Tensor], tol: float) -> list[str] | None:
    """The holders outside the largest group whose answers agree (within ``tol``), or None when no
    two agree."""
    judges = list(answers)
    agree = {h: [g for g in judges if row_gap(answers[h], answers[g]) <= tol] for h in judges}
    best = max(judges, key=lambda h: len(agree[h]))
    return None if len(agree[best]) < 2 else [h for h in judges if h not in agree[best]]


async def _judge(b: int, chains: tuple[list[str], list[str]], answered: tuple[torch.Tensor, torch.Tensor],
                 holders: dict[int, list[str]], rows: Callable[[list[str]], Awaitable[torch.Tensor]],
                 tol: float) -> tuple[list[str], list[str], int]:
    """Disputed block b: up to MAX_JUDGES of its holders recompute beside either chain's other hops
    (``answered``: what each chain answered as it is). Returns the holders named, the suspects, and
    the traversals it took; ``VerifyError`` where no two of them agree."""
    first, second = chains
    judges = list(dict.fromkeys([first[b], second[b], *holders.get(b, [])]))[:MAX_JUDGES]
    minorities, n = [], 0
    for chain, ans in zip(chains, answered):  # each judge beside either chain's other hops
        answers = {}
        for h in judges:
            if h == chain[b]:
                answers[h] = ans
            else:
                answers[h] = await rows(chain[:b] + [h] + chain[b + 1:])
                n += 1
        m = _minority(answers, tol)
        if m is None:
            raise VerifyError(f"block {b}: holders {judges} disagree and no two agree: cannot tell which is "
                              f"wrong (start a third holder, or --allow only peers you trust)", judges)
        minorities.append(m)
    # named: wrong beside both chains, when no peer sits in both chains' other hops (a hop that
    # sees the route may lie only beside a peer it wants avoided; one peer may serve several
    # blocks, or a block may have one holder); else only avoided
    independent = not set(first[:b] + first[b + 1:]) & set(second[:b] + second[b + 1:])
    both = [h for h in minorities[0] if h in minorities[1]] if independent else []
    return both, [h for h in dict.fromkeys(minorities[0] + minorities[1]) if h not in both], n


async def check_output(decoded: torch.Tensor, first: list[str], holders: dict[int, list[str]],
                       rows: Callable[[list[str]], Awaitable[torch.Tensor]], tol: float = DEFAULT_TOL) -> Check:
    """Check ``decoded`` (what chain ``first`` answered) against other ``holders`` of each block
    (live serving peers, the first chain's included or not); ``rows(route)`` recomputes."""
    K = len(first)
    second = [next((h for h in holders.get(b, []) if h != first[b]), first[b]) for b in range(K)]
    unchecked = [b for b in range(K) if second[b] == first[b]]
    checked = [b for b in range(K) if b not in unchecked]
    if not checked:
        raise VerifyError(f"cannot check the output: no block has a second live serving peer (chain {first})")
    n = 1
    ref = await rows(second)
    gap = row_gap(decoded, ref)
    if gap <= tol:
        return Check(True, second, gap, unchecked, traversals=n)
    again = await rows(first)
    n += 1
    if row_gap(again, ref) <= tol:  # the first chain agrees now, not while it decoded: which hop, unknown
        return Check(False, second, gap, unchecked, [], n,
                     "the chain answered differently while decoding than when asked again",
                     suspects=[first[b] for b in checked])
    disputed = []
    for b in checked:
        swapped = await rows(first[:b] + [second[b]] + first[b + 1:])
        n += 1
        if row_gap(swapped, again) > tol:
            disputed.append(b)
    if not disputed:  # more than one hop at once: avoid the chain's checked hops, name nobody
        return Check(False, second, gap, unchecked, [], n, "no one hop explains the difference",
                     suspects=[first[b] for b in checked])
    named: list[str] = []
    suspects: list[str] = []
    for b in disputed:
        wrong, suspect, k = await _judge(b, (first, second), (again, ref), holders, rows, tol)
        named, suspects, n = named + wrong, suspects + suspect, n + k
    if row_gap(decoded, again) > tol:  # and the first chain answered otherwise while it decoded
        suspects += [first[b] for b in checked]
    avoided = set(named) | set(suspects)
    ok = not avoided & set(first)
    return Check(ok, second, gap, unchecked, named, n,
                 "" if ok else "a hop of the chain gave answers the other holders of its block do not",
                 suspects=[h for h in dict.fromkeys(suspects) if h not in named])
