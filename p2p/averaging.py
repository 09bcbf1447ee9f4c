"""Same-block averaging over the protocol: reduce-scatter + all-gather among a group of peers.

Rules:
- A group is the sorted peer ids of the peers on one block; the flat float32 vector of a round
  is cut into P >= group size pieces of at most PIECE_FLOATS, piece j owned by member j mod R.
  Phase 1 (reduce): every member sends piece j to its owner. Phase 2 (gather): the owner
  averages what it received and sends the average of piece j to everyone. Every message is a BlockUpdate(block, round, codec, [part])
  with meta {"phase", "part", "contributors"}.
- Every incoming part is validated before use: name, shape, dtype, finite values, norm bound.
  A sender whose part fails is excluded from this and every later round, the event is kept for
  the report, and the sender is told (phase ``excluded``): it stops waiting for us. Nothing is silently dropped: a missing part leaves a hole in the coverage.
- A member that leaves mid-round (its connection closes, or the swarm declares it dead) is
  dropped from the round: the pieces it owned move to the live members (the same rule at every
  member: live member j mod R'), everyone re-sends its part there, and the round finishes with
  the others. The report lists it under ``departed``; coverage counts the live members.
- Each round reports its coverage: for every part, which peers contributed; the fraction of
  the vector averaged over everyone who should have. Below ``min_coverage`` the round raises
  ``RoundFailed`` and nothing is applied.
- Lossy codecs (fp16, bf16, int8) keep the rounding error of what this peer sent and add it to
  the next round's input (error feedback).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from blocktrain.protocol import BlockUpdate, Codec, ProtocolError

from .tensors import from_wire, to_wire

log = logging.getLogger("blocktrain.p2p")


# BlockUpdate phases that manage the group rather than carry a round's parts (see swarm.py).
CONTROL_PHASES = ("join", "welcome", "late", "absent", "excluded")

# Floats per message: 1M float32 = 4 MiB, well inside a frame (MAX_FRAME_BYTES is 16 MiB).
PIECE_FLOATS = 1 << 20


class RoundFailed(Exception):
    """A round's coverage fell below the threshold; nothing was averaged."""


@dataclass
class RoundReport:
    round: int
    members: list
    coverage: float  # fraction of the vector averaged over every expected member
    parts: list  # per part: {"owner", "contributors", "ok"}
    rejected: list = field(default_factory=list)  # {"peer", "reason"}
    seconds: float = 0.0
    bytes_sent: int = 0
    departed: list = field(default_factory=list)  # members that left mid-round (the others finished)


