"""Same-block averaging: one round as a sans-IO object, and a thin asyncio driver.

Rules:
- Rule 1: everything a round does happens in ``AveragingRound``: parts in (``receive``),
  departures in (``depart``), the deadline in (``expire``); messages out (``Part``) and, once
  ``done``, a result with its coverage. It never touches a socket, a clock or a task; the
  ``Averager`` feeds it and sends what it returns.
- Rule 2: the flat float32 vector of a round is cut into P >= R pieces of at most PIECE_FLOATS
  (R members, sorted ids); piece j is owned by member j mod R. Reduce: every member sends piece j
  to its owner. Gather: the owner averages what it received and sends the average of piece j,
  with its contributors, to everyone. Messages are BlockUpdate(block, round, codec, [part]) with
  meta {"phase", "part", "group", "contributors"}; ``group`` is a digest of the round's members,
  its number and its start point, so peers that disagree on any of them never mix.
- Rule 3: every incoming part is validated before use (name, shape, dtype, finite values, the
  norm bound). A sender whose part fails is rejected: the round goes on without it and reports
  why; the driver excludes it from later rounds and tells it (phase ``excluded``).
- Rule 4: a member that departs mid-round (its connection closes, the swarm declares it gone, or
  it says it is not in this round's group) is dropped: the pieces it owned move to the live
  members (live member j mod R', the same rule everywhere), everyone re-sends its part there, and
  the round finishes with the others. Coverage counts the live members. A member that departs
  a peer for a reason only it can see (another view of the group, unreachable) lists it in meta
  ``departed`` of every part it sends from then on; the receivers depart it too, so nobody waits
  for a member that will not come.
- Rule 5: coverage is, for every piece, whether every live member contributed; the fraction of
  the vector covered. Below ``min_coverage`` the result raises ``RoundFailed``: nothing applied.
- Rule 6 (``aggregate="robust"``, the default with 3 or more members): no member's aggregate is
  taken on trust. Every member sends its part of every piece to every member, and each computes
  every piece itself: parts whose norm exceeds RELATIVE_NORM x the median norm of the piece's
  parts are rejected (their sender named), the rest are combined by centred clipping
  (Karimireddy et al. 2021: around the coordinate-wise median, radius CLIP_RADIUS x the median
  distance), which bounds what any one member can move the result. A member whose part lies
  beyond SUSPECT_RADIUS x that median distance is reported as a suspect (the driver excludes one
  that is a suspect SUSPECT_ROUNDS rounds in a row). Honest members compute from the same parts
  with the same arithmetic, so they end with the same bytes; one that equivocates (sends members
  different parts) makes their start points differ, which the next round's group identity shows.
  With 2 members there is no majority to trust: the round is a plain mean (``robust`` False).
- Rule 7: lossy codecs (fp16, bf16, int8) keep the rounding error of what this peer sent and add
  it to the next round's input (error feedback). An owner decodes its own average exactly as the
  others do, so every member ends the round with the same bytes.
- Rule 8 (the driver): every part is fed to the round as it arrives, in the connection's reader,
  and decoded at once where it belongs: the result (``out``, the caller's buffer when given) or
  the sender's place in an arena the ``Averager`` keeps from round to round, like a lossy codec's
  buffers. A round so touches no fresh memory and no frame waits in a queue holding its receive
  buffer. When ``average`` returns, the round's messages still queued on a connection are
  released (copied), so nothing it sent views the buffers the next round writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import torch

from blocktrain.protocol import BlockUpdate, Codec, ProtocolError

from .group import CONTROL_PHASES, Phase, log_event
from .services import PeerServices, PeerUnreachable
from .tensors import ENCODED_DTYPES, decode_topk, encode_into, encode_topk, from_wire, to_wire, topk_count

log = logging.getLogger("blocktrain.p2p")

# Floats per message: 1M float32 = 4 MiB, well inside a frame (MAX_FRAME_BYTES is 16 MiB).
PIECE_FLOATS = 1 << 20
# Robust aggregation (rule 6). Honest per-step gradients of one block vary in norm by about 10x
# between members' batches (seen at a block's first steps); 100x the median is outside anything
# honest and far inside the absolute bound. Subtler parts are left to the clipping.
RELATIVE_NORM = 100.0
# Clip radius, in median distances to the coordinate-wise median: honest parts (similar
# distances) pass unclipped, so an honest round is the plain mean.
CLIP_RADIUS = 2.0
# Beyond this many median distances a part is reported as a suspect.
SUSPECT_RADIUS = 4.0
# Centred-clipping iterations (each moves the centre toward the clipped mean).
CLIP_ITERS = 3
# Rounds in a row as a suspect before a member is excluded: an honest member's batch can make it
# an outlier once or twice (a block's first steps), an attacker's update is one every round.
SUSPECT_ROUNDS = 5
# Members named (excluded, excluding us) and events kept: identities are free, so what is kept of
# them is bounded in total; past it the oldest goes (an old identity excluded long ago may come back
# and be judged again, as any new one).
MAX_NAMED = 1024


def remember(names: dict, key, value, bound: int = MAX_NAMED) -> None:
    """``names[key] = value``, the oldest entries dropped past ``bound``."""
    names[key] = value
    while len(names) > bound:
        del names[next(iter(names))]

# An update whose cosine with the coordinate-wise median (over the whole vector) is below minus
# this is a suspect too (a sign flipped on the wire); an honest one agrees with the median.
OPPOSED_COS = 0.05
AGGREGATES = ("robust", "mean")
# Rounds ahead of the one in progress whose parts are held; anything later is dropped. A member
# can be one round ahead of us (it finished the round we are finishing), never more.
AHEAD_ROUNDS = 2
# Parts held for rounds not yet begun: from members only, and at most this many bytes in all, or,
# for larger vectors, what an honest group sends us in one round: every other member's parts of a
# whole vector (robust rounds; a plain mean sends us less). A member finishes a round before us and
# starts the next one while we are finishing: what it sends then must not be lost.
MAX_EARLY_BYTES = 64 * 1024 * 1024


class RoundFailed(Exception):
    """A round's coverage fell below the threshold; nothing was averaged."""

    def __init__(self, block: int, rnd: int, coverage: float, missing: int, pieces: int, min_coverage: float,
                 silent: frozenset = frozenset()):
        super().__init__(f"block {block} round {rnd}: coverage {coverage:.1%} < {min_coverage:.0%} "
                         f"({missing} of {pieces} pieces lack a member); nothing applied")
        self.block, self.round, self.coverage = block, rnd, coverage
        self.silent = silent  # live members whose parts never came


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
    opposed: dict = field(default_factory=dict)  # robust: member -> its cosine with the median, when < -OPPOSED_COS


