"""Serving: a chain of peers, one block each, fed peer to peer; the last one answers the client.

Rules:
- A request is a PipelineForward with ``route`` (the hops' addresses), ``hop`` (the receiver's
  index) and meta: ``mode`` ("blocktrain" or "autoregressive"), ``blocks`` (the block each hop
  runs), ``reply_to`` (the client's peer id: the last hop answers on the client's own
  connection), ``prompt_len`` and ``n`` (bytes wanted); autoregressive requests also carry
  ``session``, ``pos`` and ``end``.
- blocktrain: prompt + N-1 placeholders cross the chain once; the last block's head gives all N
  bytes. autoregressive: the end-to-end model split by the same layers; one traversal per byte,
  a KV cache per peer per session, released at the session's end or after ``SESSION_IDLE_S``.
- Hidden states travel with the ``codec`` the client asks for (bf16 by default: half the bytes
  of fp32, for both modes alike). Compute runs off the event loop.
- Every hop adds its compute time to meta ``compute_s``, so the client can state the bound.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import torch

from blocktrain.blocks.model import MASK_ID, Block
from blocktrain.protocol import ConnectionClosed, PipelineForward, PipelineResult, Role

from .tensors import from_wire, to_wire
from .traffic import kind_of

MODES = ("blocktrain", "autoregressive")
SESSION_IDLE_S = 60.0  # a KV cache unused this long is freed


class PipelineError(Exception):
    """A request could not be served; the message names the hop or block that failed."""


@dataclass
class ServedBlocks:
    """What one serving peer holds: BlockTrain block k and/or block k of the end-to-end model."""
    blocktrain: dict = field(default_factory=dict)  # block index -> Block (with head if last)
    autoregressive: dict = field(default_factory=dict)  # block index -> Block of the end-to-end model


class PipelineServer:
    def __init__(self, peer, served: ServedBlocks):
        self.peer, self.served = peer, served
        self.sessions: dict[tuple, dict] = {}
        peer.on(PipelineForward, self.handle)
        self.served_requests = 0

    def _compute(self, mode: str, k: int, x: torch.Tensor, meta: dict, client: str):
        with torch.no_grad():
            if mode == "blocktrain":
                b: Block = self.served.blocktrain[k]
                h = b.trunk(x)
                if k == b.cfg.n_blocks - 1:
                    p = meta["prompt_len"]
                    return b.logits(h)[:, p - 1:].argmax(-1).to(torch.uint8), True
                return h, False
            b = self.served.autoregressive[k]
            key = (client, meta["session"])
            sess = self.sessions.setdefault(key, {"caches": [{} for _ in b.layers], "used": 0.0})
            sess["used"] = time.monotonic()
            pos = meta["pos"]
            if b.is_first:
                h = b.tok(x) + b.pos(torch.arange(pos, pos + x.shape[1]))[None]
            else:
                h = x
            for layer, cache in zip(b.layers, sess["caches"]):
                h = layer(h, cache)
            if meta.get("end"):
                self.sessions.pop(key, None)
            if b.head is not None:
                return b.logits(h)[:, -1:].argmax(-1).to(torch.uint8), True
            return h, False

    def _expire(self):
        now = time.monotonic()
        for key in [k for k, s in self.sessions.items() if now - s["used"] > SESSION_IDLE_S]:
            del self.sessions[key]

    async def handle(self, msg: PipelineForward, pc, pid):
        meta = dict(msg.meta)
        client = meta.get("reply_to", pid)
        try:
            mode, k = meta["mode"], meta["blocks"][msg.hop]
            if mode not in MODES:
                raise PipelineError(f"unknown mode {mode!r}")
            held = self.served.blocktrain if mode == "blocktrain" else self.served.autoregressive
            if k not in held:
                raise PipelineError(f"peer {self.peer.addr} does not serve block {k + 1} ({mode})")
            x = from_wire(msg.tensors[0])
            if x.dtype in (torch.bfloat16, torch.float16):
                x = x.float()
            elif x.dtype in (torch.int16, torch.int32, torch.uint8):
                x = x.long()
            t0 = time.perf_counter()
            out, last = await asyncio.to_thread(self._compute, mode, k, x, meta, client)
            meta["compute_s"] = meta.get("compute_s", 0.0) + time.perf_counter() - t0
            self._expire()
            self.served_requests += 1
            if last:
                reply = self.peer.clients.get(client)
                if reply is None:
                    raise PipelineError(f"client {client[:12]} is not connected to the last hop {self.peer.addr}")
                reply.send_nowait(PipelineResult(request_id=msg.request_id, tensors=(to_wire("bytes", out),),
                                                 meta=meta))
                return
            nxt_block = meta["blocks"][msg.hop + 1]
            try:
                nxt = await self.peer.connection_to(msg.route[msg.hop + 1])
            except ConnectionError as e:
                raise _Unreachable(nxt_block, f"block {nxt_block + 1} at {msg.route[msg.hop + 1]} is unreachable: {e}")
            nxt.send_nowait(PipelineForward(request_id=msg.request_id, route=msg.route, hop=msg.hop + 1,
                                            tensors=(to_wire("x", out, meta.get("codec", "bf16"), "never"),),
                                            meta=meta))
        except (PipelineError, ConnectionError, KeyError, IndexError, ValueError, TypeError) as e:
            failed = e.block if isinstance(e, _Unreachable) else _block_at(meta, msg.hop)
            reply = self.peer.clients.get(client)
            if reply is not None and not reply.closed.done():  # else the client's timeout reports it
                reply.send_nowait(PipelineResult(request_id=msg.request_id, tensors=(),
                                                 meta={"error": str(e), "hop": msg.hop, "block": failed}))


class _Unreachable(PipelineError):
    def __init__(self, block: int, msg: str):
        super().__init__(msg)
        self.block = block


def _block_at(meta: dict, hop: int):
    blocks = meta.get("blocks")
    return blocks[hop] if isinstance(blocks, list) and 0 <= hop < len(blocks) else None


class PipelineClient:
    """Sends requests into a chain of serving peers and collects the answers.

    ``route``: the hops' addresses, ``blocks``: the block each hop serves. The client keeps a
    connection to the first hop (requests) and the last (answers).
    """

    def __init__(self, identity, swarm_key, route: list[str], blocks: list[int], timeouts=None, link=None,
                 codec: str = "bf16", timeout_s: float = 30.0):
        from .transport import Timeouts

        self.identity, self.swarm_key = identity, swarm_key
        self.route, self.blocks = list(route), list(blocks)
        self.timeouts = timeouts or Timeouts()
        self.link = link
        self.codec = codec
        self.timeout_s = timeout_s
        self.conns: dict[str, object] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._readers: list[asyncio.Task] = []
        from blocktrain.p2p.identity import peer_id
        self.id = peer_id(identity)

    async def connect(self):
        from blocktrain.protocol import Connection

        from .transport import open_connection
        for addr in {self.route[0], self.route[-1]}:
            host, _, port = addr.rpartition(":")
            conn = Connection(Role.INITIATOR, self.identity, self.swarm_key,
                              info={"addr": "", "blocks": [], "role": "client"}, kind_of=kind_of)
            pc = await open_connection(host, int(port), conn, self.timeouts, self.link, name=addr)
            self.conns[addr] = pc
            self._readers.append(asyncio.get_running_loop().create_task(self._read(pc, addr)))
        await asyncio.sleep(0.05)  # let the peers register us before the first answer is due

    async def _read(self, pc, addr):
        while True:
            m = await pc.recv()
            if isinstance(m, ConnectionClosed):
                for f in self.pending.values():
                    if not f.done():
                        f.set_exception(PipelineError(f"hop {addr} closed the connection: {m.reason}"))
                return
            if isinstance(m, PipelineResult):
                f = self.pending.pop(m.request_id, None)
                if f is not None and not f.done():
                    f.set_result(m)

    async def close(self):
        for pc in self.conns.values():
            await pc.close("done")
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def _request(self, x: torch.Tensor, meta: dict, codec: str) -> PipelineResult:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        meta = {**meta, "blocks": self.blocks, "reply_to": self.id, "codec": self.codec}
        self.conns[self.route[0]].send_nowait(PipelineForward(
            request_id=rid, route=self.route, hop=0, tensors=(to_wire("x", x, codec, "never"),), meta=meta))
        try:
            res = await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            self.pending.pop(rid, None)
            raise PipelineError(f"no answer within {self.timeout_s}s from the chain {self.route} "
                                f"(blocks {[b + 1 for b in self.blocks]})") from None
        if "error" in res.meta:
            b = res.meta.get("block")
            raise PipelineError(f"{'block ' + str(b + 1) if isinstance(b, int) else 'the chain'} failed "
                                f"(reported by hop {res.meta.get('hop')}): {res.meta['error']}")
        return res

    async def generate_blocktrain(self, prompt: bytes, n: int) -> tuple[bytes, dict]:
        """N bytes from one traversal of the chain."""
        ids = torch.tensor([list(prompt) + [MASK_ID] * (n - 1)], dtype=torch.int16)  # 257 ids: 2 bytes each
        t0 = time.perf_counter()
        res = await self._request(ids, {"mode": "blocktrain", "prompt_len": len(prompt), "n": n}, "raw")
        out = bytes(from_wire(res.tensors[0])[0].tolist())
        return out, {"seconds": time.perf_counter() - t0, "traversals": 1, "compute_s": res.meta["compute_s"]}

    async def generate_autoregressive(self, prompt: bytes, n: int) -> tuple[bytes, dict]:
        """N bytes, one traversal each, KV caches on the peers (the prompt is sent once)."""
        session = next(self._ids)
        t0 = time.perf_counter()
        x = torch.tensor([list(prompt)], dtype=torch.int16)
        pos, out, compute = 0, [], 0.0
        for i in range(n):
            res = await self._request(x, {"mode": "autoregressive", "session": session, "pos": pos, "n": 1,
                                          "prompt_len": len(prompt), "end": i == n - 1}, "raw")
            compute += res.meta["compute_s"]
            b = int(from_wire(res.tensors[0]).reshape(-1)[0])
            out.append(b)
            pos += x.shape[1]
            x = torch.tensor([[b]], dtype=torch.int16)
        return bytes(out), {"seconds": time.perf_counter() - t0, "traversals": n, "compute_s": compute}
