"""The training peer's run loop: the rooms of p2p/swarm/ put together.

Rules:
- Schedules (schedule.py): ``relay`` trains every block in turn, lowest first, as a data-parallel
  replica of the group; at a block's end every peer keeps its parameters as a frozen lower block,
  drops its optimizer state and starts the next block as the identity with the head of the block
  below (blocks/train.py). ``parallel`` trains the peer's own block on the newest lower blocks of
  their holders (lower.py). A peer serves and reports its own ``--block``.
- Rounds (rounds.py): ``every`` steps, averaged with the group (grads or params, optional overlap).
- Joining (membership.py): ``Group`` decides; a joiner admitted at round ``at`` takes the group's
  state after ``at`` (store.py writes it, checks.py checks it).
- Restart: a peer restarted with its work directory resumes from its newest checkpoint
  (store.py), and joins the group (taking the group's state) if one is training.
- Memory: one block's gradients and optimizer state at a time; lower blocks run forward only.
- The last block's draft model (exact-mode serving) trains after the schedule, locally.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.device import host_state

from ..averaging import Averager, flatten
from ..checkpoints import CheckpointFetcher, CheckpointServer
from ..group import Group
from ..services import PeerServices
from .checks import StateCheck
from .draft import train_drafter
from .evaluation import Evaluation
from .lower import CutOff, LowerFeed
from .membership import Membership
from .report import RunState, Stats, ended_cut_off, progress_line, training_report, work_status
from .rounds import Rounds, digest
from .schedule import Position, Schedule
from .settings import TrainerSpec, job_digest
from .store import OUTER_MOMENTUM, CheckpointStore, Found

if TYPE_CHECKING:
    from blocktrain.blocks.train import BlockTrainer

log = logging.getLogger("blocktrain.p2p")


class SwarmTrainer:
    """Everything a training peer runs beside its peer: the block trainer of the block in work,
    its group and averaging, checkpoints served and fetched, and the training report."""

    def __init__(self, peer: PeerServices, spec: TrainerSpec, data: torch.Tensor, valid: torch.Tensor,
                 progress=None, on_step=None):
        """``spec``: what this peer runs; ``data``, ``valid``: the corpus's splits (uint8);
        ``progress``: where events go, as lines; ``on_step``: called after every step (rounds.py)."""
        k, mcfg, tcfg, scfg = spec.block, spec.job.model, spec.job.train, spec.job.swarm
        self.peer, self.spec, self.k, self.mcfg, self.tcfg, self.scfg = peer, spec, k, mcfg, tcfg, scfg
        self.device, self.precision = torch.device(spec.device), spec.precision  # where the block trains
        self.relay = scfg.schedule == "relay"
        self.schedule = Schedule(k, mcfg.n_blocks, tcfg.steps, scfg.steps_per_round, self.relay,
                                 scfg.eval_every, tcfg.refresh_every)
        self.dir = Path(spec.work_dir)
        self.data, self.valid, self.shard = data, valid, spec.shard
        self.progress = progress or (lambda s: None)  # events, as lines
        self.scope = "relay" if self.relay else f"block:{k}"
        self.pos = Position(self.schedule.plan[0])
        self.finals: dict[int, dict] = {}  # relay: block -> final parameters
        self.group = Group(peer.id, margin=scfg.margin)
        self.averager = Averager(peer, k, codec=scfg.codec, density=scfg.density, min_coverage=scfg.min_coverage,
                                 max_norm=scfg.max_norm, timeout_s=scfg.round_timeout_s, aggregate=scfg.aggregate,
                                 floats=_largest_block(mcfg, self.schedule.plan), steps=scfg.sync == "params")
        self.server = CheckpointServer(peer, self.dir / "serve")
        self.fetcher = CheckpointFetcher(peer)
        self.stats = Stats()
        self.check = StateCheck(mcfg, self.schedule, valid, tcfg.seq_len)
        self.store = CheckpointStore(self.server, self.dir, mcfg, tcfg, scfg, self.schedule)
        self.job = job_digest(spec.job, spec.corpus) if spec.corpus else ""  # compared at join
        self.membership = Membership(peer, self.group, self.averager, self.pos, self.scope,
                                     None if self.relay else k, self.fetcher, self.check, self.stats.joins, self._say,
                                     self.job)
        self.rounds = Rounds(peer, self.group, self.averager, self.membership, scfg, self.schedule, self.pos,
                             self.stats)
        self.rounds.on_step, self.rounds.save_join_state, self.rounds.say = on_step, self.save_join_state, self._say
        self.feed = None if self.relay else LowerFeed(peer, k, self.fetcher, self.check, self.stats.lower,
                                                      scfg.lower_timeout_s, self._waiting_for_lower)
        self.state = RunState.STARTING
        self.eval = Evaluation(self.schedule, valid, tcfg.seq_len, scfg.eval_windows, self.stats.curve)
        self.draft_seconds = 0.0  # the last block's draft phase (after the schedule; not in the busy fraction)
        self.t_start: float | None = None
        self.t_end: float | None = None
        self.memory = {"grad_optimizer_bytes": 0}
        self._resumed: bool | None = None  # prepare(): None until the first trainer is built
        self.cut_off: dict | None = None  # how the run ended cut off from its group (report.py), None if not
        peer.report_section("training", self.training_report)
        peer.report_section("work", lambda: work_status(self))

    # --- where we are (the rooms share ``pos``) ----------------------------------------------------
    block = property(lambda self: self.pos.block)
    gstep = property(lambda self: self.pos.gstep)
    rnd = property(lambda self: self.pos.rnd)
    H = property(lambda self: self.schedule.H)
    ce = property(lambda self: self.eval.ce)
    total_steps = property(lambda self: self.schedule.total_steps)

    @property
    def trainer(self) -> "BlockTrainer | None":
        """The block in work's trainer: the rounds' (one object, set in _new_trainer)."""
        return self.rounds.trainer

    @trainer.setter
    def trainer(self, tr: "BlockTrainer | None") -> None:
        self.rounds.trainer = tr

    @property
    def tr(self) -> "BlockTrainer":
        return self.rounds.tr

    def params(self) -> list:
        return list(self.tr.block.parameters())

    def training_report(self) -> dict:
        return training_report(self)

    def wall_seconds(self) -> float:
        """Since training began, without the curve's evaluations."""
        return ((self.t_end or time.monotonic()) - self.t_start - self.eval.seconds) if self.t_start else 0.0

    def _say(self, text: str) -> None:
        self.progress(text)

    def _waiting_for_lower(self) -> None:
        if self.state is not RunState.WAITING_FOR_LOWER:
            self._say(f"block {self.k}: waiting for blocks 0..{self.k - 1} from the swarm")
        self.state = RunState.WAITING_FOR_LOWER

    # --- trainers --------------------------------------------------------------------------------
    def _new_trainer(self, b: int) -> None:
        old = self.trainer
        self.trainer = None  # one block's optimizer at a time: the old one goes first
        tr = _block_trainer(self.spec, b, self.data, self.device, self.peer.id)
        if b > 0 and self.relay:
            tr.set_lower([self.finals[j] for j in range(b)], [self.schedule.S] * b)
            if old is not None and old.k == b - 1:
                tr.init_from_below(old.block)  # identity start: the head of the block below
        self.trainer = tr
        self.pos.block = b
        self.rounds.reset()
        held = tr.trainable_bytes()
        self.memory["grad_optimizer_bytes"] = max(self.memory["grad_optimizer_bytes"],
                                                  held["grads"] + held["optim_state"])

    # --- checkpoints (store.py) --------------------------------------------------------------------
    def checkpoint(self, final: bool) -> ckpt.Checkpoint:
        """Our state now as a checkpoint (``final``: the block's last), as saved and served."""
        return self.store.checkpoint(self.tr, self.rounds, final, self.gstep, self.rnd, self.block)

    def _save(self, final: bool = False) -> None:
        self.store.save(self.checkpoint(final))

    def save_join_state(self, rnd: int) -> str:
        """The group's state at the end of round ``rnd``, for its joiners (under overlap the group's
        point, not our parameters ahead of it)."""
        with self.rounds.at_agreed_point():
            c = self.checkpoint(False)
        return self.store.save_join_state(c, rnd)

    def _restore(self, c: ckpt.Checkpoint, lowers: dict, source: str) -> None:
        """Install a checkpoint of the block in work (and, relay, the final blocks below it)."""
        gstep = int(c.extra.get("gstep", c.step))
        if c.block is None:  # checks.py and the store refuse one before it gets here
            raise ValueError("an end-to-end checkpoint is not a block's state")
        if self.relay:
            self.finals.update(lowers)
            self.trainer = None
            self._new_trainer(c.block)
        self.tr.restore(c)
        self.rounds.drop_pending()
        buf = c.optim.get(OUTER_MOMENTUM)
        self.rounds.restore_mode(c.extra, c.block, gstep, source)
        self.rounds.outer._buf = buf.clone() if buf is not None else None
        self.pos.gstep = gstep
        self.pos.rnd = int(c.extra.get("round", self.rnd))
        log.info("block %d: resumed from %s at step %d (global step %d)", c.block, source, c.step, gstep)

    def _take_group_state(self, c: ckpt.Checkpoint, lowers: dict, source: str) -> None:
        self._restore(c, lowers, source)
        for j, tensors in lowers.items():  # final blocks we did not train: we hold and serve them too
            self.store.save_final_params(j, tensors)

    def _resume(self, found: Found) -> None:
        """After a restart: the state ``store.find_own`` found."""
        if found.state is not None:
            self._restore(found.state, found.finals, found.path)
            return
        finals = found.finals
        self.finals.update(finals)
        self.pos.gstep = len(finals) * self.schedule.S
        K = self.mcfg.n_blocks
        if len(finals) < K:
            from blocktrain.blocks.model import Block
            below = Block(self.mcfg, len(finals) - 1)
            below.load_state_dict(finals[len(finals) - 1])
            self._new_trainer(len(finals))
            self.tr.init_from_below(below)
        else:  # everything is final: we only serve
            self._new_trainer(K - 1)
            self.tr.block.load_state_dict(finals[K - 1])
        log.info("resumed with blocks %s final (global step %d)", sorted(finals), self.gstep)

    # --- the whole run -----------------------------------------------------------------------------
    def prepare(self) -> bool:
        """The first block's trainer, resumed from our own checkpoint if we have one (True then).
        Seconds of CPU the first time in a process (the first optimizer imports much of torch),
        10-20 s on a starved machine: a peer process runs it before it listens (app.run_peer),
        since an event loop busy with it answers no handshake and no ping (joiners time out,
        members declare it dead). Idempotent; ``run`` calls it if nobody did."""
        if self._resumed is None:
            self._new_trainer(self.schedule.plan[0])
            found = self.store.find_own()
            if found is not None:
                self._resume(found)
            self._resumed = found is not None
        return self._resumed

    async def run(self, steps: int | None = None) -> dict:
        """Train every block of the plan to ``steps`` steps each (default: the config's)."""
        if steps is not None and steps != self.schedule.S:
            if self._resumed is not None:  # where a checkpoint's step lies depends on the steps per block
                raise ValueError(f"prepared for {self.schedule.S} steps per block, asked to run {steps}")
            self.schedule.set_steps(steps)
        await self._start()
        try:
            while self.gstep < self.total_steps:
                await self._next_round()
        except asyncio.CancelledError:  # stopped: the round on the wire hands out what it owes (driver.py)
            self.rounds.drop_pending()
            raise
        self.membership.send(self.group.finish())
        self.t_end = time.monotonic()
        if not self.averager.shunned:  # excluded by the others: reported as such (excluded_by)
            self.cut_off = ended_cut_off(self.stats, self.block, self.scfg.min_group)
        if self.cut_off is not None:
            self._say(f"cut off: block {self.block} {self.cut_off['why']}; these parameters are this peer's own, "
                      f"not the swarm's")
        if self.relay and self.block != self.k:  # serve our own block
            self._restore_final_own()
        if self.k == self.mcfg.n_blocks - 1 and self.tcfg.draft_steps and self.tr.block.drafter is not None:
            await self._draft_phase()
        await self.eval.end(self.tr)
        self.state = RunState.DONE
        self.peer.write_report()
        rep = self.training_report()
        if self.cut_off is not None and not self.scfg.cut_off_ok:
            raise CutOff(self.cut_off["block"], self.cut_off["why"], rep)
        return rep

    async def _start(self) -> None:
        """Prepared, members known, (parallel) lower blocks in, the start CE, in a group."""
        resumed = self.prepare()
        self.state = RunState.WAITING_FOR_MEMBERS
        await self.peer.wait_for(self.peer.settled, self.scfg.join_timeout_s)  # who is there, before asking
        await self.peer.wait_for(lambda: len(self.membership.candidates()) + 1 >= self.scfg.min_group,
                                 self.scfg.lower_timeout_s)
        if self.feed is not None:
            await self.feed.refresh(self.tr, wait=True)
        await self.eval.start(self.tr, self.gstep, timed=False)  # before training began: not evaluation time
        if resumed:
            self._say(f"resumed at global step {self.gstep} (block {self.block})")
        self.t_start = time.monotonic()
        await self._join()
        if self.stats.joins and self.stats.joins[-1]["how"] == "fetched the group's state":
            await self.eval.start(self.tr, self.gstep, timed=True)  # we start from the group's state, not ours
        self._say(f"training block {self.block} from step {self.gstep} of {self.total_steps}, group of "
                  f"{len(self.group.members())}, rounds of {self.H} step(s) ({self.rounds.mode_line()})")
        if not self.stats.phases or self.stats.phases[-1]["block"] != self.block:
            self.stats.phases.append({"block": self.block, "start_step": self.gstep, "started": time.time()})

    async def _join(self) -> None:
        self.state = RunState.JOINING
        await self.membership.join(lambda: digest(flatten(self.params())), self.scfg.min_group,
                                   self.scfg.join_timeout_s, self.scfg.ready_timeout_s, self._take_group_state)
        self.state = RunState.TRAINING

    async def _next_round(self) -> None:
        """The schedule's next round: a rejoin first if due (the next block in _train_round); a
        block's end, saves and reports after it."""
        await self.membership.after_split()  # alone after a split: hear the other side first
        if self.membership.rejoin:
            self.membership.rejoin = False
            self.rounds.drop_pending()  # we take the group's state
            await self._join()
        if self.gstep < self.total_steps:  # (a rejoin may have taken the group's last state: saved below)
            await self._train_round()
        if self.schedule.ends_block(self.gstep, self.block):
            await self._finish_block()
        elif self.store.due() or self.gstep >= self.total_steps:
            await asyncio.to_thread(self._save, self.gstep >= self.total_steps)
        if self.schedule.report_due(self.gstep):
            self.peer.write_report()
            if self.rounds.on_step is None:
                self._say(progress_line(self, self.wall_seconds()))

    async def _train_round(self) -> None:
        b = self.schedule.block_at(self.gstep)
        if b != self.block:  # relay: the next block, on the final ones below
            await self._enter_block(b)
        if self.feed is not None and self.schedule.refresh_due(self.gstep):
            await self.feed.refresh(self.tr, wait=False)
        await self.rounds.step()
        await self.eval.point(self.tr, self.gstep, self.wall_seconds)

    async def _enter_block(self, b: int) -> None:
        """Relay: train block ``b`` on the final blocks below it. The block in work is final already
        (``_finish_block`` after the round that ended it), except where we took the group's state
        after that round (a joiner admitted at a block's last round): then it is made final here,
        as the members did, before the next block needs it."""
        if self.block not in self.finals and self.schedule.ends_block(self.gstep, self.block):
            await self._finish_block()
        self._new_trainer(b)
        self.stats.phases.append({"block": b, "start_step": self.gstep, "started": time.time()})
        self._say(f"block {b - 1} is final; training block {b} (holding block {self.k})")

    async def _finish_block(self) -> None:
        """Relay: the block in work is final; keep its parameters, drop its optimizer."""
        self.finals[self.block] = host_state(self.tr.block)
        await asyncio.to_thread(self._save, True)
        if self.stats.phases:
            self.stats.phases[-1]["end_step"] = self.gstep
            self.stats.phases[-1]["ended"] = time.time()

    async def _draft_phase(self) -> None:
        """The last block's draft model (draft.py); its checkpoint says so."""
        if self.store.own_has_drafter():
            return  # done before a restart
        self.state = RunState.DRAFT_PHASE
        n = self.tcfg.draft_steps
        self.draft_seconds = await train_drafter(self.tr, n, self.stats.draft_curve, self._say)
        c = ckpt.Checkpoint(self.mcfg.to_dict(), self.k, self.schedule.S, host_state(self.tr.block),
                            extra={"final": True, "gstep": self.total_steps, "drafter_steps": n,
                                   "train": self.tcfg.to_dict()})
        await asyncio.to_thread(self.store.publish_own, c)

    def _restore_final_own(self) -> None:
        c = self.store.load_own()
        self.trainer = None
        self._new_trainer(self.k)
        self.tr.restore(c)


