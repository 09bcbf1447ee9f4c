"""One averaging round as a sans-IO object: ``AveragingRound``, its pieces and their owners.

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 1: everything a round does happens in ``AveragingRound``: parts in (``receive``),
  departures in (``depart``), the deadline in (``expire``); messages out (``Part``) and, once
  ``done``, a result with its coverage. It never touches a socket, a clock or a task; the
  ``Averager`` (driver.py) feeds it and sends what it returns.
- Rule 2: the flat float32 vector of a round is cut into P >= R pieces of at most PIECE_FLOATS
  (R members, sorted ids); piece j is owned by member j mod R. Reduce: every member sends piece j
  to its owner. Gather: the owner averages what it received and sends the average of piece j,
  with its contributors, to everyone. Messages are BlockUpdate(block, round, codec, [part]) with
  meta {"phase", "part", "group", "contributors"}; ``group`` is a digest of the round's members,
  its number and its start point, so peers that disagree on any of them never mix.
- Rule 3 (here): every incoming part is validated before use (``validate_part``, robust.py). A
  sender whose part fails is rejected: the round goes on without it and reports why.
- Rule 4: a member that departs mid-round (its connection closes, the swarm declares it gone, or
  it says it is not in this round's group) is dropped: the pieces it owned move to the live
  members (live member j mod R', the same rule everywhere), everyone re-sends its part there, and
  the round finishes with the others. Coverage counts the live members. A member that departs
  a peer for a reason only it can see (another view of the group, unreachable) lists it in meta
  ``departed`` of every part it sends from then on; the receivers depart it too, so nobody waits
  for a member that will not come (not a departure between two members only: a gossip round's
  exclusion, rule 10, ``depart(relay=False)``). A member that began the round with another view of the group
  (its parts carry another ``group``, or it says it is not in our round's group) is recorded in
  ``mismatched`` as well, and listed in meta ``mismatched`` of every part we send, so that every
  member learns it was a mismatch whichever way it hears of it first (driver.py, rule 9, fails such
  a round). Where every member computes every piece (rule 6), a piece counts the parts a departed
  member sent before it left (the others hold them too; the driver takes in what was held of them
  ahead of the round before it departs the members that left the group before the round began).
- Rule 5: coverage is, for every piece, whether every live member contributed; the fraction of
  the vector covered. Below ``min_coverage`` the result raises ``RoundFailed``: nothing applied.
- Rule 6 (here): with ``aggregate="robust"`` and 3 or more members, every member sends its part
  of every piece to every member and computes every piece itself, by the robust aggregate of
  robust.py (which holds the rule's full text); nobody's average is taken on trust. A ``sign``
  round is gathered so too with any aggregate (with 2 members, or ``mean``, as a plain mean):
  its parts are 32x smaller than a dense average, which no owner could send as compactly.
- Rule 7 (here): a lossy round's part is encoded with error feedback (codec.py); an owner decodes
  its own average exactly as the others do, so every member ends the round with the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from blocktrain.protocol import BlockUpdate, Codec, WireTensor

from ..tensors import encode_topk, from_wire, to_wire, topk_count
from .codec import COMPACT, SIGN, TOPK, Wire, arena_views, encode_vector
from .robust import Bounds, accumulate_pairs, centred_clip, norm_outliers, opposed_members, validate_part

# Floats per message: 1M float32 = 4 MiB, well inside a frame (MAX_FRAME_BYTES is 16 MiB).
PIECE_FLOATS = 1 << 20
AGGREGATES = ("robust", "mean")


class RoundFailed(Exception):
    """A round's coverage fell below the threshold; nothing was averaged."""

    def __init__(self, block: int, rnd: int, coverage: float, missing: int, pieces: int, min_coverage: float,
                 silent: frozenset = frozenset()):
        super().__init__(f"block {block} round {rnd}: coverage {coverage:.1%} < {min_coverage:.0%} "
                         f"({missing} of {pieces} pieces lack a member); nothing applied")
        self.block, self.round, self.coverage = block, rnd, coverage
        self.silent = silent  # live members whose parts never came


class GroupMismatch(RoundFailed):
    """Members of the round began it with another view of the group (a departure or admission that
    reached them at another round than us): nothing applied, and they stay in the group (driver.py,
    rule 9): the next round, begun once the change reached both, matches."""

    def __init__(self, block: int, rnd: int, peers, silent: frozenset = frozenset()):
        Exception.__init__(self, f"block {block} round {rnd}: {', '.join(p[:12] for p in peers)} began it with "
                                 f"another view of the group; nothing applied (the next round tries again)")
        self.block, self.round, self.coverage, self.silent = block, rnd, 0.0, silent
        self.mismatched = tuple(peers)


