"""Serving: a chain of peers, one block each, fed peer to peer; the last one answers the client.

Rules:
- A request is a PipelineForward with ``route`` (the hops' addresses), ``hop`` (the receiver's
  index) and meta: ``mode`` (what the client runs: exact, autoregressive, blocktrain or
  reference), ``blocks`` (the block each hop runs), ``reply_to`` (the client's peer id: the last
  hop answers on the client's own connection), ``session`` (the client's decoding session),
  ``spec`` (one traversal, ``blocks/decode.py``), ``codec`` (of the hidden states between hops),
  ``end`` (free the session's caches afterwards). PROTOCOL.md section 7.3 lists the fields.
- Every mode is the same traversal: hop k runs ``decode.hop_step`` on its block, its cache for
  the session and the spec; hop 0 takes the token ids from the spec (no tensor), the others the
  hidden states from the hop below. The last hop answers with the spec's logits (float32) and
  drafts (int16). ``reference`` runs the end-to-end reference model split by the same layers
  (when the peer serves it); every other mode runs the BlockTrain blocks.
- The spec is checked (``decode.check_spec``: types and bounds) before any compute. A spec that
  does not fit this hop's cache (``SessionMismatch``: a new hop, an expired or evicted session)
  is answered with fault "session": the client rebuilds the caches from its committed bytes.
- A session's caches live in the hop's ``SessionTable`` (sessions.py: its bounds and who goes
  when it is full; a new session refused there is fault "hop"). A new session whose first
  traversal is refused before any compute is not kept.
- A traversal is computed in chunks of ``decode.CHUNK`` tokens (``decode.Traversal``) on the
  hop's ``batch`` compute slots (bt-peer serve --batch, serving.COMPUTE_SLOTS: 1 on CPU), each
  chunk charged its tokens by fair queuing over clients (every client the hop does not know yet
  in one flow, the newcomers'), at most MAX_WAITING waiting in all (fair.py): between chunks a
  client the hop knows, back from a round trip, takes a slot, so while its credit lasts it waits
  for one batch, not for clients flooding with long traversals. The chunks of the traversals
  holding a slot are computed together, one forward over the rows of all (continuous batching,
  batching.py); exact and autoregressive output is what each session gets alone, bitwise.
  ``end`` without a spec only frees the caches, hop by hop.
- A hop that cannot serve a request answers the client with PipelineResult(meta {"error",
  "hop", "block", "fault"}) on the client's connection; the client raises ``PipelineError``
  carrying the block, hop and fault, never a string to parse.
- Whose share a traversal takes (fair.py's client): shares.py's, by the address the client
  connects from where this hop holds its connection (hop 0: the one the request came on, a
  member's too; the last hop: the client's, which it waits for before any compute): the first
  identity of an address a share, the rest of that address one share; a middle hop by the
  ``client_addr`` hop 0 passed on (r12), as the word of the member that sent it, in a table of
  its own (``relayed_shares``: a member's made-up addresses never push out one seen here); else
  the client's id.
- Hop 0 holds a connection it refused as busy unread for the pause the client owes (BUSY_HOLD_S,
  doubled once per hold while refused in a row); a client that reconnects instead is not held,
  and pays a handshake per request.
- Compute runs off the event loop; every hop adds its compute time to meta ``compute_s``.
- Where things live: the request's vocabulary (modes, faults, refusals) is api.py's, shared
  with the client; what a hop checks and where a request goes next is hop.py's pure plan;
  this module runs the plan (sessions' caches, compute slots, forwarding, relaying errors).
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blocktrain.blocks.decode import CHUNK, SessionMismatch, Traversal
from blocktrain.blocks.device import threads
from blocktrain.blocks.invariance import RowCheck, choose_tile_rows
from blocktrain.blocks.model import Block, BlockCache
from blocktrain.protocol import PipelineForward, PipelineResult, ProtocolError

from ..services import PeerServices, PeerUnreachable
from ..tensors import from_wire, to_wire
from .api import (COMPUTE_SLOTS, DEFAULT_CODEC, MAX_CLIENT_ADDR, PipelineError, bad_request, block_at, refusal,
                  refusal_meta)
from .batching import Batcher
from .fair import FairSlots, Saturated
from .hop import HopPlan, Step, plan_hop
from .sessions import SessionsFull, SessionTable, UnknownSession
from .shares import Shares, address_share

# Traversals waiting for a compute slot at one hop, in all, those between chunks included (fair.py:
# past it room is made for a newcomer that would go before the last, or it is refused). 64: the
# sessions a hop holds (sessions.MAX_SESSIONS), one traversal at a time each. Each holds its request's
# input: hidden states of at most max_seq_len + 256 positions (decoded: 0.6 MiB at d 192 and a
# 512-byte context), usually a few KiB.
MAX_WAITING = 64
# Seconds the last hop waits for the client's own connection to register (it dialled us at once).
CLIENT_WAIT_S = 5.0
# A connection hop 0 refused as busy is not read for BUSY_HOLD_S, doubling with each busy refusal
# in a row up to BUSY_HOLD_MAX_S, until one of its requests is computed: the pause a client makes
# before it tries a busy hop again (client.py: BUSY_PAUSE_S to BUSY_PAUSE_MAX_S), enforced. A flood
# that asks again at once (384 identities, every 50 ms) was refused 5,000 times a second, and the
# hops' loops, refusing, served a legitimate client 35-59x slower than alone.
BUSY_HOLD_S, BUSY_HOLD_MAX_S = 0.25, 4.0


@dataclass
class ServedBlocks:
    """What one serving peer holds: BlockTrain blocks (with their heads) and/or blocks of the
    end-to-end reference."""
    blocktrain: dict = field(default_factory=dict)  # block index -> Block
    reference: dict = field(default_factory=dict)  # block index -> Block of the end-to-end model
    batch: int = COMPUTE_SLOTS  # traversals whose chunks the hop computes together (bt-peer serve --batch)
    # What the start-up check found per block (blocks.invariance): the rows per call its exact
    # rows are computed in, or that this machine cannot compute them batch-invariantly.
    rows: dict = field(default_factory=dict)  # Block -> RowCheck

    def held(self, mode: str) -> dict:
        return self.reference if mode == "reference" else self.blocktrain

    def check_rows(self) -> list[RowCheck]:
        """Run the batch-invariance check on every block held (at one torch thread, as served)."""
        with threads(1):
            for held in (self.blocktrain, self.reference):
                for b in held.values():
                    self.rows[b] = choose_tile_rows(b)
        return list(self.rows.values())

    def exact_refused(self, b: Block) -> str | None:
        """Why ``b``'s exact rows are not served here (None: they are). A block held without the
        start-up check (built in process) is checked now, once."""
        if b not in self.rows:
            with threads(1):
                self.rows[b] = choose_tile_rows(b)
        check = self.rows[b]
        return check.describe() if check.tile_rows is None else None

    def exact_report(self) -> dict:
        """Per BlockTrain block: how its exact rows are computed here (status, the page)."""
        return {str(k): self.rows[b].describe() for k, b in sorted(self.blocktrain.items()) if b in self.rows}


class PipelineServer:
    """One hop: ``handle`` runs hop.py's plan of each request; the server is the plan's HopState."""

    def __init__(self, peer: PeerServices, served: ServedBlocks):
        self.peer, self.served = peer, served
        self.sessions: SessionTable[BlockCache] = SessionTable()
        self._inflight: dict[str, int] = {}  # client -> requests being computed or waiting here
        self._compute = FairSlots(served.batch, MAX_WAITING)
        self.shares = Shares()  # whose share of _compute a client takes, by its address
        self._busy_holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> (hold, its end)
        self.relayed_shares = Shares()  # a middle hop's: by the client_addr members pass on, apart from ours
        # The hop's own compute thread: a batch runs on it, never on a new thread of the loop's
        # default pool (each thread that computes keeps its own math-library buffers).
        self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bt-compute")
        self._batcher = Batcher(self._threads)
        self.served_requests = 0
        peer.on(PipelineForward, self.handle)
        peer.report_section("serving", lambda: {"requests": self.served_requests, "sessions": len(self.sessions),
                                                "blocks": sorted(self.served.blocktrain),
                                                "reference_blocks": sorted(self.served.reference),
                                                "max_seq_len": self._cfg("max_seq_len"),
                                                "n_blocks": self._cfg("n_blocks"), "exact": self.served.exact_report(),
                                                **self._batcher.report()})

    def set_batch(self, n: int):
        """Compute the chunks of up to ``n`` traversals together from now on (a benchmark comparing
        batch sizes on the same hops); only while no traversal is here. The fair queue is new:
        no client is known to it (virtual times and newcomers' tokens start again)."""
        if self._inflight:
            raise RuntimeError(f"the batch size changes only while no traversal is here ({len(self._inflight)} clients' are)")
        self.served.batch = n
        self._compute = FairSlots(n, MAX_WAITING)

    # The plan's view of this hop (hop.HopState).
    @property
    def addr(self) -> str:
        return self.peer.addr

    def held(self, mode: str) -> dict:
        return self.served.held(mode)

    def is_member(self, peer_id: str) -> bool:
        return self.peer.member(peer_id) is not None

    def serves(self, addr: str, block: int | None) -> bool:
        return any(m.addr == addr for m in self.peer.members(block=block, role="serve"))

    def in_flight(self, client: str) -> int:
        return self._inflight.get(client, 0)

    def is_busy(self, key: tuple) -> bool:
        return self.sessions.is_busy(key)

    def _cfg(self, key: str) -> int | None:
        """A setting of the served model (max_seq_len, n_blocks), for clients building a chain."""
        for held in (self.served.blocktrain, self.served.reference):
            for b in held.values():
                return getattr(b.cfg, key)
        return None

    def _cache(self, key: tuple, b: Block, start: int) -> BlockCache:
        """The session's caches at this hop (sessions.py), its failures as the client reads them."""
        try:
            return self.sessions.get(key, lambda: BlockCache(b), start)
        except UnknownSession:
            raise PipelineError(f"block {b.index}: no caches for this session here (expired, evicted, or this "
                                f"hop restarted): send it again from the start", b.index, fault="session") from None
        except SessionsFull as e:
            raise PipelineError(f"block {b.index}: {e}", b.index) from None

    async def handle(self, msg: PipelineForward, pc, pid):
        """Run the plan of ``msg`` (hop.py): relay an error, free a session, or compute, then
        forward or answer; every failure is answered (``_refuse``)."""
        plan = plan_hop(msg, pid, self)
        if plan.step is Step.IGNORE:
            return
        if plan.step is Step.RELAY:
            self._tell_client(plan.client, msg.request_id, plan.meta)
            return
        try:
            if plan.served is not None:  # the request reached a block served here
                self.sessions.expire()
            if plan.error is not None:
                raise plan.error
            if plan.step is Step.END:
                await self._end(msg, plan)
            else:
                await self._traverse(msg, plan, pc if msg.hop == 0 else None, pid)
        except Exception as e:  # noqa: BLE001 - every failure is answered; a hop's state stays consistent
            if plan.key is not None and not isinstance(e, PipelineError):
                self.sessions.drop(plan.key)  # a cache half-way through a traversal is not trusted again
            await self._refuse(msg, pc, plan, refusal_meta(e, plan.block, msg.hop))

    async def _end(self, msg: PipelineForward, plan: HopPlan):
        """The plan's END: free the session's caches here, then at the next hop."""
        assert plan.key is not None, "an END plan names the session"
        self.sessions.drop(plan.key)
        if not plan.last:
            await self._forward(msg, plan.meta, None)

    async def _traverse(self, msg: PipelineForward, plan: HopPlan, sender=None, via: str | None = None):
        """The plan's COMPUTE: this block's share of the traversal, then forward or answer.
        ``sender``: at hop 0, the connection the request came on (the client's, whatever its role),
        whose address hop 0 passes on (``client_addr``); ``via``: the peer that sent it here."""
        b, key, spec, meta = plan.served, plan.key, plan.spec, plan.meta
        if sender is not None and (addr := address_share(sender.peer_addr)) is not None:
            meta["client_addr"] = addr
        assert b is not None and key is not None and spec is not None, "a COMPUTE plan names block, session, spec"
        if spec.get("invariant") and (why := self.served.exact_refused(b)):
            raise PipelineError(f"block {b.index}: {why}", b.index)  # never unexact rows under the exact name
        x = _input(msg, b, spec)
        if plan.last:  # the answer's way back, before any compute: the client's address counts its share
            await self._client(plan.client)
        cache = self._cache(key, b, spec["start"])
        t0 = time.perf_counter()
        out = await self._run_block(msg, plan, key, Traversal(b, cache, x, spec), sender, via)
        if sender is not None:
            self._busy_holds.pop(sender, None)  # computed: its next busy refusal holds it BUSY_HOLD_S
        compute = meta.get("compute_s", 0.0)
        meta["compute_s"] = (float(compute) if isinstance(compute, (int, float)) else 0.0) + time.perf_counter() - t0
        self.served_requests += 1
        if isinstance(out, dict):  # the last block: the answer
            if not plan.last:
                raise bad_request(f"block {plan.block} is the last block, but the route goes on", plan.block, msg.hop)
            reply = await self._client(plan.client)
            meta.pop("spec", None)  # the client has it
            meta["drafter"] = b.drafter is not None
            tensors = [to_wire("logits", out["logits"].float()), to_wire("drafts", out["drafts"].to(torch.int16))]
            if "q" in out:  # drawn drafts: what each was drawn from
                tensors += [to_wire("q_ids", out["q_ids"].to(torch.uint8)), to_wire("q", out["q"].half())]
            reply.send_nowait(PipelineResult(request_id=msg.request_id, meta=meta, tensors=tuple(tensors)))
            return
        await self._forward(msg, meta, to_wire("x", out, meta.get("codec", DEFAULT_CODEC), "never"))

    async def _run_block(self, msg: PipelineForward, plan: HopPlan, key: tuple, traversal: Traversal, sender=None,
                         via: str | None = None):
        """The traversal in a compute slot, a chunk at a time in the hop's batches (batching.py),
        each chunk charged its tokens (fair.py): between chunks a client that comes first takes
        the slot. The session is busy meanwhile."""
        client, k = plan.client, plan.block
        assert plan.spec is not None, "a COMPUTE plan has a spec"
        self.sessions.begin(key)
        self._inflight[client] = self._inflight.get(client, 0) + 1
        try:
            left = len(plan.spec["ids"])  # fair by tokens, a chunk at a time
            async with self._compute.hold(self._share(client, sender, plan.meta, via), min(left, CHUNK)) as between:
                while (out := await self._batcher.step(traversal)) is None:
                    left -= CHUNK
                    await between(min(left, CHUNK))  # a client that comes first goes now
                return out
        except Saturated as e:
            # Refused midway (the caches hold part of a traversal), or before a new session's first
            # chunk (an empty session would take a place in the table at no compute).
            if left < len(plan.spec["ids"]) or plan.spec["start"] == 0:
                self.sessions.drop(key)
            raise PipelineError(f"block {k} at {self.peer.addr}: {e}", k, msg.hop, fault="busy") from None
        except SessionMismatch as e:
            self.sessions.drop(key)
            raise PipelineError(str(e), k, msg.hop, fault="session") from None
        finally:
            self.sessions.end(key)  # its idle time starts when the traversal ends here
            self._inflight[client] -= 1
            if not self._inflight[client]:
                del self._inflight[client]
            if plan.meta.get("end"):
                self.sessions.drop(key)

    async def _refuse(self, msg: PipelineForward, pc, plan: HopPlan, err: dict):
        """Answer a failure: to the sender at hop 0, else on the client's connection if we hold
        it, else (a middle hop: the client dialled the first and last hops only) via the last hop."""
        client = plan.client
        if msg.hop == 0:  # the sender, on its own connection
            _send_error(pc, msg.request_id, err)
            if err.get("fault") == "busy":  # doubled once per hold: requests read before it share it
                last, until = self._busy_holds.get(pc, (BUSY_HOLD_S / 2, 0.0))
                hold = last if time.monotonic() < until else min(BUSY_HOLD_MAX_S, 2 * last)
                self._busy_holds[pc] = (hold, max(until, time.monotonic() + hold))
                pc.inbox.hold(pc.transport, hold)
        elif isinstance(client, str) and self.peer.client_connection(client) is not None:
            self._tell_client(client, msg.request_id, err)
        elif msg.hop + 1 < len(msg.route) and msg.hop > 0:
            try:
                last = await self._member_connection(msg.route[-1], block_at(plan.meta, len(msg.route) - 1),
                                                     len(msg.route) - 1)
                last.send_nowait(PipelineForward(request_id=msg.request_id, route=msg.route,
                                                 hop=len(msg.route) - 1, meta={**err, "reply_to": client}))
            except (PipelineError, ConnectionError):
                pass  # the client's timeout reports it

    async def _member_connection(self, addr: str, block: int | None, hop: int | None):
        """The connection to the live member at ``addr`` serving ``block``: a hop forwards only to
        members it knows, never to an address a request merely names."""
        if not self.serves(addr, block):
            raise PipelineError(f"the route's hop {addr} is not a live member serving block {block}", block, hop)
        try:
            return await self.peer.connection(addr)
        except PeerUnreachable:
            raise PipelineError(f"block {block} is unreachable", block, hop) from None

    async def _forward(self, msg: PipelineForward, meta: dict, tensor):
        nxt_block = block_at(meta, msg.hop + 1)
        nxt = await self._member_connection(msg.route[msg.hop + 1], nxt_block, msg.hop + 1)
        nxt.send_nowait(PipelineForward(request_id=msg.request_id, route=msg.route, hop=msg.hop + 1,
                                        tensors=() if tensor is None else (tensor,), meta=meta))

    def _share(self, client: str, sender=None, meta: dict | None = None, via: str | None = None) -> str:
        """Whose compute share ``client``'s traversals take (shares.py): by the address of its
        connection here, ``sender`` at hop 0 (a member's too), else its client connection; a
        middle hop, which has neither, by the ``client_addr`` that the member ``via`` passed on,
        as that member's word (its own addresses: one member cannot take another's)."""
        pc = sender if sender is not None else self.peer.client_connection(client)
        if pc is not None:
            return self.shares.of(client, address_share(pc.peer_addr))
        addr = (meta or {}).get("client_addr")
        if via is not None and isinstance(addr, str) and 0 < len(addr) <= MAX_CLIENT_ADDR:
            return self.relayed_shares.of(client, f"{addr} via {via[:16]}")  # never pushes out an address seen here
        return self.shares.of(client, None)

    async def _client(self, client: str):
        if not await self.peer.wait_for(lambda: self.peer.client_connection(client) is not None, CLIENT_WAIT_S):
            raise PipelineError(f"client {client[:12]} is not connected to the last hop {self.peer.addr}")
        return self.peer.client_connection(client)

    def _tell_client(self, client: str, request_id: int, meta: dict):
        reply = self.peer.client_connection(client)
        if reply is not None:
            _send_error(reply, request_id, meta)


def _send_error(pc, request_id: int, meta: dict):
    """A refusal (PipelineResult with ``error``, ``hop``, ``block``, ``fault``) on ``pc``."""
    try:
        pc.send_nowait(refusal(request_id, meta))
    except ConnectionError:
        pass


def refuse_requests(peer: PeerServices):
    """For a peer that serves nothing: every request is answered with an error at once."""
    async def handler(msg: PipelineForward, pc, pid):
        _send_error(pc, msg.request_id, {"error": f"peer {peer.addr} serves no blocks", "hop": msg.hop,
                                         "block": block_at(msg.meta, msg.hop), "fault": "hop"})
    peer.on(PipelineForward, handler)


def _input(msg: PipelineForward, b: Block, spec: dict) -> torch.Tensor | None:
    """The hidden states from the hop below, checked against the block and the spec before any
    compute. Hop 0 takes its ids from the spec: a tensor there is the request's fault. At a later
    hop the tensor is what the hop below computed (only members forward): a wrong shape, a bad
    encoding or NaN is that hop's fault (fault "hop", naming it), so the client reroutes around it."""
    if b.is_first:
        if msg.tensors:
            raise bad_request("block 0 takes its token ids from the spec, not a tensor", b.index)
        return None
    below, below_block = msg.hop - 1, block_at(msg.meta, msg.hop - 1)

    def bad_input(why: str) -> PipelineError:
        return PipelineError(f"block {b.index} got bad hidden states from hop {below} (block {below_block}): {why}",
                             below_block, below, fault="hop")
    if len(msg.tensors) != 1:
        raise bad_input(f"{len(msg.tensors)} tensors, expected one")
    w = msg.tensors[0]
    want = (1, len(spec["ids"]), b.cfg.d_model)
    if tuple(w.shape) != want or w.dtype != "float32":  # checked before anything is decompressed
        raise bad_input(f"shape {tuple(w.shape)} ({w.dtype}); block {b.index} takes {want} float32 for this spec")
    try:
        x = from_wire(w).float()
    except (ProtocolError, ValueError) as e:
        raise bad_input(f"they do not decode: {e}") from None
    if not torch.isfinite(x).all():
        raise bad_input("they hold NaN or infinity")
    return x


class ServeError(Exception):
    """What a serving peer was told to serve is not there (the message names the file and mode)."""


def load_served(blocks, checkpoints: str | Path | None = None, reference: str | Path | None = None,
                check_rows: bool = True) -> ServedBlocks:
    """Blocks ``blocks`` of a trained model: BlockTrain blocks from ``checkpoints`` (blocktrain and
    autoregressive modes) and, optionally, the end-to-end reference from ``reference``, each
    checked for batch-invariant rows unless ``check_rows`` is False (a caller that only reads the
    model's config). Raises ServeError, or NoSuchBlock for a block the model does not have."""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.model import ModelConfig

    if not checkpoints and not reference and ckpt.SHIPPED_MODEL.is_dir():
        checkpoints = ckpt.SHIPPED_MODEL  # the small trained model the package ships
    if not checkpoints and not reference:
        raise ServeError("nothing to serve: give --checkpoints DIR (bt-train's OUT/checkpoints, or bt-peer "
                         "assemble's OUT) and/or --reference DIR (bt-train's OUT/reference)")
    served = ServedBlocks()
    for directory, target, mode in ((checkpoints, served.blocktrain, "blocktrain and autoregressive"),
                                    (reference, served.reference, "reference")):
        if not directory:
            continue
        files = ckpt.block_files(directory)
        if files:  # a block the model does not have: the check and message of every --block (NoSuchBlock)
            try:
                model = ModelConfig.from_dict(ckpt.load(files[min(files)]).config)
            except (ckpt.CheckpointError, ValueError) as e:
                raise ServeError(f"{files[min(files)]}: {e}") from None
            for k in blocks:
                model.check_block(k)
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
            if b.drafter is not None and not c.extra.get("drafter_steps"):
                b.drafter = None  # never trained (its phase did not run): drafts come from the slots instead
            b.eval()
            target[k] = b
    if check_rows:
        served.check_rows()
    return served
