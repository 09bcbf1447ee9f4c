"""Gossip: a large group averages in small groups that change every round (sans-IO, pure functions).

Rule 10: a block's group of W members at a round's start, with a gossip size k (W >= 2k: below,
the partition is one small group of everyone, ``uses_gossip``), does not average all-to-all.
Each member computes the same partition of the round's members (``gossip_groups``): each id's
``sha256("{salt}|{round}|{id}")`` puts it in one of G = W // k buckets by jump consistent hashing
(``jump_bucket``); buckets are taken in order, each with the members carried over from the ones
before: under 3 members it is carried into the next, over 2k - 1 it is cut into near-equal runs
of its hash order, else it is one small group; what is carried past the last joins the last
group. So small groups have 3 to 2k + 1 members (about k + 1 on average: the buckets' sizes
vary) and change every round (random groups: a member meets a given other one about once in
W / k rounds). Members learn of a join or departure at different moments, and a view one member
apart must not move everyone: it changes that member's own small group (and a neighbour where a
bucket crosses 3 or 2k - 1); where it changes G, jump hashing moves a 1/G share of the members,
and the small groups they leave and join change (about half the members' at 40 members and k 4). (The first partition, r6.4, dealt the hash order round-robin into G
groups of k to 2k - 1: one member more or less moved most members to another small group, and in
a simulation of 64 members with 20% churn a minute and per-member views, 69% of the members'
rounds failed on rule 9's mismatches: results/gossip/churn-k4-64-own-round-robin.json.) A small group runs an ordinary ``AveragingRound`` (round.py:
rules 2-7, robust with 3 or more members) among its members only,
with start ``gossip_start(salt)``: the members' points differ (each averages only with its small
group), so no digest of a common start point can name the group, the round's members and number
do. A member waits only for its own small group: no barrier across the whole group, so a slow or
departed member delays its partners, once per departure, by at most their timeout.

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
# The largest: a small group of 3 to 2k + 1 members (about k + 1) whose robust round sends up to 2k
# copies of the vector per member (about k); at 16 that is up to 32, as much as an all-to-all round
# of 33.
MAX_GOSSIP_SIZE = 16
GOSSIP_START = "gossip"


def uses_gossip(members: int, size: int) -> bool:
    """Whether a group of ``members`` is partitioned into buckets (0: never gossip). From 2 x size
    on, usually into several small groups (one where the buckets' carries merge them all: 14% of
    rounds at 8 members and size 4); below it the partition is a single group (W // k = 1) of every member, an
    all-to-all round of the members' parameters, named as a gossip round (a group that gossiped
    holds no common start point, and one that shrinks below 2k must still average its points)."""
    return size > 0 and members >= 2 * size


def _rank(salt: str, rnd: int, pid: str) -> tuple[str, str]:
    return hashlib.sha256(f"{salt}|{rnd}|{pid}".encode()).hexdigest(), pid


def jump_bucket(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping and Veach, 2014), in integers: ``key`` (64 bits) into
    0..buckets-1, so that one bucket more moves only a 1/buckets share of the keys (into it)."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) % (1 << 64)
        j = ((b + 1) << 31) // ((key >> 33) + 1)
    return b


def gossip_groups(members, rnd: int, size: int, salt: str = "") -> list[list[str]]:
    """Round ``rnd``'s partition of ``members`` (ids) into small groups of 3 to 2 x size + 1 (about
    ``size`` + 1 on average; over 2 x size - 1 only where small buckets are merged), each sorted; the same
    on every member that holds the same members (rule 10). One member more or less changes its own
    small group (and a neighbour's); where the count of small groups changes, those that a 1/count
    share of the members leave and join; not the rest."""
    if not MIN_GOSSIP_SIZE <= size <= MAX_GOSSIP_SIZE:
        raise ValueError(f"gossip size {size}: expected {MIN_GOSSIP_SIZE}..{MAX_GOSSIP_SIZE}")
    ids = sorted(set(members))
    count = max(1, len(ids) // size)
    if count == 1:
        return [ids]
    buckets: list[list[tuple[str, str]]] = [[] for _ in range(count)]
    for p in ids:
        rank = _rank(salt, rnd, p)
        buckets[jump_bucket(int(rank[0][:16], 16), count)].append(rank)
    groups: list[list[str]] = []
    carry: list[tuple[str, str]] = []
    for b in buckets:
        cur = sorted(carry + b)
        if len(cur) < MIN_GOSSIP_SIZE:  # too small for the robust aggregate: into the next bucket
            carry = cur
            continue
        parts = -(-len(cur) // (2 * size - 1))  # too large: cut in as many near-equal runs of its order
        groups += [[p for _, p in cur[i * len(cur) // parts:(i + 1) * len(cur) // parts]] for i in range(parts)]
        carry = []
    if carry:  # the last buckets were small: with the last group
        groups[-1] += [p for _, p in carry]
    return [sorted(g) for g in groups]


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
