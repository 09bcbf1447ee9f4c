"""Decoding an assembled BlockTrain chain: autoregressive, and exact (draft, then verify).

Rules:
- Three parts, kept apart so that the network runs this code unchanged:
  1. ``hop_step(block, cache, x, spec)``: one block's share of one traversal, a pure function of
     the block, that block's ``BlockCache`` for the session, its input and the plain-data
     ``spec``. In process, ``run_chain`` calls it block after block; over the network, hop k
     calls it on the peer holding block k and forwards what it returns.
  2. ``Session`` (sans-IO, no torch modules): ``next_spec()`` says what the next traversal feeds
     the chain; ``feed(logits, drafts)`` takes the last hop's output for it and returns the bytes
     accepted. It holds the bytes, the draft tree in flight and the sampling generator.
  3. Drivers (``generate``): a session plus ``run_chain`` until the session is done.
- Exact mode: every traversal verifies the drafts proposed by the previous one and proposes the
  next. Greedy output is the argmax chain of the last head, byte for byte the autoregressive
  output (``draft_len=0`` is autoregressive decoding: the same session, one byte per traversal).
  With a temperature, drafts are verified by speculative sampling (Leviathan et al. 2023, Chen
  et al. 2023): a byte the draft model drew from q (``sample_k``: its k most likely bytes, q sent
  back with the drafts) is accepted with probability min(1, p(d) / q(d)), else p becomes
  (p - q)+ renormalised; a deterministic draft (argmax, runner-up, prompt lookup: q one-hot) with
  probability p(d), else d is removed from p; then the next sibling, or a byte drawn from p. The
  output is distributed as autoregressive sampling.
- Numerics: a verifying traversal computes a position together with others (and tree branches
  put its keys elsewhere in the cache), autoregressive decoding alone. ``invariant=True``
  (default) makes the result of every non-slot token bitwise independent of that
  (``Block.extend`` with ``exact_rows``), so greedy exact output is autoregressive output
  exactly, also when hidden states are rounded between hops, provided both modes run this code
  on the same hardware.

A traversal's spec: a dict of ints, lists of ints and bools (msgpack-able), the same for every
hop; each hop reads what it needs.

| key | type | meaning |
| --- | --- | --- |
| ``base``, ``keep`` | int, list[int] | rollback first: keep cache entries ``[0, base)`` and ``base + i`` for each ``i`` in ``keep`` (ascending), compacted. A new session: 0, []. |
| ``start`` | int | cache length after the rollback (``base + len(keep)``); a hop whose cache differs raises ``SessionMismatch`` (stale or lost session: rebuild it from the bytes). |
| ``ids`` | list[int] | the new tokens: bytes, ``MASK_ID`` (256) for placeholders. Hop 0 embeds them; the others receive hidden states of ``len(ids)`` positions. |
| ``positions`` | list[int] | absolute position of each new token (< ``max_seq_len``). |
| ``parents`` | list[int] | attention structure: token i sees the cache, its ancestors and itself; ``parents[i]`` is the earlier new token it continues, -1 for the cached prefix (``tree_mask``). |
| ``logits`` | list[int] | new tokens whose next-byte logits the last hop returns (the verified nodes). |
| ``slots`` | list[list[int]] | per entry of ``logits``, the placeholder tokens of the slot branch after it (maybe none); the last hop returns their argmax bytes as that node's draft. Placeholders come after every other new token; hop 0 derives their offsets from ``parents``. |
| ``draft`` | int | bytes the last block's draft model drafts after each entry of ``logits`` (0: none; then the slots draft). |
| ``invariant`` | bool | batch-invariant numerics (see above); the same for the whole session. |
| ``sample`` | [int, int, int] | optional: [seed, temperature x 1000, k]: the draft model draws each draft byte among its k most likely (else its argmax). |

The last hop returns ``{"logits": (B, len(logits), 256) float, "drafts": (B, len(logits), S) long}``
(S: ``draft``, else the longest slot branch; -1 pads), with ``sample`` also ``"q_ids"`` (long) and
``"q"`` (half), (B, len(logits), width x draft, k): each drawn byte's distribution. The session's
``feed`` takes exactly these.
A fault (``SessionMismatch``, a hop replaced): ``Session.reset_caches()``, then the next spec
rebuilds every hop's cache from the committed bytes (``base`` 0, ``keep`` []).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from .model import MASK_ID, VOCAB_SIZE, Block, BlockCache, tree_mask, tree_offsets


class SessionMismatch(Exception):
    """A hop's cache does not hold what the spec says it should (stale, lost or reordered)."""

    def __init__(self, block: int, have: int, want: int):
        super().__init__(f"block {block}: cache holds {have} positions after rollback, spec expects {want}")
        self.block, self.have, self.want = block, have, want


# ---------------------------------------------------------------------------------------------
# 1. One hop


@torch.no_grad()
def hop_step(block: Block, cache: BlockCache, x: torch.Tensor | None, spec: dict):
    """Block ``block``'s share of one traversal; returns hidden states (B, T, C), or for the last
    block of the chain ``{"logits", "drafts"}``. ``x``: hidden states from the hop below; for
    block 0, None (ids from ``spec``) or an id tensor (B, T) for a batch of equal sessions."""
    *_, out = hop_chunks(block, cache, x, spec)  # its last item is the result
    return out