@dataclass(frozen=True)
class Part:
    """A message for ``peer`` (``stored_bytes`` of tensor payload)."""
    peer: str
    msg: BlockUpdate
    stored_bytes: int


def _held_bytes(msg: BlockUpdate) -> int:
    """What holding ``msg`` costs: its tensors' bytes and its metadata's (re-encoded)."""
    return sum(t.stored_bytes for t in msg.tensors) + len(msgpack.packb(msg.meta, use_bin_type=True))


# The BLOCK_UPDATE codecs of a round: a tensor codec, or topk (sparse, rule 7).
TOPK = "topk"
UPDATE_CODECS = tuple(c.value for c in Codec) + (TOPK,)


def lossy_scratch(n: int, codec: Codec | str) -> dict:
    """Buffers of a lossy round of n floats: x (vector + residual), enc (x encoded: what is sent;
    topk: what the others decode), residual (what the encoding lost, fed into the next round)."""
    enc = torch.empty(n) if codec == TOPK else torch.empty(n, dtype=ENCODED_DTYPES[Codec(codec)])
    return {"x": torch.empty(n), "enc": enc, "residual": torch.empty(n)}


def _tensors(wire) -> tuple:
    return wire if isinstance(wire, tuple) else (wire,)


def _stored(wire) -> int:
    return sum(w.stored_bytes for w in _tensors(wire))


