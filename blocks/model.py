"""The block model: one causal byte Transformer cut into K blocks, each with a local head.

Rules:
- Block 0 owns the byte and position embeddings; every block owns ``layers_per_block`` layers
  and, when it trains locally, a head of its own (``LocalHead``) that maps its residual stream to
  256 next-byte logits. The assembled model is blocks 0..K-1 in order; block K-1's head gives
  the output for every position.
- ``Block.forward(x, targets=None)`` returns ``(hidden, loss)``; the loss is the block's local
  objective: CE of its head against the true next bytes. A block never sees another block's
  parameters: its input is a detached tensor.
- The end-to-end reference (``EndToEnd``) is the same K blocks with a head on the last one only,
  trained with backprop through all: same layers, same total parameters as the assembled model.
- Full-sequence output: input id ``MASK_ID`` marks a placeholder position; a model trained
  with masked future slots predicts, at each position, the byte after it, so a prompt of P bytes
  followed by N-1 placeholders yields N continuation bytes from one traversal.
- One home per concept: ``Block.embed`` is the only place ids and positions become vectors (it
  checks positions against ``max_seq_len``), ``Layer.forward(x, cache, mask)`` the only layer
  step (with or without a KV cache), ``LocalHead`` the only readout.
- Decoding (blocktrain.blocks.decode) gives new tokens explicit positions and an attention
  structure over [cached prefix + new tokens]: ``parents[i]`` is the new token that token i
  continues (-1: the cached prefix), so token i sees the whole cache, its ancestors and itself
  (``tree_mask``); a causal chain is ``[-1, 0, 1, ...]``. A ``KVCache`` holds one layer's keys
  and values; ``BlockCache.rollback`` keeps the accepted path only.
- Batch-invariant decoding (``exact_rows``): the first ``exact_rows`` new tokens of a step get
  results bitwise independent of what else shares the step and of where their visible keys sit
  in the cache, so verifying many tokens per traversal reproduces one-token-per-step decoding
  exactly. This holds by the computation's shape, not by a property of one machine's kernels
  (``Block.tile_rows``, ``_tiled``, ``_attend_exact``; blocktrain.blocks.invariance checks it
  where a model is served).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from .config import ModelConfig  # the config's home is config.py (imported from here too)

VOCAB_SIZE = 256  # bytes
MASK_ID = 256  # the placeholder input id; never an output
# Batch invariance by construction (exact rows). A math library picks its kernel, and with it the
# order of a row's sums, by the shape of a call: MKL computed F.linear over 4 rows otherwise than
# over more on an AVX-512/AMX Xeon, and over 1-3 rows otherwise than over 4 on an AMD EPYC. So in a
# step with exact rows every position-wise op (LayerNorm, the linears, GELU, the head) runs on
# fixed-shape tiles of ``Block.tile_rows`` rows, zero-padded: every call has one shape whatever the
# step holds. Attention scores are elementwise products summed pairwise in a fixed order over the
# head's width; the softmax's exp runs over scores padded with -inf to a multiple of KEY_TILE
# keys, so every element of an elementwise kernel falls in its vector body, never in a scalar tail
# that computes exp another way; the weighted sum over keys is sequential (cumsum), so masked keys add exact
# zeros wherever they sit. The one thing no shape fixes is a kernel that computes a row by its
# place within one call: ``invariance.check_block`` measures that where a model is served, and
# ``tile_rows = 1`` (every row alone in its call) does without it. All of this at one torch
# thread (bt-peer serve's, bt-bench wan's): threads split a call's work by its size.
TILE_ROWS = 8  # rows per call: 1 row decodes at 8 rows' cost (small next to a step's Python), 64 x 16 in 128 calls
KEY_TILE = 64  # scores padded to this many keys' multiple: every CPU's float vector width (<= 16) x 2 unroll divides it


class Entries:
    """A growable buffer of per-token entries along dim -2 (keys (B, nh, L, hs), features (B, L, C)).

    Allocated at the first ``append`` (zeros), grown by doubling; ``length`` entries in use.
    ``keep`` rolls back to an accepted path.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf: torch.Tensor | None = None
        self.length = 0

    def append(self, x: torch.Tensor):
        T = x.shape[-2]
        if x.requires_grad and torch.is_grad_enabled():  # training through the cache: no in-place writes
            self.buf = x if self.buf is None else torch.cat([self.buf[..., :self.length, :], x], dim=-2)
            self.length = self.capacity = self.buf.shape[-2]
            return
        if self.buf is None or self.buf.shape[:-2] != x.shape[:-2] or self.buf.dtype != x.dtype:
            assert self.length == 0, "cache batch, shape or dtype changed mid-session"
            self.buf = x.new_zeros(*x.shape[:-2], self.capacity, x.shape[-1])
        end = self.length + T
        if end > self.capacity:
            self.capacity = max(end, 2 * self.capacity)
            grown = self.buf.new_zeros(*self.buf.shape[:-2], self.capacity, self.buf.shape[-1])
            grown[..., :self.length, :] = self.buf[..., :self.length, :]
            self.buf = grown
        self.buf[..., self.length:end, :] = x
        self.length = end

    def view(self) -> torch.Tensor:
        return self.buf[..., :self.length, :]

    def keep(self, base: int, keep: list[int]):
        """Keep entries ``[0, base)`` and ``base + i`` for ``i`` in ``keep`` (ascending), compacted."""
        if not 0 <= base <= self.length:
            raise ValueError(f"rollback base {base} outside the cache's {self.length} entries")
        idx = [base + i for i in keep]
        if any(b <= a for a, b in zip(idx, idx[1:])) or (idx and (idx[0] < base or idx[-1] >= self.length)):
            raise ValueError(f"rollback keep {keep} is not ascending within the {self.length - base} newest entries")
        if idx and idx != list(range(base, base + len(idx))):
            self.buf[..., base:base + len(idx), :] = self.buf[..., idx, :]  # the gather copies before the write
        self.length = base + len(idx)


