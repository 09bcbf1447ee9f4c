"""Swarm training: peers train the model's blocks together, averaging over the protocol.

Rules:
- Schedules. ``relay`` (the default): every training peer works on the lowest unfinished block as a
  data-parallel replica; after ``steps`` steps the block is final, every peer keeps its parameters
  as a frozen lower block, drops its optimizer state and moves on to the next block, which starts
  as the identity with the head of the block below (blocks/train.py). A peer ends holding every
  block; it serves and reports its own ``--block``. ``parallel``: each peer trains its own block
  from the start, on the newest checkpoints of the blocks below, pulled from their holders.
- Rounds. A round is ``every`` steps of the block in work (relay: steps are counted across
  blocks). Rounds are numbered by attempt: a failed round still uses up its number, so members
  never mistake a retry for the attempt before it.
  ``sync="grads"``: every round is one step whose gradients are averaged before the optimizer step,
  so every member takes the same step (the optimization of one worker on the group's batches).
  ``sync="params"``: DiLoCo; ``every`` local steps, then the pseudo-gradient (round start - now) is
  averaged and the outer optimizer moves the round's start point.
- A round's group is fixed when it begins (group.py), and its identity covers its number and the
  digest of its start point, so members that diverged never average together unnoticed.
- A round that fails (coverage below the threshold) changes nothing: grads, no step; params, the
  round's start point is kept.
- Joining: ``Group`` decides (group.py). A joiner admitted at round ``at`` takes the group's state
  after ``at``: every member writes it as ``checkpoint/block{b}.r{at}`` (the same bytes on every
  member under ``grads``, so a fetch resumes across them) and says READY; with it come
  the final parameters of the blocks below (relay: ``lower-checkpoint/block{j}`` of any member).
- Restart: a peer restarted with its work directory resumes from its newest checkpoint, and joins
  the group (taking the group's state) if one is training.
- Memory: one block's gradients and optimizer state at a time; lower blocks run forward only.
- Training steps run off the event loop, so heartbeats and streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.lower import LowerInputs
from blocktrain.protocol import BlockUpdate, ProtocolError
from blocktrain.protocol.events import is_peer_id

from .averaging import UPDATE_CODECS, Averager, OuterOptimizer, RoundFailed, flatten, remember, unflatten_
from .checkpoints import CHECKPOINT, LOWER, CheckpointFetcher, CheckpointServer, FetchError, holders
from .group import Decision, Group, Phase, Send, State
from .services import PeerServices, PeerUnreachable

log = logging.getLogger("blocktrain.p2p")

SCHEDULES = ("relay", "parallel")
SYNCS = ("grads", "params")
OUTER_MOMENTUM = "outer.momentum"  # the outer optimizer's buffer, in the checkpoint's optimizer state
# Rounds kept in full in the report (the others are summed up); anomalies are always kept.
REPORT_ROUNDS = 200
# A peer outside our group is told our group's status at most this often (rule 6 of group.py).
STATUS_EVERY_S = 5.0
# ... and answered at most this often when its STATUS ranks below ours (so that it yields at once).
STATUS_REPLY_S = 0.5
READY_KEPT = 16  # READYs (round, member) a joiner keeps; the oldest round goes first
READY_PER_MEMBER = 2  # of them from one member (an honest one tells one per admission)
# Seconds between checkpoints of the block in training (and at every block's end).
SAVE_EVERY_S = 30.0
EVAL_POINTS = 20  # valid-CE points over a run when swarm.eval_every is -1 (the default)


@dataclass
class SwarmConfig:
    schedule: str = "relay"  # relay | parallel (see the module's rules)
    sync: str = "grads"  # grads: average gradients every step; params: DiLoCo every `every` steps
    every: int = 0  # local steps per round; 0 = the sync's default (grads 1, params 25)
    codec: str = "raw"  # averaging codec: raw, fp16, bf16, int8, topk (lossy ones with error feedback)
    density: float = 0.01  # topk: the fraction of each chunk of 4096 values sent per round
    aggregate: str = "robust"  # robust: every member computes every piece, centred clipping (averaging.py rule 6);
    #                           mean: reduce-scatter, each piece's owner trusted (fewer bytes with many members)
    outer: str = "sgd"  # params only: sgd | nesterov
    outer_lr: float = 1.0  # with sgd and momentum 0: the plain average of the workers' parameters
    outer_momentum: float = 0.0
    overlap: bool = False  # params only: a round is on the wire during the next round's local steps (see _round)
    min_coverage: float = 1.0
    max_norm: float = 1e4  # bound on an incoming part's L2 norm
    round_timeout_s: float = 120.0
    join_timeout_s: float = 10.0  # waiting for the answers to a JOIN
    ready_timeout_s: float = 300.0  # waiting for the group's state after our admission
    lower_timeout_s: float = 3600.0  # parallel: waiting for the lower blocks' checkpoints
    eval_windows: int = 16  # valid windows for the CE at start and end (CE per GB)
    eval_every: int = -1  # steps between valid-CE points of the chain in work (the curve, time to a CE; 0: none;
    # -1: about EVAL_POINTS over the run, so the live page draws a curve for a run of any length)
    min_group: int = 1  # start only once this many peers (us included) start together or a group exists
    margin: int = 2  # rounds between a joiner's admission and its first round

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"swarm schedule {self.schedule!r}: expected one of {SCHEDULES}")
        if self.sync not in SYNCS:
            raise ValueError(f"swarm sync {self.sync!r}: expected one of {SYNCS}")
        if self.outer not in ("sgd", "nesterov"):
            raise ValueError(f"outer optimizer {self.outer!r}: expected sgd or nesterov")
        if self.every < 0:
            raise ValueError("every must be >= 1 local step (0: the default)")
        if self.eval_every < -1:
            raise ValueError(f"eval_every {self.eval_every}: steps between CE points (0: none, -1: about "
                             f"{EVAL_POINTS} points over the run)")
        if self.sync == "grads" and self.every not in (0, 1):
            raise ValueError("sync=grads averages every step: every must be 1")
        if self.overlap and self.sync != "params":
            raise ValueError("overlap needs sync=params: a gradient is needed before the step it makes")
        if self.codec not in UPDATE_CODECS:
            raise ValueError(f"averaging codec {self.codec!r}: expected one of {UPDATE_CODECS}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density {self.density}: expected a fraction in (0, 1]")
        if self.aggregate not in ("robust", "mean"):
            raise ValueError(f"aggregate {self.aggregate!r}: expected robust or mean")
        if self.margin < 2 or self.min_group < 1:  # margin: group.py rule 2
            raise ValueError("margin must be >= 2 and min_group >= 1")
        if not 0 <= self.min_coverage <= 1:
            raise ValueError("min_coverage must be in [0, 1]")

    @property
    def steps_per_round(self) -> int:
        return self.every or (1 if self.sync == "grads" else 25)

    def outer_optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_lr, self.outer_momentum, self.outer == "nesterov")


@dataclass
class _Pending:
    """overlap: a round on the wire (its phase's update, sent) and what settling it needs."""
    rnd: int
    members: list
    loss: float
    t0: float
    task: asyncio.Future


class SwarmError(Exception):
    """Training in the swarm cannot go on (a timeout waiting for blocks or a group)."""


def digest(t: torch.Tensor) -> str:
    """A digest of a start point (crc32 of its float32 bytes): cheap, for divergence, not security."""
    return f"{zlib.crc32(t.detach().float().contiguous().numpy()):08x}"


@dataclass
class _Stats:
    rounds: list = field(default_factory=list)  # the last REPORT_ROUNDS rounds, and every anomaly
    applied: int = 0
    failed: list = field(default_factory=list)
    coverage_min: float = 1.0
    averaging_s: float = 0.0
    bytes_sent: int = 0
    losses: list = field(default_factory=list)  # (global step, loss), every 10th step
    joins: list = field(default_factory=list)  # joining the group: how, from which round, bytes
    lower: list = field(default_factory=list)  # parallel: lower-block refreshes
    phases: list = field(default_factory=list)  # relay: which block when
    curve: list = field(default_factory=list)  # (global step, seconds since training began, head CEs)
    draft_curve: list = field(default_factory=list)  # (draft step, KL per drafted byte): the last block's draft phase


# A fetched state's parameter norm, against a fresh block's, must lie in this range: training
# moves it (1.6-2.0x after 1000 steps of the shipped model), it does not zero it or scale it 1000x.
STATE_NORM_RATIO = (0.25, 8.0)
# The top head's CE of a fetched state on the joiner's own validation windows may not exceed this
# (a fresh block scores about ln 256 = 5.55; a state that scores worse than that by 0.5 is broken).
MAX_STATE_CE = math.log(256) + 0.5
STATE_CHECK_WINDOWS = 4


def _check_norm(tensors: dict, fresh: dict, block: int) -> None:
    def norm(ts):
        return math.sqrt(sum(float(t.double().square().sum()) for t in ts.values() if t.is_floating_point()))
    ratio = norm(tensors) / max(norm(fresh), 1e-12)
    lo, hi = STATE_NORM_RATIO
    if not lo <= ratio <= hi:
        raise ValueError(f"block {block}: parameter norm {ratio:.3g}x a fresh block's (plausible: {lo}-{hi}x)")


class SwarmTrainer:
    """Everything a training peer runs beside its peer: the block trainer of the block in work,
    its group and averaging, checkpoints served and fetched, and the training report."""

    def __init__(self, peer: PeerServices, k: int, mcfg, tcfg, scfg: SwarmConfig, workdir: str | Path,
                 data: torch.Tensor, valid: torch.Tensor, shard: tuple[int, int] | None = None, progress=None,
                 on_step=None):
        self.peer, self.k, self.mcfg, self.tcfg, self.scfg = peer, k, mcfg, tcfg, scfg
        self.K, self.S, self.H = mcfg.n_blocks, tcfg.steps, scfg.steps_per_round
        if self.S % self.H:
            raise ValueError(f"{self.S} steps per block do not split into rounds of {self.H} steps")
        self.dir = Path(workdir)
        self.data, self.valid, self.shard = data, valid, shard
        self.progress = progress or (lambda s: None)  # events, as lines
        self.on_step = on_step  # on_step(global step, total, loss, group size): a progress display
        self.relay = scfg.schedule == "relay"
        self.scope = "relay" if self.relay else f"block:{k}"
        self.plan = list(range(self.K)) if self.relay else [k]  # the blocks this peer trains, in order
        self.block = self.plan[0]  # the block in work
        self.gstep = 0  # global steps done (relay: across blocks)
        self.rnd = 0  # the last round attempted
        self.trainer = None
        self.finals: dict[int, dict] = {}  # relay: block -> final parameters
        self.lower = LowerInputs(k, require_final=False) if not self.relay else None
        self.lower_cache: dict[int, tuple] = {}  # parallel: block -> (checkpoint, size, sha) fetched
        self.outer = scfg.outer_optimizer()
        self.group = Group(peer.id, margin=scfg.margin)
        from blocktrain.blocks.model import Block
        with torch.random.fork_rng(devices=[]):  # counting parameters draws no random number of ours
            floats = max(sum(p.numel() for p in Block(self.mcfg, j).parameters()) for j in self.plan)
        self.averager = Averager(peer, k, codec=scfg.codec, density=scfg.density, min_coverage=scfg.min_coverage,
                                 max_norm=scfg.max_norm, timeout_s=scfg.round_timeout_s, aggregate=scfg.aggregate,
                                 floats=floats)
        self.averager.on_control = self._control
        self._avg_out: torch.Tensor | None = None  # the rounds' result buffer (consumed before the next round)
        # overlap: the point every member of the group agrees on (the outer steps of the rounds
        # settled so far), and the round on the wire (_Pending), settled at the end of the next phase
        self._g: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._members_before: list | None = None  # the last round's members
        self._eval_mark = 0  # gstep // eval_every at the last curve point
        self.server = CheckpointServer(peer, self.dir / "serve")
        self.fetcher = CheckpointFetcher(peer)
        self.stats = _Stats()
        self.state = "starting"
        self.ce: dict = {}
        self.busy_s = 0.0
        self.eval_s = 0.0  # time spent on the curve's evaluations (not training, not waiting)
        self.draft_seconds = 0.0  # the last block's draft phase (after the schedule; not in the busy fraction)
        self.last_loss = float("nan")
        self.t_start: float | None = None
        self.t_end: float | None = None
        self.memory = {"grad_optimizer_bytes": 0}
        self._ready: dict[tuple, str] = {}  # (round, member) -> name: READYs heard while joining
        self.bad_lower: dict[str, str] = {}  # holder address -> why its lower block was refused (not asked again)
        self._status_sent: dict[str, float] = {}
        self._rejoin = False
        self._resumed: bool | None = None  # prepare(): None until the first trainer is built
        self._last_save = time.monotonic()
        peer.report_section("training", self.training_report)
        peer.report_section("work", self.work_status)
        peer.on_membership(self._membership)

    # --- where we are ------------------------------------------------------------------------------
    def block_at(self, gstep: int) -> int:
        return self.plan[min(gstep // self.S, len(self.plan) - 1)] if self.relay else self.k

    @property
    def total_steps(self) -> int:
        return self.S * len(self.plan)

    def params(self) -> list:
        return list(self.trainer.block.parameters())

    def work_status(self) -> dict:
        """What this peer works on now (bt-peer status, the report)."""
        return {"holds": self.k, "training_block": self.block if self.state == "training" else None,
                "state": self.state, "schedule": self.scfg.schedule, "step": self.gstep,
                "steps": self.total_steps, "round": self.group.round, "group": self.group.members(),
                "rounds_applied": self.stats.applied, "coverage_min": self.stats.coverage_min,
                "curve": self.stats.curve[-20:]}

    def _say(self, text: str):
        self.progress(text)

    # --- trainers --------------------------------------------------------------------------------
    def _new_trainer(self, b: int):
        from blocktrain.blocks.data import ByteBatches
        from blocktrain.blocks.train import BlockTrainer

        old = self.trainer
        self.trainer = None  # one block's optimizer at a time: the old one goes first
        tr = BlockTrainer(self.mcfg, self.tcfg, b, self.data, shard=self.shard[0] if self.shard else 0,
                          num_shards=self.shard[1] if self.shard else 1)
        if self.shard is None:  # this peer's own stream of random windows over all the data
            tr.batches = ByteBatches(self.data, self.tcfg.batch_size, self.tcfg.seq_len, seed=_seed(self.peer.id, b))
        if b > 0 and self.relay:
            tr.set_lower([self.finals[j] for j in range(b)], [self.S] * b)
            if old is not None and old.k == b - 1:
                tr.init_from_below(old.block)  # identity start: the head of the block below
        self.trainer = tr
        self.block = b
        self.outer = self.scfg.outer_optimizer()
        self._drop_pending()
        self.memory["grad_optimizer_bytes"] = max(self.memory["grad_optimizer_bytes"], _grad_opt_bytes(tr))

    async def _finish_block(self):
        """Relay: the block in work is final; keep its parameters, drop its optimizer."""
        b = self.block
        self.finals[b] = {n: t.detach().clone() for n, t in self.trainer.block.state_dict().items()}
        await asyncio.to_thread(self._save, True)
        self.stats.phases[-1]["end_step"] = self.gstep
        self.stats.phases[-1]["ended"] = time.time()

    # --- checkpoints -----------------------------------------------------------------------------
    def _checkpoint(self, final: bool) -> ckpt.Checkpoint:
        c = self.trainer.checkpoint()
        if self.outer._buf is not None:
            c.optim[OUTER_MOMENTUM] = self.outer._buf
        c.extra.update(final=final, gstep=self.gstep, round=self.rnd, block_in_work=self.block,
                       schedule=self.scfg.schedule, swarm=asdict(self.scfg))
        return c

    def _save(self, final: bool = False):
        """The block in work: its full checkpoint (resume, joiners, assembly), and its parameters as a
        lower block (the handoff to the blocks above)."""
        c = self._checkpoint(final)
        b = self.block
        self.server.publish(CHECKPOINT, ckpt.block_name(b), c)
        extra = {"final": final, "round": c.extra["round"], "gstep": self.gstep}
        self.server.publish(LOWER, ckpt.block_name(b), ckpt.Checkpoint(c.config, c.block, c.step, c.tensors, extra=extra))
        if final and self.relay and b != self.k:  # only the own block's full state is kept once final
            (self.dir / "serve" / CHECKPOINT / ckpt.block_file(b)).unlink(missing_ok=True)
        self._last_save = time.monotonic()

    def _save_final_params(self, j: int, tensors: dict):
        """A final block taken from the group: its parameters as our lower block (for joiners), and,
        for our own block, as our checkpoint (for serving and assembly)."""
        c = ckpt.Checkpoint(self.mcfg.to_dict(), j, self.S, tensors,
                            extra={"final": True, "gstep": (self.plan.index(j) + 1) * self.S, "train": self.tcfg.to_dict()})
        self.server.publish(LOWER, ckpt.block_name(j), c)
        if j == self.k:
            self.server.publish(CHECKPOINT, ckpt.block_name(j), c)

    def _join_state_name(self, rnd: int) -> str:
        return f"{ckpt.block_name(self.block)}.r{rnd}"

    def _save_join_state(self, rnd: int) -> str:
        """The group's state at the end of round ``rnd``, for its joiners. Under overlap that is
        the group's point g (a member that learnt of the admission late settles ``rnd`` after its
        next local steps: its own parameters are then ahead of g, and its round counter too)."""
        name = self._join_state_name(rnd)
        own = None
        if self._g is not None and self._pending is None:
            own = flatten(self.params()).clone()
            unflatten_(self.params(), self._g)
        try:
            c = self._checkpoint(False)
        finally:
            if own is not None:
                unflatten_(self.params(), own)
        c.extra["round"] = rnd
        self.server.publish(CHECKPOINT, name, c)
        for old in (self.dir / "serve" / CHECKPOINT).glob(f"block*.r*{ckpt.SUFFIX}"):
            r = old.name[:-len(ckpt.SUFFIX)].rpartition(".r")[2]
            if r.isdigit() and int(r) < rnd - 50 * self.scfg.margin:
                old.unlink(missing_ok=True)
        return name

    def _restore(self, c: ckpt.Checkpoint, lowers: dict, source: str):
        """Install a checkpoint of the block in work (and, relay, the final blocks below it)."""
        gstep = int(c.extra.get("gstep", c.step))
        if self.relay:
            self.finals.update(lowers)
            self.trainer = None
            self._new_trainer(c.block)
        self.trainer.restore(c)
        self._drop_pending()
        buf = c.optim.get(OUTER_MOMENTUM)
        self.outer._buf = buf.clone() if buf is not None else None
        self.gstep = gstep
        self.rnd = int(c.extra.get("round", self.rnd))
        log.info("block %d: resumed from %s at step %d (global step %d)", c.block, source, c.step, gstep)

    def _resume_own(self) -> bool:
        """After a restart: our newest state in the work directory, if any. A damaged own
        checkpoint stops us (CheckpointError): the operator must see it."""
        serve = self.dir / "serve"
        if not self.relay:
            path = serve / CHECKPOINT / ckpt.block_file(self.k)
            if not path.exists():
                return False
            self._restore(ckpt.load(path), {}, str(path))
            return True
        finals = {}
        for j in self.plan:  # the blocks already final, in order
            path = serve / LOWER / ckpt.block_file(j)
            if not path.exists():
                break
            c = ckpt.load(path)
            if not (c.extra.get("final") and int(c.extra.get("gstep", -1)) == (j + 1) * self.S):
                break
            finals[j] = c.tensors
        path = serve / CHECKPOINT / ckpt.block_file(len(finals))
        if len(finals) < self.K and path.exists():
            c = ckpt.load(path)
            if c.block == len(finals) and not c.extra.get("final"):
                self._restore(c, finals, str(path))
                return True
        if not finals:
            return False
        self.finals.update(finals)
        self.gstep = len(finals) * self.S
        nxt = min(len(finals), self.K - 1)
        if len(finals) < self.K:
            from blocktrain.blocks.model import Block
            below = Block(self.mcfg, nxt - 1)
            below.load_state_dict(finals[nxt - 1])
            self._new_trainer(nxt)
            self.trainer.init_from_below(below)
        else:  # everything is final: we only serve
            self._new_trainer(self.K - 1)
            self.trainer.block.load_state_dict(finals[self.K - 1])
        log.info("resumed with blocks %s final (global step %d)", sorted(finals), self.gstep)
        return True

    # --- the group's control messages (in the connections' readers) ------------------------------
    def candidates(self) -> list[str]:
        """Live training peers in our group's scope (relay: all; parallel: those on our block)."""
        return [m.peer_id for m in self.peer.members(role="train", block=None if self.relay else self.k)
                if m.peer_id not in self.averager.banned and m.peer_id not in self.averager.shunned]

    def _control(self, msg: BlockUpdate, pc, pid: str):
        meta = msg.meta
        try:
            phase = Phase(meta.get("phase"))
        except ValueError:
            return
        if meta.get("scope") != self.scope:
            if phase is Phase.JOIN:  # another scope's join: we are not in its group
                self._send([Send(pid, msg.round, {"phase": Phase.ABSENT.value})])
            return
        if phase is Phase.JOIN:
            self._send(self.group.on_join(pid, meta))
        elif phase in (Phase.WELCOME, Phase.REDIRECT, Phase.STARTING, Phase.ABSENT):
            self.group.on_reply(pid, phase, meta)
        elif phase is Phase.ADMIT:
            if is_peer_id(meta.get("peer")):  # never an address or a name of any length
                self._send(self.group.on_admit(pid, meta))
        elif phase is Phase.READY:  # every member's, kept while we join: the newest rounds, names bounded
            at, name = meta.get("at"), meta.get("name")
            if self.state == "joining" and type(at) is int and isinstance(name, str) and len(name) <= 64:
                theirs = sorted(k for k in self._ready if k[1] == pid)
                if (at, pid) not in self._ready and len(theirs) >= READY_PER_MEMBER:
                    del self._ready[theirs[0]]  # one member's flood pushes out only its own
                self._ready[(at, pid)] = name
                while len(self._ready) > READY_KEPT:
                    del self._ready[min(self._ready)]
        elif phase is Phase.LEAVE:
            if self.group.on_leave(pid, msg.round, str(meta.get("why", ""))[:200]):
                self.averager.depart(pid, "left the group")
        elif phase is Phase.STATUS:
            size = meta.get("size")
            if pid in self.averager.banned or pid in self.averager.shunned or type(size) is not int \
                    or not 1 <= size <= len(self.candidates()) + 1:  # a size no group here can have
                return
            leave = self.group.on_status(pid, meta)
            if leave is not None:
                self._say(f"another group is larger; leaving ours to join it ({len(leave)} member(s) told)")
                self._send(leave)
                self._rejoin = True
            elif self.group.state is State.TRAINING and pid not in self.group.joined and self.group.outranks(meta) \
                    and time.monotonic() - self._status_sent.get(pid, 0.0) > STATUS_REPLY_S:
                # ours ranks higher: say so now. Two members that dropped a dead third at different
                # rounds each see the other outside; the first one's STATUS reached the other while
                # it still counted the first in, and without this reply the split lasted STATUS_EVERY_S.
                self._status_sent[pid] = time.monotonic()
                self._send([self.group.status_for(pid)])
        self.peer.notify()

    def _membership(self, ev):
        if ev.departed and self.group.depart(ev.peer_id, ev.change.value):
            log.info("%s left the group (%s)", ev.peer_id[:12], ev.change.value)

    def _send(self, sends: list[Send]):
        """Control messages, in order: on the live connection at once, else after dialling a member
        we know. A peer id from a message (an ADMIT's joiner) is never dialled as an address."""
        for s in sends:
            msg = BlockUpdate(block=self.block, round=max(0, s.round), meta={**s.meta, "scope": self.scope})
            pc = self.peer.live_connection(s.peer)
            if pc is not None:
                try:
                    pc.send_nowait(msg)
                    continue
                except (ConnectionError, ProtocolError):
                    pass
            if self.peer.member(s.peer) is None:
                log.info("not telling %s %s: not a member we know", s.peer[:12], s.meta.get("phase"))
                continue
            self.peer.spawn(self._dial_send(s.peer, msg), "group control")

    async def _dial_send(self, pid: str, msg: BlockUpdate):
        try:
            (await self.peer.connection(pid)).send_nowait(msg)
        except (ConnectionError, ProtocolError, PeerUnreachable) as e:
            log.info("cannot tell %s %s: %s", pid[:12], msg.meta.get("phase"), e)

    # --- joining -----------------------------------------------------------------------------------
    async def join(self):
        """Find our group (group.py): start it, start together, or take its state. Returns when we
        are a member (or alone)."""
        delay = 0.2
        while True:
            self.state = "joining"
            self._ready.clear()  # an earlier attempt's admission is not this one's
            start = flatten(self.params())
            rnd = self.rnd + 1
            self._send(self.group.start_join(self.candidates(), self.gstep, digest(start), rnd))
            await self.peer.wait_for(lambda: not self.group.waiting_for(), self.scfg.join_timeout_s)
            d = self.group.decide(self.scfg.min_group)
            if d.action == "train":
                self._joined(d, "own state")
                return
            if d.action == "fetch":
                if await self._take_group_state(d):
                    return
                continue
            if d.why and self.state != d.why:
                self._say(f"waiting: {d.why}")
            await asyncio.sleep(delay)  # backoff: ask again
            delay = min(2 * delay, 2.0)

    def _joined(self, d: Decision, how: str, nbytes: int = 0):
        self.rnd = d.at
        self.averager.expect(d.at + 1)
        self.averager.expect_members(self.group.members(d.at + 1))
        self.stats.joins.append({"round": d.at + 1, "how": how, "sponsor": d.sponsor, "members": list(d.members),
                                 "bytes": nbytes, "time": time.time(), "why": d.why})
        if len(d.members) > 1 or how != "own state":
            self._say(f"in a group of {len(self.group.members(d.at + 1))} from round {d.at + 1} ({d.why})")

    async def _take_group_state(self, d: Decision) -> bool:
        """Wait for a member's READY for round ``d.at`` and install that state; False to retry."""
        self.averager.expect(d.at + 1)  # the group's parts for our first round may come early
        self.averager.expect_members(d.members)
        self._say(f"admitted by {d.sponsor[:12]} from round {d.at + 1}; waiting for the group's state")
        def told():  # the first READY for our round from a member of the group that welcomed us
            return next(((p, n) for (a, p), n in self._ready.items() if a == d.at and p in d.members), None)
        ok = await self.peer.wait_for(lambda: told() is not None or self.peer.member(d.sponsor) is None,
                                      self.scfg.ready_timeout_s)
        if not ok or told() is None:
            self._say("the group's state did not come; asking again")
            self._send(self.group.give_up(d.at, d.members, "no state"))
            return False
        teller, name = told()
        others = [m.addr for m in (self.peer.member(p) for p in d.members) if m is not None and m.peer_id != teller]
        sources = [a for a in [getattr(self.peer.member(teller), "addr", None)] + others if a]
        by: list = []  # whose version of the state we got (not always the sponsor's)
        try:
            blob = await self.fetcher.fetch(sources, CHECKPOINT, name, source=by)
            c = ckpt.decode(blob, f"the group's state {name}")
            lowers, nbytes = {}, len(blob)
            if self.relay:
                for j in range(c.block):
                    lb = await self.fetcher.fetch(sources, LOWER, ckpt.block_name(j), source=by)
                    lowers[j] = ckpt.decode(lb, f"lower block {j}").tensors
                    nbytes += len(lb)
            self._check_state(c, lowers)
        except (FetchError, ckpt.CheckpointError, ValueError) as e:
            if not isinstance(e, FetchError) and len(set(by)) == 1:  # one peer's bytes, not a state of ours:
                addr = by[0]                                             # never asked again
                bad = next((m.peer_id for m in self.peer.members() if m.addr == addr), None)
                if bad is not None:
                    self.averager.reject(bad, f"served a bad state: {e}", d.at)
            self._say(f"could not take the group's state: {e}; asking again")
            self._send(self.group.give_up(d.at, d.members, "state fetch failed"))
            return False
        self._ready.clear()
        self._restore(c, lowers, f"the group's state after round {d.at} ({name})")
        for j, tensors in lowers.items():  # final blocks we did not train: we hold and serve them too
            self._save_final_params(j, tensors)
        self.group.joined_group(d.at, d.members)
        self._joined(d, "fetched the group's state", nbytes)
        return True

    def _check_state(self, c: ckpt.Checkpoint, lowers: dict):
        """A fetched state is used only if it is one of ours: block, config, shapes, finite values."""
        from blocktrain.blocks.model import Block, ModelConfig
        if ModelConfig.from_dict(c.config) != self.mcfg:
            raise ValueError("the group's model config differs from ours")
        if c.block not in self.plan:
            raise ValueError(f"the group trains block {c.block}, not one of ours {self.plan}")
        want = {n: t.shape for n, t in Block(self.mcfg, c.block).state_dict().items()}
        for tensors, b in [(c.tensors, c.block)] + [(t, j) for j, t in lowers.items()]:
            shapes = {n: t.shape for n, t in tensors.items()}
            ref = want if b == c.block else {n: t.shape for n, t in Block(self.mcfg, b).state_dict().items()}
            if shapes != ref:
                raise ValueError(f"block {b}: tensors do not match the model (names or shapes)")
            if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
                raise ValueError(f"block {b}: NaN or inf in the parameters")
        g = int(c.extra.get("gstep", c.step))
        if not 0 <= g <= self.total_steps:
            raise ValueError(f"implausible step {g} (this run has {self.total_steps})")
        with torch.random.fork_rng(devices=[]):  # fresh blocks to compare with draw no random number of ours
            self._check_plausible(c, lowers)

    def _check_plausible(self, c: ckpt.Checkpoint, lowers: dict):
        """Finite is not enough: a state scaled 1000x, zeroed or scrambled is refused by its norm
        against a fresh block's and by what it scores on our own validation windows."""
        from blocktrain.blocks.model import Block
        for tensors, b in [(c.tensors, c.block)] + [(t, j) for j, t in lowers.items()]:
            _check_norm(tensors, Block(self.mcfg, b).state_dict(), b)
        if self.relay or c.block == 0:  # the whole chain is in hand: what it scores on our own windows
            chain = []
            for j in range(c.block + 1):
                blk = Block(self.mcfg, j)
                blk.load_state_dict(c.tensors if j == c.block else lowers[j])
                chain.append(blk)
            from blocktrain.blocks.train import eval_chain
            ce = eval_chain(chain, self.valid, self.tcfg.seq_len, STATE_CHECK_WINDOWS)[-1]
            if not ce <= MAX_STATE_CE:  # also NaN
                raise ValueError(f"block {c.block}: the state scores CE {ce:.3g} on our validation windows "
                                 f"(a fresh block scores about {math.log(256):.2f}; more than {MAX_STATE_CE} is "
                                 f"not a state any training reached)")

    # --- parallel: the input handoff -------------------------------------------------------------
    async def refresh_lower(self, wait: bool) -> bool:
        """Parallel schedule: install newer checkpoints of blocks 0..k-1 from their holders; ``wait``:
        until every one is there. True if the input changed."""
        if self.relay or self.k == 0:
            return False
        deadline = time.monotonic() + self.scfg.lower_timeout_s
        delay = 1.0
        while True:
            for j in range(self.k):
                await self._offer_lower(j)
            if self.lower.ready():
                changed = self.lower.install(self.trainer)
                if changed:
                    self.stats.lower.append({"step": self.trainer.step, "lower_steps": self.lower.steps})
                return changed
            if not wait:
                return False
            if time.monotonic() > deadline:
                raise SwarmError(f"block {self.k}: lower blocks not available within {self.scfg.lower_timeout_s:.0f} s")
            if self.state != "waiting for lower blocks":
                self._say(f"block {self.k}: waiting for blocks 0..{self.k - 1} from the swarm")
            self.state = "waiting for lower blocks"
            await asyncio.sleep(delay)  # retry with backoff: the lower blocks' peers may still be starting
            delay = min(2 * delay, 10.0)

    async def _offer_lower(self, j: int):
        have = self.lower_cache.get(j)
        for addr in holders(self.peer.members(), j):
            if addr in self.bad_lower:
                continue
            if have is not None:
                now = await self.fetcher.probe(addr, LOWER, ckpt.block_name(j), have[1])
                if now is None:
                    continue
                if now[1] == have[2]:
                    return
            try:
                blob = await self.fetcher.fetch([addr], LOWER, ckpt.block_name(j))
                c = ckpt.decode(blob, f"lower block {j} from {addr}")
                self._check_lower(c, j)
            except (FetchError, ckpt.CheckpointError, ValueError) as e:
                log.info("block %d: lower block %d from %s: %s", self.k, j, addr, e)
                if not isinstance(e, FetchError):  # bad bytes, not a bad link: not asked again
                    remember(self.bad_lower, addr, f"lower block {j}: {e}")  # bounded: addresses are free
                continue
            import hashlib
            self.lower_cache[j] = (c, len(blob), hashlib.sha256(blob).digest())
            self.lower.offer(j, self.lower_cache[j][2], c.step, c.tensors, bool(c.extra.get("final")))
            return

    def _check_lower(self, c: ckpt.Checkpoint, j: int):
        from blocktrain.blocks.model import Block, ModelConfig
        if c.block != j or ModelConfig.from_dict(c.config) != self.mcfg:
            raise ValueError(f"not block {j} of our model")
        ref = {n: t.shape for n, t in Block(self.mcfg, j).state_dict().items()}
        if {n: t.shape for n, t in c.tensors.items()} != ref:
            raise ValueError("tensors do not match the model")
        if not all(torch.isfinite(t).all() for t in c.tensors.values() if t.is_floating_point()):
            raise ValueError("NaN or inf in the parameters")
        if not 0 <= c.step <= self.S:
            raise ValueError(f"implausible step {c.step}")

    # --- the rounds ----------------------------------------------------------------------------------
    async def _round(self) -> None:
        """One round of the block in work: local step(s), averaging with the group, the update."""
        if self.scfg.overlap:
            return await self._overlapped_round()
        rnd = self.rnd = self.rnd + 1
        start = flatten(self.params())
        members = self.group.begin_round(rnd, digest(start), self.block)
        members = [m for m in members if m == self.peer.id or self.peer.member(m) is not None]
        self.averager.expect_members(self.group.members(rnd + 1))  # whose parts for the next round we hold
        t0 = time.perf_counter()
        if self.scfg.sync == "grads":
            loss = await self._timed(self.trainer.compute_grads)
            vec = self.trainer.grads()
        else:
            for _ in range(self.H):
                loss = await self._timed(self.trainer.train_step)
            vec = start - flatten(self.params())
        self.last_loss = loss
        rep, avg = None, vec
        if len(members) > 1:
            try:
                if self._avg_out is None or self._avg_out.numel() != vec.numel():
                    self._avg_out = torch.empty(vec.numel())  # reused round after round: no fresh memory
                avg, rep = await self.averager.average(rnd, vec, members, start=digest(start), out=self._avg_out)
            except RoundFailed as e:
                self._round_failed(rnd, self.gstep + self.H, e,
                                   "no step" if self.scfg.sync == "grads" else "keeping the round's start point")
                if self.scfg.sync == "params":
                    unflatten_(self.params(), start)
                    self.trainer.step -= self.H
                await self._after_round(rnd, None, loss, members, time.perf_counter() - t0, failed=True)
                return
        if self.scfg.sync == "grads":
            await self._timed(self.trainer.apply_grads, avg)
        else:
            unflatten_(self.params(), self.outer.step(start, avg))
        self.gstep += self.H
        if self.on_step is not None:
            self.on_step(self.gstep, self.total_steps, loss, len(members))
        await self._after_round(rnd, rep, loss, members, time.perf_counter() - t0)

    async def _overlapped_round(self) -> None:
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
        round (group.py rule 3). A failed round changes nothing of g (its phase is lost; steps still count, so the
        members keep one schedule)."""
        rnd = self.rnd = self.rnd + 1
        if self._g is None:
            self._g = flatten(self.params()).clone()
        members = self.group.begin_round(rnd, digest(self._g), self.block)
        members = [m for m in members if m == self.peer.id or self.peer.member(m) is not None]
        self.averager.expect_members(self.group.members(rnd + 1))  # whose parts for the next round we hold
        wait = ((self.gstep + self.H) % self.S == 0 or self.group.admits_due_by(rnd)
                or members != self._members_before)
        self._members_before = members
        t0 = time.perf_counter()
        phase_start = flatten(self.params())
        for _ in range(self.H):
            loss = await self._timed(self.trainer.train_step)
        self.last_loss = loss
        vec = phase_start - flatten(self.params())
        del phase_start
        if self._pending is not None:  # it had this phase's compute to arrive
            await self._settle(self._pending)
        self._pending = _Pending(rnd, members, loss, t0, asyncio.ensure_future(
            self._average_or_alone(rnd, vec, members, digest(self._g))))
        self.gstep += self.H
        if wait:
            await self._settle(self._pending, install=True)
        else:
            unflatten_(self.params(), self._g - self.outer.lr * vec)
        if self.on_step is not None:
            self.on_step(self.gstep, self.total_steps, loss, len(members))

    async def _average_or_alone(self, rnd: int, vec: torch.Tensor, members: list, start: str):
        if len(members) <= 1:
            return vec, None
        return await self.averager.average(rnd, vec, members, start=start)

    async def _settle(self, p: "_Pending", install: bool = False) -> None:
        """Round ``p`` is done (or failed): g takes its outer step (``install``: and becomes our
        parameters, before joiners take them); its report and joiners follow."""
        self._pending = None
        try:
            avg, rep = await p.task
        except RoundFailed as e:
            self._round_failed(p.rnd, self.gstep, e, "the round's phase is lost (the group's point stays)")
            avg = rep = None
        if avg is not None:
            self._g = self.outer.step(self._g, avg)
        if install:
            unflatten_(self.params(), self._g)
        await self._after_round(p.rnd, rep, p.loss, p.members, time.perf_counter() - p.t0, failed=avg is None)

    def _round_failed(self, rnd: int, step: int, e: RoundFailed, outcome: str) -> None:
        log.warning("%s; %s", e, outcome)
        self.stats.failed.append({"round": rnd, "step": step, "reason": str(e), "silent": sorted(e.silent)})
        for pid in e.silent:  # they failed the round: they join again, taking the group's state
            self.group.depart(pid, f"silent in round {rnd}")

    def _drop_pending(self) -> None:
        """A new start (another block, a rejoin, a restored state): the round on the wire is not ours."""
        if self._pending is not None:
            task = self._pending.task
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is not ours to raise now
        self._pending, self._g, self._members_before = None, None, None

    async def _timed(self, fn, *args):
        t = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.busy_s += time.perf_counter() - t

    async def _after_round(self, rnd: int, rep, loss: float, members: list, seconds: float, failed: bool = False):
        s = self.stats
        if not failed:
            s.applied += 1
            cand = set(self.candidates()) | {self.peer.id}
            entry = {"round": rnd, "block": self.block, "step": self.gstep, "loss": round(loss, 5),
                     "members": rep.members if rep else [self.peer.id],
                     "coverage": rep.coverage if rep else 1.0, "departed": rep.departed if rep else [],
                     "rejected": rep.rejected if rep else [], "seconds": round(seconds, 4),
                     "bytes_sent": rep.bytes_sent if rep else 0, "robust": rep.robust if rep else False,
                     "suspects": rep.suspects if rep else {},
                     "candidates_outside": sorted(cand - set(members))}
            if rep:
                for pid in rep.departed:  # gone from the round: gone from the group (rule 5 of group.py),
                    if self.group.joined.get(pid, 0) <= rnd:  # unless it was admitted for a later round
                        self.group.depart(pid, rep.why.get(pid, "departed mid-round"))
                entry["why"] = rep.why
                s.coverage_min = min(s.coverage_min, rep.coverage)
                s.averaging_s += rep.seconds
                s.bytes_sent += rep.bytes_sent
            s.rounds.append(entry)
            if len(s.rounds) > REPORT_ROUNDS:  # keep the anomalies and the last REPORT_ROUNDS
                drop = next((i for i, r in enumerate(s.rounds[:-REPORT_ROUNDS])
                             if not (r["departed"] or r["rejected"] or r["candidates_outside"])), None)
                if drop is not None:
                    s.rounds.pop(drop)
            if self.gstep % 10 == 0 or self.gstep < 10:
                s.losses.append((self.gstep, round(loss, 5)))
        due = self.group.ready_due(rnd)
        if due:  # joiners admitted at this round take the state we have now
            name = await asyncio.to_thread(self._save_join_state, rnd)  # disk work off the event loop
            self._send(self.group.ready(rnd, due, name))
        self._tell_outsiders()

    def _tell_outsiders(self):
        """Rule 6 of group.py: training peers in scope but outside our group hear our status."""
        now = time.monotonic()
        members = set(self.group.members()) | set(self.group.joined)
        for pid in self.candidates():
            if pid not in members and now - self._status_sent.get(pid, 0.0) > STATUS_EVERY_S:
                self._status_sent[pid] = now
                self._send([self.group.status_for(pid)])

    # --- the whole run -----------------------------------------------------------------------------
    def eval_heads(self) -> list[float]:
        """Valid CE of every head along the chain this peer holds (relay: up to the block in work)."""
        from blocktrain.blocks.model import Block
        from blocktrain.blocks.train import eval_chain
        if self.relay:
            chain = []
            for j in range(self.block):
                b = Block(self.mcfg, j)
                b.load_state_dict(self.finals[j])
                chain.append(b)
        else:
            chain = list(self.trainer.lower)
        return eval_chain(chain + [self.trainer.block], self.valid, self.tcfg.seq_len, self.scfg.eval_windows)

    def prepare(self) -> bool:
        """The first block's trainer, resumed from our own checkpoint if we have one (True then).
        Seconds of CPU the first time in a process (the first optimizer imports much of torch),
        10-20 s on a starved machine: a peer process runs it before it listens (app.run_peer),
        since an event loop busy with it answers no handshake and no ping (joiners time out,
        members declare it dead). Idempotent; ``run`` calls it if nobody did."""
        if self._resumed is None:
            self._new_trainer(self.plan[0])
            self._resumed = self._resume_own()
        return self._resumed

    async def run(self, steps: int | None = None) -> dict:
        """Train every block of the plan to ``steps`` steps each (default: the config's)."""
        if steps is not None and steps != self.S:
            if steps % self.H:
                raise ValueError(f"{steps} steps do not split into rounds of {self.H}")
            if self._resumed is not None:  # where a checkpoint's step lies depends on the steps per block
                raise ValueError(f"prepared for {self.S} steps per block, asked to run {steps}")
            self.S = steps
        resumed = self.prepare()
        self.state = "waiting for members"
        await self.peer.wait_for(self.peer.settled, self.scfg.join_timeout_s)  # who is there, before asking
        await self.peer.wait_for(lambda: len(self.candidates()) + 1 >= self.scfg.min_group, self.scfg.lower_timeout_s)
        if not self.relay:
            await self.refresh_lower(wait=True)
        self.ce["start"] = (await asyncio.to_thread(self.eval_heads))[-1]
        self.ce["start_step"] = self.gstep
        if resumed:
            self._say(f"resumed at global step {self.gstep} (block {self.block})")
        self.t_start = time.monotonic()
        await self.join()
        if self.stats.joins and self.stats.joins[-1]["how"] == "fetched the group's state":
            await self._start_ce()  # we start from the group's state, not our own
        self.state = "training"
        self._say(f"training block {self.block} from step {self.gstep} of {self.total_steps}, group of "
                  f"{len(self.group.members())}, rounds of {self.H} step(s) ({self.scfg.sync})")
        if not self.stats.phases or self.stats.phases[-1]["block"] != self.block:
            self.stats.phases.append({"block": self.block, "start_step": self.gstep, "started": time.time()})
        while self.gstep < self.total_steps:
            if self._rejoin:
                self._rejoin = False
                self._drop_pending()  # we take the group's state
                await self.join()
                self.state = "training"
            b = self.block_at(self.gstep)
            if b != self.block:  # relay: the next block, on the final ones below
                self._new_trainer(b)
                self.stats.phases.append({"block": b, "start_step": self.gstep, "started": time.time()})
                self._say(f"block {b - 1} is final; training block {b} (holding block {self.k})")
            if not self.relay and self.gstep and self.gstep % max(self.H, self.tcfg.refresh_every) == 0:
                await self.refresh_lower(wait=False)
            await self._round()
            every = self.scfg.eval_every if self.scfg.eval_every >= 0 else max(1, self.total_steps // EVAL_POINTS)
            mark = self.gstep // every if every else None  # rounds of H steps: a point each time a multiple is passed
            if every and mark != self._eval_mark:
                self._eval_mark = mark
                t = time.monotonic()
                heads = await asyncio.to_thread(self.eval_heads)
                self.eval_s += time.monotonic() - t
                self.stats.curve.append((self.gstep, round(time.monotonic() - self.t_start - self.eval_s, 3), heads))
            if self.relay and self.gstep % self.S == 0:
                await self._finish_block()
            elif time.monotonic() - self._last_save > SAVE_EVERY_S or self.gstep >= self.total_steps:
                await asyncio.to_thread(self._save, self.gstep >= self.total_steps)
            if self.gstep % max(1, self.total_steps // 20) == 0:
                self.peer.write_report()
            if self.on_step is None and self.gstep % max(1, self.total_steps // 20) == 0:
                self._say(self._progress_line())
        self._send(self.group.finish())
        self.t_end = time.monotonic()
        if self.relay and self.block != self.k:  # serve our own block
            self._restore_final_own()
        if self.k == self.mcfg.n_blocks - 1 and self.tcfg.draft_steps and self.trainer.block.drafter is not None:
            await self._draft_phase()
        heads = await asyncio.to_thread(self.eval_heads)
        self.ce["end"], self.ce["heads"] = heads[-1], heads
        self.state = "done"
        self.peer.write_report()
        return self.training_report()

    async def _start_ce(self):
        """The CE we start from, on a few windows (so the group's next round waits on us a moment at most)."""
        t = time.monotonic()
        self.ce["start"] = (await asyncio.to_thread(self.eval_heads))[-1]
        self.ce["start_step"] = self.gstep
        self.eval_s += time.monotonic() - t

    def _progress_line(self) -> str:
        spent = time.monotonic() - self.t_start - self.eval_s
        done = self.gstep - self.stats.phases[0]["start_step"] if self.stats.phases else self.gstep
        rate = done / spent if spent > 0 else 0.0
        left = f", {(self.total_steps - self.gstep) / rate:.0f} s left" if rate > 0 else ""
        return (f"step {self.gstep}/{self.total_steps} (block {self.block}), {rate:.2f} step/s{left}, "
                f"loss {self.last_loss:.4f}, group of {len(self.group.members())}")

    async def _draft_phase(self):
        """The last block's draft model (what exact-mode serving drafts with) trains on this peer's
        own data with the chain frozen: local work, no averaging; its checkpoint says so."""
        path = self.dir / "serve" / CHECKPOINT / ckpt.block_file(self.k)
        if path.exists() and ckpt.load(path).extra.get("drafter_steps"):
            return  # done before a restart
        phase = self.trainer.draft_phase()
        n = self.tcfg.draft_steps
        self.state = "draft phase"
        self._say(f"training the draft model of block {self.k} for {n} steps (local, the chain frozen)")
        t0 = time.monotonic()
        while phase.step < n:
            chunk = min(25, n - phase.step)
            kls = await asyncio.to_thread(lambda: [phase.train_step() for _ in range(chunk)][-1])
            self.stats.draft_curve.append((phase.step, [round(k, 4) for k in kls]))
            if phase.step % max(1, n // 4) < chunk or phase.step == n:  # also on a terminal: the bar is done
                rate = phase.step / (time.monotonic() - t0)
                self._say(f"draft step {phase.step}/{n} ({rate:.2f} step/s, {(n - phase.step) / rate:.0f} s left), "
                          f"KL per drafted byte {', '.join(f'{k:.3f}' for k in kls)}")
        self.draft_seconds = time.monotonic() - t0
        tensors = {k: v.detach().clone() for k, v in self.trainer.block.state_dict().items()}
        c = ckpt.Checkpoint(self.mcfg.to_dict(), self.k, self.S, tensors,
                            extra={"final": True, "gstep": self.total_steps, "drafter_steps": n,
                                   "train": self.tcfg.to_dict()})
        await asyncio.to_thread(self.server.publish, CHECKPOINT, ckpt.block_name(self.k), c)

    def _restore_final_own(self):
        c = ckpt.load(self.dir / "serve" / CHECKPOINT / ckpt.block_file(self.k))
        self.trainer = None
        self._new_trainer(self.k)
        self.trainer.restore(c)

    def training_report(self) -> dict:
        s = self.stats
        t = self.peer.traffic_totals()
        moved = t["sent"]["wire_bytes"] + t["received"]["wire_bytes"]
        wall = ((self.t_end or time.monotonic()) - self.t_start - self.eval_s) if self.t_start else 0.0
        out = {"block": self.k, "state": self.state, "schedule": self.scfg.schedule, "sync": self.scfg.sync,
               "steps_per_round": self.H, "step": self.gstep, "steps": self.total_steps,
               "block_in_work": self.block, "round": self.group.round, "group": self.group.members(),
               "config": {"swarm": asdict(self.scfg), "train": self.tcfg.to_dict(), "model": self.mcfg.to_dict()},
               "rounds": s.rounds, "rounds_applied": s.applied, "failed_rounds": s.failed,
               "coverage_min": s.coverage_min, "averaging_seconds": round(s.averaging_s, 3),
               "update_bytes_sent": s.bytes_sent, "losses": s.losses, "joins": s.joins, "lower_refreshes": s.lower,
               "phases": s.phases, "curve": s.curve, "group_events": self.group.events,
               "draft_phase": {"curve": s.draft_curve, "seconds": self.draft_seconds},
               "rejected_updates": [e for e in self.averager.events if e["event"] == "rejected update"],
               "averaging_events": self.averager.events, "excluded_peers": dict(self.averager.banned),
               "excluded_by": dict(self.averager.shunned), "refused_lower_holders": dict(self.bad_lower),
               "busy": {"train_s": round(self.busy_s, 3), "wall_s": round(wall, 3),
                        "fraction": round(self.busy_s / wall, 4) if wall else None},
               "memory": {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                          **self.memory},
               "ce_start": self.ce.get("start"), "ce_start_step": self.ce.get("start_step"), "ce_end": self.ce.get("end"), "head_ce": self.ce.get("heads"),
               "bytes_moved": moved}
        if "start" in self.ce and "end" in self.ce and moved:
            out["ce_improvement_per_gb"] = (self.ce["start"] - self.ce["end"]) / (moved / 1e9)
        return out


def refuse_joins(peer: PeerServices):
    """For a peer that trains nothing: every JOIN is answered ABSENT at once (nobody waits on it)."""
    def handler(msg: BlockUpdate, pc, pid):
        if msg.meta.get("phase") == Phase.JOIN.value:
            try:
                pc.send_nowait(BlockUpdate(block=msg.block, round=msg.round,
                                           meta={"phase": Phase.ABSENT.value, "scope": msg.meta.get("scope")}))
            except (ConnectionError, ProtocolError):
                pass
    peer.on(BlockUpdate, handler, inline=True)


def _seed(peer_id: str, block: int) -> int:
    return (int(peer_id[:8], 16) * 1_000_003 + block) % (1 << 62)


def _grad_opt_bytes(tr) -> int:
    b = tr.trainable_bytes()
    return b["grads"] + b["optim_state"]
