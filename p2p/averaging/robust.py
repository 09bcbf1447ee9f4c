"""What a part may be, and the robust aggregate: pure functions over tensors, no state.

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 3: every incoming part is validated before use (name, shape, dtype, finite values, the
  norm bound): ``validate_part``. A sender whose part fails is rejected: the round goes on without
  it and reports why (round.py); the driver excludes it from later rounds and tells it (phase
  ``excluded``, driver.py).
- Rule 6 (``aggregate="robust"``, the default with 3 or more members): no member's aggregate is
  taken on trust. Every member sends its part of every piece to every member, and each computes
  every piece itself (round.py): parts whose norm exceeds RELATIVE_NORM x the median norm of the
  piece's parts are left out of that piece, their sender a suspect of the round (``norm_outliers``:
  one honest member's gradient was seen at 107x the others' at a block's first steps, with 4 x 32
  byte batches, and rejecting it excluded it for good); the rest are combined by
  centred clipping (Karimireddy et al. 2021: around the coordinate-wise median, radius
  CLIP_RADIUS x the median distance; ``centred_clip``), which bounds what any one member can move
  the result. A member whose part lies beyond SUSPECT_RADIUS x that median distance is reported as
  a suspect, and so is one whose update points against the median (``opposed_members``); the
  driver excludes one that is a suspect SUSPECT_ROUNDS rounds in a row (driver.py). Honest
  members compute from the same parts with the same arithmetic, so they end with the same bytes;
  one that equivocates (sends members different parts) makes their start points differ, which
  the next round's group identity shows. With 2 members there is no majority to trust: the round
  is a plain mean (``robust`` False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blocktrain.protocol import BlockUpdate, ProtocolError

from ..tensors import decode_sign, decode_topk, from_wire
from .codec import COMPACT, TOPK

# Robust aggregation (rule 6). Honest per-step gradients of one block vary in norm by about 10x
# between members' batches (seen at a block's first steps), and once by 107x (4 x 32 byte
# batches, round 37 of block 0): a part over 100x the median is left out of its piece and its
# sender is a suspect of the round; 100x is far inside the absolute bound. Subtler parts are left
# to the clipping.
RELATIVE_NORM = 100.0
# Clip radius, in median distances to the coordinate-wise median: honest parts (similar
# distances) pass unclipped, so an honest round is the plain mean.
CLIP_RADIUS = 2.0
# Beyond this many median distances a part is reported as a suspect.
SUSPECT_RADIUS = 4.0
# Centred-clipping iterations (each moves the centre toward the clipped mean).
CLIP_ITERS = 3
# An update whose cosine with the coordinate-wise median (over the whole vector) is below minus
# this is a suspect too (a sign flipped on the wire); an honest one agrees with the median.
OPPOSED_COS = 0.05
# The pair test's window (``PairWindow``): older rounds count PAIR_DECAY times less each round
# (about 10 rounds' worth in all; the noise of one round's cosine shrinks about 4x), and a pair
# counts once it holds PAIR_MIN_ROUNDS rounds. A member is opposed when the others agree among
# themselves above PAIR_AGREE and it points against them by at least half as much (and beyond
# -OPPOSED_COS): a reversed update mirrors the others' agreement, honest noise does not.
PAIR_DECAY = 0.9
PAIR_MIN_ROUNDS = 3
PAIR_AGREE = 0.1


@dataclass(frozen=True)
class Bounds:
    """What an incoming part may be (rule 3)."""
    max_norm: float = 1e6


def validate_part(msg: BlockUpdate, numel: int, bounds: Bounds, out: torch.Tensor | None = None,
                  compact: str | None = None) -> torch.Tensor:
    """The part's tensor, or ValueError saying what is wrong with it. ``compact``: the round's
    codec when it is topk or sign, and every part must be one (its indices, bits and scales checked
    first); None: a dense round."""
    if compact not in (None, *COMPACT):
        raise ValueError(f"compact codec {compact!r}: expected one of {COMPACT}")
    if (msg.codec in COMPACT or compact is not None) and msg.codec != compact:
        raise ValueError(f"a part of codec {msg.codec} in a {compact or 'dense'} round")
    try:
        if compact == TOPK:
            t = decode_topk(msg.tensors, numel, out)
        elif compact is not None:
            t = decode_sign(msg.tensors, numel, out)
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


def norm_outliers(parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Rule 6: the members whose part's norm is over RELATIVE_NORM x the median of the parts'
    norms, as member -> its norm over the median, in id order. Our own part included: every
    member leaves the same parts out, so all end with the same bytes (our own far part too)."""
    ids = sorted(parts)
    norms = {p: float(torch.linalg.vector_norm(parts[p])) for p in ids}
    med = float(torch.tensor(list(norms.values())).median())
    return {p: norms[p] / med for p in ids if med > 0 and norms[p] > RELATIVE_NORM * med}