class KVCache:
    """Keys and values of one attention layer for one decoding session: the committed
    positions, then the current step's new tokens (a tree may hold more tokens than positions)."""

    def __init__(self, capacity: int):
        self.keys, self.values = Entries(capacity), Entries(capacity)

    @property
    def length(self) -> int:
        return self.keys.length

    @length.setter
    def length(self, n: int):
        assert 0 <= n <= self.keys.length, f"cannot grow a cache by setting its length to {n}"
        self.keys.length = self.values.length = n

    @property
    def k(self) -> torch.Tensor:  # (B, nh, L, hs), all allocated entries
        return self.keys.buf

    @property
    def v(self) -> torch.Tensor:
        return self.values.buf

    def write(self, k: torch.Tensor, v: torch.Tensor):
        self.keys.append(k)
        self.values.append(v)

    def keep(self, base: int, keep: list[int]):
        self.keys.keep(base, keep)
        self.values.keep(base, keep)


def tree_mask(parents: list[int], past: int) -> torch.Tensor:
    """(T, past + T) bool: new token i sees the cached prefix [0, past), its ancestors and itself.

    ``parents[i]`` is the index of the new token that token i continues, -1 for the prefix;
    a parent precedes its child. ``[-1, 0, 1, ...]`` is the causal chain.
    """
    T = len(parents)
    if parents == list(range(-1, T - 1)):  # a chain: causal
        return torch.ones(T, past + T, dtype=torch.bool).tril(diagonal=past)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not (isinstance(p, int) and -1 <= p < i):
            raise ValueError(f"parents[{i}] = {p!r}: a parent is -1 (the cached prefix) or an earlier new token")
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return torch.cat([torch.ones(T, past, dtype=torch.bool), anc], dim=1)


def tree_offsets(ids: list[int], parents: list[int]) -> list[int]:
    """Per new token: 0 for a byte, else 1 + its parent's offset (placeholders after the last
    byte; the cached prefix holds bytes only)."""
    off: list[int] = []
    for i, p in zip(ids, parents):
        off.append(0 if i != MASK_ID else 1 + (off[p] if p >= 0 else 0))
    return off


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each new token below the cached prefix (0 for children of the prefix)."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        if not (isinstance(p, int) and -1 <= p < i):
            raise ValueError(f"parents[{i}] = {p!r}: a parent is -1 (the cached prefix) or an earlier new token")
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


