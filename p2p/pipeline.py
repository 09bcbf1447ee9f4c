"""Serving: a chain of peers, one block each, fed peer to peer; the last one answers the client.

Rules:
- A request is a PipelineForward with ``route`` (the hops' addresses), ``hop`` (the receiver's
  index) and meta: ``mode``, ``blocks`` (the block each hop runs), ``reply_to`` (the client's peer
  id: the last hop answers on the client's own connection), ``prompt_len`` and ``n`` (bytes
  wanted), ``codec`` (of the hidden states between hops); session modes also carry ``session``,
  ``pos`` and ``end``. PROTOCOL.md section 7.3 lists the fields.
- Modes. ``blocktrain``: prompt + N-1 placeholders cross the chain once; the last block's head
  gives all N bytes. ``autoregressive``: one traversal per byte through the same blocks, a KV
  cache per hop and session. ``reference``: the same, through the end-to-end reference model
  split by the same layers (when the peer serves it).
- A KV cache belongs to (client, session); it is freed at the session's end or after
  SESSION_IDLE_S, and a hop holds at most MAX_SESSIONS of them (the least recently used goes).
- A hop that cannot serve a request answers the client with PipelineResult(meta {"error",
  "hop", "block"}) on the client's connection; the client raises ``PipelineError`` carrying the
  block and hop, never a string to parse.
- Compute runs off the event loop; every hop adds its compute time to meta ``compute_s``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blocktrain.blocks.model import MASK_ID, Block
from blocktrain.protocol import PipelineForward, PipelineResult

from .services import PeerServices, PeerUnreachable
from .tensors import from_wire, to_wire

MODES = ("blocktrain", "autoregressive", "reference")
SESSION_IDLE_S = 60.0  # a KV cache unused this long is freed
# KV caches one hop holds at once: each is a few MiB for the default model and 256 bytes.
MAX_SESSIONS = 64
# Seconds the last hop waits for the client's own connection to register (it dialled us at once).
CLIENT_WAIT_S = 5.0


class PipelineError(Exception):
    """A request could not be served; ``block`` and ``hop`` say where (None: the chain as a whole);
    ``fault`` says whose: "hop" (retry elsewhere) or "request" (the request itself is bad)."""

    def __init__(self, msg: str, block: int | None = None, hop: int | None = None, fault: str = "hop"):
        super().__init__(msg)
        self.block, self.hop, self.fault = block, hop, fault


def _bad_request(msg: str, block=None, hop=None) -> PipelineError:
    return PipelineError(msg, block, hop, fault="request")


@dataclass
class ServedBlocks:
    """What one serving peer holds: BlockTrain blocks (with their heads) and/or blocks of the
    end-to-end reference."""
    blocktrain: dict = field(default_factory=dict)  # block index -> Block
    reference: dict = field(default_factory=dict)  # block index -> Block of the end-to-end model

    def held(self, mode: str) -> dict:
        return self.reference if mode == "reference" else self.blocktrain


class PipelineServer:
    def __init__(self, peer: PeerServices, served: ServedBlocks):
        self.peer, self.served = peer, served
        self.sessions: collections.OrderedDict[tuple, dict] = collections.OrderedDict()
        self.served_requests = 0
        peer.on(PipelineForward, self.handle)
        peer.report_section("serving", lambda: {"requests": self.served_requests, "sessions": len(self.sessions),
                                                "blocks": sorted(self.served.blocktrain),
                                                "reference_blocks": sorted(self.served.reference),
                                                "max_seq_len": self.max_seq_len()})

    def max_seq_len(self) -> int | None:
        for held in (self.served.blocktrain, self.served.reference):
            for b in held.values():
                return b.cfg.max_seq_len
        return None

    def _session(self, client: str, meta: dict, layers: int) -> dict:
        key = (client, meta["session"])
        sess = self.sessions.pop(key, None)
        if sess is None:
            if meta.get("pos", 0) != 0:
                raise PipelineError("session unknown here (expired, or this hop restarted): start it again")
            sess = {"caches": [{} for _ in range(layers)]}
        sess["used"] = time.monotonic()
        self.sessions[key] = sess
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return sess

    def _compute(self, mode: str, k: int, x: torch.Tensor, meta: dict, client: str):
        b: Block = self.served.held(mode)[k]
        with torch.no_grad():
            if mode == "blocktrain":
                h = b.trunk(x)
                if k == b.cfg.n_blocks - 1:
                    p = meta["prompt_len"]
                    return b.logits(h)[:, p - 1:].argmax(-1).to(torch.uint8), True
                return h, False
            sess = self._session(client, meta, len(b.layers))
            pos = meta["pos"]
            h = b.embed(x, start=pos) if b.is_first else x
            for layer, cache in zip(b.layers, sess["caches"]):
                h = layer(h, cache)
            if meta.get("end"):
                self.sessions.pop((client, meta["session"]), None)
            if b.head is not None and k == b.cfg.n_blocks - 1:
                return b.logits(h)[:, -1:].argmax(-1).to(torch.uint8), True
            return h, False

    def _expire(self):
        now = time.monotonic()
        for key in [k for k, s in self.sessions.items() if now - s["used"] > SESSION_IDLE_S]:
            del self.sessions[key]

    async def handle(self, msg: PipelineForward, pc, pid):
        meta = dict(msg.meta)
        client = meta.get("reply_to", pid)
        k = _block_at(meta, msg.hop)
        try:
            mode = meta.get("mode")
            if mode not in MODES:
                raise _bad_request(f"unknown mode {mode!r}", k, msg.hop)
            if not isinstance(k, int) or k not in self.served.held(mode):
                raise PipelineError(f"peer {self.peer.addr} does not serve block {k} ({mode})", k, msg.hop)
            x = _input(msg, self.served.held(mode)[k], meta)
            t0 = time.perf_counter()
            out, last = await asyncio.to_thread(self._compute, mode, k, x, meta, client)
            meta["compute_s"] = float(meta.get("compute_s", 0.0)) + time.perf_counter() - t0
            self._expire()
            self.served_requests += 1
            if last:
                reply = await self._client(client)
                reply.send_nowait(PipelineResult(request_id=msg.request_id, tensors=(to_wire("bytes", out),), meta=meta))
                return
            nxt_block = _block_at(meta, msg.hop + 1)
            try:
                nxt = await self.peer.connection(msg.route[msg.hop + 1])
            except (PeerUnreachable, IndexError) as e:
                raise PipelineError(f"block {nxt_block} is unreachable: {e}", nxt_block, msg.hop + 1) from None
            nxt.send_nowait(PipelineForward(request_id=msg.request_id, route=msg.route, hop=msg.hop + 1,
                                            tensors=(to_wire("x", out, meta.get("codec", "bf16"), "never"),),
                                            meta=meta))
        except (PipelineError, ConnectionError, KeyError, IndexError, ValueError, TypeError) as e:
            failed = e.block if isinstance(e, PipelineError) else k
            hop = e.hop if isinstance(e, PipelineError) and e.hop is not None else msg.hop
            fault = e.fault if isinstance(e, PipelineError) else "hop"
            reply = self.peer.client_connection(client)
            if reply is not None:  # else the client's timeout reports it
                try:
                    reply.send_nowait(PipelineResult(request_id=msg.request_id, tensors=(),
                                                     meta={"error": str(e)[:1000], "hop": hop, "block": failed,
                                                           "fault": fault}))
                except ConnectionError:
                    pass

    async def _client(self, client: str):
        if not await self.peer.wait_for(lambda: self.peer.client_connection(client) is not None, CLIENT_WAIT_S):
            raise PipelineError(f"client {client[:12]} is not connected to the last hop {self.peer.addr}")
        return self.peer.client_connection(client)


def refuse_requests(peer: PeerServices):
    """For a peer that serves nothing: every request is answered with an error at once."""
    async def handler(msg: PipelineForward, pc, pid):
        meta = msg.meta
        client = meta.get("reply_to", pid)
        reply = peer.client_connection(client) if isinstance(client, str) else None
        if reply is not None:
            try:
                reply.send_nowait(PipelineResult(request_id=msg.request_id, tensors=(),
                                                 meta={"error": f"peer {peer.addr} serves no blocks",
                                                       "hop": msg.hop, "block": _block_at(meta, msg.hop)}))
            except ConnectionError:
                pass
    peer.on(PipelineForward, handler)


def _input(msg: PipelineForward, b: Block, meta: dict) -> torch.Tensor:
    """The request's input, checked against the block before any compute (a bad request is the
    request's fault: the client is told so and does not blame the hop)."""
    if len(msg.tensors) != 1:
        raise _bad_request("expected one input tensor")
    x = from_wire(msg.tensors[0])
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    elif x.dtype in (torch.int16, torch.int32, torch.uint8):
        x = x.long()
    if x.dim() != (2 if b.is_first else 3) or x.shape[0] != 1 or x.shape[1] < 1:
        raise _bad_request(f"input of shape {tuple(x.shape)} does not fit block {b.index}", b.index)
    if b.is_first and (x.min() < 0 or x.max() > MASK_ID):
        raise _bad_request("input ids outside 0..256", b.index)
    if not b.is_first and (x.shape[-1] != b.cfg.d_model or x.dtype != torch.float32):
        raise _bad_request(f"hidden states of width {x.shape[-1]}, block {b.index} takes {b.cfg.d_model}", b.index)
    pos = meta.get("pos", 0)
    if type(pos) is not int or pos < 0 or pos + x.shape[1] > b.cfg.max_seq_len:
        raise _bad_request(f"the request needs positions up to {pos + x.shape[1]}, the model has {b.cfg.max_seq_len}: "
                           f"shorten the prompt or ask for fewer bytes", b.index)
    return x


