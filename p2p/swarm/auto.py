"""``sync = "auto"``: the rounds' arithmetic that each block picks from what its members measure.

Rules:
- A block under auto starts *probing*: rounds of one local step whose update travels sign-coded
  (``PROBE``: parameter rounds every step, codec sign, outer lr 1.7: the every-step mode of
  results/lowcomm, about 31x fewer bytes than fp32 gradients, +0.019 CE there on 2 seeds).
- Each member measures its probe rounds in which another member's part counted in every piece
  (``Pace``): compute seconds per local step, the round's seconds in averaging (from its parts
  sent to the result held, waiting for the others included) and the payload bytes it sent. Any
  other round (alone, or with every other member's part missing from a piece) measures nothing.
- The sponsor of a probe round (the smallest id of its members, group.py rule 2) says in meta
  ``choice`` of its parts what it picks from its own figures so far (``choose``: the medians of
  its last ``PACE_KEPT``), once it has measured ``MIN_PACES`` rounds. At the end of a probe round
  that applied with the sponsor's part in every piece (so every member that applied the same
  result decides alike), every member takes the sponsor's valid choice: the block's mode from the
  next round to the block's end. Any other round leaves the block probing.
- Taking gradient rounds, every member starts its inner optimizer's moments afresh at the take,
  before the round's state is saved or offered (picker.py): after the probes' local steps each
  member holds its own, and gradient rounds keep members identical only where one state is
  applied the same averaged gradient.
- A round's mode is part of its group digest (the start digest, ``|``, the mode's tag): members
  of different picks are of different views of the group (rule 9 of averaging: the round fails,
  the member that began it apart rejoins and takes the group's state, pick included). Every part
  also says the mode in meta ``mode``; a part of another mode under our group digest is forged
  and rejected by name (averaging/round.py, rule 3).
- The mode is part of the group's state (a joiner takes it) and of our checkpoint (a restart keeps
  it): checkpoint extra ``sync_mode``. Every block starts probing again (``reset``).
- The pick: every-step fp32 gradients where a gradient round would keep communication within
  ``share`` (swarm.comm_share, 10%) of the wall time; otherwise sign rounds of H local steps, H the
  smallest that keeps the probe's wire time within ``share`` (at most ``MAX_H``; outer lr 1.7
  below 4 steps, 1.0 from 4 on: results/lowcomm/horizon.md). A gradient round's wire time is
  predicted as the probe's scaled by the bytes (``grads_ratio``): fixed costs are scaled too, so
  the prediction errs towards rounds.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from blocktrain.protocol import SIGN_BYTES, TOPK_CHUNK_ELEMS

MAX_H = 64  # local steps per round auto picks at most (longer rounds: results/lowcomm, a cliff in CE)
PACE_KEPT = 8  # probe rounds whose figures are kept (the median of them is used)
MODE_FORM = re.compile(r"grads|params/([1-9][0-9]{0,2})/sign/(1\.7|1)")  # PROTOCOL.md 7.1 "Sync mode"
MAX_CHOICE_FIGURES = 8  # numbers a choice may carry beside its mode (reported, never computed with)
FIGURE_NAME = re.compile(r"[a-z_]{1,32}")  # what a figure of a choice may be called
MIN_PACES = 2  # probe rounds a sponsor measures before it picks (one round is the block's first, least typical)


@dataclass(frozen=True)
class SyncMode:
    """A round's arithmetic: ``grads`` (fp32 gradients averaged every step) or ``params`` (H local
    steps, then the sign-coded pseudo-gradient averaged and the outer step at ``outer_lr``)."""
    sync: str = "grads"
    every: int = 1
    codec: str = "raw"
    outer_lr: float = 1.0

    @property
    def tag(self) -> str:
        """What parts say in meta ``mode`` (MODE_FORM)."""
        return "grads" if self.sync == "grads" else f"params/{self.every}/{self.codec}/{self.outer_lr:g}"

    @classmethod
    def parse(cls, tag) -> "SyncMode | None":
        """The mode a peer names, or None where it is not one auto can pick (MODE_FORM)."""
        m = MODE_FORM.fullmatch(tag) if isinstance(tag, str) else None
        if m is None:
            return None
        if tag == "grads":
            return cls()
        h = int(m.group(1))
        return cls("params", h, "sign", float(m.group(2))) if h <= MAX_H else None

    def describe(self) -> str:
        if self.sync == "grads":
            return "fp32 gradients every step"
        return f"sign rounds of {self.every} step(s), outer lr {self.outer_lr:g}"


PROBE = SyncMode("params", 1, "sign", 1.7)


def rounds_lr(h: int) -> float:
    """The outer lr of sign rounds of ``h`` steps (results/lowcomm/horizon.md: 1.7 every step, 1.0
    from 4 steps on, where 1.7 lost 0.05 CE)."""
    return 1.7 if h < 4 else 1.0


def grads_ratio(n: int, members: int, aggregate: str) -> float:
    """Bytes a member sends in an fp32 gradient round over those of a sign round of the same
    ``n`` floats: 4 bytes a float against a bit and a scale per chunk; a sign round is gathered by
    every member from every member, as is a robust round of 3 or more members, while a mean round
    (or one of 2) sends each piece to its owner and back: 2 / R of that."""
    chunks = -(-n // TOPK_CHUNK_ELEMS)
    ratio = 4 * n / max(1, chunks * (SIGN_BYTES + 4))
    return ratio if aggregate == "robust" and members >= 3 else ratio * 2 / max(2, members)


@dataclass(frozen=True)
class Pace:
    """What one probe round measured on a member."""
    step_s: float  # compute seconds per local step
    wire_s: float  # seconds in averaging
    bytes_sent: int  # payload bytes this member sent
    ratio: float  # grads_ratio of the round


def choose(paces: list[Pace], share: float) -> tuple[SyncMode, dict]:
    """The mode from a member's probe rounds (medians), and the figures it was picked from."""
    step = statistics.median(p.step_s for p in paces)
    wire = statistics.median(p.wire_s for p in paces)
    ratio = statistics.median(p.ratio for p in paces)
    grads_wire = wire * ratio
    figures = {"step_s": round(step, 4), "probe_wire_s": round(wire, 4), "grads_wire_s": round(grads_wire, 4),
               "grads_share": round(grads_wire / (grads_wire + step), 4) if grads_wire + step > 0 else 0.0,
               "rounds": len(paces)}
    if figures["grads_share"] <= share:
        return SyncMode(), figures
    # wire / (wire + h * step) <= share  <=>  h >= wire * (1 - share) / (share * step)
    need = wire * (1 - share) / (share * step) if share > 0 and step > 0 else math.inf
    h = int(min(MAX_H, max(1, math.ceil(need - 1e-9))))  # (15.000000000000002 is 15)
    figures["share"] = round(wire / (wire + h * step), 4) if wire + h * step > 0 else 0.0
    return SyncMode("params", h, "sign", rounds_lr(h)), figures


