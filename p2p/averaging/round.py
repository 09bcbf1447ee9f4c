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
  ``departed`` of every part it sends from then on (not a departure between two members only: a
  gossip round's exclusion, rule 10, ``depart(relay=False)``). A member that began the round with
  another view of the group (its parts carry another ``group``, or it says it is not in our
  round's group) is recorded in ``mismatched`` as well, and listed in meta ``mismatched`` of every
  part we send (driver.py, rule 9, fails such a round). Where every member computes every piece
  (rule 6), what a member says of others is its word, not ours (r7): a receiver departs a member, or counts it mismatched, only on what it sees itself
  (the member's own parts, its ``absent``, its connection); a claim the named member's own part
  contradicts is recorded against the claimer (``Roster.relayed``; driver.py names a member whose
  word failed twice and ignores its claims). Before r7 a receiver departed the members others
  named, so one key holder's list made every member drop an honest one, or fail every round. In a
  mean round the owners are trusted (rule 2): the named members depart there, as before. Where every member computes every piece (rule 6), a piece counts the parts a departed
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
from .pieces import PieceRecords, Roster, arena_slots, largest, mean_into, summed
from .robust import Bounds, opposed_members, validate_part

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
    choices: dict = field(default_factory=dict)  # member -> its first part's meta ``choice`` (swarm/auto.py) or None


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


@dataclass(frozen=True)
class RoundSpec:
    """A round's settings, one for all the rounds of a driver (validated here)."""
    codec: Codec | str = Codec.RAW  # the update codec: a tensor codec, or topk / sign (rule 7)
    aggregate: str = "mean"  # "robust" (rule 6, with 3 or more members) or "mean"
    bounds: Bounds = Bounds()  # what an incoming part may be (rule 3)
    min_coverage: float = 1.0  # below it the result raises RoundFailed (rule 5)
    density: float = 0.01  # the fraction of each chunk a topk round sends
    mode: str = ""  # the rounds' sync mode (swarm/auto.py): said in meta ``mode``, a part of another is rejected

    def __post_init__(self):
        if self.codec not in COMPACT:
            object.__setattr__(self, "codec", Codec(self.codec))
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate {self.aggregate!r}: expected one of {AGGREGATES}")

    @property
    def compact(self) -> str | None:
        """topk or sign: a part of several raw tensors; None for a tensor codec."""
        return self.codec if self.codec in COMPACT else None

    @property
    def tensor_codec(self) -> Codec:
        """The codec of a part's tensors (a compact codec's are raw)."""
        return Codec.RAW if self.compact else Codec(self.codec)

    @property
    def update_codec(self) -> str:
        """What the parts' BlockUpdate says: topk, sign or the tensor codec's name."""
        return self.compact or self.tensor_codec.value

    @property
    def k(self) -> int:
        """topk: the values sent per chunk."""
        return topk_count(self.density) if self.codec == TOPK else 0


@dataclass(frozen=True)
class Buffers:
    """The memory a driver lends a round (rule 8), kept from round to round so that a round touches
    no fresh memory; fresh tensors where None. ``out``: where the result goes (n float32).
    ``arena``: where the other members' parts are decoded (float32: R - 1 slots of the pieces we
    compute, i.e. every piece in a robust or sign round, those we own in a mean round; or a
    function that returns one of the size it is asked; fresh for pieces that move to us mid-round).
    ``scratch``: a lossy codec's buffers (``lossy_scratch``)."""
    out: torch.Tensor | None = None
    arena: torch.Tensor | Callable[[int], torch.Tensor] | None = None
    scratch: dict | None = None


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

    def __init__(self, me: str, block: int, rnd: int, members, vector: torch.Tensor, spec: RoundSpec = RoundSpec(),
                 *, start: str = "", residual: torch.Tensor | None = None, lent: Buffers = Buffers(),
                 origin: torch.Tensor | None = None, choice: dict | None = None):
        """``spec``: the round's settings; ``start``: the digest of its start point (rule 2).
        ``residual``: the last round's error feedback (rule 7; may be ``lent.scratch``'s "residual").
        ``lent``: the driver's buffers (``Buffers``). ``origin``: where the vector is a point (a
        gossip round's parameters), our own start point of the steps it took; a robust round
        measures the members' updates from it to find one opposed to the median's (rule 6,
        ``opposed_members``); None: the vector is an update. ``choice``: swarm/auto.py's."""
        self.me, self.block, self.round, self.spec = me, block, rnd, spec
        self.say = {k: v for k, v in (("mode", spec.mode), ("choice", choice)) if v}  # our parts' meta beside
        self.choices: dict[str, object] = {}  # member -> the meta ``choice`` of its first part (None: none)
        self.roster = roster = Roster(me, members)
        self.ids, self.departed, self.rejected, self.mismatched = roster.shared()  # the roster's own lists
        self.robust = spec.aggregate == "robust" and len(self.ids) >= 3
        self.everyone = self.robust or spec.codec == SIGN  # every member computes every piece (rule 6)
        roster.trusted = not self.everyone  # owners' averages leave out whom they departed (rule 4)
        self.records = PieceRecords()
        self.group = group_digest(self.ids, rnd, f"{start}|{'robust' if self.robust else 'mean'}")
        self.n = n = vector.numel()
        self.P = max(len(self.ids), -(-n // PIECE_FLOATS))
        self.bounds_ = [(n * i) // self.P for i in range(self.P + 1)]
        self.vector = vector.detach().float().reshape(-1)  # read only: our own piece is a view of it
        self.origin = None if origin is None else origin.detach().float().reshape(-1)  # read only
        if self.origin is not None and self.origin.numel() != n:
            raise ValueError(f"origin of {self.origin.numel()} floats for a vector of {n}")
        # error feedback (rule 7), in the driver's buffers when it lends them
        enc = encode_vector(self.vector, self.spans(), spec.update_codec, spec.k, residual, lent.scratch)
        self.x, self.wires, self.residual, self.sent = enc.x, enc.wires, enc.residual, enc.sent
        self.out = _result_buffer(lent.out, vector, n)
        # each other member's slot in the arena: the places of the pieces we compute
        self._slot, size = arena_slots(self.spans(), [self.everyone or self.ids[j % len(self.ids)] == me
                                                      for j in range(self.P)])
        self._arena = arena_views(lent.arena, [p for p in self.ids if p != me], size)
        self._received: dict[int, dict[str, torch.Tensor]] = {j: {} for j in range(self.P)}
        self._sent_to: dict[int, str | set[str]] = {}  # piece -> owner (mean) or the members it went to (robust)
        self._gather_sent: set[int] = set()
        self.gathered: dict[int, list] = {}  # piece -> contributors, once its average is in ``out``
        self.finished = False

    def spans(self):
        return [(self.bounds_[j], self.bounds_[j + 1]) for j in range(self.P)]

    # --- who (pieces.py's ``Roster``) -----------------------------------------------------------
    def rejected_ids(self) -> set[str]:
        return self.roster.rejected_ids()

    def live(self) -> list[str]:
        return list(self.roster.live()[0])

    def owner(self, j: int) -> str:
        return self.roster.owner(j)

    @property
    def contradicted(self) -> dict[str, str]:
        """Members whose word about others this round contradicted what we saw (rule 4, r7)."""
        return self.roster.contradicted

    @property
    def done(self) -> bool:
        return self.finished or len(self.gathered) == self.P

    # --- inputs --------------------------------------------------------------------------------
    def start(self) -> list[Part]:
        return self._progress(final=False)

    def receive(self, pid: str, msg: BlockUpdate) -> list[Part]:
        """A part from ``pid``; returns what to send next. A part that fails validation rejects
        its sender (see ``rejected``)."""
        if self.done or pid not in self.roster.live()[1]:
            return []
        phase, j = msg.meta.get("phase"), msg.meta.get("part")
        if type(j) is not int or not 0 <= j < self.P or phase not in ("reduce", "gather"):
            return self._reject(pid, f"bad phase/part {phase!r}/{j!r}")
        gone, other = msg.meta.get("departed", []), msg.meta.get("mismatched", [])
        if not isinstance(gone, list) or len(gone) > len(self.ids):
            return self._reject(pid, "malformed 'departed'")
        if not isinstance(other, list) or len(other) > len(self.ids):
            return self._reject(pid, "malformed 'mismatched'")
        if self.spec.mode and msg.meta.get("mode") != self.spec.mode:
            return self._reject(pid, f"another sync mode: {str(msg.meta.get('mode'))[:40]!r}, ours {self.spec.mode!r}")
        self.roster.relayed(pid, gone, other)
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
            t = validate_part(msg, b - a, self.spec.bounds, into, self.spec.compact)
        except ValueError as e:
            return self._reject(pid, str(e))
        self.roster.heard_from(pid)
        if self.spec.mode:  # rounds under sync=auto only
            self.choices.setdefault(pid, msg.meta.get("choice"))
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
        if pid not in self.roster.live()[1] or pid == self.me or self.done:
            return []
        self.departed[pid] = why
        if not relay:
            self.roster.private.add(pid)
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
        self.roster.reject(pid, why)
        return self._progress(final=False)

    # --- the protocol ----------------------------------------------------------------------------
    def _own(self, j: int) -> torch.Tensor:
        """Our part of piece j as the others decode it."""
        a, b = self.bounds_[j], self.bounds_[j + 1]
        if self.spec.compact:
            assert self.sent is not None, "a topk or sign round keeps what the others decode"
            return self.sent[a:b]
        w = self.wires[j]
        assert isinstance(w, WireTensor), "a dense round's part is one tensor"
        return from_wire(w) if self.spec.tensor_codec.lossy else self.x[a:b]

    def _msg(self, phase: str, j: int, wire: Wire, **meta) -> BlockUpdate:
        return BlockUpdate(block=self.block, round=self.round, codec=self.spec.update_codec, tensors=_tensors(wire),
                           meta={"phase": phase, "part": j, "group": self.group, **meta, **self.say,
                                 **self.roster.meta()})

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
        mean_into(avg, [got[p] for p in contributors])
        w: Wire
        if self.spec.compact == TOPK:  # the average of R sparse parts has at most R x k values per chunk
            w = encode_topk(avg, self.spec.k * len(self.ids), avg)  # avg becomes what the others decode
        else:
            w = dense = to_wire("part", avg, self.spec.tensor_codec, "never")
            if self.spec.tensor_codec.lossy:
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
            for p in self.roster.live()[0]:
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
        """Piece j computed here (``PieceRecords.aggregate``), its contributors every member of ``got``
        (a far part is weighed, at nothing, as a clipped one)."""
        a, b = self.bounds_[j], self.bounds_[j + 1]
        pairs = self.robust and self.spec.update_codec == SIGN and self.origin is None
        self.records.aggregate(j, got, self.out[a:b], self.robust, pairs,
                               None if self.origin is None else self.origin[a:b])
        self.gathered[j] = sorted(got)

    @property
    def far(self) -> dict[str, float]:
        """Robust: member -> its largest part norm over the piece's median norm, where a part was
        left out of its piece for it (``norm_outliers``)."""
        return largest(self.records.far)

    @property
    def suspects(self) -> dict[str, float]:
        """Robust: member -> its largest distance over the pieces, in median distances."""
        return largest(self.records.suspects)

    @property
    def _agree(self) -> dict:
        """Robust: member -> [u . m, |u|^2] summed over the pieces, None -> |m|^2 (robust.py)."""
        return summed(self.records.agree)

    @property
    def pairs(self) -> dict:
        """Robust, parts that are updates: (p, q) -> [u_p . u_q, |u_p|^2, |u_q|^2] summed over the
        pieces that held both (``PairWindow`` takes them in)."""
        return summed(self.records.pairs)

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
                          robust=self.robust, suspects=dict(self.suspects), far=self.far, opposed=self.opposed(),
                          choices=dict(self.choices))
        if rep.coverage < self.spec.min_coverage:
            raise RoundFailed(self.block, self.round, rep.coverage, sum(not p["ok"] for p in parts), self.P,
                              self.spec.min_coverage, frozenset(self.silent()))
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