def centred_clip(x: torch.Tensor, suspects: dict, ids: list, agree: dict | None = None,
                 origin: torch.Tensor | None = None) -> torch.Tensor:
    """Centred clipping of the rows of ``x`` (R x n): start at the coordinate-wise median, clip each
    row's offset to CLIP_RADIUS median distances, move to the mean of the clipped offsets; rows
    beyond SUSPECT_RADIUS median distances are recorded in ``suspects`` (id -> distance ratio).
    ``agree`` (id -> [u . m, |u|^2], None -> |m|^2, for each row's update u and the median's m)
    accumulates over the pieces of a round, for ``opposed_members``. The rows are updates
    themselves unless ``origin`` (n) is given: then they are points (a gossip round's parameters),
    and an update is a point minus ``origin``. The arithmetic of the result is that of PROTOCOL.md
    7.1, op for op (members must end with the same bytes), in one scratch matrix instead of fresh
    ones; ``agree`` and ``origin`` do not touch it."""
    v = coordinate_median(x)
    o = origin.to(x.dtype) if agree is not None and origin is not None else None  # only the opposed test reads it
    d = torch.sub(x, v) if o is None else torch.sub(x, o)
    if agree is not None:
        u, m = (x, v) if o is None else (d, v - o)
        dots, sq = (u @ m).tolist(), (u * u).sum(1).tolist()
        for i, p in enumerate(ids):
            acc = agree.setdefault(p, [0.0, 0.0])
            acc[0] += dots[i]
            acc[1] += sq[i]
        agree[None] = agree.get(None, 0.0) + float(m @ m)
    if o is not None:
        torch.sub(x, v, out=d)
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


def accumulate_pairs(pairs: dict, x: torch.Tensor, ids: list) -> None:
    """Adds each pair of rows' dot product and squared norms to ``pairs`` ((ids[i], ids[k]) for
    i < k -> [x_i . x_k, |x_i|^2, |x_k|^2]), for ``pair_cosines``."""
    g = (x @ x.T).tolist()
    for i, p in enumerate(ids):
        for k in range(i + 1, len(ids)):
            acc = pairs.setdefault((p, ids[k]), [0.0, 0.0, 0.0])
            acc[0] += g[i][k]
            acc[1] += g[i][i]
            acc[2] += g[k][k]