def choice_of(said) -> tuple[SyncMode, dict] | None:
    """A sponsor's meta ``choice`` ({"mode": tag, figure: number, ...}) checked: its mode, and its
    finite non-negative figures (at most MAX_CHOICE_FIGURES, names of at most 32 characters);
    None where it is not one."""
    if not isinstance(said, dict) or len(said) > MAX_CHOICE_FIGURES + 1:
        return None
    mode = SyncMode.parse(said.get("mode"))
    if mode is None:
        return None
    figures = {}
    for k, v in said.items():
        if k == "mode":
            continue
        if not isinstance(k, str) or not FIGURE_NAME.fullmatch(k) or type(v) not in (int, float) \
                or not 0 <= v < 1e12:
            return None
        figures[k] = v
    return mode, figures


class AutoSync:
    """One member's auto state for the block in work: probing (``mode`` is PROBE) until a choice
    is taken; its own probe figures, and the choice it takes (``chosen``: the report's)."""

    def __init__(self, share: float):
        self.share = share
        self.mode = PROBE
        self.paces: list[Pace] = []
        self.chosen: dict | None = None  # {"mode", "round", "by", "figures"} once taken

    @property
    def probing(self) -> bool:
        return self.chosen is None

    def reset(self) -> None:
        """Another block: probing again."""
        self.mode, self.paces, self.chosen = PROBE, [], None

    def measured(self, pace: Pace) -> None:
        self.paces = (self.paces + [pace])[-PACE_KEPT:]

    def proposal(self) -> dict | None:
        """What we say in meta ``choice`` when we sponsor a probe round (None: no figures yet)."""
        if len(self.paces) < MIN_PACES:
            return None
        mode, figures = choose(self.paces, self.share)
        return {"mode": mode.tag, **figures}

    def take(self, said, rnd: int, by: str) -> bool:
        """The sponsor's choice at the end of probe round ``rnd``: taken if valid (True)."""
        checked = choice_of(said)
        if checked is None or not self.probing:
            return False
        self.mode, figures = checked
        self.chosen = {"mode": self.mode.tag, "round": rnd, "by": by, "figures": figures}
        return True

    @property
    def saved(self) -> str:
        """Checkpoint extra ``sync_mode``: the mode taken, "" while probing."""
        return "" if self.chosen is None else self.mode.tag

    def restore(self, tag, source: str = "a checkpoint") -> None:
        """A checkpoint's ``sync_mode`` (ours after a restart, or the group's state): probing where
        it names none ("": the block had not chosen yet)."""
        self.reset()
        mode = SyncMode.parse(tag)
        if mode is not None:
            self.mode = mode
            self.chosen = {"mode": mode.tag, "round": None, "by": source, "figures": {}}