class BlockCache:
    """One decoding session's state in one block: a ``KVCache`` per layer; with a draft model,
    also its layers' caches and the block's output feature of every cached token. Entry i of
    each is the session's i-th token (the draft model's cache also holds the drafting steps of
    the current traversal, past the tokens); all roll back together."""

    def __init__(self, block: "Block"):
        cap = block.cfg.max_seq_len
        self.layers = [KVCache(cap) for _ in block.layers]
        d = block.drafter
        self.drafter = [KVCache(cap) for _ in d.layers] if d is not None else []
        self.features = Entries(cap) if d is not None else None  # (B, L, C)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def rollback(self, base: int, keep: list[int]):
        """Keep entries ``[0, base)`` and ``base + i`` for ``i`` in ``keep``: the accepted path."""
        for c in self.layers + self.drafter:
            c.keep(base, keep)
        if self.features is not None:
            self.features.keep(base, keep)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.max_seq_len = cfg.max_seq_len
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, cache: KVCache | dict | None = None, mask: torch.Tensor | None = None):
        """Causal self-attention, or ``mask`` (bool, True = may attend): (T, T) or (B, 1, T, T)
        without a cache, (T, past + T) over [cache + new] with one. A ``dict`` cache (older
        callers) holds a ``KVCache`` under "kv"."""
        if isinstance(cache, dict):
            cache = cache.setdefault("kv", KVCache(self.max_seq_len))
        if cache is not None:
            return self.proj(self.attend_ragged(self.qkv(x), [x.shape[1]], [cache], [mask], [0]))
        B, T, C = x.shape
        q, k, v = self._heads(self.qkv(x))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def attend_ragged(self, qkv, sizes: list[int], caches: list[KVCache], masks: list, exact_rows: list[int]):
        """Decoding steps of several sessions at once, between the projections: ``qkv`` (B,
        sum(sizes), 3C) holds each one's new tokens in turn; each attends over its own cache
        (``forward``'s arguments, one per session); returns (B, sum(sizes), C) for ``proj``. The
        first ``exact_rows`` tokens of a session are computed batch-invariantly (``_attend_exact``)."""
        B, _, C3 = qkv.shape
        ys = []
        for part, cache, mask, n in zip(qkv.split(sizes, dim=1), caches, masks, exact_rows):
            T = part.shape[1]
            q, k, v = self._heads(part)
            past = cache.length
            cache.write(k, v)
            if mask is None:  # new tokens see every cached key and the new keys up to themselves
                mask = torch.ones(T, past + T, dtype=torch.bool, device=qkv.device).tril(diagonal=past)
            assert mask.shape[-2:] == (T, past + T), f"mask {tuple(mask.shape)} for {T} new tokens after {past}"
            keys, values = cache.k[:, :, :past + T], cache.v[:, :, :past + T]
            if n:
                y_exact = _attend_exact(q, keys, values, mask, n)
            if n < T:
                y_rest = F.scaled_dot_product_attention(q[:, :, n:], keys, values, attn_mask=mask[n:])
            y = y_exact if n == T else y_rest if n == 0 else torch.cat([y_exact, y_rest], dim=2)
            ys.append(y.transpose(1, 2).contiguous().view(B, T, C3 // 3))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def _heads(self, qkv):
        """(B, T, 3C) -> q, k, v, each (B, nh, T, hs)."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        return (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv.split(C, dim=2))


def _tiled(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn`` over the rows of ``x`` (..., C), called on fixed-shape tiles of ``rows`` rows
    (the last zero-padded), each tile 64-byte aligned: what ``fn`` gives a row depends on the row
    and its place in a tile, never on how many rows the step holds (the model's rules)."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n % rows:
        flat = torch.cat([flat, flat.new_zeros(rows - n % rows, flat.shape[1])])
    out = []
    for t in flat.split(rows):
        out.append(fn(t.clone() if t.data_ptr() % 64 else t))  # one alignment for every call
    y = out[0] if len(out) == 1 else torch.cat(out)
    return y[:n].view(*x.shape[:-1], y.shape[-1])


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in one fixed order: halves added elementwise (each add rounded
    alone, the same in a vector lane or a scalar loop), zero-padded to a power of two."""
    w = x.shape[-1]
    if w & (w - 1):
        x = F.pad(x, (0, (1 << w.bit_length()) - w))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _attend_exact(q, keys, values, mask, n: int, chunk: int = 16):
    """Attention of queries ``[0, n)``, each bitwise independent of the other queries, of how
    many keys the cache holds and of where its visible keys sit among masked ones: scores are
    products summed pairwise over the head's width (``_pairwise_sum``), the softmax's max is
    exact and its exp runs over scores padded to a multiple of KEY_TILE keys (exp(-inf) = 0),
    and numerator and normaliser are sums accumulated in key order (``cumsum``; a zero weight
    leaves a sequential sum unchanged)."""
    L = keys.shape[2]
    pad = -L % KEY_TILE
    scale = 1.0 / math.sqrt(q.shape[-1])
    vz = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)  # (B, nh, L, hs + 1): weights' sum last
    out = []
    for i in range(0, n, chunk):  # bounded memory: (B, nh, chunk, L, hs + 1)
        j = min(n, i + chunk)
        s = _pairwise_sum(q[:, :, i:j, None, :] * keys[:, :, None]) * scale  # (B, nh, c, L)
        s = F.pad(s.masked_fill(~mask[i:j], float("-inf")), (0, pad), value=float("-inf"))
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))[..., :L]
        acc = torch.cumsum(e[..., None] * vz[:, :, None], dim=3)[:, :, :, -1]
        out.append(acc[..., :-1] / acc[..., -1:])
    return torch.cat(out, dim=2)