def _block_at(meta: dict, hop: int):
    blocks = meta.get("blocks")
    if isinstance(blocks, list) and type(hop) is int and 0 <= hop < len(blocks) and type(blocks[hop]) is int:
        return blocks[hop]
    return None


class ServeError(Exception):
    """What a serving peer was told to serve is not there (the message names the file and mode)."""


def load_served(blocks, checkpoints: str | Path | None = None, reference: str | Path | None = None) -> ServedBlocks:
    """Blocks ``blocks`` of a trained model: BlockTrain blocks from ``checkpoints`` (blocktrain and
    autoregressive modes) and, optionally, the end-to-end reference from ``reference``."""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.model import ModelConfig

    if not checkpoints and not reference:
        raise ServeError("nothing to serve: give --checkpoints DIR (bt-train's OUT/checkpoints, or bt-peer "
                         "assemble's OUT) and/or --reference DIR (bt-train's OUT/reference)")
    served = ServedBlocks()
    for directory, target, mode in ((checkpoints, served.blocktrain, "blocktrain and autoregressive"),
                                    (reference, served.reference, "reference")):
        if not directory:
            continue
        for k in blocks:
            path = ckpt.block_path(directory, k)
            if not path.exists():
                raise ServeError(f"{path} is missing: block {k} cannot be served in {mode} mode "
                                 f"(found: {sorted(p.name for p in ckpt.block_files(directory).values()) or 'none'})")
            try:
                c = ckpt.load(path)
            except ckpt.CheckpointError as e:
                raise ServeError(str(e)) from None
            cfg = ModelConfig.from_dict(c.config)
            if c.block != k or k >= cfg.n_blocks:
                raise ServeError(f"{path} holds block {c.block} of a {cfg.n_blocks}-block model, not block {k}")
            b = Block(cfg, k, with_head=(k == cfg.n_blocks - 1) if target is served.reference else True)
            try:
                b.load_state_dict(c.tensors)
            except RuntimeError as e:
                raise ServeError(f"{path}: its tensors do not fit the model config: {e}") from None
            b.eval()
            target[k] = b
    return served