@dataclass
class RoundReport:
    round: int
    members: list
    coverage: float  # fraction of the vector averaged over every live member
    parts: list  # per piece: {"owner", "contributors", "ok"}
    rejected: list = field(default_factory=list)  # {"peer", "reason"}
    seconds: float = 0.0
    bytes_sent: int = 0
    departed: list = field(default_factory=list)  # members that left mid-round (the others finished)
    why: dict = field(default_factory=dict)  # departed or rejected member -> why
    robust: bool = False  # aggregated by rule 6 (no average taken on trust)
    suspects: dict = field(default_factory=dict)  # robust: member -> its distance, in median distances
    far: dict = field(default_factory=dict)  # robust: member -> its largest part norm over the median's, when > 100x
    opposed: dict = field(default_factory=dict)  # robust: member -> its cosine with the median, when < -OPPOSED_COS


@dataclass(frozen=True)
class Part:
    """A message for ``peer`` (``stored_bytes`` of tensor payload)."""
    peer: str
    msg: BlockUpdate
    stored_bytes: int


def _tensors(wire: Wire) -> tuple:
    return wire if isinstance(wire, tuple) else (wire,)


def _stored(wire: Wire) -> int:
    return sum(w.stored_bytes for w in _tensors(wire))


def group_digest(members, rnd: int, start: str) -> str:
    """Identifies a round's group: its members, its number and its start point (rule 2)."""
    return hashlib.sha256(f"{','.join(sorted(members))}|{rnd}|{start}".encode()).hexdigest()[:16]


def _largest(records: dict[int, dict]) -> dict[str, float]:
    """Per-piece records (piece -> member -> a float): each member's largest, over the pieces."""
    out: dict[str, float] = {}
    for j in sorted(records):
        for p, v in records[j].items():
            out[p] = max(out.get(p, 0.0), v)
    return out


def _summed(records: dict[int, dict]) -> dict:
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


def _mean_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """The plain mean of ``parts`` (in member order) into ``out``: the first copied, the others added
    one by one, then divided by their count, in float32 (PROTOCOL.md 7.1: members must get the same
    bytes, so the order of the additions is part of the rule)."""
    out.copy_(parts[0])
    for v in parts[1:]:
        out.add_(v)
    out.div_(len(parts))


def _result_buffer(out: torch.Tensor | None, vector: torch.Tensor, n: int) -> torch.Tensor:
    """Where a round's result goes: ``out`` (checked: n contiguous float32 apart from the vector)
    as a flat view, or a fresh tensor."""
    if out is not None and (out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous()
                            or out.data_ptr() == vector.data_ptr()):
        raise ValueError(f"out holds {out.numel()} {out.dtype}, expected {n} contiguous float32 apart from "
                         "the vector")
    return torch.empty(n) if out is None else out.view(-1)  # gathered pieces are decoded into it


