"""Same-block averaging over the protocol: reduce-scatter + all-gather among a group of peers.

Rules:
- A group is the sorted peer ids of the peers on one block; the flat float32 vector of a round
  is cut into P >= group size pieces of at most PIECE_FLOATS, piece j owned by member j mod R.
  Phase 1 (reduce): every member sends piece j to its owner. Phase 2 (gather): the owner
  averages what it received and sends the average of piece j to everyone. Every message is a BlockUpdate(block, round, codec, [part])
  with meta {"phase", "part", "contributors"}.
- Every incoming part is validated before use: name, shape, dtype, finite values, norm bound.
  A sender whose part fails is excluded from this and every later round, and the event is kept
  for the report. Nothing is silently dropped: a missing part leaves a hole in the coverage.
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
import time
from dataclasses import dataclass, field

import torch

from blocktrain.protocol import BlockUpdate, Codec, ProtocolError

from .tensors import from_wire, to_wire

log = logging.getLogger("blocktrain.p2p")


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


class Averager:
    def __init__(self, peer, block: int, codec: str = "raw", min_coverage: float = 1.0,
                 max_norm: float = 1e6, timeout_s: float = 30.0):
        self.peer, self.block = peer, block
        self.codec = Codec(codec)
        self.min_coverage, self.max_norm, self.timeout_s = min_coverage, max_norm, timeout_s
        self.banned: dict[str, str] = {}  # peer id -> why
        self.events: list[dict] = []
        self._inbox: dict[tuple, asyncio.Queue] = {}
        self._residual: torch.Tensor | None = None
        self._done: collections.deque = collections.deque(maxlen=64)  # recently closed rounds
        peer.on(BlockUpdate, self._route, inline=True)

    def _route(self, msg: BlockUpdate, pc, pid):
        if msg.block != self.block or msg.round in self._done:
            return  # another block's, or a straggler for a round already closed
        self._queue(msg.round).put_nowait((pid, msg))

    def _queue(self, rnd: int) -> asyncio.Queue:
        return self._inbox.setdefault(rnd, asyncio.Queue())

    def _validate(self, msg: BlockUpdate, want_numel: int) -> torch.Tensor:
        if len(msg.tensors) != 1 or msg.tensors[0].name != "part":
            raise ValueError("expected one tensor named 'part'")
        w = msg.tensors[0]
        if w.dtype != "float32" or w.shape != (want_numel,):
            raise ValueError(f"part is {w.dtype} {w.shape}, expected float32 ({want_numel},)")
        t = from_wire(w)
        if not torch.isfinite(t).all():
            raise ValueError("part holds NaN or inf")
        norm = float(t.norm())
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

    async def average(self, rnd: int, vector: torch.Tensor, members: dict[str, str]) -> tuple[torch.Tensor, RoundReport]:
        """Average ``vector`` (1-D float32) with ``members`` (peer id -> address, self included)."""
        t0 = time.perf_counter()
        members = {pid: a for pid, a in members.items() if pid not in self.banned}
        ids = sorted(members)
        gid = hashlib.sha256("".join(ids).encode()).hexdigest()[:16]  # members disagreeing on it don't mix
        me, R, n = ids.index(self.peer.id), len(ids), vector.numel()
        P = max(R, -(-n // PIECE_FLOATS))  # pieces: each fits a frame; piece j belongs to member j % R
        bounds = [(n * i) // P for i in range(P + 1)]
        x = vector.detach().float().reshape(-1).clone()
        if self.codec.lossy and self._residual is not None and self._residual.numel() == n:
            x += self._residual  # error feedback
        sent_codes = torch.empty_like(x) if self.codec.lossy else None
        bytes_sent = 0
        conns = {}
        for pid in ids:
            if pid != self.peer.id:
                try:
                    conns[pid] = await self.peer.connection_to(members[pid])
                except ConnectionError as e:
                    log.info("round %d: cannot reach %s: %s", rnd, pid[:12], e)
        q = self._queue(rnd)
        # phase 1 (reduce): piece j to its owner
        for j in range(P):
            w = to_wire("part", x[bounds[j]:bounds[j + 1]], self.codec, "never")
            if sent_codes is not None:
                sent_codes[bounds[j]:bounds[j + 1]] = from_wire(w)
            msg = BlockUpdate(block=self.block, round=rnd, codec=self.codec.value, tensors=(w,),
                              meta={"phase": "reduce", "part": j, "group": gid})
            owner = ids[j % R]
            if owner == self.peer.id:
                q.put_nowait((owner, msg))
            elif owner in conns:
                try:
                    await conns[owner].send(msg, bulk=True)
                    bytes_sent += w.stored_bytes
                except (ConnectionError, ProtocolError) as e:
                    log.info("round %d: sending to %s failed: %s", rnd, owner[:12], e)
        if sent_codes is not None:
            self._residual = x - sent_codes
        mine = [j for j in range(P) if j % R == me]
        acc = {j: torch.zeros(bounds[j + 1] - bounds[j]) for j in mine}
        contrib: dict[int, list] = {j: [] for j in mine}
        gathered: dict[int, tuple[torch.Tensor, list]] = {}
        rejected = []
        deadline = time.monotonic() + self.timeout_s
        gather_sent = False

        async def send_gather():
            nonlocal bytes_sent
            for j in mine:
                avg = acc[j] / max(1, len(contrib[j]))
                gathered[j] = (avg, list(contrib[j]))
                w = to_wire("part", avg, self.codec, "never")
                for pid, pc in conns.items():
                    if pid in self.banned:
                        continue
                    try:
                        await pc.send(BlockUpdate(block=self.block, round=rnd, codec=self.codec.value, tensors=(w,),
                                                  meta={"phase": "gather", "part": j, "contributors": contrib[j],
                                                        "group": gid}),
                                      bulk=True)
                        bytes_sent += w.stored_bytes
                    except (ConnectionError, ProtocolError):
                        pass

        while True:
            expected = set(ids) - set(self.banned)
            if not gather_sent and all(set(contrib[j]) >= expected for j in mine):
                gather_sent = True
                await send_gather()
            if gather_sent and len(gathered) == P:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                if not gather_sent:  # send what we have: the coverage says what is missing
                    gather_sent = True
                    await send_gather()
                break
            try:
                pid, msg = await asyncio.wait_for(q.get(), left)
            except asyncio.TimeoutError:
                continue
            if pid in self.banned:
                continue
            if msg.meta.get("group") != gid:  # another view of the group: not an attack, not usable
                if not any(e.get("peer") == pid and e["event"] == "group mismatch" for e in self.events):
                    self.events.append({"event": "group mismatch", "peer": pid, "round": rnd, "time": time.time()})
                    log.info("round %d: %s sees another group; its parts are not mixed in", rnd, pid[:12])
                continue
            phase, j = msg.meta.get("phase"), msg.meta.get("part")
            if not isinstance(j, int) or not 0 <= j < P or phase not in ("reduce", "gather"):
                self._reject(pid, f"bad phase/part {phase!r}/{j!r}", rnd)
                rejected.append({"peer": pid, "reason": self.banned[pid]})
                continue
            try:
                t = self._validate(msg, bounds[j + 1] - bounds[j])
            except ValueError as e:
                self._reject(pid, str(e), rnd)
                rejected.append({"peer": pid, "reason": str(e)})
                continue
            if phase == "reduce" and j % R == me and pid not in contrib[j]:
                acc[j] += t
                contrib[j].append(pid)
            elif phase == "gather" and pid == ids[j % R] and j not in gathered:
                c = msg.meta.get("contributors")
                gathered[j] = (t, c if isinstance(c, list) else [])
        self._inbox.pop(rnd, None)
        self._done.append(rnd)
        out = vector.detach().float().reshape(-1).clone()  # pieces that never came back keep our values
        parts, covered = [], 0
        for j in range(P):
            got = gathered.get(j)
            ok = got is not None and set(got[1]) >= set(ids)
            if got is not None:
                out[bounds[j]:bounds[j + 1]] = got[0]
            if ok:
                covered += bounds[j + 1] - bounds[j]
            parts.append({"owner": ids[j % R], "contributors": got[1] if got else [], "ok": ok})
        rep = RoundReport(rnd, ids, covered / n if n else 1.0, parts, rejected, time.perf_counter() - t0, bytes_sent)
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

