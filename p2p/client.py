"""The serving client: pick a chain of serving peers from the swarm view, push requests through
it, collect the answers, and retry through other holders when a hop fails.

Rules:
- The client keeps a connection to the first hop (requests) and the last (answers); it is a
  client, never a member. Answers are matched to requests by id; a connection that closes fails
  every request waiting on it.
- ``generate`` asks a member for its view (STATUS), builds a chain (one live serving peer per
  block, smallest peer id first, avoiding peers that failed), and on a failure that names a block
  avoids that hop the next time; a request that gets no answer lets the swarm notice the silent
  peer (``dead_after_s``) before asking again.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import torch

from blocktrain.blocks.model import MASK_ID
from blocktrain.protocol import ConnectionClosed, PipelineForward, PipelineResult, Role

from .checkpoints import holders, status_members
from .identity import peer_id
from .node import query_status
from .pipeline import MODES, PipelineError
from .tensors import from_wire, to_wire
from .transport import CLIENT_INFO, Timeouts, make_connection, open_connection


class NoChain(PipelineError):
    """The swarm has no live serving peer for some block."""


class PipelineClient:
    """Sends requests into a chain of serving peers and collects the answers.

    ``route``: the hops' addresses, ``blocks``: the block each hop serves.
    """

    def __init__(self, identity, swarm_key, route: list[str], blocks: list[int], timeouts: Timeouts | None = None,
                 link=None, codec: str = "bf16", timeout_s: float = 30.0):
        self.identity, self.swarm_key = identity, swarm_key
        self.route, self.blocks = list(route), list(blocks)
        self.timeouts = timeouts or Timeouts()
        self.link, self.codec, self.timeout_s = link, codec, timeout_s
        self.conns: dict[str, object] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._readers: list[asyncio.Task] = []
        self.id = peer_id(identity)

    async def connect(self):
        for addr in dict.fromkeys([self.route[0], self.route[-1]]):
            host, _, port = addr.rpartition(":")
            conn = make_connection(Role.INITIATOR, self.identity, self.swarm_key, info=CLIENT_INFO)
            pc = await open_connection(host, int(port), conn, self.timeouts, self.link, name=addr)
            self.conns[addr] = pc
            self._readers.append(asyncio.get_running_loop().create_task(self._read(pc, addr)))

    async def _read(self, pc, addr):
        try:
            while True:
                m = await pc.recv()
                if isinstance(m, ConnectionClosed):
                    break
                if isinstance(m, PipelineResult):
                    f = self.pending.pop(m.request_id, None)
                    if f is not None and not f.done():
                        f.set_result(m)
        except ConnectionError:
            pass
        for f in self.pending.values():
            if not f.done():
                f.set_exception(PipelineError(f"hop {addr} closed the connection: {pc.close_reason}"))

    async def close(self):
        for pc in self.conns.values():
            await pc.close("done")
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    def sent_wire_bytes(self) -> int:
        return sum(pc.conn.counter.snapshot()["sent"]["total"]["wire_bytes"] for pc in self.conns.values())

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
                                f"(blocks {self.blocks})") from None
        if "error" in res.meta:
            b, hop = res.meta.get("block"), res.meta.get("hop")
            fault = "request" if res.meta.get("fault") == "request" else "hop"
            where = f"block {b}" if isinstance(b, int) else "the chain"
            text = (f"the request was refused by {where}: {res.meta['error']}" if fault == "request"
                    else f"{where} failed (reported by hop {hop}): {res.meta['error']}")
            raise PipelineError(text, b if isinstance(b, int) else None, hop if isinstance(hop, int) else None, fault)
        return res

    async def generate_blocktrain(self, prompt: bytes, n: int) -> tuple[bytes, dict]:
        """N bytes from one traversal of the chain."""
        ids = torch.tensor([list(prompt) + [MASK_ID] * (n - 1)], dtype=torch.int16)  # 257 ids: 2 bytes each
        t0 = time.perf_counter()
        res = await self._request(ids, {"mode": "blocktrain", "prompt_len": len(prompt), "n": n}, "raw")
        out = bytes(from_wire(res.tensors[0])[0].tolist())
        return out, {"seconds": time.perf_counter() - t0, "traversals": 1, "compute_s": res.meta["compute_s"]}

    async def generate_autoregressive(self, prompt: bytes, n: int, mode: str = "autoregressive") -> tuple[bytes, dict]:
        """N bytes, one traversal each, KV caches on the peers (the prompt is sent once)."""
        session = next(self._ids)
        t0 = time.perf_counter()
        x = torch.tensor([list(prompt)], dtype=torch.int16)
        pos, out, compute = 0, [], 0.0
        for i in range(n):
            res = await self._request(x, {"mode": mode, "session": session, "pos": pos, "n": 1,
                                          "prompt_len": len(prompt), "end": i == n - 1}, "raw")
            compute += res.meta["compute_s"]
            b = int(from_wire(res.tensors[0]).reshape(-1)[0])
            out.append(b)
            pos += x.shape[1]
            x = torch.tensor([[b]], dtype=torch.int16)
        return bytes(out), {"seconds": time.perf_counter() - t0, "traversals": n, "compute_s": compute}

    async def generate(self, prompt: bytes, n: int, mode: str) -> tuple[bytes, dict]:
        if mode == "blocktrain":
            return await self.generate_blocktrain(prompt, n)
        return await self.generate_autoregressive(prompt, n, mode)


def chain(st: dict, avoid: set = frozenset()) -> list[str]:
    """One live serving peer per block 0..K-1 from a status reply, avoiding ``avoid``."""
    members = [m for m in status_members(st) if m["addr"] not in avoid]
    blocks = sorted({b for m in members if m["role"] == "serve" and m["state"] == "alive" for b in m["blocks"]})
    if not blocks:
        raise NoChain("no live serving peers known" + (f" (avoiding {sorted(avoid)})" if avoid else ""))
    route = []
    for b in range(max(blocks) + 1):
        h = holders(members, b, "serve")
        if not h:
            raise NoChain(f"no live peer serves block {b}" + (f" (avoiding {sorted(avoid)})" if avoid else ""), b)
        route.append(h[0])
    return route


async def _chain_when_ready(host, port, ident, key, tmo, avoid, timeout: float):
    """The swarm view and a chain through it; while the serving peers are still starting (no chain
    yet, or the peer not yet listening), ask again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = await query_status(host, port, ident, key, tmo)
            return st, chain(st, avoid)
        except (NoChain, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)  # serving peers join by gossip within a heartbeat or two