class Averager:
    def __init__(self, peer, block: int, codec: str = "raw", min_coverage: float = 1.0,
                 max_norm: float = 1e6, timeout_s: float = 30.0):
        self.peer, self.block = peer, block
        self.codec = Codec(codec)
        self.min_coverage, self.max_norm, self.timeout_s = min_coverage, max_norm, timeout_s
        self.banned: dict[str, str] = {}  # peer id -> why
        self.shunned: dict[str, str] = {}  # peers that excluded us -> their reason
        self.events: list[dict] = []
        self._inbox: dict[tuple, asyncio.Queue] = {}
        self._residual: torch.Tensor | None = None
        self._done: collections.deque = collections.deque(maxlen=64)  # recently closed rounds
        self.on_control = None  # fn(msg, pc, pid) for the group's join/welcome/late messages
        peer.on(BlockUpdate, self._route, inline=True)

    def _route(self, msg: BlockUpdate, pc, pid):
        if msg.block == self.block and msg.meta.get("phase") == "excluded":
            self.excluded_by(pid, msg.round, str(msg.meta.get("reason", ""))[:500])
            return
        if msg.block == self.block and msg.meta.get("phase") in CONTROL_PHASES:
            if self.on_control is not None:
                self.on_control(msg, pc, pid)
            return
        if msg.block != self.block or msg.round in self._done:
            return  # another block's, or a straggler for a round already closed
        self._queue(msg.round).put_nowait((pid, msg))

    def _queue(self, rnd: int) -> asyncio.Queue:
        return self._inbox.setdefault(rnd, asyncio.Queue())

    def _validate(self, msg: BlockUpdate, want_numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if len(msg.tensors) != 1 or msg.tensors[0].name != "part":
            raise ValueError("expected one tensor named 'part'")
        w = msg.tensors[0]
        if w.dtype != "float32" or w.shape != (want_numel,):
            raise ValueError(f"part is {w.dtype} {w.shape}, expected float32 ({want_numel},)")
        t = from_wire(w, out=out)
        norm = float(torch.linalg.vector_norm(t))  # one pass: NaN or inf anywhere makes it NaN or inf
        if not math.isfinite(norm):
            raise ValueError(f"part holds NaN or inf (its norm is {norm})")
        if norm > self.max_norm:
            raise ValueError(f"part norm {norm:.3g} exceeds the bound {self.max_norm:.3g}")
        return t

    def _reject(self, pid: str, why: str, rnd: int):
        if pid not in self.banned:
            self.banned[pid] = why
            self.events.append({"event": "rejected update", "peer": pid, "round": rnd, "reason": why,
                                "time": time.time()})
            log.warning("block %d round %d: rejected update from %s: %s; excluded from later rounds",
                        self.block, rnd, pid[:12], why)
            m = self.peer.members.get(pid)
            if m is not None and m.conn is not None:  # tell it, so it stops waiting for us
                try:
                    m.conn.send_nowait(BlockUpdate(block=self.block, round=rnd, meta={"phase": "excluded", "reason": why}))
                except (ConnectionError, ProtocolError):
                    pass

    def excluded_by(self, pid: str, rnd: int, why: str):
        """``pid`` rejected our update and will ignore us: stop waiting for it, now and later."""
        if pid not in self.shunned:
            self.shunned[pid] = why
            self.events.append({"event": "excluded by", "peer": pid, "round": rnd, "reason": why, "time": time.time()})
            log.warning("block %d: %s rejected our update in round %d (%s) and excludes us", self.block, pid[:12],
                        rnd, why)

    def _departed(self, pid: str, conns: dict) -> bool:
        """A member that left mid-round: its connection closed or the swarm declared it gone."""
        pc = conns.get(pid)
        m = self.peer.members.get(pid)
        return pc is None or pc.closed.done() or m is None or m.state != "alive" or pid in self.shunned

    async def average(self, rnd: int, vector: torch.Tensor, members: dict[str, str]) -> tuple[torch.Tensor, RoundReport]:
        """Average ``vector`` (1-D float32) with ``members`` (peer id -> address, self included)."""
        t0 = time.perf_counter()
        members = {pid: a for pid, a in members.items() if pid not in self.banned and pid not in self.shunned}
        ids = sorted(members)
        gid = hashlib.sha256("".join(ids).encode()).hexdigest()[:16]  # members disagreeing on it don't mix
        R, n = len(ids), vector.numel()
        P = max(R, -(-n // PIECE_FLOATS))  # pieces: each fits a frame; piece j belongs to member j % R
        bounds = [(n * i) // P for i in range(P + 1)]
        x = vector.detach().float().reshape(-1)  # read only: our own piece is a view of it
        if self.codec.lossy and self._residual is not None and self._residual.numel() == n:
            x = x + self._residual  # error feedback
        wires = [to_wire("part", x[bounds[j]:bounds[j + 1]], self.codec, "never") for j in range(P)]
        if self.codec.lossy:
            self._residual = x - torch.cat([from_wire(w) for w in wires])
        bytes_sent = 0
        conns = {}
        for pid in ids:
            if pid != self.peer.id:
                try:
                    conns[pid] = await self.peer.connection_to(members[pid])
                except ConnectionError as e:
                    log.info("round %d: cannot reach %s: %s", rnd, pid[:12], e)
        q = self._queue(rnd)
        departed: set[str] = set()
        out = torch.empty(n)  # the round's result: gathered pieces are decoded straight into it
        received: dict[int, dict[str, torch.Tensor]] = {j: {} for j in range(P)}  # reduce parts that reached us
        sent_to: dict[int, str] = {}  # piece -> the owner our part went to
        gather_sent: dict[int, list] = {}  # piece -> contributors of the average we sent
        gathered: dict[int, list] = {}  # piece -> its contributors, once its average is in ``out``
        rejected = []
        deadline = time.monotonic() + self.timeout_s

        def live() -> list[str]:
            return [p for p in ids if p not in departed and p not in self.banned]

        def owner(j: int) -> str:
            o = ids[j % R]
            if o in departed or o in self.banned:  # the piece moves to a live member, the same for all
                alive = live()
                o = alive[j % len(alive)]
            return o

        async def send(pid, msg, w) -> None:
            nonlocal bytes_sent
            try:
                await conns[pid].send(msg, bulk=True)
                bytes_sent += w.stored_bytes
            except (ConnectionError, ProtocolError, KeyError) as e:
                log.info("round %d: sending to %s failed: %s", rnd, pid[:12], e)

        async def progress(final: bool):
            expected = set(live())
            for j in range(P):  # our part of every piece goes to its current owner
                o = owner(j)
                if sent_to.get(j) == o:
                    continue
                sent_to[j] = o
                if o == self.peer.id:
                    received[j][o] = from_wire(wires[j]) if self.codec.lossy else x[bounds[j]:bounds[j + 1]]
                else:
                    await send(o, BlockUpdate(block=self.block, round=rnd, codec=self.codec.value, tensors=(wires[j],),
                                              meta={"phase": "reduce", "part": j, "group": gid}), wires[j])
            for j in range(P):  # pieces we own: average once every live member's part is in
                if owner(j) != self.peer.id or j in gather_sent:
                    continue
                got = {p: t for p, t in received[j].items() if p in expected}
                if not final and not set(got) >= expected:
                    continue
                vals = list(got.values())
                avg = out[bounds[j]:bounds[j + 1]]
                avg.copy_(vals[0])
                for v in vals[1:]:
                    avg.add_(v)
                avg.div_(len(vals))
                contributors = sorted(got)
                gather_sent[j] = contributors
                gathered[j] = contributors
                w = to_wire("part", avg, self.codec, "never")
                msg = BlockUpdate(block=self.block, round=rnd, codec=self.codec.value, tensors=(w,),
                                  meta={"phase": "gather", "part": j, "contributors": contributors, "group": gid})
                for pid in expected - {self.peer.id}:
                    await send(pid, msg, w)

        while True:
            await progress(final=False)
            if len(gathered) == P:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                await progress(final=True)  # send what we have: the coverage says what is missing
                break
            try:
                pid, msg = await asyncio.wait_for(q.get(), min(left, 0.2))
            except asyncio.TimeoutError:
                for pid in set(live()) - {self.peer.id}:
                    if self._departed(pid, conns):
                        departed.add(pid)
                        log.info("block %d round %d: %s left mid-round; finishing with the others",
                                 self.block, rnd, pid[:12])
                continue
            if pid in self.banned:
                continue
            if msg.meta.get("group") != gid or pid not in members:  # another view of the group: not an attack, not usable
                if not any(e.get("peer") == pid and e["event"] == "group mismatch" for e in self.events):
                    self.events.append({"event": "group mismatch", "peer": pid, "round": rnd, "time": time.time()})
                    log.info("round %d: %s sees another group; its parts are not mixed in", rnd, pid[:12])
                continue
            phase, j = msg.meta.get("phase"), msg.meta.get("part")
            if not isinstance(j, int) or not 0 <= j < P or phase not in ("reduce", "gather"):
                self._reject(pid, f"bad phase/part {phase!r}/{j!r}", rnd)
                rejected.append({"peer": pid, "reason": self.banned[pid]})
                continue
            wanted = phase == "gather" and j not in gathered and pid == owner(j)
            try:  # the awaited average goes straight into the result (refilled below if it is rejected)
                t = self._validate(msg, bounds[j + 1] - bounds[j], out[bounds[j]:bounds[j + 1]] if wanted else None)
            except ValueError as e:
                self._reject(pid, str(e), rnd)
                rejected.append({"peer": pid, "reason": str(e)})
                continue
            if phase == "reduce":
                received[j].setdefault(pid, t)  # kept even before we know we own it (a departure moves pieces)
            elif wanted:
                c = msg.meta.get("contributors")
                gathered[j] = c if isinstance(c, list) else []
        self._inbox.pop(rnd, None)
        self._done.append(rnd)
        expected = set(live())
        parts, covered = [], 0
        for j in range(P):
            got = gathered.get(j)
            ok = got is not None and set(got) >= expected
            if got is None:  # a piece that never came back keeps our values
                out[bounds[j]:bounds[j + 1]] = vector.detach().reshape(-1)[bounds[j]:bounds[j + 1]]
            if ok:
                covered += bounds[j + 1] - bounds[j]
            parts.append({"owner": owner(j), "contributors": got or [], "ok": ok})
        rep = RoundReport(rnd, ids, covered / n if n else 1.0, parts, rejected, time.perf_counter() - t0, bytes_sent,
                          departed=sorted(departed))
        if rep.coverage < self.min_coverage:
            raise RoundFailed(f"block {self.block} round {rnd}: coverage {rep.coverage:.1%} < {self.min_coverage:.0%} "
                              f"({sum(not p['ok'] for p in parts)} of {P} pieces lack a member); nothing applied")
        return out, rep


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