class Layer(nn.Module):
    """Pre-LN Transformer layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x, cache: KVCache | dict | None = None, mask: torch.Tensor | None = None):
        x = x + self.attn(self.ln1(x), cache, mask)
        return x + self.mlp(x)

    def mlp(self, x):
        return self.out(F.gelu(self.fc(self.ln2(x))))

    def forward_ragged(self, x, sizes: list[int], caches: list[KVCache], masks: list, exact_rows: list[int],
                       tile_rows: int = 0):
        """Several sessions' decoding steps at once (``Attention.attend_ragged``); with
        ``tile_rows``, every position-wise op on fixed-shape tiles of that many rows (``_tiled``)."""
        if not tile_rows:
            x = x + self.attn.proj(self.attn.attend_ragged(self.attn.qkv(self.ln1(x)), sizes, caches, masks,
                                                           exact_rows))
            return x + self.mlp(x)
        # the same ops as the modules' forwards, called directly: a tile is a few dozen rows, and a
        # module call's Python costs about what such an op computes
        ln1, ln2, qkv_, proj, fc, out = self.ln1, self.ln2, self.attn.qkv, self.attn.proj, self.fc, self.out
        qkv = _tiled(lambda t: F.linear(F.layer_norm(t, ln1.normalized_shape, ln1.weight, ln1.bias, ln1.eps),
                                        qkv_.weight, qkv_.bias), x, tile_rows)
        y = self.attn.attend_ragged(qkv, sizes, caches, masks, exact_rows)
        x = x + _tiled(lambda t: F.linear(t, proj.weight, proj.bias), y, tile_rows)
        return x + _tiled(lambda t: F.linear(F.gelu(F.linear(F.layer_norm(t, ln2.normalized_shape, ln2.weight,
                                                                          ln2.bias, ln2.eps), fc.weight, fc.bias)),
                                             out.weight, out.bias), x, tile_rows)

    def zero_output(self):
        """Make the layer the identity map (its residual branches add zero)."""
        for lin in (self.attn.proj, self.out):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)


class LocalHead(nn.Module):
    """Residual stream -> next-byte logits: ``depth`` layers, LayerNorm, linear."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(depth))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.lm(self.ln(h))  # (B, T, 256)


