"""``bt-bench gossip``: hundreds of virtual members of one block, gossip against all-to-all.

A discrete-event simulator in one process, around the real sans-IO code: every round of every
member is an ``AveragingRound`` (p2p/averaging/round.py), fed the real parts its partners' rounds
return, in the order a virtual network delivers them; small groups come from ``gossip_groups``
(gossip.py, rule 10). Only the network and the clock are virtual:

- Each member has an uplink rate and a one-way latency, drawn log-uniform (``--rate-mbit``,
  ``--rtt-ms``: ranges). A part leaves when its sender's uplink is free and arrives its bytes
  over the rate, plus the two ends' latencies halved, later. Downlinks are not contended.
- A local step takes ``--step-ms`` of virtual compute, scaled per member by a log-normal factor
  (sigma 0.3): members are not equally fast.
- No global barrier: a member's round r begins when its own round r - 1 is done and its local
  steps ran; its round ends when its small group's parts came, or at its deadline
  (``round_timeout_s``, 120 s) with what came. Rounds are simulated in order, but their times are
  each member's own; parts that come rounds ahead are not limited (real peers hold two rounds
  ahead, early.py).
- Churn (``--churn``: the fraction of members that leave per minute of virtual time; as many
  join): a leaver crashes at a random moment. One that left before a round's partition is not in
  it; one that leaves before sending its round's parts is silent there, and its partners depart
  it (round.py rule 4) one ``--timeout-s`` after they began: the heartbeat timeout of the
  membership layer. A joiner takes a random member's parameters (their bytes over its rate) and
  is in the first partition after that.
- Membership (``--views own``, the default): each member learns of a change at its own moment,
  as real peers do: of a departure when its heartbeat timeout fires, ``--timeout-s`` after the
  crash plus up to ``--heartbeat-s`` (members last heard the leaver up to one heartbeat apart);
  of a join up to two heartbeats after the joiner took its state (the membership gossip). Each
  member partitions its own view: a view one member apart puts some members (one or two small
  groups; about half where the count of small groups changes) in other small groups than the
  others compute, so their parts carry another ``group`` digest; the receiver departs the sender
  and tells it ``absent`` (both ways), and the round goes on without it (a gossip round,
  PROTOCOL r6.14; an all-to-all round fails by driver.py's rule 9, up to ``MISMATCH_ROUNDS``
  since the member's view of the group last changed). A crashed member still in a view is a
  silent partner there. A part that comes after the receiver's round ended is answered
  ``absent`` only if it carries another digest; the driver also answers one of the same view
  once the receiver has begun its next round (not simulated: slightly optimistic).
  ``--views shared``: every member holds one view, departures known at once and joins after
  their state transfer (the optimistic bound, and the model before views).
- Attackers average honestly themselves (they take their round's result) and send their own
  update reversed (``flip``) or 8 times as large (``x8``) to their partners.

The model is a small byte-level MLP (the previous 4 bytes, an embedding of 16 each, a hidden
layer, 256 logits; about 45 k parameters), one per member, trained by AdamW on its own random
windows of WikiText-2 (train split), H local steps a round; all members' models are one batched
tensor, so a step of 256 members is one batched matmul. A round averages the members' parameters
(gossip averages parameters: rule 10). Loss is each honest member's own model on a fixed sample
of the validation split, averaged over members; the consensus distance is the root mean square
distance of the members' parameter vectors from their mean, also relative to that mean's norm.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from blocktrain.blocks.data import load_split
from blocktrain.p2p.averaging import AveragingRound, RoundFailed, RoundSpec
from blocktrain.p2p.averaging.round import GroupMismatch
from blocktrain.p2p.averaging.driver import MISMATCHED, mismatches_within_allowance, outliers_in_a_row
from blocktrain.p2p.averaging.gossip import check_gossip_codec, gossip_groups, gossip_start

from .options import BadOption

CONTEXT = 4  # previous bytes the model sees
EMBED = 16
HIDDEN = 128
ATTACKS = ("flip", "x8")
VIEWS = ("own", "shared")


@dataclass
class SimConfig:
    members: int = 16
    mode: str = "gossip"  # or "all": one round of every member
    size: int = 4  # gossip: small groups of about size + 1 (3 to 2 x size + 1)
    rounds: int = 40
    local_steps: int = 8  # H: local steps between rounds
    batch: int = 32
    lr: float = 1e-2
    codec: str = "raw"
    aggregate: str = "robust"
    churn: float = 0.0  # fraction of members leaving (and as many joining) per minute of virtual time
    timeout_s: float = 5.0  # a silent partner is departed this long after a member began its round
    views: str = "own"  # "own": each member learns of a join or departure at its own moment; "shared": at once
    heartbeat_s: float = 1.0  # spread of the moments members learn of a change (views "own")
    round_timeout_s: float = 120.0  # a round not done by then ends with what came (swarm.round_timeout_s)
    step_ms: float = 200.0  # virtual compute per local step (median)
    rtt_ms: tuple = (10.0, 200.0)  # log-uniform range of a member's round trip
    rate_mbit: tuple = (10.0, 1000.0)  # log-uniform range of a member's uplink
    attackers: int = 0
    attack: str = "flip"
    eval_every: int = 5
    eval_windows: int = 4096  # validation positions of the loss
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("gossip", "all"):
            raise ValueError(f"mode {self.mode!r}: expected gossip or all")
        if self.mode == "gossip":
            check_gossip_codec(self.codec)
        if self.attack not in ATTACKS:
            raise ValueError(f"attack {self.attack!r}: expected one of {ATTACKS}")
        if self.views not in VIEWS:
            raise ValueError(f"views {self.views!r}: expected one of {VIEWS}")
        if not 0 <= self.attackers < self.members:
            raise ValueError(f"{self.attackers} attackers among {self.members} members")
        if self.members < 2:
            raise ValueError("at least 2 members")


class BatchedMLP:
    """One small model per row of ``params`` (rows, n): all members' steps in one batched pass."""

    def __init__(self, rows: int, gen: torch.Generator):
        shapes = {"emb": (256, EMBED), "w1": (CONTEXT * EMBED, HIDDEN), "b1": (HIDDEN,),
                  "w2": (HIDDEN, 256), "b2": (256,)}
        self.slices, at = {}, 0
        for name, shape in shapes.items():
            self.slices[name] = (at, at + math.prod(shape), shape)
            at += math.prod(shape)
        self.n = at
        one = torch.empty(at)
        for name, (a, b, shape) in self.slices.items():  # every member starts from the same point
            fan_in = shape[0] if name in ("w1", "w2") else 1
            one[a:b] = torch.randn(b - a, generator=gen) * (0.02 if name == "emb" else fan_in ** -0.5) \
                if not name.startswith("b") else 0.0
        self.params = one.repeat(rows, 1)
        self.m = torch.zeros_like(self.params)  # AdamW moments and step counts, per row
        self.v = torch.zeros_like(self.params)
        self.t = torch.zeros(rows)

    def _views(self, p: torch.Tensor) -> dict:
        return {name: p[:, a:b].view(p.shape[0], *shape) for name, (a, b, shape) in self.slices.items()}

    def loss(self, p: torch.Tensor, ctx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-row mean cross-entropy (rows,) of ``ctx`` (rows, B, CONTEXT) -> ``y`` (rows, B)."""
        w = self._views(p)
        rows, B = y.shape
        emb = torch.gather(w["emb"], 1, ctx.reshape(rows, -1, 1).expand(-1, -1, EMBED))  # (rows, B*C, E)
        h = F.gelu(torch.baddbmm(w["b1"][:, None], emb.reshape(rows, B, CONTEXT * EMBED), w["w1"]))
        logits = torch.baddbmm(w["b2"][:, None], h, w["w2"])  # (rows, B, 256)
        return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none").view(rows, B).mean(1)

    def step(self, ctx: torch.Tensor, y: torch.Tensor, lr: float, betas=(0.9, 0.99), eps: float = 1e-8) -> torch.Tensor:
        """One Adam step of every row (each row its own model, its own moments and step count)."""
        p = self.params.requires_grad_(True)
        losses = self.loss(p, ctx, y)
        losses.sum().backward()
        g = p.grad
        assert g is not None, "the batched loss depends on every row"
        with torch.no_grad():
            self.t += 1
            self.m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            self.v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            denom = (self.v / (1 - betas[1] ** self.t)[:, None]).sqrt_().add_(eps)
            p.addcdiv_(self.m, denom * (1 - betas[0] ** self.t)[:, None], value=-lr)
        p.grad = None
        self.params = p.detach()
        return losses.detach()

    def keep(self, rows: list[int]) -> None:
        """Only ``rows``, in that order (members that left are dropped)."""
        idx = torch.tensor(rows, dtype=torch.long)
        self.params, self.m, self.v, self.t = self.params[idx], self.m[idx], self.v[idx], self.t[idx]

    def add_row(self, like: int) -> int:
        """A joiner's row: ``like``'s parameters, fresh optimizer state."""
        self.params = torch.cat([self.params, self.params[like:like + 1].clone()])
        self.m = torch.cat([self.m, torch.zeros(1, self.n)])
        self.v = torch.cat([self.v, torch.zeros(1, self.n)])
        self.t = torch.cat([self.t, torch.zeros(1)])
        return self.params.shape[0] - 1


@dataclass
class Member:
    pid: str
    row: int
    rate_bps: float  # uplink, bytes per second
    latency_s: float  # one way, its half of every link it is on
    speed: float  # compute time factor
    ready: float = 0.0  # when its next round begins (virtual seconds)
    done: float = 0.0  # when its last round ended
    leaves: float = math.inf  # when it crashes
    attacker: bool = False
    residual: torch.Tensor | None = None  # a lossy codec's error feedback


@dataclass
class RoundStats:
    round: int
    members: int
    groups: int
    bytes_per_member: float
    wait_s: float  # median over members of (round end - round begin): the exchange and the waiting
    time_s: float  # median member's round end (virtual)
    silent: int = 0
    mismatched: int = 0  # honest members whose round saw a partner with another view of the group
    blocked_s: float = 0.0  # the longest an honest member waited past its live partners' readiness (silent partner)
    failed: int = 0  # honest members whose round failed (nothing applied)
    loss: float | None = None
    consensus: float | None = None
    consensus_rel: float | None = None
    named: int = 0  # honest members that rejected an attacker (so far)
    honest_excluded: int = 0  # exclusions (events) of an honest member by an honest one, so far: wrongly named


@dataclass
class SimResult:
    config: SimConfig
    rounds: list = field(default_factory=list)
    final_loss: float = math.nan
    final_consensus: float = math.nan
    joined: int = 0
    left: int = 0


def _components(groups_of: dict) -> list[dict]:
    """``groups_of`` (member -> the small group it computed) cut where no member's small group
    reaches another's: parts never cross between them, so each is one exchange (one small group
    each where the members' views agree)."""
    root = {p: p for g in groups_of.values() for p in g}

    def find(p: str) -> str:
        while root[p] != p:
            root[p] = root[root[p]]
            p = root[p]
        return p
    for g in groups_of.values():
        for p in g[1:]:
            root[find(p)] = find(g[0])
    parts: dict[str, dict] = {}
    for pid, g in groups_of.items():
        parts.setdefault(find(pid), {})[pid] = g
    return list(parts.values())


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


class _Deliveries:
    """The messages of one exchange in virtual time: each sender's uplink (a part leaves once the
    ones before it are serialized at its rate), the bytes each sent, and a heap of deliveries
    (time, order queued, receiver, sender, message)."""

    def __init__(self, members: dict, rounds: dict, gone: set):
        self.members, self.rounds, self.gone = members, rounds, gone
        self.uplink = {pid: members[pid].ready for pid in rounds}
        self.nbytes = dict.fromkeys(rounds, 0)
        self.told: set[tuple[str, str]] = set()  # (receiver, sender): told absent once a round
        self.heap: list = []
        self.seq = 0

    def push(self, at: float, dst: str, src: str, msg) -> None:
        heapq.heappush(self.heap, (at, self.seq, dst, src, msg))
        self.seq += 1

    def send(self, src: str, parts, now: float) -> None:
        for p in parts:
            if p.peer not in self.rounds and p.peer not in self.gone:
                continue
            start = max(now, self.uplink[src])
            self.uplink[src] = start + p.stored_bytes / self.members[src].rate_bps
            self.nbytes[src] += p.stored_bytes
            if p.peer in self.rounds:  # a member that is gone: what is sent to it goes nowhere
                self.push(self.uplink[src] + self.members[src].latency_s + self.members[p.peer].latency_s, p.peer,
                          src, p.msg)

    def tell_absent(self, dst: str, src: str, now: float) -> None:
        if (dst, src) not in self.told:
            self.told.add((dst, src))
            self.push(now + self.members[dst].latency_s + self.members[src].latency_s, src, dst, "absent")


class Simulation:
    def __init__(self, cfg: SimConfig, train: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.train = load_split("train") if train is None else train
        valid = load_split("valid") if valid is None else valid
        pos = torch.randint(CONTEXT, valid.numel(), (cfg.eval_windows,), generator=self.gen)
        self.eval_ctx = valid[pos[:, None] + torch.arange(-CONTEXT, 0)[None]].long()
        self.eval_y = valid[pos].long()
        self.model = BatchedMLP(cfg.members, self.gen)
        self.members: dict[str, Member] = {}
        self.roster: dict[str, list] = {}  # views "own": every id ever in -> [joined (None: from the start), crashed]
        self.next_id = 0
        for i in range(cfg.members):
            self._new_member(i, 0.0, attacker=i < cfg.attackers)
        # the next join (as many join as leave, on average); drawn after the members, as before
        self._next_join = self.rng.expovariate(cfg.churn * cfg.members / 60) if cfg.churn > 0 else math.inf
        self.result = SimResult(cfg)
        self.named: set[str] = set()  # honest members that rejected an attacker
        self.honest_excluded = 0  # exclusions of an honest member by an honest one
        self.banned: dict[str, set[str]] = {}  # member -> ids it rejected (excluded from its rounds)
        self.streak: dict[str, dict[str, int]] = {}  # member -> other -> suspect rounds in a row
        # Views "own": the moments each member learns of a change (drawn on first use, from a generator
        # of their own so that the rest of the run draws as with one view); rule 9's counts per member.
        self._lag_rng = random.Random(cfg.seed + 7919)
        self._lags: dict[str, dict[tuple, float]] = {}  # member -> (who, kind) -> lag
        self._mismatches: dict[str, dict] = {}  # member -> its rule-9 count (mismatches_within_allowance)

    def _new_member(self, row: int, t: float, attacker: bool = False) -> Member:
        pid = f"{self.next_id:04d}" + f"{self.rng.getrandbits(48):012x}"
        self.next_id += 1
        c = self.cfg
        rtt = _log_uniform(self.rng, *c.rtt_ms) / 1000
        m = Member(pid, row, _log_uniform(self.rng, *c.rate_mbit) * 1e6 / 8, rtt / 4, math.exp(self.rng.gauss(0, 0.3)),
                   ready=t, done=t, attacker=attacker)
        if c.churn > 0:
            m.leaves = t + self.rng.expovariate(c.churn / 60)  # each member leaves at rate churn per minute
        self.members[pid] = m
        self.roster[pid] = [None, math.inf]
        return m

    # --- local steps ------------------------------------------------------------------------
    def _local_steps(self, rnd: int) -> dict:
        """H local steps of every member (rows of the batched model), each on its own windows.
        Returns every member's start point: what an attacker's attack moves from, and what a
        member's robust round measures its partners' updates from (``origin``, as the driver's)."""
        live = sorted(self.members.values(), key=lambda m: m.row)
        self.model.keep([m.row for m in live])  # the rows of members that left go
        for i, m in enumerate(live):
            m.row = i
        before = self.model.params.clone()
        starts = {m.pid: before[m.row] for m in live}
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + rnd)
        for _ in range(self.cfg.local_steps):
            pos = torch.randint(CONTEXT, self.train.numel(), (len(live), self.cfg.batch), generator=g)
            ctx = self.train[pos[..., None] + torch.arange(-CONTEXT, 0)].long()
            self.model.step(ctx, self.train[pos].long(), self.cfg.lr)
        return starts

    # --- one round --------------------------------------------------------------------------
    def round(self, rnd: int) -> RoundStats:
        c = self.cfg
        live = sorted(self.members.values(), key=lambda m: m.pid)
        t_partition = min(self._ready_at(m) for m in live)
        for m in [m for m in live if m.leaves <= t_partition]:  # left before the partition: not in it
            self._leave(m)
        self._joins(t_partition, [m for m in live if m.pid in self.members])
        live = sorted(self.members.values(), key=lambda m: m.pid)
        for m in live:
            m.ready = self._ready_at(m)
        starts = self._local_steps(rnd)
        silent = {m.pid for m in live if m.leaves < m.ready}  # crashes before sending this round's parts
        views = self._views(live, silent)
        memo: dict[tuple, list] = {}
        groups_of: dict[str, list[str]] = {}  # each member's own small group, from its own view
        for pid, view in views.items():
            if view not in memo:
                memo[view] = gossip_groups(view, rnd, c.size, salt="sim") if c.mode == "gossip" else [list(view)]
            groups_of[pid] = next(g for g in memo[view] if pid in g)
        sent_bytes: dict[str, int] = {}
        stats = RoundStats(rnd, len(live), len({tuple(g) for g in groups_of.values()}), 0.0, 0.0, 0.0,
                           silent=len(silent))
        waits, ends, done = [], [], {}
        for part in _components(groups_of):  # members whose small groups overlap, one exchange each
            done.update(self._exchange(part, rnd, views, starts))  # (memory: a lossy round's at a time)
        for pid, (end, nbytes, blocked, failed, mismatched) in done.items():
            m = self.members[pid]
            waits.append(end - m.ready)
            ends.append(end)
            m.done = end
            sent_bytes[pid] = nbytes
            if not m.attacker:  # what the honest members suffered
                stats.blocked_s = max(stats.blocked_s, blocked)
                stats.failed += failed
                stats.mismatched += mismatched
        for pid in silent:
            self._leave(self.members[pid])
        stats.bytes_per_member = statistics.fmean(sent_bytes.values()) if sent_bytes else 0.0
        stats.wait_s = statistics.median(waits) if waits else 0.0
        stats.time_s = statistics.median(ends) if ends else 0.0
        stats.named, stats.honest_excluded = len(self.named), self.honest_excluded
        return stats

    def _ready_at(self, m: Member) -> float:
        """When ``m``'s next round begins: its last round's end, then its local steps."""
        return m.done + self.cfg.local_steps * self.cfg.step_ms / 1000 * m.speed

    def _leave(self, m: Member) -> None:
        del self.members[m.pid]
        self.roster[m.pid][1] = m.leaves
        self.result.left += 1

    def _views(self, live: list[Member], silent: set) -> dict[str, tuple]:
        """The group as each member that runs this round sees it as the round begins (sorted ids):
        with views "shared", the live members; with "own", those it has learned of (rules above)."""
        c = self.cfg
        if c.views == "shared":
            ids = tuple(m.pid for m in live)
            return {m.pid: ids for m in live if m.pid not in silent}
        t0 = min(m.ready for m in live)
        for pid, (_, left) in list(self.roster.items()):  # every member learned of it: forgotten
            if left + c.timeout_s + c.heartbeat_s < t0:
                del self.roster[pid]
                self._lags.pop(pid, None)
                for lags in self._lags.values():  # it observes nothing more either
                    lags.pop((pid, "join"), None)
                    lags.pop((pid, "left"), None)
        return {m.pid: tuple(p for p in sorted(self.roster) if p == m.pid or self._knows(m.pid, p, m.ready))
                for m in live if m.pid not in silent}

    def _knows(self, who: str, pid: str, t: float) -> bool:
        """Whether ``who`` counts ``pid`` in the group at ``t``: it learned of its join (up to two
        heartbeats after it) and not yet of its crash (the heartbeat timeout, up to one heartbeat
        more)."""
        joined, left = self.roster[pid]
        if joined is not None and t < joined + self._lag(who, pid, "join", 2 * self.cfg.heartbeat_s):
            return False
        return left == math.inf or t < left + self.cfg.timeout_s + self._lag(who, pid, "left", self.cfg.heartbeat_s)

    def _lag(self, who: str, pid: str, kind: str, most: float) -> float:
        """When ``who`` learns of ``pid``'s ``kind`` of change, after it (drawn once; kept while
        ``pid`` is in the roster)."""
        lags = self._lags.setdefault(pid, {})
        if (who, kind) not in lags:
            lags[who, kind] = self._lag_rng.uniform(0, most)
        return lags[who, kind]

    def _joins(self, t: float, live: list[Member]) -> None:
        """Joiners up to ``t`` (as many as leave, on average): each takes a random live member's
        parameters over its own link and is in from the first partition after."""
        c = self.cfg
        if c.churn <= 0 or not live:
            return
        while self._next_join <= t:
            sponsor = self.rng.choice(live)
            row = self.model.add_row(sponsor.row)
            m = self._new_member(row, self._next_join)
            m.done = self._next_join + self.model.n * 4 / min(m.rate_bps, sponsor.rate_bps) + m.latency_s + sponsor.latency_s
            m.done = max(m.done, t)
            self.roster[m.pid][0] = m.done  # the others learn of it from then on
            self.result.joined += 1
            self._next_join += self.rng.expovariate(c.churn * c.members / 60)

    def _vector(self, m: Member, starts: dict) -> torch.Tensor:
        x = self.model.params[m.row]
        if not m.attacker:
            return x
        s = starts[m.pid]  # its round's start: the update it took is s - x
        return s + (x - s) * (-1.0 if self.cfg.attack == "flip" else 8.0)

    def _exchange(self, groups_of: dict, rnd: int, views: dict, starts: dict) -> dict:
        """Every member's round (``groups_of``: the small group it computed), message by message in
        virtual time. A member of a small group that does not run this round (crashed, or crashes
        before sending) is a silent partner; a part whose ``group`` digest is not the receiver's is
        answered ``absent`` (rule 9). Returns, per member: (its round's end, bytes it sent, how long
        a silent partner held it past its live partners' readiness, 1 if its round failed, 1 if it
        saw another view of the group)."""
        rounds = self._open_rounds(groups_of, rnd, starts)
        gone = set().union(*groups_of.values()) - set(rounds)  # in a small group, not running this round
        net = _Deliveries(self.members, rounds, gone)
        end = self._start_rounds(net, self._exclusions(rounds))
        self._deliver(net, end)
        return self._close_rounds(rounds, net.nbytes, end, views)

    def _open_rounds(self, groups_of: dict, rnd: int, starts: dict) -> dict[str, AveragingRound]:
        """The sans-IO round of every member running this round, on its small group."""
        c = self.cfg
        rounds: dict[str, AveragingRound] = {}
        for pid, group in groups_of.items():
            m = self.members[pid]
            rounds[pid] = AveragingRound(pid, 0, rnd, group, self._vector(m, starts),
                                         RoundSpec(codec=c.codec, aggregate=c.aggregate, min_coverage=1.0),
                                         start=gossip_start("sim") if c.mode == "gossip" else "all",
                                         residual=m.residual, origin=starts[pid])
        return rounds

    def _exclusions(self, rounds: dict[str, AveragingRound]) -> dict[str, list]:
        """What each member sends as its round begins: a member we excluded departs our round at
        once, and hears that it is excluded and stops waiting for us (as the driver's _feed: the
        parts it returns are sent)."""
        first: dict[str, list] = {pid: [] for pid in rounds}
        for pid, r in rounds.items():
            for other in self.banned.get(pid, set()) & set(rounds) & set(r.ids):
                first[pid] += r.depart(other, "excluded", relay=False)
                if pid in rounds[other].ids:
                    first[other] += rounds[other].depart(pid, "excluded us", relay=False)
        return first

    def _start_rounds(self, net: _Deliveries, first: dict[str, list]) -> dict[str, float]:
        """Every round's first parts sent as its member is ready, the heartbeat timeout of each
        silent partner and the round's deadline queued; each round's end (inf: not yet)."""
        end = {pid: math.inf for pid in net.rounds}
        for pid, r in net.rounds.items():
            ready = self.members[pid].ready
            net.send(pid, first[pid] + r.start(), ready)
            for s in net.gone & set(r.ids):  # the heartbeat timeout departs it
                net.push(ready + self.cfg.timeout_s, pid, s, None)
            net.push(ready + self.cfg.round_timeout_s, pid, "", None)  # its deadline
            if r.done:
                end[pid] = ready
        return end

    def _deliver(self, net: _Deliveries, end: dict[str, float]) -> None:
        """Every queued message in time order, into its receiver's round; what the round answers
        is sent on; ``end`` records when each round finished."""
        while net.heap:
            now, _, dst, src, msg = heapq.heappop(net.heap)
            r = net.rounds[dst]
            if r.done:  # a part of another view after our round ended: we are not in its round (driver.py)
                if msg is not None and not isinstance(msg, str) and msg.meta.get("group") != r.group:
                    net.tell_absent(dst, src, now)
                continue
            if msg is None and not src:  # the round's deadline (the driver's round_timeout_s): what came
                net.send(dst, r.expire(), now)  # is averaged, the coverage says what is missing
                end[dst] = now
                continue
            if msg is None:
                out = r.depart(src, "silent past the timeout")
            elif isinstance(msg, str):  # the sender's absent: we are not in its round's group
                out = r.mismatch(src, MISMATCHED[1])
            elif msg.meta.get("group") != r.group:  # the driver's check (rule 9): another view of the group
                out = r.mismatch(src, MISMATCHED[0])
                net.tell_absent(dst, src, now)
            else:
                out = r.receive(src, msg)
            net.send(dst, out, now)
            if r.done:
                end[dst] = now

    def _close_rounds(self, rounds: dict[str, AveragingRound], nbytes: dict[str, int], end: dict[str, float],
                      views: dict) -> dict:
        """Each finished round applied as the driver does (rejections, suspicions, rule 9, then the
        average or, failed, the feedback undone): per member, what ``_exchange`` returns."""
        out = {}
        for pid, r in rounds.items():
            m = self.members[pid]
            assert r.done, "every round is done by its deadline"
            failed = 0
            for rej in r.rejected:  # as the driver: rejections as they come, suspicions, then rule 9
                self._reject(pid, rej["peer"])
            self._suspicions(pid, r)
            try:
                self._rule9(pid, views[pid], r)
                vec, _ = r.result()
                self.model.params[m.row] = vec  # an attacker too: it averages honestly itself
            except RoundFailed:
                r.undo_feedback()
                failed = 1
            m.residual = r.residual
            live = [self.members[p].ready for p in r.ids if p in rounds]
            blocked = end[pid] - max(live) if r.departed else 0.0  # a partner silent, of another view, excluded
            out[pid] = (end[pid], nbytes[pid], blocked, failed, int(bool(r.mismatched)))
        return out

    def _rule9(self, pid: str, view: tuple, r: AveragingRound) -> None:
        """The driver's rule 9, in all-to-all rounds: the round fails (GroupMismatch) when a member
        saw another group in it and, since ``pid``'s view of the whole group last changed, in at
        most MISMATCH_ROUNDS rounds. A gossip round goes on without it (rule 10, r6.14)."""
        if self.cfg.mode == "gossip":
            return
        tolerated = mismatches_within_allowance(r, view, self._mismatches.setdefault(pid, {}))
        if tolerated:
            raise GroupMismatch(0, r.round, tolerated, frozenset(r.silent()))

    def _reject(self, pid: str, other: str) -> None:
        self.banned.setdefault(pid, set()).add(other)
        if other in self.members and not self.members[pid].attacker:
            if self.members[other].attacker:
                self.named.add(pid)
            else:
                self.honest_excluded += 1

    def _suspicions(self, pid: str, r: AveragingRound) -> None:
        """The driver's rule 6: a partner that was a suspect in SUSPECT_ROUNDS rounds in a row that
        they shared is excluded."""
        for other, _ in outliers_in_a_row(r, pid, self.streak.setdefault(pid, {})):
            self._reject(pid, other)

    # --- measures -----------------------------------------------------------------------------
    def honest(self) -> list[Member]:
        return [m for m in sorted(self.members.values(), key=lambda m: m.pid) if not m.attacker]

    @torch.no_grad()
    def loss(self) -> float:
        hon = self.honest()
        rows = torch.tensor([m.row for m in hon])
        p = self.model.params[rows]
        total = torch.zeros(len(hon))
        n = self.eval_y.numel()
        for a in range(0, n, 1024):
            ctx, y = self.eval_ctx[a:a + 1024], self.eval_y[a:a + 1024]
            total += self.model.loss(p, ctx.expand(len(hon), -1, -1), y.expand(len(hon), -1)) * y.numel()
        return float((total / n).mean())

    @torch.no_grad()
    def consensus(self) -> tuple[float, float]:
        p = self.model.params[torch.tensor([m.row for m in self.honest()])]
        mean = p.mean(0)
        d = float(((p - mean) ** 2).sum(1).mean().sqrt())
        return d, d / float(mean.norm())

    def run(self, progress=None) -> SimResult:
        c = self.cfg
        for rnd in range(1, c.rounds + 1):
            st = self.round(rnd)
            if rnd % c.eval_every == 0 or rnd == c.rounds:
                st.loss = self.loss()
                st.consensus, st.consensus_rel = self.consensus()
            self.result.rounds.append(st)
            if progress is not None:
                progress(st)
        self.result.final_loss = self.result.rounds[-1].loss or math.nan
        self.result.final_consensus = self.result.rounds[-1].consensus_rel or math.nan
        return self.result


def simulate(cfg: SimConfig, progress=None, train=None, valid=None) -> SimResult:
    return Simulation(cfg, train, valid).run(progress)


# All-to-all references above this many members average with the plain mean: a robust round of W
# members has every member compute every piece from W parts (rule 6), W^2 x P parts per round in
# this one process (64 members: minutes a round), where the mean's reduce-scatter sends 2 W P.
ROBUST_ALL_MAX = 16


def _summary(res: SimResult, target: float | None) -> dict:
    rows = res.rounds
    evals = [r for r in rows if r.loss is not None]
    reach = next((r for r in evals if target is not None and r.loss <= target), None)
    return {
        "mode": res.config.mode, "aggregate": res.config.aggregate, "attackers": res.config.attackers,
        "bytes_per_member_per_round": statistics.median(r.bytes_per_member for r in rows),
        "consensus_distance": res.final_consensus,
        "consensus_distance_max": max(r.consensus_rel for r in evals),
        "loss": res.final_loss,
        "time_s": rows[-1].time_s,
        "round_wait_s": statistics.median(r.wait_s for r in rows),
        "max_blocked_s": max(r.blocked_s for r in rows),
        "silent": sum(r.silent for r in rows), "failed_rounds": sum(r.failed for r in rows),
        "mismatched_rounds": sum(r.mismatched for r in rows),
        "member_rounds": sum(r.members - r.silent for r in rows),
        "joined": res.joined, "left": res.left, "named_by": rows[-1].named,
        "honest_excluded_by_honest": rows[-1].honest_excluded,
        "target_loss": target, "rounds_to_target": reach.round if reach else None,
        "time_to_target_s": reach.time_s if reach else None,
        "curve": [{"round": r.round, "loss": r.loss, "consensus_distance": r.consensus_rel, "time_s": r.time_s}
                  for r in evals],
    }


def bench(sizes: list[int], all_sizes: list[int], base: SimConfig, target_loss: float | None = None,
          progress=None) -> dict:
    """Per size: gossip and, at ``all_sizes``, all-to-all (robust up to ROBUST_ALL_MAX members, the
    mean above), and with attackers the honest gossip run beside; the same seed and data for all."""
    train, valid = load_split("train"), load_split("valid")
    out: dict = {"config": {k: v for k, v in asdict(base).items() if k not in ("members", "mode")},
                 "robust_all_max": ROBUST_ALL_MAX, "sizes": []}
    for W in sizes:
        runs = {"gossip": replace(base, members=W, mode="gossip")}
        if W in all_sizes:
            runs["all_to_all"] = replace(base, members=W, mode="all", attackers=0, churn=0.0,
                                         aggregate=base.aggregate if W <= ROBUST_ALL_MAX else "mean")
        if base.attackers:
            runs["honest"] = replace(base, members=W, mode="gossip", attackers=0)
        done = {}
        for name, cfg in runs.items():
            done[name] = simulate(cfg, progress and (lambda st, n=name, w=W: progress(w, n, st)), train, valid)
        target = target_loss
        if target is None and "all_to_all" in done:
            target = done["all_to_all"].final_loss + 0.02
        entry = {"members": W, **_summary(done.pop("gossip"), target)}
        for name, res in done.items():
            entry[name] = _summary(res, target)
        out["sizes"].append(entry)
    b = [s["bytes_per_member_per_round"] for s in out["sizes"]]
    out["bytes_spread"] = max(b) / min(b) if b else None
    return out


def check_sizes(sizes: list[int], members: str) -> None:
    """``bt-bench gossip``'s sizes (``members`` as given): each 4..1024 members. Raises BadOption."""
    if not sizes or any(not 4 <= w <= 1024 for w in sizes):
        raise BadOption(f"{members!r}: sizes of 4..1024 members", "--members")


def check_attackers(attackers: int, sizes: list[int]) -> None:
    """Fewer attackers than the members of the smallest size. Raises BadOption."""
    if attackers and attackers >= min(sizes):
        raise BadOption(f"{attackers} attackers need more members than that", "--attackers")


def report(result: dict) -> list[str]:
    """``bt-bench gossip``'s report of ``bench``'s result: a row per run of every size, then the
    spread of the bytes a member sends."""
    lines = [f"{'members':>7} {'run':<11} {'kB/member/round':>15} {'consensus':>9} {'CE':>7} {'to target':>9} "
             f"{'time s':>8} {'blocked s':>9}"]
    for s in result["sizes"]:
        for name, run in [("gossip", s), *((k, s[k]) for k in ("all_to_all", "honest") if k in s)]:
            lines.append(f"{s['members']:>7} {name:<11} {run['bytes_per_member_per_round'] / 1e3:>15,.1f} "
                         f"{run['consensus_distance']:>9.4f} {run['loss']:>7.4f} {str(run['rounds_to_target']):>9} "
                         f"{run['time_s']:>8.1f} {run['max_blocked_s']:>9.2f}")
    return lines + [f"per-member bytes, largest / smallest size: {result['bytes_spread']:.2f}x"]


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in result["sizes"]:
        for name, run in [("gossip", s), *((k, s[k]) for k in ("all_to_all", "honest") if k in s)]:
            c = run["curve"]
            ls = "-" if name == "gossip" else "--" if name == "all_to_all" else ":"
            label = f"{s['members']} members, {name.replace('_', '-')}"
            a1.plot([r["round"] for r in c], [r["consensus_distance"] for r in c], ls, label=label)
            a2.plot([r["round"] for r in c], [r["loss"] for r in c], ls, label=label)
    a1.set_yscale("log")
    a1.set_xlabel("round")
    a1.set_ylabel("consensus distance (RMS / |mean|)")
    a2.set_xlabel("round")
    a2.set_ylabel("validation CE (mean over members)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle("Gossip in small changing groups vs all-to-all (simulated members, real rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
