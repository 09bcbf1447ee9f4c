"""The round step: local steps of the block in work, averaging with the group, the update.

Rules:
- A round's group is fixed when it begins (group.py); its identity covers its number and the
  digest of its start point, so members that diverged never average together unnoticed.
- ``sync="grads"``: a round is one step whose gradients are averaged before the optimizer step,
  so every member takes the same step.
- ``sync="params"`` (DiLoCo): ``H`` local steps, then the pseudo-gradient (round start - now) is
  averaged and the outer optimizer (averaging/outer.py) moves the round's start point.
- A failed round (coverage below the threshold) changes nothing: grads, no step; params, the
  round's start point is kept (the steps are taken back). Members silent in it leave the group and
  join again, taking the group's state.
- ``overlap`` (params only): see ``_overlapped``.
- ``sync="auto"`` (auto.py): each block probes with sign rounds of one step, the sponsor of a probe
  round says its pick in its parts, and every member takes it at that round's end; the mode is
  set on the schedule, the averager and the outer step before each round (picker.py).
- ``gossip`` (params only, no overlap): every round averages the parameters in the small groups
  of averaging/gossip.py (rule 10; below 2 x gossip members, one small group of everyone, still
  of parameters: the members' points differ, so no start point is common): see ``_gossip``.
- Training steps run off the event loop (heartbeats and streams go on meanwhile); their time is
  ``busy_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..averaging import Averager, RoundFailed, flatten, unflatten_
from ..averaging.gossip import gossip_group, gossip_start
from ..group import Group, State
from ..services import PeerServices
from .picker import Picker
from .membership import Membership
from .report import Stats, round_entry
from .schedule import Position, Schedule

if TYPE_CHECKING:
    from blocktrain.blocks.train import BlockTrainer

log = logging.getLogger("blocktrain.p2p")


def digest(t: torch.Tensor) -> str:
    """A digest of a start point (crc32 of its float32 bytes): cheap, for divergence, not security."""
    return f"{zlib.crc32(t.detach().float().contiguous().numpy().data):08x}"


@dataclass
class _Pending:
    """overlap: a round on the wire (its phase's update, sent) and what settling it needs."""
    rnd: int
    members: list
    loss: float
    t0: float
    task: asyncio.Future


class Rounds:
    def __init__(self, peer: PeerServices, group: Group, averager: Averager, membership: Membership,
                 scfg, schedule: Schedule, pos: Position, stats: Stats):
        self.peer, self.group, self.averager, self.membership = peer, group, averager, membership
        self.scfg, self.schedule, self.pos, self.stats = scfg, schedule, pos, stats
        self.trainer: BlockTrainer | None = None  # the block in work's (set by the run loop)
        self.outer = scfg.outer_optimizer()
        self.picker = Picker(scfg.comm_share, scfg.aggregate, schedule, averager, pos, stats, peer.id,
                             lambda line: self.say(line)) if scfg.sync == "auto" else None
        self.busy_s = 0.0
        self.last_loss = float("nan")
        self.on_step: Callable | None = None  # on_step(global step, total, loss, group size)
        self.save_join_state: Callable[[int], str] = lambda rnd: ""  # the store's, via the run loop
        self.say: Callable[[str], None] = lambda line: None  # the run's progress lines
        self._avg_out: torch.Tensor | None = None  # the rounds' result buffer (consumed before the next round)
        # overlap: the point every member of the group agrees on (the outer steps of the rounds
        # settled so far), and the round on the wire (_Pending), settled at the end of the next phase
        self._g: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._members_before: list | None = None  # the last round's members

    @property
    def tr(self) -> "BlockTrainer":
        """The block in work's trainer (there is one from ``prepare`` on)."""
        assert self.trainer is not None, "no block in work yet"
        return self.trainer

    def params(self) -> list:
        return list(self.tr.block.parameters())

    def reset(self) -> None:
        """Another block: a fresh outer optimizer, and the round on the wire is not ours; auto
        probes again."""
        self.outer = self.scfg.outer_optimizer()
        self.drop_pending()
        if self.picker is not None:
            self.picker.reset()

    @property
    def sync(self) -> str:
        """The sync of the rounds now: grads or params (auto: its mode's)."""
        return self.picker.auto.mode.sync if self.picker is not None else self.scfg.sync

    def apply_mode(self) -> None:
        """auto: the mode taken set on the schedule, the averager and the outer step (picker.py)."""
        outer = self.picker.apply(self.tr) if self.picker is not None else None
        if outer is not None:
            self.outer = outer

    def _start_digest(self, start) -> str:
        """A round's start digest (auto: with its mode, picker.py)."""
        return digest(start) if self.picker is None else self.picker.start(digest(start))

    def checkpoint_extra(self) -> dict:
        """What a checkpoint keeps of the rounds beside the store's (sync=auto: the block's pick)."""
        return {"sync_mode": self.picker.auto.saved} if self.picker is not None else {}

    def restore_mode(self, extra: dict, block: int, gstep: int, source: str) -> None:
        """A checkpoint's rounds (sync=auto: its pick, set at once; ``source``: where it came from)."""
        if self.picker is not None:
            self.picker.restore_from(extra, block, gstep, source)
            self.apply_mode()

    def mode_line(self) -> str:
        """The rounds' arithmetic now, in words (the report, status and the start line)."""
        if self.picker is not None:
            return self.picker.line()
        return f"{self.scfg.sync}{f' every {self.schedule.H}' if self.scfg.sync == 'params' else ''}, {self.scfg.codec}"

    def drop_pending(self) -> None:
        """A new start (another block, a rejoin, a restored state): the round on the wire is not ours."""
        if self._pending is not None:
            task = self._pending.task
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is not ours to raise now
        self._pending, self._g, self._members_before = None, None, None

    @contextlib.contextmanager
    def at_agreed_point(self):
        """Under overlap with no round on the wire, our parameters are ahead of the group's point g:
        inside this block they are g (a member that learnt of an admission late settles the
        joiners' round after its next local steps), and ours again after it."""
        own = None
        if self._g is not None and self._pending is None:
            own = flatten(self.params()).clone()
            unflatten_(self.params(), self._g)
        try:
            yield
        finally:
            if own is not None:
                unflatten_(self.params(), own)

    def _begin(self, start: torch.Tensor) -> tuple[int, list]:
        rnd = self.pos.rnd = self.pos.rnd + 1
        members = self.group.begin_round(rnd, digest(start), self.pos.block)
        members = [m for m in members if m == self.peer.id or self.peer.member(m) is not None]
        self.averager.expect_members(self.group.members(rnd + 1))  # whose parts for the next round we hold
        return rnd, members

    def _gone(self, rnd: int, members: list) -> dict:
        """Members of round ``rnd`` that left the group while its local steps ran (its members were
        fixed before them) by a LEAVE, or as the swarm saw them leave or die: they depart the round
        as it begins. Restarted with its identity, such a member is a member of the swarm again
        (perhaps admitted again for a later round) and would answer that it is not in the round: a
        mismatch, which fails the round for us while the members that began it before the
        departure finish it without it, and the group's points part. Members a round departed
        (unreachable, another view) are not: they may still send their parts of this round."""
        if self.group.state is not State.TRAINING:  # we yielded meanwhile (group.py rule 6):
            return {m: "we left the group (yielding)" for m in members if m != self.peer.id}  # the round is ours alone
        if self.group.round != rnd:
            return {}
        now = set(self.group.members(rnd))
        left = self.membership.left  # (a member back in the group is forgotten there: tell_outsiders)
        return {m: left[m] for m in members if m not in now and m in left}

    def _result_buffer(self, n: int) -> torch.Tensor:
        """The rounds' result buffer of ``n`` floats, reused round after round: no fresh memory."""
        if self._avg_out is None or self._avg_out.numel() != n:
            self._avg_out = torch.empty(n)
        return self._avg_out

    async def _timed(self, fn, *args):
        t = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.busy_s += time.perf_counter() - t

    async def _local_steps(self, h: int) -> float:
        for _ in range(h):
            loss = await self._timed(self.tr.train_step)
        self.last_loss = loss
        return loss

    def _stepped(self, loss: float, members: list, h: int) -> None:
        self.pos.gstep += h
        if self.on_step is not None:
            self.on_step(self.pos.gstep, self.schedule.total_steps, loss, len(members))

    async def step(self) -> None:
        """One round of the block in work."""
        self.apply_mode()
        if self.scfg.overlap:
            return await self._overlapped()
        start = flatten(self.params())
        rnd, members = self._begin(start)
        if len(members) <= 1:  # a member that still counts us in hears now that we are not in its round
            self.averager.alone(rnd)  # (under overlap the round's task says so: the last round may be on the wire)
        t0, busy0, h = time.perf_counter(), self.busy_s, self.schedule.round_steps(self.pos.gstep)
        if self.scfg.gossip and len(members) > 1:  # below 2 x gossip members, one small group of all
            return await self._gossip(rnd, members, t0, start, h)
        grads = self.sync == "grads"
        if grads:
            loss = self.last_loss = await self._timed(self.tr.compute_grads)
            vec = self.tr.grads()
        else:
            loss = await self._local_steps(h)
            vec = start - flatten(self.params())
        step_s, said = (self.busy_s - busy0) / h, self.picker.choice(members) if self.picker is not None else None
        rep, avg = None, vec
        if len(members) > 1:
            try:
                avg, rep = await self.averager.average(rnd, vec, members, start=self._start_digest(start),
                                                       out=self._result_buffer(vec.numel()),
                                                       gone=self._gone(rnd, members), choice=said)
            except RoundFailed as e:
                self._failed(rnd, self.pos.gstep + h, e, "no step" if grads else "keeping the round's start point")
                if not grads:
                    unflatten_(self.params(), start)
                    self.tr.step -= h
                await self._after(rnd, None, loss, members, time.perf_counter() - t0, failed=True)
                return
        if grads:
            await self._timed(self.tr.apply_grads, avg)
        else:
            unflatten_(self.params(), self.outer.step(start, avg))
        self._stepped(loss, members, h)
        if self.picker is not None:
            self.picker.probed(rnd, members, rep, step_s, said, self.tr)
        await self._after(rnd, rep, loss, members, time.perf_counter() - t0)

    async def _gossip(self, rnd: int, members: list, t0: float, start: torch.Tensor, h: int) -> None:
        """Rule 10 (averaging/gossip.py): H local steps, then the parameters averaged with this
        round's small group only (the same partition on every member); a failed round keeps our
        own parameters and steps (no member waits for an agreed point). A block's last round is
        one small group of every member, so that the block ends on one point (the relay's next
        block trains on it; it is the checkpoint served). Who departed a small group's round
        leaves that round only: the rest of the group never heard of it, and the partition of
        every later round needs the same members on every member (the group's own signals, a
        LEAVE or the swarm's dead peer, remove a member from the group). ``start``: our parameters
        before the local steps, which the robust round measures the partners' updates from."""
        salt = f"block{self.pos.block}"
        small = sorted(members) if self.schedule.last_round(self.pos.gstep) else \
            gossip_group(members, self.peer.id, rnd, self.scfg.gossip, salt)
        loss = await self._local_steps(h)
        vec = flatten(self.params())
        try:
            avg, rep = await self.averager.average(rnd, vec, small, start=gossip_start(salt), group=members,
                                                   out=self._result_buffer(vec.numel()), origin=start)
        except RoundFailed as e:
            self._failed(rnd, self.pos.gstep + h, e, "keeping our own parameters (gossip)", depart=False)
            self._stepped(loss, members, h)
            await self._after(rnd, None, loss, members, time.perf_counter() - t0, failed=True)
            return
        unflatten_(self.params(), avg)
        self._stepped(loss, members, h)  # the report's round names the small group (rep.members)
        await self._after(rnd, rep, loss, members, time.perf_counter() - t0, depart=False)

    async def _overlapped(self) -> None:
        """sync=params with overlap: the round of phase r (its H local steps) is on the wire while
        phase r+1 computes. With g the point the group agrees on (every settled round's outer step
        applied) and d_r = (phase r's start - its end), phase r+1 starts from g - outer_lr * d_r: our
        own phase stands in for the group's average until that arrives (an eager update). At the
        end of phase r+1, round r is settled (g takes its outer step) and round r+1 sent.

        A round is waited for at once (no overlap) where every member must end it at the same
        point: the last round of a block (relay's handoff, the final checkpoint) and a round at
        whose end joiners take the group's state; then every member's parameters are g, byte for
        byte. So is a group's first round and the first after a change of members: a member
        starting together with us counts as in step only while we have not gone past its first
        round (group.py rule 3). A failed round changes nothing of g (its phase is lost; steps
        still count, so the members keep one schedule)."""
        if self._g is None:
            self._g = flatten(self.params()).clone()
        rnd, members = self._begin(self._g)
        wait = (self.schedule.last_round(self.pos.gstep) or self.group.admits_due_by(rnd)
                or members != self._members_before)
        self._members_before = members
        t0 = time.perf_counter()
        phase_start = flatten(self.params())
        h = self.schedule.round_steps(self.pos.gstep)
        loss = await self._local_steps(h)
        vec = phase_start - flatten(self.params())
        del phase_start
        if self._pending is not None:  # it had this phase's compute to arrive
            await self._settle(self._pending)
        self._pending = _Pending(rnd, members, loss, t0, asyncio.ensure_future(
            self._average_or_alone(rnd, vec, members, digest(self._g), self._gone(rnd, members))))
        self.pos.gstep += h
        if wait:
            await self._settle(self._pending, install=True)
        else:
            unflatten_(self.params(), self._g - self.outer.lr * vec)
        if self.on_step is not None:
            self.on_step(self.pos.gstep, self.schedule.total_steps, loss, len(members))

    async def _average_or_alone(self, rnd: int, vec: torch.Tensor, members: list, start: str, gone: dict):
        """``gone``: taken when the round is sent (the task first runs after the next round began)."""
        if len(members) <= 1:
            self.averager.alone(rnd)  # a member that still counts us in hears that we are not in its round
            return vec, None
        return await self.averager.average(rnd, vec, members, start=start, gone=gone)

    async def _settle(self, p: _Pending, install: bool = False) -> None:
        """Round ``p`` is done (or failed): g takes its outer step (``install``: and becomes our
        parameters, before joiners take them); its report and joiners follow."""
        self._pending = None
        try:
            avg, rep = await p.task
        except RoundFailed as e:
            self._failed(p.rnd, self.pos.gstep, e, "the round's phase is lost (the group's point stays)")
            avg = rep = None
        assert self._g is not None
        if avg is not None:
            self._g = self.outer.step(self._g, avg)
        if install:
            unflatten_(self.params(), self._g)
        await self._after(p.rnd, rep, p.loss, p.members, time.perf_counter() - p.t0, failed=avg is None)

    def _failed(self, rnd: int, step: int, e: RoundFailed, outcome: str, depart: bool = True) -> None:
        """``depart``: members silent in it leave the group (not in a gossip round: _gossip)."""
        log.warning("%s; %s", e, outcome)
        self.stats.failed.append({"round": rnd, "step": step, "reason": str(e), "silent": sorted(e.silent)})
        for pid in e.silent if depart else ():  # they failed the round: they join again, taking the group's state
            self.group.depart(pid, f"silent in round {rnd}")

    async def _after(self, rnd: int, rep, loss: float, members: list, seconds: float, failed: bool = False,
                     depart: bool = True):
        """The round's report and joiners; ``depart``: its departed members leave the group (not
        in a gossip round: _gossip)."""
        if not failed:
            cand = set(self.membership.candidates()) | {self.peer.id}
            entry = round_entry(rnd, self.pos.block, self.pos.gstep, loss, rep, self.peer.id, members, cand, seconds)
            if rep and depart:
                for pid in rep.departed:  # gone from the round: gone from the group (rule 5 of group.py),
                    if self.group.joined.get(pid, 0) <= rnd:  # unless it was admitted for a later round
                        self.group.depart(pid, rep.why.get(pid, "departed mid-round"))
            alone = rep is not None and len(rep.departed) >= len(members) - 1  # every other member departed
            self.stats.record_round(entry, rep, self.pos.gstep, loss, 1 if alone else len(members),
                                    self.scfg.min_group)
        await self.membership.round_done(rnd, self.save_join_state)
