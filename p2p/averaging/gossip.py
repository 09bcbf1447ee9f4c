"""Gossip: a large group averages in small groups that change every round (sans-IO, pure functions).

Rule 10: a block's group of W members at a round's start, with a gossip size k (W >= 2k: below,
the partition is one small group of everyone, ``uses_gossip``), does not average all-to-all. Each member computes the same partition of the
round's members (``gossip_groups``): every id is ordered by ``sha256("{salt}|{round}|{id}")``
(hex, ties by id), and the member at place i of that order goes to small group i mod G, with
G = W // k groups; so every small group has k to 2k - 1 members, and the partition is new every
round (random groups: a member meets a given other one about once in W / k rounds, and the
spread of the members' points shrinks about k-fold a round). A small group runs an ordinary
``AveragingRound`` (round.py: rules 2-7, robust with 3 or more members) among its members only,
with start ``gossip_start(salt)``: the members' points differ (each averages only with its small
group), so no digest of a common start point can name the group, the round's members and number
do. A member waits only for its own small group: no barrier across the whole group, so a slow or
departed member delays its k - 1 partners, once per departure, by at most their timeout.

What the members average in a gossip round is their parameters (after their local steps), not a
pseudo-gradient from a start point they share: there is none. A lossy dense codec (fp16, bf16,
int8) keeps its error feedback as in any round; the compact codecs (topk, sign) encode an update
from a point every receiver holds, and gossip partners hold no common point, so gossip refuses
them (``check_gossip_codec``).
"""

from __future__ import annotations

import hashlib

from .codec import COMPACT

# The smallest gossip size: below 3 a small group cannot use the robust aggregate (rule 6), and a
# pair would take a malicious partner's vector at half weight.
MIN_GOSSIP_SIZE = 3
# The largest: a small group of k to 2k - 1 members whose robust round sends k - 1 to 2k - 2 copies
# of the vector per member; at 16 that is up to 30, as much as an all-to-all round of 31.
MAX_GOSSIP_SIZE = 16
GOSSIP_START = "gossip"


def uses_gossip(members: int, size: int) -> bool:
    """Whether a group of ``members`` is cut into several small groups of ``size`` (0: never gossip).
    From 2 x size on: below it the partition is a single group (W // k = 1) of every member, an
    all-to-all round of the members' parameters, named as a gossip round (a group that gossiped
    holds no common start point, and one that shrinks below 2k must still average its points)."""
    return size > 0 and members >= 2 * size


def _rank(salt: str, rnd: int, pid: str) -> tuple[str, str]:
    return hashlib.sha256(f"{salt}|{rnd}|{pid}".encode()).hexdigest(), pid


def gossip_groups(members, rnd: int, size: int, salt: str = "") -> list[list[str]]:
    """Round ``rnd``'s partition of ``members`` (ids) into small groups of ``size`` to 2 x size - 1,
    each sorted; the same on every member that holds the same members (rule 10)."""
    if not MIN_GOSSIP_SIZE <= size <= MAX_GOSSIP_SIZE:
        raise ValueError(f"gossip size {size}: expected {MIN_GOSSIP_SIZE}..{MAX_GOSSIP_SIZE}")
    ids = sorted(set(members))
    order = sorted(ids, key=lambda p: _rank(salt, rnd, p))
    count = max(1, len(ids) // size)
    return [sorted(order[g::count]) for g in range(count)]


def gossip_group(members, me: str, rnd: int, size: int, salt: str = "") -> list[str]:
    """The small group of round ``rnd`` that ``me`` (one of ``members``) averages with."""
    for g in gossip_groups(set(members) | {me}, rnd, size, salt):
        if me in g:
            return g
    raise AssertionError("every member is in one small group")


def gossip_start(salt: str = "") -> str:
    """The start point named in a gossip round's ``group`` digest (round.py ``group_digest``)."""
    return f"{GOSSIP_START}|{salt}"


def check_gossip_codec(codec: str) -> None:
    if codec in COMPACT:
        raise ValueError(f"codec {codec!r} encodes an update from a point every receiver holds; gossip "
                         "partners hold none (rule 10): use raw, fp16, bf16 or int8")