class Drafter(nn.Module):
    """Exact mode's draft model on the last block (EAGLE-style, Li et al. 2024).

    Entry t pairs the block's output feature at t-1 with the byte at t and predicts the
    feature at t; read out through the block's own head, it drafts the byte at t+1. Fed its own
    prediction and draft byte, it drafts further. It attends over the entries of the session
    (its own KV cache). Trained with the chain frozen (``TrainConfig.draft_frac``): the
    chain's next-byte predictions are untouched.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE + 1, cfg.d_model)  # + MASK_ID (a placeholder fed as a token)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.inp = nn.Linear(2 * cfg.d_model, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.draft_layers))

    def forward(self, f_prev, ids, caches: list | None = None, mask: torch.Tensor | None = None):
        """(B, T, C) features of the previous tokens, (B, T) bytes -> (B, T, C) predicted features."""
        u = self.inp(torch.cat([self.ln(f_prev), self.tok(ids)], dim=-1))
        for i, layer in enumerate(self.layers):
            u = layer(u, None if caches is None else caches[i], mask)
        return u


class Block(nn.Module):
    """Block ``index`` of the model: [embeddings] + layers + [local head]."""

    def __init__(self, cfg: ModelConfig, index: int, with_head: bool = True):
        super().__init__()
        assert 0 <= index < cfg.n_blocks, f"block index {index} not in [0, {cfg.n_blocks})"
        self.cfg, self.index = cfg, index
        if index == 0:
            self.tok = nn.Embedding(VOCAB_SIZE + 1, cfg.d_model)  # + MASK_ID
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            if cfg.slot_offsets:
                self.slot_off = nn.Embedding(cfg.slot_offsets, cfg.d_model)  # placeholder j bytes after the last byte
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers_per_block))
        top = index == cfg.n_blocks - 1
        self.head = LocalHead(cfg, 0 if top else cfg.head_layers) if with_head else None
        self.drafter = Drafter(cfg) if (top and with_head and cfg.draft_layers > 0) else None
        # Rows per fixed-shape call in steps with exact rows (the model's rules): TILE_ROWS, or 1
        # where invariance.check_block finds that this machine's kernels compute a row by its place.
        self.tile_rows = TILE_ROWS
        self.apply(_init_weights)
        if index > 0 and cfg.identity_init:
            for layer in self.layers:
                layer.zero_output()

    @property
    def is_first(self) -> bool:
        return self.index == 0

    def embed(self, idx, positions=None, offsets=None):
        """Ids (B, T) at ``positions`` ((T,) or (B, T); default 0..T-1) -> (B, T, C).

        A placeholder (``MASK_ID``) also gets the embedding of its offset: how many tokens after
        the last byte it continues (``offsets`` (B, T) or (T,); default: counted along the
        sequence, ``slot_offsets``)."""
        B, T = idx.shape
        if positions is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} bytes > max_seq_len {self.cfg.max_seq_len}")
            positions = torch.arange(T, device=idx.device)
        else:
            positions = torch.as_tensor(positions, dtype=torch.long, device=idx.device)
            assert positions.shape[-1] == T, f"{positions.shape[-1]} positions for {T} tokens"
            if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.cfg.max_seq_len):
                raise ValueError(f"positions {int(positions.min())}..{int(positions.max())} outside the "
                                 f"embedding's [0, {self.cfg.max_seq_len}) (max_seq_len)")
        pe = self.pos(positions)
        x = self.tok(idx) + (pe[None] if pe.dim() == 2 else pe)  # (B, T, C)
        if self.cfg.slot_offsets:
            is_slot = idx == MASK_ID
            if offsets is None:
                offsets = placeholder_offsets(idx)
            off = torch.as_tensor(offsets, dtype=torch.long, device=idx.device).expand(B, T)
            slot = self.slot_off((off.clamp(1, self.cfg.slot_offsets) - 1))
            x = x + torch.where(is_slot[..., None], slot, torch.zeros_like(slot))
        return x

    def trunk(self, x, caches: list | None = None, positions=None, mask: torch.Tensor | None = None, offsets=None):
        """Input (ids for block 0, else a residual stream) -> this block's residual stream.

        ``caches``: one KV cache per layer (decoding); ``positions``, ``offsets``: of the input
        tokens (``embed``); ``mask``: attention structure."""
        h = self.embed(x, positions, offsets) if self.is_first else x
        for i, layer in enumerate(self.layers):
            h = layer(h, None if caches is None else caches[i], mask)
        return h

    def extend(self, x, cache: BlockCache, positions, mask: torch.Tensor, exact_rows: int = 0, offsets=None):
        """Decoding step: new tokens (ids for block 0, else hidden (B, T, C)) at ``positions``
        through this block's layers, attending over [cache + new] under ``mask`` (T, past + T);
        their keys and values are appended to ``cache``. The first ``exact_rows`` tokens are
        computed batch-invariantly (the model's rules)."""
        return self.extend_many([(x, cache, positions, mask, exact_rows, offsets)])[0]

    def extend_many(self, steps: list[tuple]) -> list[torch.Tensor]:
        """``extend`` for several sessions at once, each step ``(x, cache, positions, mask,
        exact_rows, offsets)`` with its own cache (the same batch size B for all): one forward
        over the rows of all (``Layer.forward_ragged``), in fixed-shape tiles of ``tile_rows``
        rows when any step has exact rows; returns each step's output. Exact rows are bitwise
        what ``extend`` gives the step alone."""
        xs, sizes, masks, exact = [], [], [], []
        for x, cache, positions, mask, exact_rows, offsets in steps:
            T = x.shape[1]
            assert 0 <= exact_rows <= T, f"exact_rows {exact_rows} of {T} tokens"
            xs.append(self.embed(x, positions, offsets) if self.is_first else x)
            sizes.append(T)
            masks.append(mask)
            exact.append(exact_rows)
        tiles = self.tile_rows if any(exact) else 0
        h = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
        for i, layer in enumerate(self.layers):
            h = layer.forward_ragged(h, sizes, [s[1].layers[i] for s in steps], masks, exact, tiles)
        return list(h.split(sizes, dim=1))

    def forward(self, x, targets=None, layout: dict | None = None, weights=None):
        """``(hidden, loss)``: loss is the local objective when targets are given: CE of the
        head against ``targets`` (-100: none), averaged, or summed with per-token ``weights``.
        ``layout``: positions, mask and offsets of tokens that are not a plain causal sequence
        (slot branches, see ``train.slot_batch``)."""
        h = self.trunk(x, **(layout or {}))
        if targets is None:
            return h, None
        assert self.head is not None, "this block has no local head"
        return h, local_loss(self.head(h), targets, weights)

    def logits(self, h, exact: bool = False):
        """Next-byte logits of hidden states (B, T, C); ``exact``: each row's batch-invariantly
        (fixed-shape tiles; a head without layers of its own, as the last block's)."""
        assert self.head is not None, "this block has no local head"
        if not exact:
            return self.head(h)
        assert not self.head.layers, "rows are read out on their own only by a head without layers"
        return _tiled(self.head, h, self.tile_rows)

    def param_count(self, include_head: bool = True) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if include_head or not n.startswith("head."))


