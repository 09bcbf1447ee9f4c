"""A round's pieces, apart from the round's protocol (round.py): who owns each, where the other
members' parts of each are decoded, and what the aggregate of each found.

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 2: piece j is owned by member j mod R (sorted ids): ``Roster.owner``.
- Rule 4: a member that departs, or is rejected, is no longer live; the pieces it owned move to
  live member j mod R', the same rule everywhere (``Roster``). What another member says of third
  members (meta ``departed``, ``mismatched``) is weighed here as evidence (``Roster.relayed``).
- Rule 6: a piece computed by every member is the robust aggregate of robust.py, or the plain mean
  (``PieceRecords.aggregate``); what the aggregate found is kept per piece, so a piece computed again
  replaces its record and what a member is named for does not depend on the order parts came in.
"""

from __future__ import annotations

import torch

from .robust import accumulate_pairs, centred_clip, norm_outliers


def mean_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """The plain mean of ``parts`` (in member order) into ``out``: the first copied, the others added
    one by one, then divided by their count, in float32 (PROTOCOL.md 7.1: members must get the same
    bytes, so the order of the additions is part of the rule)."""
    out.copy_(parts[0])
    for v in parts[1:]:
        out.add_(v)
    out.div_(len(parts))


def arena_slots(spans: list[tuple[int, int]], computed: list[bool]) -> tuple[dict[int, tuple[int, int]], int]:
    """Each piece we compute (``computed[j]``: robust or sign, every piece; mean, those we own) -> its
    place in a member's slot of the arena, the same in every slot; and the slot's size."""
    slot: dict[int, tuple[int, int]] = {}
    at = 0
    for j, (a, b) in enumerate(spans):
        if computed[j]:
            slot[j] = (at, at + b - a)
            at += b - a
    return slot, at


class Roster:
    """Who is in a round as ``me`` sees it: its members (``ids``, sorted; ours included), those
    departed (-> why), rejected ({"peer", "reason"}, in order) and mismatched (they began the round
    with another view of the group, rule 4); so who is live, and who owns each piece now."""

    def shared(self) -> tuple:
        """Its ids, departed, rejected and mismatched: shared with the round, which reads them as its own."""
        return self.ids, self.departed, self.rejected, self.mismatched

    def __init__(self, me: str, members):
        self.me, self.ids = me, sorted(set(members) | {me})
        self.departed: dict[str, str] = {}
        self.private: set[str] = set()  # departed, not relayed in meta ``departed`` (AveragingRound.depart)
        self.rejected: list[dict] = []  # {"peer", "reason"}, in order
        self.mismatched: set[str] = set()  # began the round with another view of the group (rule 4)
        self.claims: dict[str, dict[str, str]] = {}  # member named in others' relays -> {claimer: what it said}
        self.heard: set[str] = set()  # members whose part came with our view
        self.contradicted: dict[str, str] = {}  # claimer -> why: the named member's own part says otherwise
        self.ignored: frozenset[str] = frozenset()  # claimers whose word is not even recorded (the driver's)
        self.trusted = False  # a mean round's: what a member relays departs the named members (``_obeyed``)
        self._key: tuple | None = None  # (departed, rejected) counts the cache of ``live`` is for
        self._live: tuple[list[str], set[str]] = ([], set())

    def rejected_ids(self) -> set[str]:
        return {r["peer"] for r in self.rejected}

    def live(self) -> tuple[list[str], set[str]]:
        """The live members, as a list and a set: kept until a member departs or is rejected (both
        only grow), since every part asks who owns every piece."""
        key = (len(self.departed), len(self.rejected))
        if self._key != key:
            bad = self.rejected_ids()
            live = [p for p in self.ids if p not in self.departed and p not in bad]
            self._live, self._key = (live, set(live)), key
        return self._live

    def owner(self, j: int) -> str:
        """Piece j's owner now: member j mod R, or, gone, live member j mod R' (rule 4)."""
        live, alive = self.live()
        o = self.ids[j % len(self.ids)]
        return o if o in alive or not live else live[j % len(live)]

    def reject(self, pid: str, why: str) -> None:
        if pid != self.me and all(r["peer"] != pid for r in self.rejected):
            self.rejected.append({"peer": pid, "reason": why})

    def relayed(self, pid: str, gone: list, other: list) -> None:
        """What ``pid``'s part says of others (rule 4, r7): meta ``mismatched`` and ``departed`` are
        its word about third members, evidence and never a departure here where every member
        computes every piece (in a mean round, ``trusted``, they depart the named, ``_obeyed``). A claim is contradicted
        when the named member's own part of the round comes with our view (for ``departed``: after
        the claim), or when it says we saw another group while its part carries our view; the
        claimer is then ``contradicted`` (the driver names a member whose word failed so twice and
        ``ignored`` its claims). Kept: at most one claim per (member named, claimer) of the round."""
        if pid in self.ignored:
            return
        if self.trusted:
            return self._obeyed(pid, gone, other)
        for said, named in (("saw another group", other), ("departed", gone)):
            for d in named:
                if not isinstance(d, str) or d == pid or d not in self.ids:
                    continue
                if d == self.me:  # in a part of our own view, which it sent us
                    self.contradicted.setdefault(pid, f"said we {said}, in a part of our own view")
                elif said == "saw another group" and d in self.heard:
                    self.contradicted.setdefault(pid, f"said {d[:12]} {said}; its part came with our view")
                else:
                    self.claims.setdefault(d, {}).setdefault(pid, said)

    def _obeyed(self, pid: str, gone: list, other: list) -> None:
        """A mean round's (its owners are trusted, rule 2): the named members depart as at ``pid``,
        since an owner's average leaves out the members it departed (the rule of every round before
        r7)."""
        for d in other:  # before ``departed`` lists them: a relayed mismatch is one
            if isinstance(d, str) and d != self.me and d != pid and d in self.ids:
                self.mismatched.add(d)
                if d in self.live()[1]:
                    self.departed[d] = f"another view of the group, said {pid[:12]}"
        for d in gone:
            if isinstance(d, str) and d != self.me and d != pid and d in self.live()[1]:
                self.departed[d] = f"departed at {pid[:12]}"

    def heard_from(self, pid: str) -> None:
        """``pid``'s part of the round came with our view: what others said of it is contradicted."""
        self.heard.add(pid)
        for claimer, said in self.claims.pop(pid, {}).items():
            self.contradicted.setdefault(claimer, f"said {pid[:12]} {said}; its part came after, with our view")

    def meta(self) -> dict:
        """What our parts relay (rule 4): meta ``departed`` (not the private ones) and ``mismatched``."""
        meta: dict = {}
        relayed = sorted(p for p in self.departed if p not in self.private)
        if relayed:
            meta["departed"] = relayed
        if self.mismatched:
            meta["mismatched"] = sorted(self.mismatched)
        return meta