@torch.no_grad()  # each resumption, on whatever thread runs it
def hop_chunks(block: Block, cache: BlockCache, x: torch.Tensor | None, spec: dict) -> Iterator:
    """``hop_step`` a chunk of at most ``CHUNK`` new tokens at a time: yields None after each
    chunk but the last, then the result (a ``Traversal`` stepped alone)."""
    t = Traversal(block, cache, x, spec)
    while (out := t.step_alone()) is None:
        yield None
    yield out


class Traversal:
    """One block's share of one traversal, computed a chunk of at most ``CHUNK`` new tokens at a
    time: alone (``hop_chunks``), or together with other sessions' traversals at a serving hop
    (``step_together``: one forward over the rows of all). A serving hop gives its compute slot
    up between chunks (one long traversal does not hold it throughout); every caller computes
    the same chunks, so the result depends neither on who runs it nor on what shares its steps.
    A chunk's tokens see the cache, which holds the chunks before it: rows are those of one step
    (batch-invariant rows bitwise, the others up to rounding). The rollback runs with the first
    chunk (``SessionMismatch`` then). Abandoned midway, the cache holds part of the traversal:
    drop the session (a serving hop does)."""

    def __init__(self, block: Block, cache: BlockCache, x: torch.Tensor | None, spec: dict):
        self.block, self.cache, self.x, self.spec = block, cache, x, spec
        self.i = -1  # new tokens computed; -1: the rollback has not run
        self.hs: list[torch.Tensor] = []

    def _begin(self):
        block, cache, spec = self.block, self.cache, self.spec
        base, keep = spec["base"], spec["keep"]
        if cache.length < base + (keep[-1] + 1 if keep else 0):  # it never held what the rollback keeps
            raise SessionMismatch(block.index, cache.length, spec["start"])
        cache.rollback(base, keep)
        if cache.length != spec["start"]:
            raise SessionMismatch(block.index, cache.length, spec["start"])
        ids = spec["ids"]
        if block.is_first and self.x is None:
            self.x = torch.tensor([ids], dtype=torch.long)
        self.T = T = len(ids)
        assert self.x is not None and self.x.shape[1] == T, f"block {block.index}: input of {self.x.shape[1]} positions for {T} tokens"
        self.past = cache.length
        self.mask = tree_mask(spec["parents"], self.past)
        self.exact = 0
        if spec.get("invariant"):  # every token but the slot branches, which the session lays out last
            self.exact = T - sum(len(s) for s in spec.get("slots") or [])
            assert all(i >= self.exact for s in spec.get("slots") or [] for i in s), "slot tokens must come last"
        self.offsets = tree_offsets(ids, spec["parents"]) if block.is_first else None
        self.i = 0

    def chunk(self) -> tuple:
        """The next chunk, as ``Block.extend_many`` takes a step (the rollback before the first)."""
        if self.i < 0:
            self._begin()
        i, j = self.i, min(self.T, self.i + CHUNK)  # a token's ancestors precede it: [cache + chunks so far]
        assert self.x is not None and i < j, "a traversal past its last chunk"
        return (self.x[:, i:j], self.cache, self.spec["positions"][i:j], self.mask[i:j, :self.past + j],
                max(0, min(j, self.exact) - i), None if self.offsets is None else self.offsets[i:j])

    def took(self, h: torch.Tensor):
        """The chunk's output: returns None while chunks are left, then the traversal's result
        (hidden states, or the last block's ``readout``)."""
        self.hs.append(h)
        self.i = min(self.T, self.i + CHUNK)
        if self.i < self.T:
            return None
        h = self.hs[0] if len(self.hs) == 1 else torch.cat(self.hs, dim=1)
        block = self.block
        return h if block.index < block.cfg.n_blocks - 1 else readout(block, self.cache, h, self.spec)

    def step_alone(self):
        return self.took(self.block.extend(*self.chunk()))


@torch.no_grad()
def step_together(traversals: list[Traversal]) -> list:
    """The next chunk of each traversal, those of one block in one forward (``Block.extend_many``);
    per traversal what ``Traversal.took`` returns, or the exception it raised. A forward that
    fails over a group is undone (each cache back to its length before) and its steps run one by
    one, so a failure lands on the traversal that caused it and the others go on."""
    outs: list = [None] * len(traversals)
    groups: dict[int, list[tuple[int, tuple]]] = {}
    for n, t in enumerate(traversals):
        try:
            groups.setdefault(id(t.block), []).append((n, t.chunk()))
        except Exception as e:  # noqa: BLE001 - its own rollback or spec: this traversal only
            outs[n] = e
    for group in groups.values():
        block = traversals[group[0][0]].block
        lengths = [[c.length for c in step[1].layers] for _, step in group]
        try:
            hs = block.extend_many([step for _, step in group])
        except Exception as e:  # noqa: BLE001 - whose step it was is found one by one
            if len(group) == 1:
                outs[group[0][0]] = e
                continue
            for (_, step), before in zip(group, lengths):
                for c, length in zip(step[1].layers, before):
                    c.length = length
            hs = None
        for i, (n, step) in enumerate(group):
            try:
                h = hs[i] if hs is not None else block.extend(*step)
                outs[n] = traversals[n].took(h)
            except Exception as e:  # noqa: BLE001 - its forward or readout: this traversal only
                outs[n] = e
    return outs


