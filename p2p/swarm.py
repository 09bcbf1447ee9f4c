"""Swarm training of one block: local steps, and every H steps a DiLoCo-style outer step
averaged with the other peers on the same block.

Rules:
- The pseudo-gradient of a round is (parameters at the round's start) - (parameters now). It is
  averaged over the group (``Averager``), then the outer optimizer moves the round's start point
  (SGD or Nesterov); everyone in the group ends the round with the same parameters.
- A round that fails (coverage below the threshold) changes nothing and keeps the round's start:
  the next round's pseudo-gradient spans both rounds, so peers that shared a start share the
  next one again. It is reported, never hidden.
- The group of round r is this peer and every live member on the same block that agreed with us
  to average from a round <= r. Agreeing is a handshake over BLOCK_UPDATE control phases: a
  joiner sends ``join`` for round r to every member; a member that has not yet begun round r
  answers ``welcome``, one that has answers ``late`` and the joiner catches up again, one that
  is not training (still waiting for its lower blocks, or finished) answers ``absent``.
- A joiner (or a restarted peer whose group moved on) first pulls the block's latest checkpoint
  (kind ``checkpoint``: parameters, AdamW state, outer momentum, step) from a member, verified,
  and starts from it. Checkpoints are written after every applied round, so they hold the
  group's common start point.
- Block k's input handoff: the parameters of blocks 0..k-1 (kind ``lower-checkpoint``, written
  beside the full checkpoint) are pulled from their holders before training and, at every round
  boundary, again if they changed (``sequential``: only the final ones).
- Training steps run off the event loop, so heartbeats and streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.protocol import BlockUpdate, ProtocolError

from .averaging import Averager, OuterOptimizer, RoundFailed, flatten, unflatten_
from .checkpoints import CheckpointFetcher, CheckpointServer, FetchError

log = logging.getLogger("blocktrain.p2p")

SCHEDULES = ("staggered", "parallel", "sequential")
OUTER_MOMENTUM = "outer.momentum"  # the outer optimizer's buffer, in the checkpoint's optimizer state


@dataclass
class SwarmConfig:
    every: int = 25  # local steps per round (H)
    codec: str = "raw"  # averaging codec: raw, fp16, bf16, int8 (with error feedback)
    outer: str = "sgd"  # sgd | nesterov
    outer_lr: float = 1.0  # with sgd and momentum 0: the plain average of the workers' parameters
    outer_momentum: float = 0.0
    min_coverage: float = 1.0
    max_norm: float = 1e4  # bound on an incoming part's L2 norm
    round_timeout_s: float = 120.0
    schedule: str = "parallel"  # how block k's lower blocks are refreshed (see module doc)
    join_timeout_s: float = 10.0
    lower_timeout_s: float = 3600.0  # how long to wait for the lower blocks' checkpoints
    eval_windows: int = 16  # valid windows for the CE at start and end (CE per GB)
    min_group: int = 1  # wait until this many peers (us included) agreed to train the block together

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"swarm schedule {self.schedule!r}: expected one of {SCHEDULES}")
        if self.outer not in ("sgd", "nesterov"):
            raise ValueError(f"outer optimizer {self.outer!r}: expected sgd or nesterov")
        if self.every < 1:
            raise ValueError("every must be at least 1 local step")

    def outer_optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_lr, self.outer_momentum, self.outer == "nesterov")


@dataclass
class SwarmReport:
    rounds: list = field(default_factory=list)  # per round: coverage, members, departed, seconds, bytes
    failed: list = field(default_factory=list)  # per failed round: the reason
    losses: list = field(default_factory=list)
    catch_up: list = field(default_factory=list)  # checkpoints pulled to join: from, step
    lower: list = field(default_factory=list)  # lower-block refreshes: step, lower steps


class SwarmBlockTrainer:
    """Trains ``trainer``'s block in the group of peers on that block."""

    def __init__(self, peer, trainer, averager: Averager, every: int = 50, outer: OuterOptimizer | None = None):
        self.peer, self.trainer, self.averager = peer, trainer, averager
        self.every = every
        self.outer = outer or OuterOptimizer()
        self.report = SwarmReport()
        self.params = list(trainer.block.parameters())
        self.joined: dict[str, int] = {}  # member -> first round we average with it
        self.begun = 0  # the last round whose group we fixed
        self._replies: dict[str, asyncio.Future] = {}
        self.accepting = False  # whether we answer joins with welcome: from our own join to our end
        self.absent: set[str] = set()  # members that did not answer our join, or were not training
        averager.on_control = self._control

    # --- the group ---------------------------------------------------------------------------
    def candidates(self) -> dict[str, str]:
        """Live training members on our block (peer id -> address), but none that excluded us
        or that we excluded."""
        k, av = self.trainer.k, self.averager
        return {pid: m.info.addr for pid, m in self.peer.members.items()
                if m.state == "alive" and k in m.info.blocks and m.info.role == "train"
                and pid not in av.banned and pid not in av.shunned}

    def group(self, rnd: int | None = None) -> dict[str, str]:
        g = {self.peer.id: self.peer.addr}
        for pid, addr in self.candidates().items():
            if rnd is None or self.joined.get(pid, math.inf) <= rnd:
                g[pid] = addr
        return g

    def _control(self, msg: BlockUpdate, pc, pid: str):
        phase = msg.meta.get("phase")
        if phase == "join":
            self.absent.discard(pid)
            if not self.accepting:  # not training (yet): it must not wait for us
                reply = BlockUpdate(block=msg.block, round=msg.round, meta={"phase": "absent"})
            elif msg.round > self.begun:
                self.joined[pid] = msg.round
                reply = BlockUpdate(block=msg.block, round=msg.round, meta={"phase": "welcome"})
                log.info("block %d: %s joins from round %d", msg.block, pid[:12], msg.round)
            else:
                reply = BlockUpdate(block=msg.block, round=self.begun, meta={"phase": "late"})
            try:
                pc.send_nowait(reply)
            except (ConnectionError, ProtocolError):
                pass
        elif phase in ("welcome", "late", "absent"):
            fut = self._replies.get(pid)
            if fut is not None and not fut.done():
                fut.set_result((phase, msg.round))

    async def join_group(self, rnd: int, timeout_s: float = 10.0, only_new: bool = False) -> list[str]:
        """Agree with every current member (``only_new``: those we have no agreement with) to
        average from round ``rnd``; the members that answered ``late`` (they already began it)."""
        late = []
        self.accepting = True
        members = {pid: a for pid, a in self.candidates().items()
                   if not only_new or (pid not in self.joined and pid not in self.absent)}
        loop = asyncio.get_running_loop()
        self._replies = {pid: loop.create_future() for pid in members}
        for pid, addr in members.items():
            try:
                pc = await self.peer.connection_to(addr)
                pc.send_nowait(BlockUpdate(block=self.trainer.k, round=rnd, meta={"phase": "join"}))
            except (ConnectionError, ProtocolError) as e:
                self._replies[pid].set_result(("unreachable", str(e)))
        done, _ = await asyncio.wait(self._replies.values(), timeout=timeout_s) if members else (set(), set())
        for pid, fut in self._replies.items():
            if fut not in done:
                log.info("block %d: %s did not answer our join", self.trainer.k, pid[:12])
                self.absent.add(pid)
                continue
            phase, _ = fut.result()
            if phase == "welcome":
                self.joined[pid] = rnd
                self.absent.discard(pid)
            elif phase == "late":
                late.append(pid)
            else:  # absent or unreachable: it will ask us itself once it trains
                self.absent.add(pid)
        self._replies = {}
        return late

    async def _repair(self, rnd: int):
        """Views of the group can differ (a join answered ``late`` by some members and
        ``welcome`` by others): after every round, agree again with the members we have no
        agreement with, from the next round; those that were absent ask us themselves."""
        if any(pid not in self.joined and pid not in self.absent for pid in self.candidates()):
            await self.join_group(rnd, timeout_s=2.0, only_new=True)

    # --- training ----------------------------------------------------------------------------
    def round_of(self, step: int) -> int:
        return -(-step // self.every)

    async def run(self, steps: int, on_round=None, before_round=None) -> SwarmReport:
        """Train to ``steps`` local steps. ``before_round()`` runs (awaited) at every round start
        (lower-block refresh); ``on_round(applied)`` after every round (checkpoint)."""
        start = flatten(self.params)
        self.accepting = True
        while self.trainer.step < steps:
            if before_round is not None and self.trainer.step % self.every == 0:
                await before_round()
            loss = await asyncio.to_thread(self.trainer.train_step)
            self.report.losses.append(loss)
            if self.trainer.step % self.every and self.trainer.step < steps:
                continue
            rnd = self.round_of(self.trainer.step)
            self.begun = rnd
            group = self.group(rnd)
            pseudo_grad = start - flatten(self.params)
            if len(group) == 1:
                avg, rep = pseudo_grad, None
            else:
                try:
                    avg, rep = await self.averager.average(rnd, pseudo_grad, group)
                except RoundFailed as e:
                    log.warning("%s; keeping the round's start point", e)
                    self.report.failed.append({"round": rnd, "step": self.trainer.step, "reason": str(e)})
                    if on_round is not None:
                        await on_round(False)
                    await self._repair(rnd + 1)
                    continue
            new = self.outer.step(start, avg)
            unflatten_(self.params, new)
            start = new
            self.report.rounds.append({
                "round": rnd, "step": self.trainer.step, "loss": loss,
                "members": rep.members if rep else [self.peer.id], "coverage": rep.coverage if rep else 1.0,
                "departed": rep.departed if rep else [], "rejected": rep.rejected if rep else [],
                "seconds": round(rep.seconds, 4) if rep else 0.0, "bytes_sent": rep.bytes_sent if rep else 0})
            if on_round is not None:
                await on_round(True)
            await self._repair(rnd + 1)
        self.accepting = False
        return self.report


# ---------------------------------------------------------------------------------------------
# A peer that trains one block in the swarm (``bt-peer join --block K``)


class SwarmPeer:
    """Everything a training peer runs beside its ``Peer``: the block trainer and its group,
    checkpoints served and fetched, the lower blocks' handoff, and the training report."""

    def __init__(self, peer, k: int, mcfg, tcfg, scfg: SwarmConfig, workdir: str | Path, data: torch.Tensor,
                 valid: torch.Tensor, shard: tuple[int, int] | None = None, progress=None):
        from blocktrain.blocks.schedule import make_plans
        from blocktrain.blocks.train import BlockTrainer

        self.peer, self.k, self.mcfg, self.tcfg, self.scfg = peer, k, mcfg, tcfg, scfg
        self.dir = Path(workdir)
        self.valid = valid
        self.progress = progress or (lambda s: None)
        self.trainer = BlockTrainer(mcfg, tcfg, k, data, shard=shard[0] if shard else 0,
                                    num_shards=shard[1] if shard else 1)  # the same initial block on every peer
        if shard is None:  # no shard given: this peer's own stream of random windows over all the data
            from blocktrain.blocks.data import ByteBatches
            self.trainer.batches = ByteBatches(data, tcfg.batch_size, tcfg.seq_len, seed=int(peer.id[:8], 16))
        plans = make_plans("parallel" if scfg.schedule == "sequential" else scfg.schedule, mcfg.n_blocks, tcfg.steps,
                           tcfg.decay_frac)
        self.trainer.lr_plan = (plans[k].decay_start, plans[k].decay_end)
        self.server = CheckpointServer(peer, self.dir / "serve")
        self.fetcher = CheckpointFetcher(peer)
        self.averager = Averager(peer, k, codec=scfg.codec, min_coverage=scfg.min_coverage, max_norm=scfg.max_norm,
                                 timeout_s=scfg.round_timeout_s)
        self.swarm = SwarmBlockTrainer(peer, self.trainer, self.averager, every=scfg.every,
                                       outer=scfg.outer_optimizer())
        self.lower_cache: dict[int, _Lower] = {}  # block -> the newest copy fetched
        self.lower_in_use: dict[int, bytes] = {}  # block -> sha256 of the copy the trainer uses
        self.state = "starting"
        self.ce = {}
        self.saved_step: int | None = None  # step of the checkpoint this run last wrote
        peer.report_extra["training"] = self.training_report

    @property
    def own_path(self) -> Path:
        return self.dir / "serve" / "checkpoint" / f"block{self.k}.safetensors"

    def _holders(self, j: int) -> list[str]:
        return [m.info.addr for pid, m in sorted(self.peer.members.items())
                if m.state == "alive" and j in m.info.blocks and m.info.role == "train"]

    # --- checkpoints -------------------------------------------------------------------------
    def _restore(self, c: ckpt.Checkpoint, source: str):
        self.trainer.restore(c)
        buf = c.optim.get(OUTER_MOMENTUM)
        self.swarm.outer._buf = buf.clone() if buf is not None else None
        log.info("block %d: resumed from %s at step %d", self.k, source, c.step)

    def save(self, final: bool = False):
        c = self.trainer.checkpoint()
        if self.swarm.outer._buf is not None:
            c.optim[OUTER_MOMENTUM] = self.swarm.outer._buf
        c.extra.update(final=final, round=self.swarm.round_of(self.trainer.step), swarm=asdict(self.scfg))
        ckpt.save(c, self.own_path)
        self.saved_step = c.step
        # the input handoff needs the parameters alone
        ckpt.save(ckpt.Checkpoint(c.config, c.block, c.step, c.tensors, extra={"final": final, "round": c.extra["round"]}),
                  self.dir / "serve" / "lower-checkpoint" / f"block{self.k}.safetensors")

    async def catch_up(self) -> bool:
        """Pull the group's latest checkpoint if it is ahead of ours; True if we took it."""
        holders = self._holders(self.k)
        if not holders:
            return False
        try:
            blob = await self.fetcher.fetch(holders, "checkpoint", f"block{self.k}")
        except FetchError as e:  # nobody has written one yet: a fresh group
            log.info("block %d: no checkpoint to catch up from: %s", self.k, e)
            return False
        try:
            c = ckpt.decode(blob, "fetched checkpoint")
        except ckpt.CheckpointError as e:
            log.warning("block %d: fetched checkpoint unusable: %s", self.k, e)
            return False
        if c.step <= self.trainer.step:
            return False
        self._restore(c, "the group's checkpoint")
        self.swarm.report.catch_up.append({"step": c.step, "bytes": len(blob), "time": time.time()})
        return True

    # --- the input handoff -------------------------------------------------------------------
    async def refresh_lower(self, wait: bool) -> bool:
        """Install newer checkpoints of blocks 0..k-1 from their holders; ``wait``: until every one
        is there (and final, for ``sequential``). True if the input changed."""
        if self.k == 0:
            return False
        deadline = time.monotonic() + self.scfg.lower_timeout_s
        while True:
            got, changed = {}, False
            for j in range(self.k):
                c = await self._lower(j)
                if c is not None:
                    got[j] = c
            final_ok = self.scfg.schedule != "sequential" or all(bool(c.extra.get("final")) for c in got.values())
            if len(got) == self.k and final_ok:
                if any(self.lower_in_use.get(j) != c.sha for j, c in got.items()):
                    self.trainer.set_lower([got[j].ck.tensors for j in range(self.k)], [got[j].ck.step for j in range(self.k)])
                    self.lower_in_use = {j: c.sha for j, c in got.items()}
                    changed = True
                    self.swarm.report.lower.append({"step": self.trainer.step, "lower_steps": self.trainer.lower_steps})
                return changed
            if not wait:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"block {self.k}: lower blocks not available within {self.scfg.lower_timeout_s:.0f} s")
            if self.state != "waiting for lower blocks":
                self.progress(f"block {self.k}: waiting for blocks 0..{self.k - 1} from the swarm"
                              + (" (their final checkpoints)" if self.scfg.schedule == "sequential" else ""))
            self.state = "waiting for lower blocks"
            await asyncio.sleep(1.0)

    async def _lower(self, j: int):
        """Block j's newest parameters from its holders (our copy if unchanged), or None."""
        have = self.lower_cache.get(j)
        for addr in self._holders(j):
            if have is not None:
                now = await self.fetcher.probe(addr, "lower-checkpoint", f"block{j}", have.size)
                if now is None:
                    continue
                if now[1] == have.sha:
                    return have
            try:
                blob = await self.fetcher.fetch([addr], "lower-checkpoint", f"block{j}")
                c = ckpt.decode(blob, f"lower block {j} from {addr}")
            except (FetchError, ckpt.CheckpointError) as e:
                log.info("block %d: lower block %d from %s: %s", self.k, j, addr, e)
                continue
            self.lower_cache[j] = _Lower(c, len(blob), hashlib.sha256(blob).digest())
            return self.lower_cache[j]
        return have

    # --- the whole run -----------------------------------------------------------------------
    def eval_ce(self) -> float:
        from blocktrain.blocks.train import eval_chain
        return eval_chain(self.trainer.lower + [self.trainer.block], self.valid, self.tcfg.seq_len,
                          self.scfg.eval_windows)[-1]

    async def run(self, steps: int | None = None) -> dict:
        steps = steps or self.tcfg.steps
        if self.own_path.exists():
            own = ckpt.load(self.own_path)  # a damaged own checkpoint stops us
            self._restore(own, str(self.own_path))
            self.saved_step = own.step
        await asyncio.sleep(2 * self.peer.timeouts.heartbeat_s)  # let gossip bring in the members
        await self.refresh_lower(wait=True)
        self.ce["start"] = await asyncio.to_thread(self.eval_ce)
        for attempt in range(5):
            self.state = "joining"
            await self.catch_up()
            late = await self.swarm.join_group(self.swarm.round_of(self.trainer.step) + 1, self.scfg.join_timeout_s)
            if not late:
                break
            log.info("block %d: %d members already began the round; catching up again", self.k, len(late))
        deadline = time.monotonic() + self.scfg.lower_timeout_s
        while len(self.swarm.group(self.swarm.round_of(self.trainer.step) + 1)) < self.scfg.min_group:
            if self.state != "waiting for the group":
                self.state = "waiting for the group"
                self.progress(f"block {self.k}: waiting until {self.scfg.min_group} peers train this block")
            if time.monotonic() > deadline:
                raise TimeoutError(f"block {self.k}: fewer than {self.scfg.min_group} peers within "
                                   f"{self.scfg.lower_timeout_s:.0f} s")
            await asyncio.sleep(0.2)
        self.state = "training"
        self.progress(f"block {self.k}: training from step {self.trainer.step} to {steps}, group of "
                      f"{len(self.swarm.group(self.swarm.round_of(self.trainer.step) + 1))} peer(s), "
                      f"rounds of {self.scfg.every} steps")

        async def before_round():
            if self.scfg.schedule != "sequential" and self.trainer.step:
                await self.refresh_lower(wait=False)

        async def on_round(applied: bool):
            if applied:
                self.save(final=self.trainer.step >= steps)
            r = self.swarm.report
            last = r.rounds[-1] if applied else r.failed[-1]
            self.progress(f"block {self.k}: step {self.trainer.step}/{steps} loss {r.losses[-1]:.4f} "
                          + (f"round {last['round']}: {len(last['members'])} peer(s), coverage {last['coverage']:.0%}"
                             if applied else f"round {last['round']} FAILED"))
            self.peer.write_report()

        await self.swarm.run(steps, on_round=on_round, before_round=before_round)
        if self.saved_step != self.trainer.step:
            self.save(final=True)  # the last round failed: keep the local result
        self.ce["end"] = await asyncio.to_thread(self.eval_ce)
        self.state = "done"
        self.peer.write_report()
        return self.training_report()

    def training_report(self) -> dict:
        r = self.swarm.report
        t = self.peer.traffic_report()["totals"]
        moved = t["sent"]["wire_bytes"] + t["received"]["wire_bytes"]
        out = {"block": self.k, "state": self.state, "step": self.trainer.step, "steps": self.tcfg.steps,
               "config": {"swarm": asdict(self.scfg), "train": self.tcfg.to_dict(), "model": self.mcfg.to_dict()},
               "rounds": r.rounds, "failed_rounds": r.failed, "catch_up": r.catch_up, "lower_refreshes": r.lower,
               "rejected_updates": [e for e in self.averager.events if e["event"] == "rejected update"],
               "averaging_events": self.averager.events, "excluded_peers": dict(self.averager.banned),
               "excluded_by": dict(self.averager.shunned),
               "ce_start": self.ce.get("start"), "ce_end": self.ce.get("end"), "bytes_moved": moved}
        if "start" in self.ce and "end" in self.ce and moved:
            out["ce_improvement_per_gb"] = (self.ce["start"] - self.ce["end"]) / (moved / 1e9)
        return out


@dataclass
class _Lower:
    ck: ckpt.Checkpoint
    size: int
    sha: bytes

    @property
    def extra(self) -> dict:
        return self.ck.extra