def local_loss(logits, targets, weights=None):
    """CE of ``logits`` (B, T, 256) against ``targets`` (B, T; -100: none): the mean, or the sum
    weighted by ``weights`` (B, T)."""
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return (ce * weights.flatten()).sum()


def placeholder_offsets(idx: torch.Tensor) -> torch.Tensor:
    """(B, T): for a placeholder, its distance to the last byte before it in the row; else 0."""
    T = idx.shape[-1]
    t = torch.arange(T, device=idx.device).expand_as(idx)
    last_byte = torch.where(idx != MASK_ID, t, torch.full_like(t, -1)).cummax(dim=-1).values
    return torch.where(idx == MASK_ID, t - last_byte, torch.zeros_like(t))


def _init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


class Assembled(nn.Module):
    """Blocks 0..K-1 chained once; ``forward`` returns every block's head logits."""

    def __init__(self, blocks: list[Block]):
        super().__init__()
        cfg = blocks[0].cfg
        assert [b.index for b in blocks] == list(range(cfg.n_blocks)), "need blocks 0..K-1 in order"
        self.cfg = cfg
        self.blocks = nn.ModuleList(blocks)

    @torch.no_grad()
    def forward(self, idx, all_heads: bool = False):
        h, out = idx, []
        for b in self.blocks:
            h = b.trunk(h)
            if all_heads or b.index == self.cfg.n_blocks - 1:
                out.append(b.logits(h))
        return out if all_heads else out[0]

    @torch.no_grad()
    def generate_one_traversal(self, prompt: torch.Tensor, n_bytes: int) -> torch.Tensor:
        """N continuation bytes from one traversal: prompt + N-1 placeholders, greedy."""
        return one_traversal(lambda ids: self(ids), prompt, n_bytes, self.cfg.max_seq_len)