def readout(block: Block, cache: BlockCache, h: torch.Tensor, spec: dict) -> dict:
    """The last hop's answer: logits at ``spec["logits"]``; drafts from the draft model
    (``spec["draft"]`` bytes per verified node) or else from the slot branches' argmax."""
    logits = block.logits(h[:, spec["logits"]], exact=bool(spec.get("invariant")))
    slots = spec.get("slots") or []
    n_tokens = len(spec["ids"]) - sum(len(s) for s in slots)  # slot tokens come last
    if block.drafter is not None:
        drafted = drafter_step(block, cache, h[:, :n_tokens], spec, logits, spec.get("draft", 0),
                               spec.get("width", 1))
        if spec.get("draft", 0):
            return {"logits": logits, **drafted}
    S = max((len(s) for s in slots), default=0)
    drafts = torch.full((h.shape[0], len(spec["logits"]), S), -1, dtype=torch.long)
    if S:
        flat = [i for s in slots for i in s]
        best = block.logits(h[:, flat]).argmax(-1)  # (B, total slots)
        j = 0
        for n, s in enumerate(slots):
            drafts[:, n, :len(s)] = best[:, j:j + len(s)]
            j += len(s)
    return {"logits": logits, "drafts": drafts}


def drafter_step(block: Block, cache: BlockCache, f: torch.Tensor, spec: dict, logits: torch.Tensor,
                 steps: int, width: int = 1) -> torch.Tensor:
    """The draft model's share of a traversal at the last hop.

    Entries for the new (non-slot) tokens join its cache: token i pairs the feature of its
    parent (the last cached token for the root) with its byte. Then, from every verified node v
    at once, ``steps`` drafting steps: the first pairs v's feature with v's argmax byte (the
    byte that will follow v if v is the last accepted node, under greedy decoding), each next
    one the predicted feature with the byte just drafted. Returns ``{"drafts": (B, len(logits),
    steps)}``.

    ``width`` W > 1 (sampling: the byte after v is drawn, not always v's argmax): W chains per
    verified node, the first steps pairing v's feature with each of v's W most likely bytes.
    ``"drafts"`` is then (B, len(logits), W * (1 + 2 * steps)): per chain its first byte, its
    ``steps`` drafts, then each step's second most likely byte (a sibling of that step's draft);
    the session continues the chain whose first byte is the byte it emitted. With ``spec["sample"]``
    each draft byte is drawn (``draft_distribution``, ``sample_from``) and the result also holds
    ``"q_ids"`` and ``"q"``, (B, len(logits), W * steps, k): each step's distribution."""
    d = block.drafter
    B, n, C = f.shape
    start = cache.features.length
    parents = spec["parents"][:n]
    if start:
        last = cache.features.view()[:, start - 1:start]
    else:
        last = f.new_zeros(B, 1, C)
    f_prev = torch.cat([last, f], dim=1)[:, [p + 1 for p in parents]]  # parent -1 -> the last cached
    ids = torch.tensor([spec["ids"][:n]], dtype=torch.long).expand(B, n)
    tree = tree_mask(parents, start)  # (n, start + n)
    d(f_prev, ids, cache.drafter, tree)
    cache.features.append(f)
    verify = spec["logits"]
    V, W = len(verify), width
    if steps == 0 or V == 0:
        return {"drafts": torch.full((B, V, steps), -1, dtype=torch.long)}
    first = logits.topk(W, dim=-1).indices  # (B, V, W); W = 1: the argmax
    drafts = torch.full((B, V * W, steps), -1, dtype=torch.long)
    second = torch.full((B, V * W, steps), -1, dtype=torch.long)
    base = tree[verify].repeat_interleave(W, dim=0)  # (V * W, start + n): what each chain's node sees
    own = torch.eye(V * W, dtype=torch.bool)
    u, byte = f[:, verify].repeat_interleave(W, dim=1), first.reshape(B, V * W)  # chain v * W + j
    sample = spec.get("sample")
    gen = torch.Generator().manual_seed(sample[0]) if sample else None
    q_ids = q_p = None
    if sample:
        q_ids = torch.zeros((B, V * W, steps, sample[2]), dtype=torch.long)
        q_p = torch.zeros((B, V * W, steps, sample[2]), dtype=torch.float16)
    for s in range(steps):
        mask = torch.cat([base] + [own] * (s + 1), dim=1)  # + this chain's previous steps and itself
        u = d(u, byte, cache.drafter, mask)
        lg = block.logits(u)
        if sample:  # drawn from the draft model's own distribution, which the answer carries
            ids, probs = draft_distribution(lg, sample[1] / 1000, sample[2])
            pick = sample_from(probs, torch.rand((B, V * W), generator=gen, dtype=torch.float64))
            byte = ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
            runner = torch.where(pick == 0, ids[..., 1 if ids.shape[-1] > 1 else 0], ids[..., 0])
            q_ids[:, :, s], q_p[:, :, s] = ids, probs
        else:
            top2 = lg.topk(2, dim=-1).indices
            byte, runner = top2[..., 0], top2[..., 1]
        drafts[:, :, s], second[:, :, s] = byte, runner
    out = {"drafts": drafts}
    if W > 1:
        chains = torch.cat([first.unsqueeze(-1), drafts.view(B, V, W, steps), second.view(B, V, W, steps)], dim=-1)
        out["drafts"] = chains.view(B, V, W * (1 + 2 * steps))
    if sample:
        out["q_ids"], out["q"] = q_ids.view(B, V, W * steps, -1), q_p.view(B, V, W * steps, -1)
    return out