class AveragingRound:
    """One round of reduce-scatter + all-gather, as seen by member ``me`` (sans-IO)."""

    def __init__(self, me: str, block: int, rnd: int, members, vector: torch.Tensor, *,
                 codec: Codec | str = Codec.RAW, start: str = "", bounds: Bounds = Bounds(),
                 min_coverage: float = 1.0, residual: torch.Tensor | None = None, aggregate: str = "mean",
                 out: torch.Tensor | None = None,
                 arena: torch.Tensor | Callable[[int], torch.Tensor] | None = None, scratch: dict | None = None,
                 density: float = 0.01, origin: torch.Tensor | None = None):
        """``out``: where the result goes (n float32; a fresh tensor if None). ``arena``: where the
        other members' parts are decoded (float32: R - 1 slots of the pieces we compute, i.e. every
        piece in a robust or sign round, those we own in a mean round; or a function that returns
        one of the size it is asked), reused across rounds by the driver so that a round touches no
        fresh memory; fresh tensors if None (and for pieces that move to us mid-round).
        ``scratch``: a lossy codec's buffers (``lossy_scratch``), lent the same way; ``residual``
        may be its "residual". ``density``: the fraction of each chunk a topk round sends.
        ``origin``: where the vector is a point (a gossip round's parameters), our own start point
        of the steps it took; a robust round measures the members' updates from it to find one
        opposed to the median's (rule 6, ``opposed_members``). None: the vector is an update itself."""
        if codec not in COMPACT:
            codec = Codec(codec)
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate {aggregate!r}: expected one of {AGGREGATES}")
        self.me, self.block, self.round = me, block, rnd
        self.ids = sorted(set(members) | {me})
        self.compact = codec if codec in COMPACT else None  # topk or sign: parts of several raw tensors
        self.sparse = codec == TOPK
        self.k = topk_count(density) if self.sparse else 0
        self.codec = Codec.RAW if self.compact else Codec(codec)  # a compact codec's tensors are raw
        self.update_codec = self.compact or self.codec.value
        self.bounds, self.min_coverage = bounds, min_coverage
        self.robust = aggregate == "robust" and len(self.ids) >= 3
        self.everyone = self.robust or codec == SIGN  # every member computes every piece (rule 6)
        # robust, per piece (a piece computed again replaces its record, so what a member names does
        # not depend on the order parts came in): suspects, member -> distance in median distances;
        # member -> [u . m, |u|^2], None -> |m|^2 (robust.py); in sign rounds of updates, (p, q) ->
        # [u_p . u_q, |u_p|^2, |u_q|^2] (``accumulate_pairs``, for the driver's ``PairWindow``)
        self._piece_suspects: dict[int, dict] = {}
        self._piece_far: dict[int, dict] = {}  # member -> its part's norm over the median's (left out)
        self._piece_agree: dict[int, dict] = {}
        self._piece_pairs: dict[int, dict] = {}
        self.group = group_digest(self.ids, rnd, f"{start}|{'robust' if self.robust else 'mean'}")
        self.n = n = vector.numel()
        self.P = max(len(self.ids), -(-n // PIECE_FLOATS))
        self.bounds_ = [(n * i) // self.P for i in range(self.P + 1)]
        self.vector = vector.detach().float().reshape(-1)  # read only: our own piece is a view of it
        self.origin = None if origin is None else origin.detach().float().reshape(-1)  # read only
        if self.origin is not None and self.origin.numel() != n:
            raise ValueError(f"origin of {self.origin.numel()} floats for a vector of {n}")
        # error feedback (rule 7), in the driver's buffers when it lends them
        enc = encode_vector(self.vector, self.spans(), self.update_codec, self.k, residual, scratch)
        self.x, self.wires, self.residual, self.sent = enc.x, enc.wires, enc.residual, enc.sent
        self.out = _result_buffer(out, vector, n)
        self._lay_out_arena(arena)
        self.departed: dict[str, str] = {}
        self._live_key: tuple | None = None  # (departed, rejected) counts the cache of ``_live`` is for
        self._live_cache: tuple[list[str], set[str]] = ([], set())
        self._owners: list[str] = []  # piece -> its owner now (kept with the cache)
        self.mismatched: set[str] = set()  # members that began the round with another view of the group (rule 4)
        self._private: set[str] = set()  # departed, not relayed in meta ``departed`` (``depart``)
        self.rejected: list[dict] = []  # {"peer", "reason"}, in order
        self._received: dict[int, dict[str, torch.Tensor]] = {j: {} for j in range(self.P)}
        self._sent_to: dict[int, str | set[str]] = {}  # piece -> owner (mean) or the members it went to (robust)
        self._gather_sent: set[int] = set()
        self.gathered: dict[int, list] = {}  # piece -> contributors, once its average is in ``out``
        self.finished = False

    def _lay_out_arena(self, arena: torch.Tensor | Callable[[int], torch.Tensor] | None) -> None:
        """Each other member's slot in the arena: the places of the pieces we compute (robust or
        sign: every piece; mean: the pieces we own), the same in every slot."""
        R = len(self.ids)
        self._slot: dict[int, tuple[int, int]] = {}  # piece -> its place in each member's arena slot
        at = 0
        for j, (a, b) in enumerate(self.spans()):
            if self.everyone or self.ids[j % R] == self.me:
                self._slot[j] = (at, at + b - a)
                at += b - a
        self._arena = arena_views(arena, [p for p in self.ids if p != self.me], at)

    def spans(self):
        return [(self.bounds_[j], self.bounds_[j + 1]) for j in range(self.P)]

    # --- who -----------------------------------------------------------------------------------
    def rejected_ids(self) -> set[str]:
        return {r["peer"] for r in self.rejected}

    def live(self) -> list[str]:
        return list(self._live()[0])

    def _live(self) -> tuple[list[str], set[str]]:
        """The live members, as a list and a set: kept until a member departs or is rejected (both
        only grow), since every part asks who owns every piece."""
        key = (len(self.departed), len(self.rejected))
        if self._live_key != key:
            bad = self.rejected_ids()
            live = [p for p in self.ids if p not in self.departed and p not in bad]
            alive, R = set(live), len(self.ids)
            owners = [self.ids[j % R] for j in range(self.P)]  # a piece of a gone owner moves to a live
            self._owners = [o if o in alive or not live else live[j % len(live)]  # member, the same for
                            for j, o in enumerate(owners)]                     # all (rule 4)
            self._live_cache, self._live_key = (live, alive), key
        return self._live_cache

    def owner(self, j: int) -> str:
        self._live()
        return self._owners[j]

    @property
    def done(self) -> bool:
        return self.finished or len(self.gathered) == self.P

    # --- inputs --------------------------------------------------------------------------------
    def start(self) -> list[Part]:
        return self._progress(final=False)

    def receive(self, pid: str, msg: BlockUpdate) -> list[Part]:
        """A part from ``pid``; returns what to send next. A part that fails validation rejects
        its sender (see ``rejected``)."""
        if self.done or pid not in self._live()[1]:
            return []
        phase, j = msg.meta.get("phase"), msg.meta.get("part")
        if type(j) is not int or not 0 <= j < self.P or phase not in ("reduce", "gather"):
            return self._reject(pid, f"bad phase/part {phase!r}/{j!r}")
        gone, other = msg.meta.get("departed", []), msg.meta.get("mismatched", [])
        if not isinstance(gone, list) or len(gone) > len(self.ids):
            return self._reject(pid, "malformed 'departed'")
        if not isinstance(other, list) or len(other) > len(self.ids):
            return self._reject(pid, "malformed 'mismatched'")
        for d in other:  # before ``departed`` lists them: a relayed mismatch is one
            if isinstance(d, str) and d != self.me and d != pid and d in self.ids:
                self.mismatched.add(d)
                if d in self._live()[1]:
                    self.departed[d] = f"another view of the group, said {pid[:12]}"
        for d in gone:
            if isinstance(d, str) and d != self.me and d != pid and d in self._live()[1]:
                self.departed[d] = f"departed at {pid[:12]}"
        a, b = self.bounds_[j], self.bounds_[j + 1]
        if self.everyone and phase != "reduce":
            return self._reject(pid, "sent an average in a round where every member computes every piece")
        wanted = phase == "gather" and j not in self.gathered and pid == self.owner(j)
        into = None  # the awaited average goes straight into the result (refilled at the end if rejected)
        if wanted:
            into = self.out[a:b]
        elif phase == "reduce" and self._arena is not None and pid not in self._received[j] and j in self._slot:
            into = self._arena[pid][slice(*self._slot[j])]  # this member's place for the piece in the arena
        try:
            t = validate_part(msg, b - a, self.bounds, into, self.compact)
        except ValueError as e:
            return self._reject(pid, str(e))
        if phase == "reduce":
            self._received[j].setdefault(pid, t)  # kept before we know we own it (a departure moves pieces)
        elif wanted:
            c = msg.meta.get("contributors")
            self.gathered[j] = [p for p in c if isinstance(p, str)] if isinstance(c, list) else []
        return self._progress(final=False)

    def depart(self, pid: str, why: str, relay: bool = True) -> list[Part]:
        """``pid`` leaves the round; ``relay``: listed in meta ``departed`` of our parts (rule 4), so
        the others depart it too; not for a matter between the two of us (a gossip round's
        exclusion, rule 10 of the package: relayed, it would let an excluded member have its
        excluder departed by everyone who hears of it first)."""
        if pid not in self._live()[1] or pid == self.me or self.done:
            return []
        self.departed[pid] = why
        if not relay:
            self._private.add(pid)
        return self._progress(final=False)

    def mismatch(self, pid: str, why: str) -> list[Part]:
        """``pid`` began the round with another view of the group: recorded (even if it departed
        already, e.g. by a relay that came first), and departed."""
        if pid in self.ids and pid != self.me and not self.done:
            self.mismatched.add(pid)
        return self.depart(pid, why)

    def undo_feedback(self) -> None:
        """The round failed (nothing of it applied): the error feedback goes back to what it was
        before it (x - vector: the old residual, to float32 rounding), so the next round does not
        send the lost round's update again."""
        if self.residual is not None:
            torch.sub(self.x, self.vector, out=self.residual)

    def expire(self) -> list[Part]:
        """The deadline passed: send what we have; the coverage says what is missing."""
        if self.done:
            return []
        out = self._progress(final=True)
        self.finished = True
        return out

    def _reject(self, pid: str, why: str) -> list[Part]:
        if pid != self.me and all(r["peer"] != pid for r in self.rejected):
            self.rejected.append({"peer": pid, "reason": why})
        return self._progress(final=False)

    # --- the protocol ----------------------------------------------------------------------------
    def _own(self, j: int) -> torch.Tensor:
        """Our part of piece j as the others decode it."""
        a, b = self.bounds_[j], self.bounds_[j + 1]
        if self.compact:
            assert self.sent is not None, "a topk or sign round keeps what the others decode"
            return self.sent[a:b]
        w = self.wires[j]
        assert isinstance(w, WireTensor), "a dense round's part is one tensor"
        return from_wire(w) if self.codec.lossy else self.x[a:b]

    def _msg(self, phase: str, j: int, wire: Wire, **meta) -> BlockUpdate:
        relayed = sorted(p for p in self.departed if p not in self._private)
        if relayed:
            meta["departed"] = relayed
        if self.mismatched:
            meta["mismatched"] = sorted(self.mismatched)
        return BlockUpdate(block=self.block, round=self.round, codec=self.update_codec, tensors=_tensors(wire),
                           meta={"phase": phase, "part": j, "group": self.group, **meta})

    def _progress(self, final: bool) -> list[Part]:
        if self.everyone:
            return self._progress_robust(final)
        out: list[Part] = []
        live = set(self.live())
        spans = self.spans()
        for j, (a, b) in enumerate(spans):  # our part of every piece goes to its current owner
            o = self.owner(j)
            if self._sent_to.get(j) == o or j in self.gathered:  # a piece whose average came is done
                continue
            self._sent_to[j] = o
            if o == self.me:
                self._received[j][o] = self._own(j)
            else:
                out.append(Part(o, self._msg("reduce", j, self.wires[j]), _stored(self.wires[j])))
        for j, (a, b) in enumerate(spans):  # pieces we own: average once every live member's part is in
            if self.owner(j) != self.me or j in self._gather_sent or j in self.gathered:
                continue
            got = {p: t for p, t in self._received[j].items() if p in live}
            if not final and not set(got) >= live:
                continue
            out += self._gather(j, got, live)
        return out

    def _gather(self, j: int, got: dict[str, torch.Tensor], live: set[str]) -> list[Part]:
        """A mean round: piece j (ours) averaged from ``got`` into the result, sent to the others."""
        avg = self.out[self.bounds_[j]:self.bounds_[j + 1]]
        contributors = sorted(got)
        _mean_into(avg, [got[p] for p in contributors])
        w: Wire
        if self.sparse:  # the average of R sparse parts has at most R x k values per chunk
            w = encode_topk(avg, self.k * len(self.ids), avg)  # avg becomes what the others decode
        else:
            w = dense = to_wire("part", avg, self.codec, "never")
            if self.codec.lossy:
                from_wire(dense, out=avg)  # what the others will decode (rule 6)
        self._gather_sent.add(j)
        self.gathered[j] = contributors
        msg = self._msg("gather", j, w, contributors=contributors)
        return [Part(p, msg, _stored(w)) for p in sorted(live - {self.me})]

    def _progress_robust(self, final: bool) -> list[Part]:
        """Rule 6: our part of every piece to every live member; every piece computed here (robust:
        by the robust aggregate; a sign round of 2 members or ``mean``: the plain mean)."""
        out: list[Part] = []
        spans = self.spans()
        for j, (a, b) in enumerate(spans):
            sent = self._sent_to.setdefault(j, set())
            assert isinstance(sent, set), "a robust round keeps the members each piece went to"
            if self.me not in sent:
                sent.add(self.me)
                self._received[j][self.me] = self._own(j)
            for p in self._live()[0]:
                if p not in sent:
                    sent.add(p)
                    out.append(Part(p, self._msg("reduce", j, self.wires[j]), _stored(self.wires[j])))
        live, bad = set(self.live()), self.rejected_ids()  # computing a piece rejects nobody (r6.23)
        for j in range(len(spans)):
            if j in self.gathered:
                continue  # a part of a member that departed since counts: the others hold it too
            got = {p: t for p, t in self._received[j].items() if p not in bad}
            if final or set(got) >= live:
                self._robust_piece(j, got)
        if any(bad & set(self.gathered[j]) for j in self.gathered):
            for j in list(self.gathered):  # a member was rejected after some pieces counted it: redo them
                if bad & set(self.gathered[j]):
                    del self.gathered[j]
            return out + self._progress_robust(final)
        return out

    def _robust_piece(self, j: int, got: dict) -> None:
        a, b = self.bounds_[j], self.bounds_[j + 1]
        ids = sorted(got)
        for rec in (self._piece_suspects, self._piece_far, self._piece_agree, self._piece_pairs):
            rec.pop(j, None)
        considered = ids  # the piece's contributors: a far part is weighed (at nothing), as a clipped one
        if self.robust and len(ids) >= 3:
            far = norm_outliers(got)  # left out of this piece (ours too): suspects, not rejected
            if far:
                self._piece_far[j] = far
                ids = [p for p in ids if p not in far]
        avg = self.out[a:b]
        pairs_wanted = self.robust and self.update_codec == SIGN and self.origin is None and len(ids) >= 2
        x = torch.stack([got[p] for p in ids]) if pairs_wanted or (self.robust and len(ids) >= 3) else None
        if pairs_wanted and x is not None:  # every piece of two parts or more: a member that
            pairs: dict = {}  # withholds a part cannot choose where an honest pair is measured
            accumulate_pairs(pairs, x, ids)
            self._piece_pairs[j] = pairs
        if x is not None and len(ids) >= 3:
            suspects: dict[str, float] = {}
            agree: dict = {}
            self._piece_suspects[j], self._piece_agree[j] = suspects, agree
            avg.copy_(centred_clip(x, suspects, ids, agree, None if self.origin is None else self.origin[a:b]))
        else:
            _mean_into(avg, [got[p] for p in ids])
        self.gathered[j] = considered

    @property
    def far(self) -> dict[str, float]:
        """Robust: member -> its largest part norm over the piece's median norm, where a part was
        left out of its piece for it (``norm_outliers``)."""
        return _largest(self._piece_far)

    @property
    def suspects(self) -> dict[str, float]:
        """Robust: member -> its largest distance over the pieces, in median distances."""
        return _largest(self._piece_suspects)

    @property
    def _agree(self) -> dict:
        """Robust: member -> [u . m, |u|^2] summed over the pieces, None -> |m|^2 (robust.py)."""
        return _summed(self._piece_agree)

    @property
    def pairs(self) -> dict:
        """Robust, parts that are updates: (p, q) -> [u_p . u_q, |u_p|^2, |u_q|^2] summed over the
        pieces that held both (``PairWindow`` takes them in)."""
        return _summed(self._piece_pairs)

    def result(self) -> tuple[torch.Tensor, RoundReport]:
        """The averaged vector and the round's report; RoundFailed below ``min_coverage``."""
        live = set(self.live())
        parts, covered = [], 0
        for j, (a, b) in enumerate(self.spans()):
            got = self.gathered.get(j)
            ok = got is not None and set(got) >= live
            if got is None or (not self.everyone and any(r["peer"] == self.owner(j) for r in self.rejected)):
                self.out[a:b] = self.vector[a:b]  # a piece that never came back keeps our values
                ok = False
            if ok:
                covered += b - a
            parts.append({"owner": "everyone" if self.everyone else self.owner(j), "contributors": got or [], "ok": ok})
        rep = RoundReport(self.round, self.ids, covered / self.n if self.n else 1.0, parts, list(self.rejected),
                          departed=sorted(self.departed),
                          why={**self.departed, **{r["peer"]: r["reason"] for r in self.rejected}},
                          robust=self.robust, suspects=dict(self.suspects), far=self.far, opposed=self.opposed())
        if rep.coverage < self.min_coverage:
            raise RoundFailed(self.block, self.round, rep.coverage, sum(not p["ok"] for p in parts), self.P,
                              self.min_coverage, frozenset(self.silent()))
        return self.out, rep

    def opposed(self) -> dict:
        """Robust: members whose update points against the coordinate-wise median over the whole
        vector (cosine below -OPPOSED_COS), as member -> cosine (``opposed_members``, robust.py)."""
        return opposed_members(self._agree, self.me, self.live())

    def silent(self) -> set:
        """Live members whose part of a piece we own never came (direct evidence only: an owner
        whose average did not come may itself be waiting for someone)."""
        live = set(self.live())
        out = set()
        for j in range(self.P):
            if self.everyone or self.owner(j) == self.me:
                out |= live - set(self._received[j]) - {self.me}
        return out
