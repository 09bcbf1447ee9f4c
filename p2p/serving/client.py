"""The serving client: pick a chain of serving peers from the swarm view, push traversals through
it, collect the answers, and retry through other holders when a hop fails.

Rules:
- The client keeps a connection to the first hop (requests) and the last (answers); it is a
  client, never a member. Answers are matched to requests by id; a connection that closes fails
  every request waiting on it. It sends a PING on each every ``keepalive_s``: a hop closes a
  client it has not heard for ``client_idle_s`` (300 s), and the last hop only answers (a session
  longer than that lost its answers).
- Decoding is ``blocks/decode.Session`` (sans-IO): the client sends its specs and feeds it the
  last hop's logits and drafts (sampling: drawn drafts and their distributions, checked
  first). ``exact`` (the default): the last block drafts (and the client
  by prompt lookup), the next traversal verifies; greedy output is the autoregressive output byte for byte, sampled output
  is distributed as autoregressive sampling. ``autoregressive`` and ``reference``: one byte per
  traversal (the BlockTrain blocks, or the end-to-end reference model). ``blocktrain``: one
  traversal for the whole output (prompt + placeholders, greedy), the paper's one-shot mode.
- A hop that lost the session's caches (fault "session") costs one rebuild on the same chain;
  a failed hop costs a new chain: ``generate`` keeps the session and rebuilds the caches there.
- ``generate`` asks a member for its view (STATUS) and builds a chain through it (view.py: one
  live serving peer per block, smallest peer id first, avoiding peers that failed); on a failure
  that names a block it avoids that hop the next time; a request that gets no answer lets the
  swarm notice the silent peer (``dead_after_s``) before asking again. A saturated hop (fault
  "busy") is not a failed one: the next chain goes through another holder of its block where
  there is one, else through it again, after a pause that doubles (BUSY_PAUSE_S up to
  BUSY_PAUSE_MAX_S, at most BUSY_TRIES times); the session goes on where it was, and a busy
  refusal is not one of the ``attempts``.
- The request's vocabulary (modes, faults, refusals) is api.py's, shared with the hops; the
  client imports no server module.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import torch

from blocktrain.blocks.decode import MAX_TREE, Sampling, Session, one_traversal_spec, recompute_spec
from blocktrain.protocol import ConnectionClosed, Ping, PipelineForward, PipelineResult, ProtocolError, Role

from ..identity import peer_id
from ..tensors import from_wire, to_wire
from ..transport import CLIENT_INFO, PeerConnection, Timeouts, make_connection, open_connection
from ..view import NoChain, chain, chain_when_ready, holders, status_members
from .api import DEFAULT_CODEC, MODES, PipelineError
from .verify import DEFAULT_TOL, CheckFailed, OutputRejected, check_output


DRAFT_LEN = 16  # bytes drafted per traversal in exact mode, greedy
# Sampled exact mode: draft chains per verified node, one per likely next byte, each this long.
# Sampled drafts are rarely accepted past a few bytes: chains of 8 keep 98% of 16's bytes per
# traversal (2.51 against 2.57, results/serving/drafting.json) for less drafting at the last hop,
# and over 3 WAN hops gave 2.1x autoregressive against 1.8x (results/wan/wan-valid-64-t08-wide*.json).
DRAFT_WIDTH, SAMPLED_DRAFT_LEN = 4, 8
# Sampled exact mode: the draft model draws each draft byte from its own SAMPLE_K most likely bytes
# at the session's temperature, and the answer carries those distributions, so a draft byte is
# accepted with probability min(1, p/q) rather than p(its argmax). k was chosen on windows of the
# training split (results/serving/drafting-drawn-k.json, bytes per traversal: k 8 3.68, 16 4.29,
# 64 4.64): 16 takes most of the gain, and the answer carries 3 bytes per (byte, weight) pair.
SAMPLE_K = 16
# Exact mode also drafts by prompt lookup: after the longest earlier match of the last LOOKUP
# bytes, what followed it, as a second branch of the tree (a small model's output repeats itself;
# results/wan/wan-valid-256-greedy-lookup.json, results/serving/drafting.json).
LOOKUP = 8
KEEPALIVE_S = 30.0  # a PING on each connection this often (hops close clients silent for 300 s)
# A saturated hop (fault "busy": its waiting traversals are at their bound) is tried again after a
# pause, doubling from BUSY_PAUSE_S to BUSY_PAUSE_MAX_S, at most BUSY_TRIES times: a flood's queue
# turns over in seconds, and the hop makes room for a client that waited its turn (fair.py).
BUSY_PAUSE_S, BUSY_PAUSE_MAX_S, BUSY_TRIES = 0.25, 4.0, 12


def draft_length(draft_len: int | None, sampling: Sampling) -> int:
    """The bytes drafted per traversal: ``draft_len`` as given, else the default for greedy or
    sampled decoding."""
    if draft_len is not None:
        return draft_len
    return SAMPLED_DRAFT_LEN if sampling.temperature > 0 else DRAFT_LEN


def _request_id() -> int:
    """A fresh, unguessable request id: a peer that cannot read our traffic cannot name our
    requests (to answer one in our place)."""
    return secrets.randbits(63)


# Streaming output: called with the output so far (it only grows) and the seconds since the request began.
OnBytes = Callable[[bytes, float], None]

class PipelineClient:
    """Sends requests into a chain of serving peers and collects the answers.

    ``route``: the hops' addresses, ``blocks``: the block each hop serves.
    """

    def __init__(self, identity, swarm_key, route: list[str], blocks: list[int], timeouts: Timeouts | None = None,
                 link=None, codec: str = DEFAULT_CODEC, timeout_s: float = 30.0,
                 keepalive_s: float | None = KEEPALIVE_S, bind: str | None = None):
        self.identity, self.swarm_key, self.bind = identity, swarm_key, bind  # bind: our local address
        self.route, self.blocks = list(route), list(blocks)
        self.timeouts = timeouts or Timeouts()
        self.link, self.codec, self.timeout_s, self.keepalive_s = link, codec, timeout_s, keepalive_s
        self.conns: dict[str, PeerConnection] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._readers: list[asyncio.Task] = []
        self.id = peer_id(identity)
        self.last_rows: torch.Tensor | None = None  # blocktrain: the logits its output came from
        self._drafter = True  # the last hop says whether its block has a draft model

    async def connect(self):
        """Connect to the first and last hops; one that cannot be reached is that hop's failure
        (``PipelineError`` naming its index, so a caller reroutes around it)."""
        for addr in dict.fromkeys([self.route[0], self.route[-1]]):
            host, _, port = addr.rpartition(":")
            conn = make_connection(Role.INITIATOR, self.identity, self.swarm_key, info=CLIENT_INFO)
            hop = self.route.index(addr)
            try:
                pc = await open_connection(host, int(port), conn, self.timeouts, self.link, name=addr, bind=self.bind)
            except (ConnectionError, OSError) as e:
                raise PipelineError(f"cannot reach hop {hop} ({addr}): {e}", self.blocks[hop], hop) from None
            self.conns[addr] = pc
            self._readers.append(asyncio.get_running_loop().create_task(self._read(pc, addr)))
        if self.keepalive_s:  # at least twice within the hops' idle limit (PROTOCOL.md 7.3)
            every = min(self.keepalive_s, self.timeouts.client_idle_s / 2)
            self._readers.append(asyncio.get_running_loop().create_task(self._keepalive(every)))

    async def _keepalive(self, every: float):
        """A PING on every open connection each ``every`` seconds (``keepalive_s`` None: no task)."""
        nonce = 0
        while True:
            await asyncio.sleep(every)  # the keepalive: time is the behaviour here
            for pc in self.conns.values():
                nonce += 1
                try:
                    pc.send_nowait(Ping(nonce=nonce))
                except (ConnectionError, ProtocolError):
                    pass  # a closed connection: its reader fails what waited on it

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
            await pc.close("done", linger=False)  # a client: nothing to be taken for a member lost
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    def sent_wire_bytes(self) -> int:
        return sum(pc.conn.counter.snapshot()["sent"]["total"]["wire_bytes"] for pc in self.conns.values())

    async def _request(self, meta: dict, x: torch.Tensor | None = None) -> PipelineResult:
        rid = _request_id()
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        meta = {**meta, "blocks": self.blocks, "reply_to": self.id, "codec": self.codec}
        tensors = () if x is None else (to_wire("x", x, self.codec, "never"),)
        self.conns[self.route[0]].send_nowait(PipelineForward(request_id=rid, route=tuple(self.route), hop=0,
                                                              tensors=tensors, meta=meta))
        try:
            async with asyncio.timeout(self.timeout_s):
                res = await fut
        except TimeoutError:
            self.pending.pop(rid, None)
            raise PipelineError(f"no answer within {self.timeout_s}s from the chain {self.route} "
                                f"(blocks {self.blocks})") from None
        if "error" in res.meta:
            raise PipelineError.from_meta(res.meta)
        return res

    def _end(self, session: int, mode: str):
        """Free the session's caches along the chain (no answer comes back)."""
        try:
            self.conns[self.route[0]].send_nowait(PipelineForward(
                request_id=_request_id(), route=tuple(self.route), hop=0,
                meta={"mode": mode, "session": session, "end": True, "blocks": self.blocks, "reply_to": self.id}))
        except ConnectionError:
            pass  # the hops free it when it idles

    async def traverse(self, session: int, mode: str, spec: dict, end: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One traversal of ``spec``: (logits (V, 256), drafts (V, S), compute seconds)."""
        a = await self.answer(session, mode, spec, end)
        return a.logits, a.drafts, a.compute_s

    async def answer(self, session: int, mode: str, spec: dict, end: bool = False) -> Answer:
        """One traversal of ``spec``, the last hop's whole answer, checked."""
        res = await self._request({"mode": mode, "session": session, "spec": spec, "end": end})
        last = len(self.route) - 1
        asked = bool(spec.get("sample")) and spec.get("draft", 0) > 0  # drawn drafts, where the hop draws
        if len(res.tensors) not in ((2, 4) if asked else (2,)):
            raise PipelineError(f"the last hop answered {len(res.tensors)} tensors, expected logits and drafts"
                                + (" (and the distributions its drafts were drawn from)" if asked else ""), hop=last)
        drawn = len(res.tensors) == 4  # else its drafts are its argmax chains (a hop of r9 or before)
        logits, drafts = from_wire(res.tensors[0]), from_wire(res.tensors[1])
        V = len(spec["logits"])
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (1, V) or logits.shape[2] != 256 or drafts.dim() != 3 \
                or tuple(drafts.shape[:2]) != (1, V) or not torch.isfinite(logits).all():
            raise PipelineError(f"the last hop answered logits {tuple(logits.shape)} and drafts {tuple(drafts.shape)} "
                                f"for {V} verified tokens", hop=last)
        if drafts.is_floating_point():
            raise PipelineError(f"the last hop answered drafts of {drafts.dtype}, expected int16", hop=last)
        q_ids = q = None
        if drawn:  # the drafts as the session reads them
            q_ids, q = _drawn_from(res.tensors[2], res.tensors[3], drafts[0].long(), spec, last)
        self._drafter = bool(res.meta.get("drafter", True))
        return Answer(logits[0].float(), drafts[0].long(), q_ids, q, float(res.meta.get("compute_s", 0.0)))

    async def run(self, s: Session, mode: str, session: int | None = None, rebuilds: int = 2,
                  on_bytes: OnBytes | None = None) -> dict:
        """Drive ``s`` to its end through this chain; a hop that lost the caches ("session" fault)
        gets them rebuilt from the committed bytes, at most ``rebuilds`` times. ``on_bytes(output,
        seconds)``: after every traversal that accepted bytes, the output so far (it only grows)."""
        session = secrets.randbits(62) if session is None else session  # unguessable, new per run
        compute, ended = 0.0, False
        t0 = time.perf_counter()
        arrivals: list[list[float]] = []  # [seconds, bytes of output] after each traversal that added some
        try:
            while s.state != "done":
                spec = s.next_spec()
                ended = s._left() <= 1  # this traversal surely finishes the output
                try:
                    a = await self.answer(session, mode, spec, end=ended)
                except PipelineError as e:
                    if e.fault != "session" or rebuilds <= 0:
                        raise
                    rebuilds -= 1
                    s.stats.rebuilds += 1  # over every chain this session tried
                    s.reset_caches()
                    continue
                compute += a.compute_s
                if not self._drafter and s.drafter:  # no draft model at the last hop: draft by slots,
                    # as many after each verified node as keep the tree within a hop's bounds
                    s.drafter, s.slots = False, min(s.draft_len, max(0, MAX_TREE // (1 + s.draft_len) - 1))
                try:
                    took = s.feed(a.logits, a.drafts, a.q_ids, a.q)
                except ValueError as e:  # its drafts are not what it says it drew them from
                    raise PipelineError(f"the last hop's answer: {e}", hop=len(self.route) - 1) from None
                if took:
                    arrivals.append([round(time.perf_counter() - t0, 4), len(s.output)])
                    if on_bytes is not None:
                        on_bytes(s.output, arrivals[-1][0])
        finally:
            if not ended:
                self._end(session, mode)
        return {"seconds": time.perf_counter() - t0, "traversals": s.stats.traversals, "compute_s": compute,
                "first_byte_s": arrivals[0][0] if arrivals else None, "arrivals": arrivals,
                "bytes_per_traversal": s.stats.bytes_per_traversal(len(s.output)),
                "drafted": s.stats.drafted, "accepted": s.stats.accepted, "rebuilds": s.stats.rebuilds,
                "positions": s.stats.new_tokens}

    async def generate_blocktrain(self, prompt: bytes, n: int, sampling: Sampling = Sampling(),
                                  on_bytes: OnBytes | None = None) -> tuple[bytes, dict]:
        """N bytes from one traversal of the chain (prompt + N-1 placeholders)."""
        t0 = time.perf_counter()
        spec = one_traversal_spec(prompt, n)
        logits, _, compute = await self.traverse(secrets.randbits(62), "blocktrain", spec, end=True)
        self.last_rows = logits  # what the output was decoded from (checked by --verify)
        if sampling.temperature == 0:
            out = logits.argmax(-1).tolist()
        else:
            import numpy as np
            rng = np.random.default_rng(sampling.seed)
            out = [int(rng.choice(256, p=sampling.probs(row))) for row in logits]
        seconds = time.perf_counter() - t0
        if on_bytes is not None:
            on_bytes(bytes(out), seconds)
        return bytes(out), {"seconds": seconds, "traversals": 1, "compute_s": compute,
                            "bytes_per_traversal": float(n), "positions": len(spec["ids"]),
                            "first_byte_s": seconds, "arrivals": [[round(seconds, 4), len(out)]]}

    async def recompute(self, tokens: bytes, n_prompt: int, mode: str) -> torch.Tensor:
        """The rows a finished output was decoded from, recomputed by this chain in one traversal
        (a new session, ended with it): blocktrain's own traversal again, else ``recompute_spec``."""
        n = len(tokens) - n_prompt
        spec = one_traversal_spec(tokens[:n_prompt], n) if mode == "blocktrain" else recompute_spec(tokens, n_prompt)
        logits, _, _ = await self.traverse(secrets.randbits(62), mode, spec, end=True)
        return logits

    async def generate(self, prompt: bytes, n: int, mode: str = "exact", sampling: Sampling = Sampling(),
                       draft_len: int | None = None, max_seq_len: int | None = None,
                       on_bytes: OnBytes | None = None) -> tuple[bytes, dict]:
        if mode == "blocktrain":
            return await self.generate_blocktrain(prompt, n, sampling, on_bytes)
        s = new_session(prompt, n, mode, sampling, draft_len, max_seq_len)
        stats = await self.run(s, mode, on_bytes=on_bytes)
        return s.output, stats


def new_session(prompt: bytes, n: int, mode: str, sampling: Sampling = Sampling(), draft_len: int | None = None,
                max_seq_len: int | None = None) -> Session:
    exact = mode == "exact"
    return Session(prompt, n, max_seq_len or len(prompt) + n,
                   draft_len=draft_length(draft_len, sampling) if exact else 0, drafter=exact,
                   lookup=LOOKUP if exact else 0, sampling=sampling, invariant=True, width=DRAFT_WIDTH,
                   sample_k=SAMPLE_K if exact else 0)


@dataclass(frozen=True)
class Answer:
    """The last hop's answer to one traversal: logits (V, 256), drafts (V, S), and with drawn
    drafts the distributions they were drawn from (ids long, probabilities float16, (V, W x draft, k))."""
    logits: torch.Tensor
    drafts: torch.Tensor
    q_ids: torch.Tensor | None
    q: torch.Tensor | None
    compute_s: float


def _drawn_from(ids_wire, q_wire, drafts: torch.Tensor, spec: dict, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributions a drawn draft's bytes came from, checked: one per drafting step of every
    chain of every verified node, over ``k`` distinct bytes, weights finite, >= 0, not all 0; and
    every drawn byte of every chain (``drafts``, (V, S)) among its step's bytes with a weight
    above 0. All of them, not only the chain the session goes on with: which answers a client
    refuses must not depend on the bytes it drew."""
    ids, q = from_wire(ids_wire), from_wire(q_wire)
    V, k, W, steps = len(spec["logits"]), spec["sample"][2], spec.get("width", 1), spec["draft"]
    shape = (1, V, W * steps, k)
    if ids.dtype != torch.uint8 or q.dtype != torch.float16 or tuple(ids.shape) != shape or tuple(q.shape) != shape:
        raise PipelineError(f"the last hop answered draft distributions {ids.dtype} {tuple(ids.shape)} and "
                            f"{q.dtype} {tuple(q.shape)}, expected uint8 and float16 {shape}", hop=last)
    ids = ids[0].long()
    q = q[0]
    distinct = bool((ids.sort(-1).values.diff(dim=-1) != 0).all()) if k > 1 else True
    if not torch.isfinite(q).all() or (q < 0).any() or not (q.float().sum(-1) > 0).all() or not distinct:
        raise PipelineError("the last hop answered draft distributions that are not distributions "
                            "(weights not finite, below 0 or all 0, or a byte twice)", hop=last)
    if tuple(drafts.shape) != (V, W * (1 + 2 * steps) if W > 1 else steps):
        raise PipelineError(f"the last hop answered drafts {tuple(drafts.shape)} for {V} nodes, {W} chain(s) "
                            f"of {steps} drawn bytes", hop=last)
    drawn = drafts.reshape(V, W, 1 + 2 * steps)[:, :, 1:1 + steps].reshape(V, W * steps) if W > 1 else drafts
    weight = torch.where(ids == drawn.unsqueeze(-1), q.float(), torch.zeros(())).sum(-1)
    if ((drawn < -1) | (drawn >= 256)).any() or ((drawn >= 0) & (weight <= 0)).any():
        raise PipelineError("the last hop answered drawn drafts outside the distributions it says it drew "
                            "them from", hop=last)
    return ids, q


def check_request(prompt: bytes, n: int, mode: str, max_seq_len: int | None = None, sampling: Sampling = Sampling(),
                  draft_len: int | None = None):
    """Bad requests fail here, with the fix, before anything is sent."""
    if mode not in MODES:
        raise PipelineError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}", fault="request")
    if not prompt:
        raise PipelineError("the prompt is empty: give at least one byte of text to continue", fault="request")
    if n < 1:
        raise PipelineError("ask for at least one byte", fault="request")
    if sampling.temperature < 0 or sampling.top_k < 0 or not 0 <= sampling.top_k <= 256:
        raise PipelineError("temperature must be >= 0 and top-k in 0..256", fault="request")
    if draft_len is not None and not 0 <= draft_len <= 32:
        raise PipelineError("draft length must be in 0..32", fault="request")
    if max_seq_len is not None and len(prompt) + n - 1 > max_seq_len:
        raise PipelineError(f"prompt ({len(prompt)} bytes) + {n} bytes exceeds the model's {max_seq_len} positions: "
                            f"shorten the prompt or ask for at most {max(0, max_seq_len - len(prompt) + 1)} bytes",
                            fault="request")


async def generate(host: str, port: int, ident, key, prompt: bytes, n: int, mode: str, timeout: float,
                   attempts: int = 3, log=lambda s: None, sampling: Sampling = Sampling(),
                   draft_len: int | None = None, wait_s: float | None = None, verify: bool = False,
                   verify_tol: float = DEFAULT_TOL, on_bytes: OnBytes | None = None) -> tuple[bytes, dict]:
    """Pick a chain from the swarm view via HOST:PORT and run the request; when a hop fails, retry
    through another peer holding that block, from the prompt (a saturated hop: module rules,
    ``stats["busy_retries"]``). While nothing listens at HOST:PORT or no chain is there yet, ask
    again for up to ``wait_s`` (default: ``timeout``). ``verify``: check the output on other
    holders (verify.py); a chain with a hop named there is avoided and the output generated again
    (``stats["verify"]`` says what was checked). ``on_bytes``: the output as it is accepted (not
    with ``verify``: a rejected output is made again from the prompt); a retry on another chain
    starts again from the prompt (exact: the same bytes). ``stats["first_byte_s"]`` counts from
    this call, as ``stats["seconds"]`` does (the view, connections and failed attempts included)."""
    if verify and on_bytes is not None:
        raise ValueError("streamed output cannot be verified first: give one or the other")
    check_request(prompt, n, mode, sampling=sampling, draft_len=draft_len)
    tmo = Timeouts(connect_s=timeout, handshake_s=timeout)
    avoid, busy, kept = set(), _Busy(), []  # type: set[str], _Busy, list[Session]  # kept: see _run_on
    last: Exception | None = None
    t0 = time.perf_counter()
    first: list[float] = []  # when the first byte came, from t0

    def came(output: bytes, seconds: float) -> None:
        if output and not first:
            first.append(time.perf_counter() - t0)
        if on_bytes is not None:
            on_bytes(output, seconds)
    attempt = 0
    while attempt < attempts:
        st, route = await _next_chain(host, port, ident, key, tmo, avoid, busy,
                                      timeout if wait_s is None else wait_s, log)
        msl = (st.get("serving") or {}).get("max_seq_len")
        check_request(prompt, n, mode, msl, sampling, draft_len)
        client = PipelineClient(ident, key, route, list(range(len(route))), tmo, timeout_s=timeout)
        try:
            await client.connect()
            # a checked output that failed is made again from the prompt
            out, stats, rows = await _run_on(client, prompt, n, mode, sampling, kept, verify, draft_len, msl, came)
            stats["route"], stats["attempts"], stats["first_byte_s"] = route, attempt + 1, first[0] if first else None
            stats["busy_retries"] = busy.tries
            if verify:
                recompute = functools.partial(_recompute, ident, key, tmo, timeout, prompt + out, len(prompt), mode)
                stats["verify"] = await _verified(rows, route, status_members(st), avoid, recompute, verify_tol, log)
            stats["seconds"] = time.perf_counter() - t0
            return out, stats
        except (PipelineError, ConnectionError) as e:
            if getattr(e, "fault", "hop") == "request":
                raise  # no other chain would serve it either (VerifyError: nothing can be checked)
            last = e
            if busy.refused(e, route, log):
                continue  # the session in ``kept`` goes on from its committed bytes
            kept.clear()  # a failed hop: from the prompt
            attempt += 1
            log(f"attempt {attempt} through {route} failed: {e}")
            await _avoid_after(e, route, avoid, tmo)
        finally:
            await client.close()
    raise PipelineError(f"gave up after {attempts} attempts: {last}")


async def _next_chain(host, port, ident, key, tmo: Timeouts, avoid: set[str], busy: _Busy, wait_s: float,
                      log) -> tuple[dict, list[str]]:
    """The swarm view and the next chain through it, avoiding ``avoid``, and ``busy``'s hops where
    their blocks have other holders."""
    try:
        st, route = await chain_when_ready(host, port, ident, key, tmo, avoid, wait_s, log)
    except NoChain as e:  # the view's failure, as the client's: no chain to run it on
        raise PipelineError(str(e), e.block) from None
    route = busy.route(st, avoid, route)
    await busy.wait(route, log)
    return st, route


class _Busy:
    """One request's saturated hops (fault "busy"): the next chain goes around each through another
    holder of its block where there is one, else through it again after a pause that doubles from
    BUSY_PAUSE_S to BUSY_PAUSE_MAX_S; at most BUSY_TRIES refusals."""

    def __init__(self) -> None:
        self.hops: set[str] = set()
        self.tries, self.pause = 0, BUSY_PAUSE_S

    def route(self, st: dict, avoid: set[str], route: list[str]) -> list[str]:
        """``route`` (a chain avoiding ``avoid``) with every busy hop whose block has another
        holder left out; a chain of another length (a block left with no holder) is not taken."""
        around: set[str] = set()
        for hop in sorted(self.hops):
            try:
                if len(chain(st, avoid | around | {hop})) == len(route):
                    around.add(hop)
            except NoChain:
                pass  # its block has no other holder: through it again
        return chain(st, avoid | around) if around else route

    def refused(self, e: Exception, route: list[str], log) -> bool:
        """True where ``e`` is a busy hop of ``route`` and refusals are left: try again (not an attempt)."""
        hop = getattr(e, "hop", None)
        if getattr(e, "fault", None) != "busy" or not isinstance(hop, int) or not 0 <= hop < len(route) \
                or self.tries >= BUSY_TRIES:
            return False
        self.tries += 1
        self.hops.add(route[hop])
        log(f"{route[hop]} is saturated: {e}")
        return True

    async def wait(self, route: list[str], log) -> None:
        """The pause before a chain that goes through a busy hop again."""
        if self.hops & set(route):
            log(f"trying a saturated hop again in {self.pause:.2f} s")
            await asyncio.sleep(self.pause)
            self.pause = min(2 * self.pause, BUSY_PAUSE_MAX_S)


async def _run_on(client: PipelineClient, prompt: bytes, n: int, mode: str, sampling: Sampling, kept: list,
                  fresh: bool, draft_len: int | None, msl,
                  on_bytes: OnBytes | None = None) -> tuple[bytes, dict, torch.Tensor]:
    """The request run through ``client``'s chain: the output, its stats and the rows it was
    decoded from. ``kept`` holds the session (none: a new one, also where ``fresh``): it goes on
    where it was on this chain, and stays there for the caller after a failure."""
    if mode == "blocktrain":
        out, stats = await client.generate_blocktrain(prompt, n, sampling, on_bytes)
        assert client.last_rows is not None  # generate_blocktrain sets it
        return out, stats, client.last_rows
    if kept and not fresh:
        kept[0].reset_caches()  # a new chain: its hops hold nothing of this session
    else:
        kept[:] = [new_session(prompt, n, mode, sampling, draft_len, msl)]
    s = kept[0]
    stats = await client.run(s, mode, on_bytes=on_bytes)
    stats["traversals"] = s.stats.traversals
    return s.output, stats, torch.stack(s.rows)


async def _verified(rows: torch.Tensor, route: list[str], members, avoid: set[str], recompute, tol: float,
                    log) -> dict:
    """``--verify``: the output's rows checked on the other holders of each block (verify.py), as
    ``stats["verify"]``; ``OutputRejected`` when a hop of its chain was named or is a suspect."""
    others = {b: [h for h in holders(members, b, "serve") if h not in avoid] for b in range(len(route))}
    check = await check_output(rows, route, others, recompute, tol)
    if check.named:
        log(f"--verify named {check.named}: their answers differ from the other holders of their block")
    if check.suspects:
        log(f"--verify avoids {check.suspects} (suspects, not named: {check.why or 'unresolved'})")
    if not check.ok:
        raise OutputRejected(f"the output through {route} failed its check: {check.why}", check.named + check.suspects)
    return check.as_dict()


async def _avoid_after(e: Exception, route: list[str], avoid: set[str], tmo: Timeouts) -> None:
    """A failed attempt through ``route``: the hops it blames are avoided next (a rejected output's
    named and suspect hops, a recomputing chain's failed hop, the hop that failed); with none to
    blame, wait until the swarm notices a silent peer."""
    hop = getattr(e, "hop", None)
    if isinstance(e, OutputRejected):
        avoid.update(e.avoid)
    elif isinstance(e, CheckFailed) and e.addr is not None:
        avoid.add(e.addr)
    elif isinstance(hop, int) and 0 <= hop < len(route):
        avoid.add(route[hop])
    else:  # no answer: let the swarm notice the silent peer
        await asyncio.sleep(tmo.dead_after_s)  # the swarm's liveness timeout is the behaviour here


async def _recompute(ident, key, tmo: Timeouts, timeout: float, tokens: bytes, n_prompt: int, mode: str,
                     route: list[str]) -> torch.Tensor:
    """``tokens``' decoded rows, recomputed through ``route`` by a client of its own."""
    client = PipelineClient(ident, key, route, list(range(len(route))), tmo, timeout_s=timeout)
    try:
        await client.connect()
        return await client.recompute(tokens, n_prompt, mode)
    except PipelineError as e:  # its hop is this route's, and its fault never the request's (it was served)
        hop = e.hop if isinstance(e.hop, int) and 0 <= e.hop < len(route) else None
        raise CheckFailed(f"checking through {route}: {e}", None if hop is None else route[hop]) from None
    finally:
        await client.close()