def check_request(prompt: bytes, n: int, mode: str, max_seq_len: int | None = None):
    """Bad requests fail here, with the fix, before anything is sent."""
    if mode not in MODES:
        raise PipelineError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}", fault="request")
    if not prompt:
        raise PipelineError("the prompt is empty: give at least one byte of text to continue", fault="request")
    if n < 1:
        raise PipelineError("ask for at least one byte", fault="request")
    if max_seq_len is not None and len(prompt) + n > max_seq_len:
        raise PipelineError(f"prompt ({len(prompt)} bytes) + {n} bytes exceeds the model's {max_seq_len} positions: "
                            f"shorten the prompt or ask for at most {max(0, max_seq_len - len(prompt))} bytes",
                            fault="request")


async def generate(host: str, port: int, ident, key, prompt: bytes, n: int, mode: str, timeout: float,
                   attempts: int = 3, log=lambda s: None) -> tuple[bytes, dict]:
    """Pick a chain from the swarm view via HOST:PORT and run the request; when a hop fails, retry
    through another peer holding that block."""
    check_request(prompt, n, mode)
    tmo = Timeouts(connect_s=timeout, handshake_s=timeout)
    avoid: set[str] = set()
    last: Exception | None = None
    for attempt in range(attempts):
        st, route = await _chain_when_ready(host, port, ident, key, tmo, avoid, timeout)
        check_request(prompt, n, mode, (st.get("serving") or {}).get("max_seq_len"))
        client = PipelineClient(ident, key, route, list(range(len(route))), tmo, timeout_s=timeout)
        try:
            await client.connect()
            out, stats = await client.generate(prompt, n, mode)
            stats["route"] = route
            return out, stats
        except (PipelineError, ConnectionError) as e:
            if getattr(e, "fault", "hop") == "request":
                raise  # no other chain would serve it either
            last = e
            log(f"attempt {attempt + 1} through {route} failed: {e}")
            hop = getattr(e, "hop", None)
            if isinstance(hop, int) and 0 <= hop < len(route):
                avoid.add(route[hop])
            else:  # no answer: let the swarm notice the silent peer before asking again
                await asyncio.sleep(tmo.dead_after_s)  # the swarm's liveness timeout is the behaviour here
        finally:
            await client.close()
    raise PipelineError(f"gave up after {attempts} attempts: {last}")