def _seed(peer_id: str, block: int) -> int:
    return (int(peer_id[:8], 16) * 1_000_003 + block) % (1 << 62)


def _block_trainer(spec: TrainerSpec, b: int, data: torch.Tensor, device: torch.device,
                   peer_id: str) -> BlockTrainer:
    """Block ``b``'s trainer on ``data``: on the spec's shard of it, or, with none, on this peer's
    own stream of random windows over all of it."""
    from blocktrain.blocks.data import ByteBatches
    from blocktrain.blocks.train import BlockTrainer

    mcfg, tcfg, shard = spec.job.model, spec.job.train, spec.shard
    tr = BlockTrainer(mcfg, tcfg, b, data, shard=shard[0] if shard else 0, num_shards=shard[1] if shard else 1,
                      device=device, precision=spec.precision)
    if shard is None:
        tr.batches = ByteBatches(data, tcfg.batch_size, tcfg.seq_len, seed=_seed(peer_id, b))
    return tr


def _largest_block(mcfg, plan) -> int:
    """The most parameters of a block in ``plan`` (the averager's buffers are sized once)."""
    from blocktrain.blocks.model import Block
    with torch.random.fork_rng(devices=[]):  # counting parameters draws no random number of ours
        return max(sum(p.numel() for p in Block(mcfg, j).parameters()) for j in plan)