def largest(records: dict[int, dict]) -> dict[str, float]:
    """Per-piece records (piece -> member -> a float): each member's largest, over the pieces."""
    out: dict[str, float] = {}
    for j in sorted(records):
        for p, v in records[j].items():
            out[p] = max(out.get(p, 0.0), v)
    return out


def summed(records: dict[int, dict]) -> dict:
    """Per-piece records (piece -> key -> a float or a list of floats) summed key by key, in piece
    order: the same float sums at every member whatever order its pieces were computed in."""
    out: dict = {}
    for j in sorted(records):
        for k, v in records[j].items():
            if isinstance(v, float):
                out[k] = out.get(k, 0.0) + v
            else:
                acc = out.setdefault(k, [0.0] * len(v))
                for i, x in enumerate(v):
                    acc[i] += x
    return out


class PieceRecords:
    """What the aggregate of each piece found (rule 6), piece -> its record: ``suspects`` (member ->
    its distance, in median distances), ``far`` (member -> its part's norm over the median's, left
    out), ``agree`` (member -> [u . m, |u|^2], None -> |m|^2; robust.py) and, in sign rounds of
    updates, ``pairs`` ((p, q) -> [u_p . u_q, |u_p|^2, |u_q|^2]: ``accumulate_pairs``, for the
    driver's ``PairWindow``)."""

    def __init__(self) -> None:
        self.suspects: dict[int, dict] = {}
        self.far: dict[int, dict] = {}
        self.agree: dict[int, dict] = {}
        self.pairs: dict[int, dict] = {}

    def aggregate(self, j: int, got: dict[str, torch.Tensor], avg: torch.Tensor, robust: bool, pairs: bool,
                  origin: torch.Tensor | None) -> None:
        """Piece j of ``got`` (member -> its part) into ``avg``: with ``robust``, parts far above the
        others left out (their senders recorded), the rest centred-clipped from 3 parts up (measured
        from ``origin`` where the parts are points); else, or below 3 parts, their plain mean.
        ``pairs``: the pairs of the parts taken, recorded, from 2 parts up."""
        for records in (self.suspects, self.far, self.agree, self.pairs):
            records.pop(j, None)
        ids = sorted(got)
        if robust and len(ids) >= 3:
            far = norm_outliers(got)  # left out of this piece (ours too): suspects, not rejected
            if far:
                self.far[j] = far
                ids = [p for p in ids if p not in far]
        pairs = pairs and len(ids) >= 2
        x = torch.stack([got[p] for p in ids]) if pairs or (robust and len(ids) >= 3) else None
        if pairs and x is not None:  # every piece of two parts or more: a member that
            rec: dict = {}  # withholds a part cannot choose where an honest pair is measured
            accumulate_pairs(rec, x, ids)
            self.pairs[j] = rec
        if x is not None and len(ids) >= 3:
            suspects: dict[str, float] = {}
            agree: dict = {}
            self.suspects[j], self.agree[j] = suspects, agree
            avg.copy_(centred_clip(x, suspects, ids, agree, origin))
        else:
            mean_into(avg, [got[p] for p in ids])