def one_traversal(forward, prompt: torch.Tensor, n_bytes: int, max_seq_len: int) -> torch.Tensor:
    assert prompt.dim() == 2 and prompt.shape[1] >= 1, "prompt must be (B, P) with P >= 1"
    assert n_bytes >= 1, "n_bytes must be >= 1"
    B, P = prompt.shape
    if P + n_bytes - 1 > max_seq_len:
        raise ValueError(f"prompt {P} + {n_bytes} bytes needs {P + n_bytes - 1} positions > {max_seq_len}")
    ids = torch.cat([prompt, torch.full((B, n_bytes - 1), MASK_ID, dtype=prompt.dtype)], dim=1)
    logits = forward(ids)  # one traversal
    return logits[:, P - 1:].argmax(-1)  # (B, N)


class EndToEnd(nn.Module):
    """The reference: the same K blocks, one head on the last, trained through all of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "identity_init": False})
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg, k, with_head=(k == cfg.n_blocks - 1)) for k in range(cfg.n_blocks))

    def forward(self, idx, targets=None, caches: list | None = None, layout: dict | None = None, weights=None):
        h = idx
        for k, b in enumerate(self.blocks):
            h = b.trunk(h, None if caches is None else caches[k], **(layout or {}))
        logits = self.blocks[-1].logits(h)
        if targets is None:
            return logits, None
        return logits, local_loss(logits, targets, weights)

    def new_caches(self) -> list:
        return [[{} for _ in b.layers] for b in self.blocks]

    @torch.no_grad()
    def forward_cached(self, idx, caches: list, start: int):
        """Forward ``idx`` at positions ``start..`` using and extending ``caches`` (KV per layer)."""
        b0 = self.blocks[0]
        T = idx.shape[1]
        h = b0.embed(idx, torch.arange(start, start + T))
        for k, b in enumerate(self.blocks):
            for i, layer in enumerate(b.layers):
                h = layer(h, caches[k][i])
        return self.blocks[-1].logits(h)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_bytes: int) -> torch.Tensor:
        """Greedy byte-by-byte decoding with a KV cache: N traversals, no prefix recomputation."""
        caches = self.new_caches()
        logits = self.forward_cached(prompt, caches, 0)
        out, pos = [], prompt.shape[1]
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(n_bytes):
            out.append(nxt)
            if len(out) == n_bytes:
                break
            logits = self.forward_cached(nxt, caches, pos)
            pos += 1
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(out, dim=1)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def matmul_flops_per_token(cfg: ModelConfig, layers: int, head_layers: int, seq_len: int) -> int:
    """Forward FLOPs per token of ``layers`` trunk layers plus a head (2 * weights + attention)."""
    d = cfg.d_model
    per_layer = 2 * (4 * d * d + 2 * cfg.mlp_ratio * d * d) + 2 * 2 * seq_len * d  # weights + QK^T, AV
    return per_layer * (layers + head_layers) + 2 * d * VOCAB_SIZE


def train_flops_per_token(cfg: ModelConfig, block: int | None, seq_len: int) -> int:
    """Training FLOPs per token: 3x forward for trained parts, 1x for frozen lower blocks.

    ``block=None`` is the end-to-end model (all layers trained, one shallow head).
    """
    L = cfg.layers_per_block
    if block is None:
        return 3 * matmul_flops_per_token(cfg, cfg.n_layer, 0, seq_len)
    head = 0 if block == cfg.n_blocks - 1 else cfg.head_layers
    frozen = matmul_flops_per_token(cfg, block * L, 0, seq_len) - 2 * cfg.d_model * VOCAB_SIZE
    return 3 * matmul_flops_per_token(cfg, L, head, seq_len) + frozen


def draft_flops_per_token(cfg: ModelConfig, seq_len: int, unroll: int) -> int:
    """Draft-phase FLOPs per token: the frozen chain forward once, the draft model (input
    projection, layers, readout) trained (3x forward) at every unrolled step."""
    d = cfg.d_model
    chain = matmul_flops_per_token(cfg, cfg.n_layer, 0, seq_len)
    draft = matmul_flops_per_token(cfg, cfg.draft_layers, 0, unroll * seq_len) + 2 * 2 * d * d
    return chain + 3 * unroll * draft


def lr_at(step: int, total: int, peak: float, warmup: int, decay_start: int, decay_end: int, floor: float) -> float:
    """Warmup-stable-decay: linear warmup, constant, cosine down to ``floor*peak``, then the floor."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if step < decay_start:
        return peak
    if step >= decay_end:
        return peak * floor
    t = (step - decay_start) / max(1, decay_end - decay_start)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
