"""sync=auto in a trainer's rounds: ``Picker`` sets the block's mode (auto.py) on the schedule, the
averager and the outer step, says the sponsor's choice, takes it, and keeps it in checkpoints.

Rules:
- A mode is set once per change (``apply``), before a round: the schedule's round length, the
  averager's codec and the tag its parts say, the outer step (sgd at the mode's rate, no momentum).
- Taking gradient rounds after probing, every member starts its inner optimizer's moments afresh
  (``BlockTrainer.reset_optimizer``) at once, before the round's state is saved for joiners or in
  a checkpoint: after local steps each member holds its own, and gradient rounds keep members
  identical only where one state takes the same averaged gradient. A state restored in gradient
  rounds is the group's and is kept.
- The sponsor's choice rides on its parts of a probe round (``choice``); at the round's end every
  member takes it (``probed``) if the sponsor's part counted in every piece of the result.
- Rounds under auto carry the mode's tag in their group digest (``start``).
- Checkpoints carry the block's pick in extra ``sync_mode`` ("" while probing): a joiner takes the
  group's, a restart keeps its own (``restore_from``).
"""

from __future__ import annotations

from typing import Callable

from ..averaging import Averager, OuterOptimizer
from .auto import AutoSync, Pace, grads_ratio
from .report import Stats
from .schedule import Position, Schedule


class Picker:
    def __init__(self, share: float, aggregate: str, schedule: Schedule, averager: Averager, pos: Position,
                 stats: Stats, me: str, say: Callable[[str], None]):
        self.auto = AutoSync(share)
        self.aggregate, self.schedule, self.averager, self.pos, self.stats, self.me = (aggregate, schedule, averager,
                                                                                       pos, stats, me)
        self.applied: str | None = None  # the mode the schedule, averager and outer step are set for
        self.say = say  # the run's progress lines

    def reset(self) -> None:
        """Another block: probing again."""
        self.auto.reset()
        self.applied = None

    def apply(self, tr) -> OuterOptimizer | None:
        """The mode taken, set (``tr``: the block's trainer); the new outer step, None if unchanged."""
        m = self.auto.mode
        if self.applied == m.tag:
            return None
        self.schedule.pick(m.every)
        self.averager.set_mode(m.codec, m.tag, steps=m.sync == "params")
        self.applied = m.tag
        return OuterOptimizer(m.outer_lr, 0.0, False)

    def choice(self, members: list) -> dict | None:
        """What we say in meta ``choice`` of a probe round we sponsor (None: nothing)."""
        if not self.auto.probing or len(members) < 2 or min(members) != self.me:
            return None
        return self.auto.proposal()

    def start(self, digest: str) -> str:
        """A round's start digest with its mode: members of different modes never mix (rule 9)."""
        return f"{digest}|{self.applied}"

    def probed(self, rnd: int, members: list, rep, step_s: float, said: dict | None, tr) -> None:
        """A probe round of ``members`` applied (``rep``: its report, None alone): its figures kept
        and its sponsor's choice taken (ours, ``said``; another's, as its parts said it), where the
        sponsor's part counted in every piece of the result; ``tr``: the block's trainer."""
        if not self.auto.probing or rep is None or not rep.parts:
            return
        counted = [m for m in members if all(m in p["contributors"] for p in rep.parts)]  # alike on all members
        if any(m != self.me for m in counted):  # another member's part counted: the round measured the link
            floats = sum(p.numel() for p in tr.block.parameters())
            self.auto.measured(Pace(step_s, rep.seconds, rep.bytes_sent,
                                    grads_ratio(floats, len(members), self.aggregate)))
        sponsor = min(members)
        if sponsor not in counted or \
                not self.auto.take(said if sponsor == self.me else rep.choices.get(sponsor), rnd, sponsor):
            return
        if self.auto.mode.sync == "grads":  # before any state of this round is saved or offered
            tr.reset_optimizer()
        f = self._record(self.pos.block, self.pos.gstep)["figures"]
        seen = (f": a step {f['step_s']:.3g} s, a probe round {f['probe_wire_s']:.3g} s on the wire, a gradient round "
                f"{f['grads_share']:.0%} of the time" if {"step_s", "probe_wire_s", "grads_share"} <= set(f) else "")
        self.say(f"block {self.pos.block}: sync auto: {self.auto.mode.describe()} from round {rnd + 1} "
                 f"(sponsor {sponsor[:12]}{seen})")

    def line(self) -> str:
        return f"auto: {'probing with ' if self.auto.probing else ''}{self.auto.mode.describe()}"

    def restore_from(self, extra: dict, block: int, gstep: int, source: str) -> None:
        """A checkpoint's pick (the group's state, or ours after a restart), set at once."""
        self.auto.restore(extra.get("sync_mode", ""), source)
        self.applied = None
        if self.auto.chosen is not None:
            self._record(block, gstep)

    def _record(self, block: int, gstep: int) -> dict:
        """The pick taken, in the report's ``sync_choices``; the entry."""
        entry = {"block": block, "step": gstep, **(self.auto.chosen or {})}
        self.stats.sync_choices.append(entry)
        return entry