def pair_cosines(pairs: dict, live) -> dict[str, float]:
    """Each member of ``live`` that shares pieces with another -> the upper median of its updates'
    cosines with the other live members' (``pairs`` as ``accumulate_pairs`` made it; each pair
    over the pieces that held both, so a part that missed a piece does not shrink a cosine). The
    upper median (of two: the larger) keeps a member's figure at or above its lowest cosine with an
    honest member while honest members are at least half of the others: an attacker can lower
    its own cosines, not an honest member's below the honest ones."""
    cos: dict[str, list[float]] = {}
    for (p, q), (dot, pp, qq) in pairs.items():
        if p in live and q in live and pp > 0 and qq > 0:
            c = dot / math.sqrt(pp * qq)
            cos.setdefault(p, []).append(c)
            cos.setdefault(q, []).append(c)
    return {p: sorted(cs)[len(cs) // 2] for p, cs in cos.items()}


class PairWindow:
    """Rule 6's pair test, over the last rounds (robust rounds whose parts are sign-coded updates:
    the low-communication mode, where each part is a member's optimizer step; not gossip rounds,
    and not per-step gradients, whose cosines late in a deeper block are too weak and noisy):
    every pair of members' dot product and squared norms (``accumulate_pairs``), the older
    rounds' decayed by PAIR_DECAY a round. A member that flips its sign on the wire only once the
    updates are noisy agrees with the coordinate-wise median less than honest members do but rarely
    against it (over the median of 4 sign parts its own part tips the coordinates where the others
    split), while against each honest member's update it points away. One round's cosines are
    noisy where the members' common direction is weak; summed over rounds the noise shrinks and
    an honest figure stays near its mean. Per-step gradients are left out: late in a deeper block
    an honest member's figure was below -0.05 for 5 rounds in a row, alone (one round) and over a
    window of 0.8 (the relay test, 1 run in 3). Only pairs among the latest round's members are
    kept (at most R(R-1)/2)."""

    def __init__(self) -> None:
        self.acc: dict[tuple[str, str], list[float]] = {}  # (p, q), p < q -> [dot, |u_p|^2, |u_q|^2, rounds]

    def add(self, pairs: dict, ids) -> None:
        """Takes in one round's ``pairs`` among its members ``ids``."""
        keep = set(ids)
        for k in list(self.acc):
            if k[0] in keep and k[1] in keep:
                dot, pp, qq, k_rounds = self.acc[k]
                self.acc[k] = [dot * PAIR_DECAY, pp * PAIR_DECAY, qq * PAIR_DECAY, k_rounds]
            else:
                del self.acc[k]
        for k, (dot, pp, qq) in pairs.items():
            if k[0] in keep and k[1] in keep:
                acc = self.acc.setdefault(k, [0.0, 0.0, 0.0, 0.0])
                acc[0] += dot
                acc[1] += pp
                acc[2] += qq
                acc[3] += 1.0

    def figures(self, live) -> dict[str, float]:
        """Each member of ``live`` -> its figure: ``pair_cosines`` over the window's pairs that hold
        PAIR_MIN_ROUNDS rounds or more."""
        return pair_cosines({k: v[:3] for k, v in self.acc.items() if v[3] >= PAIR_MIN_ROUNDS}, live)

    def opposed(self, live, me: str) -> dict[str, float]:
        """Members of ``live`` (``me`` never) whose figure (``pair_cosines`` over the window's pairs
        of at least PAIR_MIN_ROUNDS rounds) is below -OPPOSED_COS and below minus half of the
        others' agreement, the lower median of the other members' figures, which must be above
        PAIR_AGREE (where the common direction is weak, or every member's updates point apart as
        when each one's data differs from the mean, nobody is singled out). Member -> its figure."""
        fig = self.figures(live)
        out = {}
        for j, c in fig.items():
            if j == me or c >= -OPPOSED_COS:
                continue
            others = sorted(v for k, v in fig.items() if k != j)
            agree = others[(len(others) - 1) // 2] if others else 0.0
            if agree > PAIR_AGREE and c < -agree / 2:
                out[j] = round(c, 3)
        return out


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


def opposed_members(agree: dict, me: str, live) -> dict[str, float]:
    """Rule 6: members in ``live`` (``me`` never) whose update points against the coordinate-wise
    median's over the whole vector (cosine below -OPPOSED_COS), as member -> cosine; ``agree`` as
    ``centred_clip`` accumulated it over a round's pieces. A sign flipped on the wire sits no
    farther from the median than an honest member's noise, so distance alone never names it; an
    honest update agrees with the median's (its own share of it, and the signal).

    In a gossip round the parts are points, and every part's cosine with the median is about 1:
    the updates are measured from our own start point (``origin``). The partners' start points
    differ from ours by the consensus distance, and every partner's offset shares the part from
    our start point to the group's centre, which the median's has too: a reversed update still
    points against the median's while the consensus distance is under about 0.7 of an update's
    norm (tests/test_rounds.py: opposed at 0.5, not at 1.0; at 0.7 for 5 of 9 receivers in
    experiments/gossip/flip_naming.py; in the simulator, bench/gossip.py, it is 0.5 at the
    median, up to 1.3). Compared with our own update instead, a reversal shows at any consensus distance, but
    a partner that averaged with the attacker before has its start point pulled back along the
    common direction, and honest partners were named (11 exclusions among 15 honest members in
    the simulator's 16-member run). A reversal the median misses: ``PairWindow``."""
    mm = agree.get(None, 0.0)
    out = {}
    for p, acc in agree.items():
        if p is None or p == me or p not in live:
            continue
        dot, xx = acc
        if not (xx > 0 and mm > 0):
            continue
        cos = dot / math.sqrt(xx * mm)
        if cos < -OPPOSED_COS:
            out[p] = round(cos, 3)
    return out