def draft_distribution(logits: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a sampled draft byte is drawn from: the draft model's ``k`` most likely
    bytes at ``temperature``, renormalised, as float16 (ids (..., k) long, probs (..., k) half;
    the session reads back these very numbers, so hop and client use one distribution)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    top = probs.topk(k, dim=-1)
    return top.indices, (top.values / top.values.sum(-1, keepdim=True)).half()


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the index into the last dim of ``probs`` (float16 weights, normalised here in
    float64) that uniform ``u`` falls in."""
    w = probs.double()
    cdf = torch.cumsum(w / w.sum(-1, keepdim=True), dim=-1)
    # u scaled into [0, cdf's last): the index found has a weight above 0 (the first weight,
    # the largest, is never 0), whatever the rounding of the last cumulative sum
    return (cdf < (u * cdf[..., -1]).unsqueeze(-1)).sum(-1)


def new_caches(blocks: list[Block]) -> list[BlockCache]:
    return [BlockCache(b) for b in blocks]


def run_chain(blocks: list[Block], caches: list[BlockCache], spec: dict, ids: torch.Tensor | None = None,
              between=None) -> dict:
    """One traversal in process. ``between(h)``: applied to the hidden states sent from a hop to
    the next (e.g. the network's bf16 rounding)."""
    x = ids
    for k, (b, c) in enumerate(zip(blocks, caches)):
        x = hop_step(b, c, x, spec)
        if between is not None and k < len(blocks) - 1:
            x = between(x)
    return x


# ---------------------------------------------------------------------------------------------
# 2. The session (sans-IO)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # sample among the k most likely bytes; 0: all 256
    seed: int = 0

    def probs(self, logits) -> np.ndarray:
        """The autoregressive sampling distribution for one position's logits (float64)."""
        z = torch.as_tensor(logits, dtype=torch.float64) / self.temperature
        if 0 < self.top_k < z.numel():
            kth = torch.topk(z, self.top_k).values[-1]
            z = torch.where(z < kth, torch.full_like(z, float("-inf")), z)
        return torch.softmax(z, dim=-1).numpy()


@dataclass
class SessionStats:
    traversals: int = 0
    drafted: int = 0  # draft bytes sent for verification
    accepted: int = 0  # of which accepted
    new_tokens: int = 0  # positions computed by every hop, all traversals
    accepted_by_source: dict = field(default_factory=dict)  # "model" / "lookup" -> accepted bytes
    drafted_by_source: dict = field(default_factory=dict)
    accept_hist: dict = field(default_factory=dict)  # draft bytes accepted in a traversal -> traversals
    rebuilds: int = 0  # caches a hop lost mid-session (fault "session"), rebuilt from the committed bytes

    def bytes_per_traversal(self, n: int) -> float:
        return n / max(1, self.traversals)


class Session:
    """Draft-and-verify decoding of ``n_bytes`` after ``prompt``, as plain data in and out.

    ``draft_len``: bytes drafted per traversal (0: autoregressive, one byte per traversal).
    ``drafter``: the last block's draft model drafts them. ``slots``: placeholders after every
    verified node, whose argmax drafts the next traversal (at most ``draft_len`` are used). ``lookup``: also draft by prompt
    lookup (the longest earlier match of the last ``lookup`` bytes, then what followed it), as a
    second branch of the draft tree. States: ``"spec"`` (call ``next_spec``), ``"output"`` (call
    ``feed``), ``"done"``.
    """

    def __init__(self, prompt: bytes | list[int], n_bytes: int, max_seq_len: int, *, draft_len: int = 0,
                 drafter: bool = False, slots: int = 0, lookup: int = 0, sampling: Sampling = Sampling(),
                 invariant: bool = True, width: int = 1, sample_k: int = 0):
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt must hold at least one byte")
        if n_bytes < 1:
            raise ValueError("n_bytes must be >= 1")
        if any(not 0 <= b < VOCAB_SIZE for b in prompt):
            raise ValueError("prompt bytes must be in [0, 256)")
        if len(prompt) + n_bytes - 1 > max_seq_len:
            raise ValueError(f"prompt {len(prompt)} + {n_bytes} bytes needs {len(prompt) + n_bytes - 1} positions "
                             f"> max_seq_len {max_seq_len}")
        if sampling.temperature < 0 or sampling.top_k < 0:
            raise ValueError("temperature and top_k must be >= 0")
        if drafter and slots:
            raise ValueError("drafts come from the draft model or from slots, not both")
        if not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width must be in 1..{MAX_WIDTH}")
        self.tokens = prompt
        self.n_prompt, self.n_bytes, self.max_seq_len = len(prompt), n_bytes, max_seq_len
        self.draft_len, self.slots, self.lookup, self.sampling = draft_len, slots, lookup, sampling
        self.drafter = drafter
        # greedy output always follows a node's argmax: one chain; sampled, ``width`` chains
        self.width = width if sampling.temperature > 0 else 1
        # sampled: the draft model draws its drafts from its own k most likely bytes (0: its argmax)
        self.sample_k = sample_k if sampling.temperature > 0 and drafter else 0
        if not 0 <= self.sample_k <= MAX_SAMPLE_K:
            raise ValueError(f"sample_k must be in 0..{MAX_SAMPLE_K}")
        self.invariant = invariant
        self.rng = np.random.default_rng(sampling.seed)
        self.draft_seeds = np.random.default_rng([sampling.seed, 1])  # the hop's draws: a stream apart from ours
        self.cached = 0  # tokens whose keys are in every hop's cache once the next rollback is done
        self.base, self.keep = 0, []  # rollback of the next spec
        self.model_draft: list[int] = []  # from the last traversal's slots / draft module
        self.model_alt: list[int] = []  # wide drafts: the runner-up byte at each step of model_draft
        self.model_q: list[np.ndarray] = []  # sampled drafts: the distribution each byte of model_draft was drawn from
        self.state = "spec"
        self.stats = SessionStats()
        self._pending: dict | None = None
        self.rows: list[torch.Tensor] = []  # per output byte, the logits row it was chosen from (checks)

    def reset_caches(self):
        """The chain lost this session's caches (a hop failed, or a new one took its block): the
        next spec starts every hop from an empty cache and re-sends every committed byte. A
        traversal in flight is abandoned; its drafts are proposed again. Batch-invariant
        numerics make the rebuilt caches, and so the output, the same as without the fault."""
        assert self.state != "done", "the session is over"
        if self.state == "output":  # drop the traversal in flight; its counts stay (it was sent)
            self._pending = None
        self.cached, self.base, self.keep = 0, 0, []
        self.state = "spec"

    @property
    def output(self) -> bytes:
        return bytes(self.tokens[self.n_prompt:self.n_prompt + self.n_bytes])

    def _left(self) -> int:
        return self.n_bytes - (len(self.tokens) - self.n_prompt)

    def _lookup_draft(self, n: int) -> list[int]:
        t, m = self.tokens, self.lookup
        for size in range(min(m, len(t) - 1), 0, -1):
            key = t[-size:]
            for s in range(len(t) - size - 1, -1, -1):  # the latest earlier occurrence
                if t[s:s + size] == key:
                    return t[s + size:s + size + n]
        return []

    def _draft_tree(self, budget: int) -> tuple[list[int], list[int], list[str], list]:
        """Draft nodes (ids, parents relative to the root's last token = -1, source, and the
        distribution a sampled draft was drawn from, else None)."""
        branches = []
        if budget > 0 and self.draft_len > 0:
            if self.model_draft:
                branches.append(("model", self.model_draft[:min(budget, self.draft_len)]))
            if self.lookup:
                branches.append(("lookup", self._lookup_draft(min(budget, self.draft_len))))
        ids, parents, source, qs = [], [], [], []
        children: dict[tuple[int, int], int] = {}  # (parent, byte) -> node: branches share prefixes
        model_parents = []  # the parent of each node of the model's branch
        for src, seq in branches:
            parent = -1
            for i, b in enumerate(seq):
                if src == "model":
                    model_parents.append(parent)
                node = children.get((parent, b))
                if node is None and len(ids) >= MAX_VERIFY - 1:  # a hop verifies at most MAX_VERIFY nodes
                    break
                if node is None:  # the model's branch comes first: a node it drew keeps its distribution
                    node = len(ids)
                    children[(parent, b)] = node
                    ids.append(b)
                    parents.append(parent)
                    source.append(src)
                    qs.append(self.model_q[i] if src == "model" and i < len(self.model_q) else None)
                parent = node
        for parent, b in zip(model_parents, self.model_alt):  # wide drafts: each step's runner-up, a leaf
            if 0 <= b < VOCAB_SIZE and (parent, b) not in children and len(ids) < MAX_VERIFY - 1:
                children[(parent, b)] = len(ids)
                ids.append(b)
                parents.append(parent)
                source.append("model")
                qs.append(None)
        return ids, parents, source, qs

    def next_spec(self) -> dict:
        assert self.state == "spec", f"next_spec() in state {self.state!r}"
        root = self.tokens[self.cached:]  # committed bytes not in the caches yet (prompt, or the last byte)
        R, start = len(root), self.cached
        left = self._left()
        # positions: root at start.., drafts below; the last verified node's slots go one further
        room = self.max_seq_len - (start + R)  # positions free after the root
        budget = min(left - 1, room)
        d_ids, d_par, d_src, d_q = self._draft_tree(budget)
        ids = list(root)
        parents = [-1] + list(range(R - 1))
        depth = list(range(R))
        for b, p in zip(d_ids, d_par):
            parents.append(R - 1 if p < 0 else R + p)
            depth.append(depth[parents[-1]] + 1)
            ids.append(b)
        verify = [R - 1] + [R + i for i in range(len(d_ids))]
        slot_lists = []
        for v in verify:
            s = min(self.slots, self.draft_len, left - 1 - (depth[v] - (R - 1)) - 1,
                    self.max_seq_len - 1 - (start + depth[v]))
            branch, parent = [], v
            for j in range(max(0, s)):
                ids.append(MASK_ID)
                parents.append(parent)
                depth.append(depth[parent] + 1)
                parent = len(ids) - 1
                branch.append(parent)
            slot_lists.append(branch)
        spec = {"base": self.base, "keep": list(self.keep), "start": start, "ids": ids,
                "positions": [start + d for d in depth], "parents": parents, "logits": verify,
                "slots": slot_lists, "draft": min(self.draft_len, max(0, left - 2)) if self.drafter else 0,
                "invariant": self.invariant}
        # as many chains as keep the last hop's drafting within its bound
        width = max(1, min(self.width, MAX_DRAFTING // (len(verify) * spec["draft"]))) if spec["draft"] else 1
        if spec["draft"] and width > 1:
            spec["width"] = width
        if spec["draft"] and self.sample_k:
            spec["sample"] = [int(self.draft_seeds.integers(1 << 62)),
                              min(MAX_SAMPLE_MILLI, max(1, round(self.sampling.temperature * 1000))), self.sample_k]
        self._pending = {"R": R, "start": start, "d_ids": d_ids, "d_par": d_par, "d_src": d_src, "d_q": d_q,
                         "draft": spec["draft"], "width": width, "sample": "sample" in spec}
        self.stats.traversals += 1
        self.stats.new_tokens += len(ids)
        self.stats.drafted += len(d_ids)
        for s in d_src:
            self.stats.drafted_by_source[s] = self.stats.drafted_by_source.get(s, 0) + 1
        self.state = "output"
        return spec

    def feed(self, logits, drafts=None, q_ids=None, q=None) -> list[int]:
        """The last hop's output for the spec just issued -> the bytes accepted (drafts + one).
        ``q_ids``, ``q``: with sampled drafts, the distribution each draft byte was drawn from."""
        assert self.state == "output", f"feed() in state {self.state!r}"
        pend = self._pending
        logits = torch.as_tensor(logits)
        if logits.dim() == 3:
            logits = logits[0]
        d_ids, d_par, d_src = pend["d_ids"], pend["d_par"], pend["d_src"]
        assert logits.shape == (1 + len(d_ids), VOCAB_SIZE), f"logits {tuple(logits.shape)} for {1 + len(d_ids)} nodes"
        children: dict[int, list[int]] = {}
        for i, p in enumerate(d_par):
            children.setdefault(p, []).append(i)
        node, path, out, rows = -1, [], [], []
        while True:
            row = logits[node + 1]
            rows.append(row)
            kids = children.get(node, [])
            nxt, byte = self._choose(row, [(k, d_ids[k], pend["d_q"][k]) for k in kids])
            if nxt is None:
                out.append(byte)  # the model's own byte: correction, or the bonus after a full match
                emitted = byte
                break
            path.append(nxt)
            out.append(d_ids[nxt])
            node = nxt
        nxt_drafts = self._next_drafts(pend, drafts, q_ids, q, node, emitted)  # may refuse: nothing committed yet
        for src in (d_src[i] for i in path):
            self.stats.accepted += 1
            self.stats.accepted_by_source[src] = self.stats.accepted_by_source.get(src, 0) + 1
        self.stats.accept_hist[len(path)] = self.stats.accept_hist.get(len(path), 0) + 1
        R, start = pend["R"], pend["start"]
        self.base = start
        self.keep = list(range(R)) + [R + i for i in path]
        self.cached = start + len(self.keep)
        out = out[:self._left()]
        self.tokens.extend(out)
        self.rows.extend(r.float().clone() for r in rows[:len(out)])
        self.model_draft, self.model_alt, self.model_q = nxt_drafts
        self._pending = None
        self.state = "done" if self._left() <= 0 else "spec"
        return out

    def _next_drafts(self, pend: dict, drafts, q_ids, q, node: int, emitted: int) -> tuple[list, list, list]:
        """What the next traversal verifies from the last hop's drafts: the chain after ``node``
        (of W chains, the one that begins with the byte ``emitted``; up to its first -1), each
        step's runner-up, and for drawn drafts the distribution of each byte. ``ValueError``
        where drawn drafts do not match their distributions (the caller refuses the answer)."""
        if drafts is None or not torch.as_tensor(drafts).numel():
            return [], [], []
        d = torch.as_tensor(drafts)
        row = (d[0] if d.dim() == 3 else d)[node + 1].tolist()
        W, steps = pend["width"], pend["draft"]
        alt, chain_at = [], 0
        if W > 1 and len(row) == W * (1 + 2 * steps):  # W chains: the one that begins with the byte emitted
            chains = [row[j * (1 + 2 * steps):(j + 1) * (1 + 2 * steps)] for j in range(W)]
            chain_at = next((j for j, c in enumerate(chains) if c[0] == emitted), None)
            if chain_at is None:
                return [], [], []
            row, alt = chains[chain_at][1:1 + steps], chains[chain_at][1 + steps:]
        draft = list(itertools.takewhile(lambda b: 0 <= b < VOCAB_SIZE, row))
        if not (pend["sample"] and draft and q is not None):  # argmax chains, or nothing drawn
            return draft, alt, []
        if len(draft) > steps:
            raise ValueError(f"{len(draft)} drawn drafts where {steps} were asked for")
        qs = _draft_qs(q_ids, q, node + 1, chain_at * steps, len(draft))
        if any(qs[i][b] <= 0 for i, b in enumerate(draft)):
            raise ValueError("a sampled draft byte outside the distribution it was drawn from")
        return draft, alt, qs

    def _choose(self, logits: torch.Tensor, kids: list[tuple]) -> tuple[int | None, int]:
        """(child accepted or None, its byte or the byte emitted instead). ``kids``: (node, byte,
        the distribution it was drawn from or None: a deterministic draft)."""
        if self.sampling.temperature == 0:
            best = int(torch.argmax(logits))
            for k, b, _ in kids:
                if b == best:
                    return k, b
            return None, best
        p = self.sampling.probs(logits)
        for k, b, q in kids:  # speculative sampling, one draft byte at a time
            if q is not None:  # drawn from q: accept with min(1, p/q), else go on with (p - q)+
                if self.rng.random() < min(1.0, p[b] / q[b]):
                    return k, b
                p = np.maximum(p - q, 0.0)
            else:  # deterministic (q one-hot): accept with p(b), else remove b
                if p[b] > 0 and self.rng.random() < p[b]:
                    return k, b
                p[b] = 0.0
            total = p.sum()
            if total <= 0:  # every possible byte was drafted and rejected (rounding: q above p everywhere)
                raise ValueError("speculative sampling exhausted the distribution")
            p = p / total
        return None, int(self.rng.choice(VOCAB_SIZE, p=p))


def _draft_qs(q_ids, q, node: int, at: int, n: int) -> list[np.ndarray]:
    """The ``n`` distributions (over 256 bytes, float64) of a chain's sampled drafts, from the
    last hop's sparse answer: node ``node``'s entries ``at..at+n``."""
    ids = torch.as_tensor(q_ids)
    ps = torch.as_tensor(q)
    if ids.dim() == 4:
        ids, ps = ids[0], ps[0]
    if ids.shape != ps.shape or ids.dim() != 3 or not (0 <= node < ids.shape[0] and at + n <= ids.shape[1]):
        raise ValueError(f"draft distributions {tuple(ids.shape)} hold no rows {at}..{at + n} of node {node}")
    out = []
    for i in range(at, at + n):
        w = ps[node, i].double()
        dist = np.zeros(VOCAB_SIZE)
        np.add.at(dist, ids[node, i].numpy(), (w / w.sum()).numpy())
        out.append(dist)
    return out


# ---------------------------------------------------------------------------------------------
# 3. In-process drivers


def drive(session: Session, step) -> bytes:
    """Run ``session`` to the end; ``step(spec) -> {"logits", "drafts"}`` is one traversal."""
    while session.state != "done":
        out = step(session.next_spec())
        session.feed(out["logits"], out.get("drafts"), out.get("q_ids"), out.get("q"))
    return session.output


@torch.no_grad()
def generate(blocks: list[Block], prompt: bytes | list[int], n_bytes: int, *, draft_len: int = 0,
             drafter: bool = False, slots: int = 0, lookup: int = 0, sampling: Sampling = Sampling(),
             invariant: bool = True, between=None, width: int = 1, sample_k: int = 0) -> tuple[bytes, SessionStats]:
    """Decode ``n_bytes`` after ``prompt`` with the chain ``blocks`` in process.

    ``draft_len=0``: autoregressive (one traversal per byte). Otherwise exact mode with the
    given drafts. ``between``: applied to hidden states between hops (network codec)."""
    for b in blocks:
        b.eval()
    s = Session(prompt, n_bytes, blocks[0].cfg.max_seq_len, draft_len=draft_len, drafter=drafter, slots=slots,
                lookup=lookup, sampling=sampling, invariant=invariant, width=width, sample_k=sample_k)
    caches = new_caches(blocks)
    drive(s, lambda spec: run_chain(blocks, caches, spec, between=between))
    return s.output, s.stats


def bf16_round(h: torch.Tensor) -> torch.Tensor:
    """What the network's default codec does to hidden states between hops."""
    return h.to(torch.bfloat16).to(h.dtype)


# ---------------------------------------------------------------------------------------------
# 4. Specs from elsewhere (the network): checked before any compute

# New tokens a hop computes at a time (hop_chunks): a serving hop's compute slot changes hands
# between chunks; and a chunk's batch-invariant rows attend over the keys so far, not over the
# whole traversal's, so chunks cost no more than one long step. Any size gives the same exact
# rows (model.py's rules; tests/test_decode.py runs chunks of 1 to 25 tokens).
CHUNK = 16
MAX_TREE = 256  # new tokens of one traversal beyond max_seq_len (draft tree and slot branches)
MAX_VERIFY = 65  # verified nodes (logits rows) per traversal: the root and two draft branches of 32
MAX_DRAFT = 32  # draft-model bytes per verified node
MAX_WIDTH = 4  # draft-model chains per verified node (sampling; the reference client asks for 4)
MAX_DRAFTING = MAX_VERIFY * MAX_DRAFT  # verified nodes x chains x steps of one traversal: as before widths
MAX_SAMPLE_K = 16  # bytes a drawn draft is drawn among (the answer carries their probabilities)
MAX_SAMPLE_MILLI = 100_000  # a drawn draft's temperature, x 1000


class BadSpec(ValueError):
    """A spec that this code would not issue: wrong types, or numbers outside their bounds."""


def _ints(v, lo: int, hi: int, what: str, max_len: int) -> list[int]:
    if not isinstance(v, (list, tuple)) or len(v) > max_len:
        raise BadSpec(f"{what}: expected a list of at most {max_len} ints")
    if not all(type(x) is int and lo <= x < hi for x in v):
        raise BadSpec(f"{what}: every entry must be an int in [{lo}, {hi})")
    return list(v)


def check_spec(spec, max_seq_len: int) -> dict:
    """``spec`` as ``hop_step`` takes it, or ``BadSpec`` naming the field: every number from a
    peer is bounded before use (cache growth, compute and reply size follow from these bounds)."""
    if not isinstance(spec, dict):
        raise BadSpec("the spec must be a map")
    cap = max_seq_len + MAX_TREE
    out = {}
    for key in ("base", "start"):
        v = spec.get(key)
        if type(v) is not int or not 0 <= v <= max_seq_len:
            raise BadSpec(f"{key}: an int in [0, {max_seq_len}]")
        out[key] = v
    out["keep"] = _ints(spec.get("keep", []), 0, cap, "keep", cap)
    if any(b <= a for a, b in zip(out["keep"], out["keep"][1:])) or out["base"] + len(out["keep"]) != out["start"]:
        raise BadSpec("keep must ascend, and base + len(keep) must equal start")
    ids = out["ids"] = _ints(spec.get("ids"), 0, MASK_ID + 1, "ids", cap)
    if not ids:
        raise BadSpec("ids: at least one token")
    T = len(ids)
    out["positions"] = _ints(spec.get("positions"), 0, max_seq_len, "positions", T)
    out["parents"] = _ints(spec.get("parents"), -1, T, "parents", T)
    if len(out["positions"]) != T or len(out["parents"]) != T or any(p >= i for i, p in enumerate(out["parents"])):
        raise BadSpec("positions and parents: one per token; a parent is -1 or an earlier token")
    out["logits"] = _ints(spec.get("logits"), 0, T, "logits", T)
    if not out["logits"]:
        raise BadSpec("logits: at least one token")
    slots = spec.get("slots") or []
    if not isinstance(slots, (list, tuple)) or (slots and len(slots) != len(out["logits"])):
        raise BadSpec("slots: none, or one list per entry of logits")
    out["slots"] = [_ints(s, 0, T, "slots", T) for s in slots]
    flat = [i for s in out["slots"] for i in s]
    if flat and (sorted(flat) != list(range(T - len(flat), T)) or any(ids[i] != MASK_ID for i in flat)):
        raise BadSpec("slot tokens are distinct placeholders, after every other token")
    if any(i >= T - len(flat) for i in out["logits"]):
        raise BadSpec("logits: verified tokens come before the slot tokens")
    draft = spec.get("draft", 0)
    if type(draft) is not int or not 0 <= draft <= MAX_DRAFT:
        raise BadSpec(f"draft: an int in [0, {MAX_DRAFT}]")
    out["draft"] = draft
    width = spec.get("width", 1)
    if type(width) is not int or not 1 <= width <= MAX_WIDTH:
        raise BadSpec(f"width: an int in [1, {MAX_WIDTH}]")
    out["width"] = width
    if draft and len(out["logits"]) * width * draft > MAX_DRAFTING:  # the last hop's drafting work and cache
        raise BadSpec(f"logits x width x draft: at most {MAX_DRAFTING} drafting steps a traversal")
    if draft and len(out["logits"]) > MAX_VERIFY:  # the draft model runs ``draft`` steps from every one
        raise BadSpec(f"logits: at most {MAX_VERIFY} tokens when the draft model drafts")
    if "sample" in spec:
        sample = spec["sample"]
        if not isinstance(sample, (list, tuple)) or len(sample) != 3 or not all(type(x) is int for x in sample) \
                or not (0 <= sample[0] < 1 << 62 and 1 <= sample[1] <= MAX_SAMPLE_MILLI
                        and 1 <= sample[2] <= MAX_SAMPLE_K):
            raise BadSpec(f"sample: [seed in [0, 2^62), temperature x 1000 in [1, {MAX_SAMPLE_MILLI}], "
                          f"k in [1, {MAX_SAMPLE_K}]]")
        out["sample"] = list(sample)
    inv = spec.get("invariant", False)
    if type(inv) is not bool:
        raise BadSpec("invariant: a bool")
    out["invariant"] = inv
    return out


def recompute_spec(tokens: bytes | list[int], n_prompt: int) -> dict:
    """The spec that recomputes a finished output in one traversal: the prompt and the output but
    its last byte in one causal chain (new session, batch-invariant rows), the logits of every
    position that chose an output byte. Its rows are, on the same hardware, the rows
    ``Session.rows`` recorded while decoding (every mode but blocktrain's), up to rounding."""
    tokens = list(tokens)
    T = len(tokens) - 1
    return {"base": 0, "keep": [], "start": 0, "ids": tokens[:T], "positions": list(range(T)),
            "parents": list(range(-1, T - 1)), "logits": list(range(n_prompt - 1, T)), "slots": [], "draft": 0,
            "invariant": True}


def row_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two answers for the same positions are: the largest total-variation distance
    between their next-byte distributions (temperature 1), over the rows. 0: the same
    distributions; 1: disjoint. Different shapes are 1."""
    if a.shape != b.shape:
        return 1.0
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    return float(0.5 * (p - q).abs().sum(-1).max()) if a.numel() else 0.0


def one_traversal_spec(prompt: bytes | list[int], n_bytes: int) -> dict:
    """The spec of BlockTrain's one-traversal output: the prompt, then ``n_bytes - 1``
    placeholders in one causal chain; the last hop returns the logits of the prompt's last byte
    and of every placeholder (greedy: their argmax is the output)."""
    P = len(prompt)
    T = P + n_bytes - 1
    return {"base": 0, "keep": [], "start": 0, "ids": list(prompt) + [MASK_ID] * (n_bytes - 1),
            "positions": list(range(T)), "parents": list(range(-1, T - 1)), "logits": list(range(P - 1, T)),
            "slots": [], "draft": 0, "invariant": False}