def group_digest(members, rnd: int, start: str) -> str:
    """Identifies a round's group: its members, its number and its start point (rule 2)."""
    return hashlib.sha256(f"{','.join(sorted(members))}|{rnd}|{start}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Bounds:
    """What an incoming part may be (rule 3)."""
    max_norm: float = 1e6


def validate_part(msg: BlockUpdate, numel: int, bounds: Bounds, out: torch.Tensor | None = None,
                  sparse: bool = False) -> torch.Tensor:
    """The part's tensor, or ValueError saying what is wrong with it. ``sparse``: the round's
    codec is topk, and every part must be one (indices, values and scales checked first)."""
    if sparse != (msg.codec == TOPK):
        raise ValueError(f"a part of codec {msg.codec} in a {'topk' if sparse else 'dense'} round")
    try:
        if sparse:
            t = decode_topk(msg.tensors, numel, out)
        else:
            if len(msg.tensors) != 1 or msg.tensors[0].name != "part":
                raise ValueError("expected one tensor named 'part'")
            w = msg.tensors[0]
            if w.dtype != "float32" or w.shape != (numel,):
                raise ValueError(f"part is {w.dtype} {w.shape}, expected float32 ({numel},)")
            t = from_wire(w, out=out)
    except ProtocolError as e:  # e.g. lz4 data that does not decompress: the sender's fault
        raise ValueError(f"part does not decode: {e}") from None
    norm = float(torch.linalg.vector_norm(t))  # one pass: NaN or inf anywhere makes it NaN or inf
    if not math.isfinite(norm):
        raise ValueError(f"part holds NaN or inf (its norm is {norm})")
    if norm > bounds.max_norm:
        raise ValueError(f"part norm {norm:.3g} exceeds the bound {bounds.max_norm:.3g}")
    return t


class AveragingRound:
    """One round of reduce-scatter + all-gather, as seen by member ``me`` (sans-IO)."""

    def __init__(self, me: str, block: int, rnd: int, members, vector: torch.Tensor, *, codec: Codec = Codec.RAW,
                 start: str = "", bounds: Bounds = Bounds(), min_coverage: float = 1.0,
                 residual: torch.Tensor | None = None, aggregate: str = "mean", out: torch.Tensor | None = None,
                 arena: torch.Tensor | Callable[[int], torch.Tensor] | None = None, scratch: dict | None = None,
                 density: float = 0.01):
        """``out``: where the result goes (n float32; a fresh tensor if None). ``arena``: where the
        other members' parts are decoded (float32: R - 1 slots of the pieces we compute, i.e. every
        piece in a robust round, those we own in a mean round; or a function that returns one of
        the size it is asked), reused across rounds by the driver so that a round touches no
        fresh memory; fresh tensors if None (and for pieces that move to us mid-round).
        ``scratch``: a lossy codec's buffers (``lossy_scratch``), lent the same way; ``residual``
        may be its "residual". ``density``: the fraction of each chunk a topk round sends."""
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate {aggregate!r}: expected one of {AGGREGATES}")
        self.me, self.block, self.round = me, block, rnd
        self.ids = sorted(set(members) | {me})
        self.sparse = codec == TOPK
        self.k = topk_count(density) if self.sparse else 0
        self.codec = Codec.RAW if self.sparse else Codec(codec)  # topk's tensors are raw
        self.update_codec = TOPK if self.sparse else self.codec.value
        self.bounds, self.min_coverage = bounds, min_coverage
        lossy = self.sparse or self.codec.lossy
        self.robust = aggregate == "robust" and len(self.ids) >= 3
        self.suspects: dict[str, float] = {}  # robust: member -> its largest distance, in median distances
        self._agree: dict = {}  # robust: member -> [x . median, |x|^2] over the pieces; None -> |median|^2
        self.group = group_digest(self.ids, rnd, f"{start}|{'robust' if self.robust else 'mean'}")
        R, n = len(self.ids), vector.numel()
        self.n = n
        self.P = max(R, -(-n // PIECE_FLOATS))
        self.bounds_ = [(n * i) // self.P for i in range(self.P + 1)]
        self.vector = vector.detach().float().reshape(-1)  # read only: our own piece is a view of it
        x, self.residual = self.vector, None
        if lossy:  # error feedback (rule 7), in the driver's buffers when it lends them
            enc_dtype = torch.float32 if self.sparse else ENCODED_DTYPES[self.codec]
            scratch = scratch if scratch is not None and scratch["x"].numel() == n \
                and scratch["enc"].dtype == enc_dtype else lossy_scratch(n, self.update_codec)
            x = scratch["x"]
            if residual is not None and residual.numel() == n:
                torch.add(self.vector, residual, out=x)  # before the residual's buffer is written again
            else:
                x.copy_(self.vector)
            if self.codec is Codec.INT8 and not bool(torch.isfinite(x).all()):  # before anything is written
                raise ValueError("non-finite values cannot be int8-encoded")
            res = scratch["residual"]  # first what the others decode, then what they miss of x
            if self.sparse:
                self.sent = scratch["enc"]  # what the others decode of our part
                self.wires = [encode_topk(x[a:b], self.k, self.sent[a:b]) for a, b in self.spans()]
                res.copy_(self.sent)
            else:
                self.wires = [encode_into("part", x[a:b], self.codec, scratch["enc"][a:b], res[a:b])
                              for a, b in self.spans()]
            self.residual = torch.sub(x, res, out=res)
        else:
            self.wires = [to_wire("part", x[a:b], self.codec, "never") for a, b in self.spans()]
        self.x = x
        if out is not None and (out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous()
                                or out.data_ptr() == vector.data_ptr()):
            raise ValueError(f"out holds {out.numel()} {out.dtype}, expected {n} contiguous float32 apart from "
                             "the vector")
        self.out = torch.empty(n) if out is None else out.view(-1)  # gathered pieces are decoded into it
        others = [p for p in self.ids if p != me]
        self._slot: dict[int, tuple[int, int]] = {}  # piece -> its place in each member's arena slot
        at = 0
        for j, (a, b) in enumerate(self.spans()):  # robust: every piece; mean: the pieces we own
            if self.robust or self.ids[j % R] == me:
                self._slot[j] = (at, at + b - a)
                at += b - a
        self._arena = None
        if callable(arena):  # the driver lends one of the size asked
            arena = arena(len(others) * at)
        if arena is not None and arena.dtype == torch.float32 and arena.numel() >= len(others) * at:
            self._arena = {p: arena[i * at:(i + 1) * at] for i, p in enumerate(others)}
        self.departed: dict[str, str] = {}
        self.rejected: list[dict] = []  # {"peer", "reason"}, in order
        self._received: dict[int, dict[str, torch.Tensor]] = {j: {} for j in range(self.P)}
        self._sent_to: dict[int, object] = {}  # piece -> owner (mean) or the members it went to (robust)
        self._gather_sent: set[int] = set()
        self.gathered: dict[int, list] = {}  # piece -> contributors, once its average is in ``out``
        self.finished = False

    def spans(self):
        return [(self.bounds_[j], self.bounds_[j + 1]) for j in range(self.P)]

    # --- who -----------------------------------------------------------------------------------
    def live(self) -> list[str]:
        bad = {r["peer"] for r in self.rejected}
        return [p for p in self.ids if p not in self.departed and p not in bad]

    def owner(self, j: int) -> str:
        o = self.ids[j % len(self.ids)]
        live = self.live()
        if o not in live:  # the piece moves to a live member, the same for all (rule 4)
            o = live[j % len(live)]
        return o

    @property
    def done(self) -> bool:
        return self.finished or len(self.gathered) == self.P

    # --- inputs --------------------------------------------------------------------------------
    def start(self) -> list[Part]:
        return self._progress(final=False)

    def receive(self, pid: str, msg: BlockUpdate) -> list[Part]:
        """A part from ``pid``; returns what to send next. A part that fails validation rejects
        its sender (see ``rejected``)."""
        if self.done or pid not in self.live():
            return []
        phase, j = msg.meta.get("phase"), msg.meta.get("part")
        if type(j) is not int or not 0 <= j < self.P or phase not in ("reduce", "gather"):
            return self._reject(pid, f"bad phase/part {phase!r}/{j!r}")
        gone = msg.meta.get("departed", [])
        if not isinstance(gone, list) or len(gone) > len(self.ids):
            return self._reject(pid, "malformed 'departed'")
        for d in gone:
            if isinstance(d, str) and d != self.me and d != pid and d in self.live():
                self.departed[d] = f"departed at {pid[:12]}"
        a, b = self.bounds_[j], self.bounds_[j + 1]
        if self.robust and phase != "reduce":
            return self._reject(pid, "sent an average in a robust round (nobody's average is taken on trust)")
        wanted = phase == "gather" and j not in self.gathered and pid == self.owner(j)
        into = None  # the awaited average goes straight into the result (refilled at the end if rejected)
        if wanted:
            into = self.out[a:b]
        elif phase == "reduce" and self._arena is not None and pid not in self._received[j] and j in self._slot:
            into = self._arena[pid][slice(*self._slot[j])]  # this member's place for the piece in the arena
        try:
            t = validate_part(msg, b - a, self.bounds, into, self.sparse)
        except ValueError as e:
            return self._reject(pid, str(e))
        if phase == "reduce":
            self._received[j].setdefault(pid, t)  # kept before we know we own it (a departure moves pieces)
        elif wanted:
            c = msg.meta.get("contributors")
            self.gathered[j] = [p for p in c if isinstance(p, str)] if isinstance(c, list) else []
        return self._progress(final=False)

    def depart(self, pid: str, why: str) -> list[Part]:
        if pid not in self.live() or pid == self.me or self.done:
            return []
        self.departed[pid] = why
        return self._progress(final=False)

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
        if self.sparse:
            return self.sent[a:b]
        return from_wire(self.wires[j]) if self.codec.lossy else self.x[a:b]

    def _msg(self, phase: str, j: int, wire, **meta) -> BlockUpdate:
        if self.departed:
            meta["departed"] = sorted(self.departed)
        return BlockUpdate(block=self.block, round=self.round, codec=self.update_codec, tensors=_tensors(wire),
                           meta={"phase": phase, "part": j, "group": self.group, **meta})

    def _progress(self, final: bool) -> list[Part]:
        if self.robust:
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
            avg = self.out[a:b]
            vals = list(got.values())
            avg.copy_(vals[0])
            for v in vals[1:]:
                avg.add_(v)
            avg.div_(len(vals))
            contributors = sorted(got)
            if self.sparse:  # the average of R sparse parts has at most R x k values per chunk
                w = encode_topk(avg, self.k * len(self.ids), avg)  # avg becomes what the others decode
            else:
                w = to_wire("part", avg, self.codec, "never")
                if self.codec.lossy:
                    from_wire(w, out=avg)  # what the others will decode (rule 6)
            self._gather_sent.add(j)
            self.gathered[j] = contributors
            msg = self._msg("gather", j, w, contributors=contributors)
            out += [Part(p, msg, _stored(w)) for p in sorted(live - {self.me})]
        return out

    def _progress_robust(self, final: bool) -> list[Part]:
        """Rule 6: our part of every piece to every live member; every piece computed here."""
        out: list[Part] = []
        spans = self.spans()
        for j, (a, b) in enumerate(spans):
            sent = self._sent_to.setdefault(j, set())
            if self.me not in sent:
                sent.add(self.me)
                self._received[j][self.me] = self._own(j)
            for p in self.live():
                if p not in sent:
                    sent.add(p)
                    out.append(Part(p, self._msg("reduce", j, self.wires[j]), _stored(self.wires[j])))
        progressed = True
        while progressed:  # a rejection shrinks the live set: pieces may complete (or change) again
            progressed = False
            live = set(self.live())
            for j, (a, b) in enumerate(spans):
                if j in self.gathered:
                    continue
                got = {p: t for p, t in self._received[j].items() if p in live}
                if not final and not set(got) >= live:
                    continue
                before = len(self.rejected)
                self._robust_piece(j, got)
                progressed = progressed or len(self.rejected) > before
        if any(j in self.gathered and not set(self.gathered[j]) <= set(self.live()) for j in range(self.P)):
            for j in list(self.gathered):  # a member was rejected after some pieces counted it: redo them
                if not set(self.gathered[j]) <= set(self.live()):
                    del self.gathered[j]
            return out + self._progress_robust(final)
        return out

    def _robust_piece(self, j: int, got: dict) -> None:
        a, b = self.bounds_[j], self.bounds_[j + 1]
        ids = sorted(got)
        if len(ids) >= 3:
            norms = {p: float(torch.linalg.vector_norm(got[p])) for p in ids}
            med = float(torch.tensor(list(norms.values())).median())
            for p in ids:
                if med > 0 and norms[p] > RELATIVE_NORM * med and p != self.me:
                    self._reject(p, f"part norm {norms[p]:.3g} is over {RELATIVE_NORM:g}x the median of the "
                                    f"round's parts ({med:.3g})")
            ids = [p for p in ids if p in self.live()]
        avg = self.out[a:b]
        avg.copy_(centred_clip(torch.stack([got[p] for p in ids]), self.suspects, ids, self._agree) if len(ids) >= 3
                  else torch.stack([got[p] for p in ids]).mean(0))
        self.gathered[j] = ids

    def result(self) -> tuple[torch.Tensor, RoundReport]:
        """The averaged vector and the round's report; RoundFailed below ``min_coverage``."""
        live = set(self.live())
        parts, covered = [], 0
        for j, (a, b) in enumerate(self.spans()):
            got = self.gathered.get(j)
            ok = got is not None and set(got) >= live
            if got is None or (not self.robust and any(r["peer"] == self.owner(j) for r in self.rejected)):
                self.out[a:b] = self.vector[a:b]  # a piece that never came back keeps our values
                ok = False
            if ok:
                covered += b - a
            parts.append({"owner": "everyone" if self.robust else self.owner(j), "contributors": got or [], "ok": ok})
        rep = RoundReport(self.round, self.ids, covered / self.n if self.n else 1.0, parts, list(self.rejected),
                          departed=sorted(self.departed),
                          why={**self.departed, **{r["peer"]: r["reason"] for r in self.rejected}},
                          robust=self.robust, suspects=dict(self.suspects), opposed=self.opposed())
        if rep.coverage < self.min_coverage:
            raise RoundFailed(self.block, self.round, rep.coverage, sum(not p["ok"] for p in parts), self.P,
                              self.min_coverage, frozenset(self.silent()))
        return self.out, rep

    def opposed(self) -> dict:
        """Robust: members whose update points against the coordinate-wise median over the whole
        vector (cosine below -OPPOSED_COS), as member -> cosine. A sign flipped on the wire sits
        no farther from the median than an honest member's noise, so distance alone never names
        it; an honest update agrees with the median (its own share of it, and the signal)."""
        mm = self._agree.get(None, 0.0)
        out = {}
        for p, acc in self._agree.items():
            if p is None or p == self.me or p not in self.live():
                continue
            dot, xx = acc
            if not (xx > 0 and mm > 0):
                continue
            cos = dot / math.sqrt(xx * mm)
            if cos < -OPPOSED_COS:
                out[p] = round(cos, 3)
        return out

    def silent(self) -> set:
        """Live members whose part of a piece we own never came (direct evidence only: an owner
        whose average did not come may itself be waiting for someone)."""
        live = set(self.live())
        out = set()
        for j in range(self.P):
            if self.robust or self.owner(j) == self.me:
                out |= live - set(self._received[j]) - {self.me}
        return out


class Averager:
    """Drives averaging rounds for one block over the peer's connections (the thin asyncio part)."""

    def __init__(self, peer: PeerServices, block: int, codec: str = "raw", min_coverage: float = 1.0,
                 max_norm: float = 1e6, timeout_s: float = 30.0, aggregate: str = "mean", floats: int = 0,
                 density: float = 0.01):
        """``floats``: the vector size of the rounds, when known before the first one (it sizes what
        is held of members' parts that come before we begin a round; later rounds know it)."""
        self.peer, self.block, self.aggregate = peer, block, aggregate
        self._floats, self._others = floats, 0  # the last round's vector size and other members
        self._suspect_streak: dict[str, int] = {}
        if codec not in UPDATE_CODECS:
            raise ValueError(f"averaging codec {codec!r}: expected one of {UPDATE_CODECS}")
        self.codec, self.density = codec, density
        self.min_coverage, self.timeout_s = min_coverage, timeout_s
        self.bounds = Bounds(max_norm)
        self.banned: dict[str, str] = {}  # peer id -> why (we rejected its update)
        self.shunned: dict[str, str] = {}  # peers that rejected ours -> their reason
        self.events: list[dict] = []
        self._residual: torch.Tensor | None = None
        self._arena = torch.empty(0)  # members' parts of a round are decoded here (AveragingRound)
        self._scratch: dict | None = None  # a lossy codec's buffers, lent to every round
        self._round: AveragingRound | None = None
        self._outbox: list[Part] = []  # what the round in progress has to send next
        self._wake: asyncio.Event | None = None  # set when the outbox has parts or the round is done
        self._failure: BaseException | None = None  # a bug met while feeding the round (raised by average)
        self._early: dict[int, list] = {}  # round -> (pid, msg) that came before we began it
        self._early_bytes = 0
        self._early_from: dict[str, int] = {}  # member -> bytes of it held in _early
        self._stranger_bytes = 0  # of _early_bytes, from members that were not in our last round
        self._last_ids: frozenset = frozenset()  # the members of our last round
        self.next_members: frozenset = frozenset()  # those the group expects in our next round
        self._early_dropped: set = set()  # rounds whose early parts overflowed (logged once each)
        self._absent_told: set = set()
        self.on_control = None  # fn(msg, pc, pid) for the group's control phases
        self.current = 0  # the round in progress, or the last one
        peer.on(BlockUpdate, self._route, inline=True)
        peer.on_membership(self._membership)

    # --- inputs, in the connections' readers ---------------------------------------------------
    def _route(self, msg: BlockUpdate, pc, pid: str):
        phase = msg.meta.get("phase")
        if phase is not None and not isinstance(phase, str):  # refused by name (the peer closes the sender)
            raise ValueError(f"BLOCK_UPDATE meta.phase must be a string, not {type(phase).__name__}")
        if phase == Phase.EXCLUDED.value:
            self.excluded_by(pid, msg.round, str(msg.meta.get("reason", ""))[:500])
        elif phase == Phase.ABSENT.value and msg.meta.get("round_group") is not None:
            self._put(msg.round, pid, msg)  # "I am not in your round": a departure for that round
        elif phase in CONTROL_PHASES:
            if self.on_control is not None:
                self.on_control(msg, pc, pid)
        elif pid in self.banned:
            return
        else:
            self._put(msg.round, pid, msg)

    def _put(self, rnd: int, pid: str, msg):
        r = self._round
        if r is not None and rnd == r.round:
            self._feed(pid, msg)
        elif self.current < rnd <= self.current + AHEAD_ROUNDS:
            if self.peer.member(pid) is None:
                return
            size = _held_bytes(msg)
            per_sender, strangers = self._early_caps()
            known = self._known(pid)
            if self._early_from.get(pid, 0) + size <= per_sender and (known or self._stranger_bytes + size <= strangers):
                self._early.setdefault(rnd, []).append((pid, msg))
                self._early_bytes += size
                self._early_from[pid] = self._early_from.get(pid, 0) + size
                self._stranger_bytes += 0 if known else size
            elif rnd not in self._early_dropped:
                self._early_dropped.add(rnd)
                log.warning("block %d: parts for round %d came before we began it and exceed what is held "
                            "(%d bytes from one member, %d from members not in our last round); dropped from "
                            "%s (that round will miss them)", self.block, rnd, per_sender, strangers, pid[:12])
        elif msg.tensors and msg.meta.get("group") and rnd != self.current:
            self._tell_absent(pid, rnd)  # a round we are not in at all

    def _early_caps(self) -> tuple[int, int]:
        """(from one member, from all members outside our last and next rounds): bytes held of
        parts for rounds not begun. An honest member sends us at most one vector's worth for the
        next round (a robust round: its part of every piece). The members of our last round and of
        the next one the group expects get that each; anyone else (identities made for the
        purpose: they are free) shares one pool, so what is held is bounded by the group, not by
        how many identities exist."""
        vector = 4 * self._floats + (1 << 20)
        return max(vector, MAX_EARLY_BYTES // max(1, self._others)), max(MAX_EARLY_BYTES // 4, vector)

    def _recount_early(self) -> None:
        self._early_bytes, self._early_from, self._stranger_bytes = 0, {}, 0
        for items in self._early.values():
            for pid, m in items:
                size = _held_bytes(m)  # re-encodes the metadata: once per message
                self._early_bytes += size
                self._early_from[pid] = self._early_from.get(pid, 0) + size
                self._stranger_bytes += 0 if self._known(pid) else size

    def _membership(self, ev):
        if ev.departed and self._round is not None:
            self._feed(ev.peer_id, ev.change.value)

    def _known(self, pid: str) -> bool:
        """A member of our last round or of the next one the group expects (the driver's word):
        its early parts are held up to a vector's worth each (a group's first round, a joiner's)."""
        return pid in self._last_ids or pid in self.next_members

    def expect_members(self, ids) -> None:
        """The members the group expects in our next round (the swarm's group view)."""
        self.next_members = frozenset(ids)
        self._recount_early()

    def expect(self, rnd: int) -> None:
        """Our next round is ``rnd``: its parts (and the next one's) are held if they come early;
        those held for earlier rounds are not ours: their senders hear that we are not in them."""
        self.current = rnd - 1
        for old in [k for k in self._early if k < rnd]:
            for pid, msg in self._early.pop(old):
                if msg.tensors:
                    self._tell_absent(pid, old)
        self._recount_early()

    def depart(self, pid: str, why: str) -> None:
        """A member left the group (a service's own signal): it departs the round in progress."""
        if self._round is not None:
            self._feed(pid, why)

    # --- rounds --------------------------------------------------------------------------------
    async def average(self, rnd: int, vector: torch.Tensor, members, start: str = "",
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, RoundReport]:
        """Average ``vector`` (1-D float32) with ``members`` (peer ids, or id -> address; ours
        included) in round ``rnd`` whose start point has digest ``start``. The result is written
        into ``out`` when given (a caller that reuses one buffer round after round makes the round
        touch no fresh memory), else into a new tensor."""
        t0 = time.perf_counter()
        ids = [p for p in members if p not in self.banned and p not in self.shunned]
        if self.codec != "raw" and (self._scratch is None or self._scratch["x"].numel() != vector.numel()):
            self._scratch = None
            self._scratch = lossy_scratch(vector.numel(), self.codec)
        r = AveragingRound(self.peer.id, self.block, rnd, ids, vector, codec=self.codec, start=start,
                           bounds=self.bounds, min_coverage=self.min_coverage, residual=self._residual,
                           aggregate=self.aggregate, out=out, arena=self._lend_arena, scratch=self._scratch,
                           density=self.density)
        self._round, self._outbox, self._wake, self.current = r, [], asyncio.Event(), rnd
        self._floats, self._others, self._last_ids = vector.numel(), len(r.ids) - 1, frozenset(r.ids)
        self._early_dropped = {k for k in self._early_dropped if k > rnd}
        early = self._early.pop(rnd, [])  # parts that came before we began the round
        for old in [k for k in self._early if k < rnd]:
            del self._early[old]
        self._recount_early()
        bytes_sent = 0
        conns, sent = {}, []
        deadline = time.monotonic() + self.timeout_s
        try:
            for pid in r.ids:
                if pid != self.peer.id and self.peer.member(pid) is None:
                    self._feed(pid, "not a member")
            self._outbox += r.start()
            for pid, msg in early:
                self._feed(pid, msg)
            while True:
                while self._outbox:  # parts go out in order; what comes meanwhile is fed in as it comes
                    p = self._outbox.pop(0)
                    try:
                        if p.peer not in conns:
                            conns[p.peer] = await self.peer.connection(p.peer)
                        sent.append(p.msg)
                        await conns[p.peer].send(p.msg, bulk=True)
                        bytes_sent += p.stored_bytes
                    except (ConnectionError, ProtocolError) as e:
                        log.info("round %d: sending to %s failed: %s", rnd, p.peer[:12], e)
                        self._feed(p.peer, f"unreachable: {e}")
                if self._failure is not None:
                    raise self._failure
                if r.done:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    before = len(r.rejected)
                    self._outbox += r.expire()
                    for rej in r.rejected[before:]:  # robust pieces computed now can reject a member
                        self._reject(rej["peer"], rej["reason"], rnd)
                    continue
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._round, self._outbox, self._wake, self._failure = None, [], None, None
            for pc in conns.values():  # what is still queued stops viewing our buffers (reused next round)
                pc.release_queued(sent)
        self._residual = r.residual
        self._suspicions(r, rnd)
        out, rep = r.result()
        rep.seconds, rep.bytes_sent = time.perf_counter() - t0, bytes_sent
        return out, rep

    def _feed(self, pid: str, msg) -> None:
        """Everything for the round in progress goes in here as it comes, in the connections'
        readers: a part is checked and decoded where it belongs at once (no frame waits in a queue
        holding its receive buffer while we send); what the round has to send next goes to the
        outbox. ``msg`` is a BlockUpdate or, for a departure, why."""
        r = self._round
        before = len(r.rejected)
        try:
            if isinstance(msg, str):
                out = r.depart(pid, msg)
            elif msg.meta.get("phase") == Phase.ABSENT.value:
                out = r.depart(pid, "not in this round's group")
            elif msg.meta.get("group") != r.group:  # another view of the group: not usable
                self._mismatch(pid, r.round)
                out = r.depart(pid, "sees another group")
            else:
                out = r.receive(pid, msg)
        except Exception as e:  # a bug, not the peer's doing: the round fails here, the reader goes on
            log.exception("round %d: feeding a part from %s failed", r.round, pid[:12])
            self._failure = e
            out = []
        for rej in r.rejected[before:]:
            self._reject(rej["peer"], rej["reason"], r.round)
        self._outbox += out
        self._wake.set()

    def _lend_arena(self, floats: int) -> torch.Tensor:
        """The arena for a round that needs ``floats``: kept from round to round, remade when too
        small or more than twice too large (the group shrank)."""
        if not floats <= self._arena.numel() <= 2 * floats:
            self._arena = torch.empty(0)  # the old one goes first: never both at once
            self._arena = torch.empty(floats)
        return self._arena

    def _suspicions(self, r: AveragingRound, rnd: int):
        """Rule 6: a member that is a suspect SUSPECT_ROUNDS rounds in a row is excluded (named)."""
        if not r.robust:
            return
        opposed = r.opposed()
        for pid in r.live():
            if pid == self.peer.id:
                continue
            if pid in r.suspects or pid in opposed:
                self._suspect_streak[pid] = self._suspect_streak.get(pid, 0) + 1
                if self._suspect_streak[pid] >= SUSPECT_ROUNDS:
                    why = (f"{r.suspects[pid]:.1f} median distances from the others'" if pid in r.suspects else
                           f"pointing against the others' median, cosine {opposed[pid]:.2f}")
                    self._reject(pid, f"its update was an outlier {SUSPECT_ROUNDS} rounds in a row ({why} in round "
                                      f"{rnd})", rnd)
            else:
                self._suspect_streak.pop(pid, None)

    def _mismatch(self, pid: str, rnd: int):
        if not any(e.get("peer") == pid and e["event"] == "group mismatch" for e in self.events):
            log_event(self.events, {"event": "group mismatch", "peer": pid, "round": rnd, "time": time.time()})
            log.info("round %d: %s sees another group; its parts are not mixed in", rnd, pid[:12])
        self._tell_absent(pid, rnd)

    def _tell_absent(self, pid: str, rnd: int):
        if (pid, rnd) in self._absent_told:
            return
        self._absent_told.add((pid, rnd))
        if len(self._absent_told) > 4096:
            self._absent_told.clear()
        self._tell(pid, BlockUpdate(block=self.block, round=rnd, meta={"phase": Phase.ABSENT.value,
                                                                       "round_group": True}))

    def _tell(self, pid: str, msg: BlockUpdate):
        self.peer.spawn(self._send_control(pid, msg), f"tell {msg.meta.get('phase')}")

    async def _send_control(self, pid: str, msg: BlockUpdate):
        try:
            (await self.peer.connection(pid)).send_nowait(msg)
        except (ConnectionError, ProtocolError, PeerUnreachable):
            pass

    def _reject(self, pid: str, why: str, rnd: int):
        self.reject(pid, why, rnd)

    def reject(self, pid: str, why: str, rnd: int):
        """Exclude ``pid`` from our rounds from now on, tell it, and report why."""
        if pid in self.banned:
            return
        remember(self.banned, pid, why)
        log_event(self.events, {"event": "rejected update", "peer": pid, "round": rnd, "reason": why, "time": time.time()})
        log.warning("block %d round %d: rejected update from %s: %s; excluded from later rounds",
                    self.block, rnd, pid[:12], why)
        self._tell(pid, BlockUpdate(block=self.block, round=rnd, meta={"phase": Phase.EXCLUDED.value, "reason": why}))

    def excluded_by(self, pid: str, rnd: int, why: str):
        """``pid`` rejected our update and will ignore us: stop waiting for it, now and later."""
        if pid in self.shunned:
            return
        remember(self.shunned, pid, why)
        log_event(self.events, {"event": "excluded by", "peer": pid, "round": rnd, "reason": why, "time": time.time()})
        log.warning("block %d: %s rejected our update in round %d (%s) and excludes us", self.block, pid[:12], rnd, why)
        if self._round is not None:
            self._feed(pid, "excluded us")


def centred_clip(x: torch.Tensor, suspects: dict, ids: list, agree: dict | None = None) -> torch.Tensor:
    """Centred clipping of the rows of ``x`` (R x n): start at the coordinate-wise median, clip each
    row's offset to CLIP_RADIUS median distances, move to the mean of the clipped offsets; rows
    beyond SUSPECT_RADIUS median distances are recorded in ``suspects`` (id -> distance ratio).
    ``agree`` (id -> [row . median, |row|^2], None -> |median|^2) accumulates over the pieces of a
    round, for AveragingRound.opposed. The arithmetic is that of PROTOCOL.md 7.1, op for op
    (members must end with the same bytes), in one scratch matrix instead of fresh ones."""
    v = coordinate_median(x)
    if agree is not None:
        dots, sq = (x @ v).tolist(), (x * x).sum(1).tolist()
        for i, p in enumerate(ids):
            acc = agree.setdefault(p, [0.0, 0.0])
            acc[0] += dots[i]
            acc[1] += sq[i]
        agree[None] = agree.get(None, 0.0) + float(v @ v)
    d = torch.sub(x, v)
    dist = torch.linalg.vector_norm(d, dim=1)
    scale = float(dist.median())
    if scale == 0.0:
        return x.mean(0)
    for i, p in enumerate(ids):
        ratio = float(dist[i]) / scale
        if ratio > SUSPECT_RADIUS:
            suspects[p] = max(suspects.get(p, 0.0), round(ratio, 2))
    tau = CLIP_RADIUS * scale
    for k in range(CLIP_ITERS):
        if k:
            torch.sub(x, v, out=d)
        n = torch.linalg.vector_norm(d, dim=1, keepdim=True).clamp_min(1e-30)
        v = v + d.mul_(torch.clamp(tau / n, max=1.0)).mean(0)
    return v


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """``x.median(dim=0).values`` (the lower median for an even count of rows), by a sorting
    network of elementwise min/max over the rows: for the few rows of a group, 30-60x faster
    than ``torch.median`` on this CPU (27 ms -> 0.5 ms for 3 x 730k floats). Same values; which
    zero the median of a +0.0 and a -0.0 is may differ from torch's (they compare equal; after an
    optimizer step the sign could show only in a parameter that is itself exactly zero)."""
    r = x.shape[0]
    if r > 16:
        return x.median(dim=0).values
    rows = list(x.unbind(0))
    for k in range(r):  # odd-even transposition: r passes sort r rows
        for i in range(k % 2, r - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows[(r - 1) // 2].clone() if r == 1 else rows[(r - 1) // 2]


def flatten(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params]) if params else torch.empty(0)


def unflatten_(params, vec: torch.Tensor):
    pos = 0
    for p in params:
        k = p.numel()
        p.data.copy_(vec[pos:pos + k].view_as(p))
        pos += k
    assert pos == vec.numel(), "vector and parameters differ in size"


@dataclass
class OuterOptimizer:
    """DiLoCo's outer step: pseudo-gradient = start - now, averaged; SGD or Nesterov momentum."""
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    _buf: torch.Tensor | None = None

    def step(self, start: torch.Tensor, avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
        g = avg_pseudo_grad
        if self.momentum:
            self._buf = g.clone() if self._buf is None else self._buf.mul_(self.momentum).add_(g)
            g = g + self.momentum * self._buf if self.nesterov else self._buf
        return start - self.lr * g
