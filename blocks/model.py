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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F

VOCAB_SIZE = 256  # bytes
MASK_ID = 256  # the placeholder input id; never an output


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128  # residual width (the default model trains in minutes on 2 cores)
    n_head: int = 4  # attention heads; d_model % n_head == 0
    n_layer: int = 6  # layers of the whole model (end-to-end reference = assembled model)
    n_blocks: int = 3  # K: blocks the layers are cut into, n_layer % n_blocks == 0
    max_seq_len: int = 512  # positions the embedding knows (prompt + placeholders)
    mlp_ratio: int = 4  # MLP hidden = mlp_ratio * d_model
    head_layers: int = 1  # extra Transformer layers in the local heads of blocks 0..K-2
    identity_init: bool = True  # blocks 1..K-1 start as the identity (zeroed output projections)

    def __post_init__(self):
        if min(self.d_model, self.n_head, self.n_layer, self.n_blocks, self.max_seq_len, self.mlp_ratio) < 1:
            raise ValueError("d_model, n_head, n_layer, n_blocks, max_seq_len and mlp_ratio must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_layer % self.n_blocks:
            raise ValueError(f"n_layer {self.n_layer} does not split into {self.n_blocks} blocks")
        if self.head_layers < 0:
            raise ValueError("head_layers must be >= 0")

    @property
    def layers_per_block(self) -> int:
        return self.n_layer // self.n_blocks

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return config_from_dict(cls, d)


def config_from_dict(cls, d: dict):
    """Build config dataclass ``cls`` from a dict; unknown keys are errors, never ignored."""
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    return cls(**d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, cache: dict | None = None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if cache is not None and "k" in cache:
            past = cache["k"].shape[2]
            k = torch.cat([cache["k"], k], dim=2)
            v = torch.cat([cache["v"], v], dim=2)
        else:
            past = 0
        if cache is not None:
            cache["k"], cache["v"] = k, v
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries see every cached key and the new keys up to themselves
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Layer(nn.Module):
    """Pre-LN Transformer layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x, cache: dict | None = None):
        x = x + self.attn(self.ln1(x), cache)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

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


class Block(nn.Module):
    """Block ``index`` of the model: [embeddings] + layers + [local head]."""

    def __init__(self, cfg: ModelConfig, index: int, with_head: bool = True):
        super().__init__()
        assert 0 <= index < cfg.n_blocks, f"block index {index} not in [0, {cfg.n_blocks})"
        self.cfg, self.index = cfg, index
        if index == 0:
            self.tok = nn.Embedding(VOCAB_SIZE + 1, cfg.d_model)  # + MASK_ID
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers_per_block))
        top = index == cfg.n_blocks - 1
        self.head = LocalHead(cfg, 0 if top else cfg.head_layers) if with_head else None
        self.apply(_init_weights)
        if index > 0 and cfg.identity_init:
            for layer in self.layers:
                layer.zero_output()

    @property
    def is_first(self) -> bool:
        return self.index == 0

    def embed(self, idx, start: int = 0):
        """Byte ids at positions start..start+T-1 -> the residual stream: the one embedding site."""
        B, T = idx.shape
        if start < 0 or start + T > self.cfg.max_seq_len:
            raise ValueError(f"positions {start}..{start + T - 1} exceed max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(start, start + T, device=idx.device)
        return self.tok(idx) + self.pos(pos)[None]  # (B, T, C)

    def trunk(self, x, caches: list | None = None):
        """Input (ids for block 0, else a residual stream) -> this block's residual stream."""
        h = self.embed(x) if self.is_first else x
        for i, layer in enumerate(self.layers):
            h = layer(h, None if caches is None else caches[i])
        return h

    def forward(self, x, targets=None):
        """``(hidden, loss)``: loss is the local objective when targets are given."""
        h = self.trunk(x)
        if targets is None:
            return h, None
        assert self.head is not None, "this block has no local head"
        return h, F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten(), ignore_index=-100)

    def logits(self, h):
        assert self.head is not None, "this block has no local head"
        return self.head(h)

    def param_count(self, include_head: bool = True) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if include_head or not n.startswith("head."))


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

    def forward(self, idx, targets=None, caches: list | None = None):
        h = idx
        for k, b in enumerate(self.blocks):
            h = b.trunk(h, None if caches is None else caches[k])
        logits = self.blocks[-1].logits(h)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def new_caches(self) -> list:
        return [[{} for _ in b.layers] for b in self.blocks]

    @torch.no_grad()
    def forward_cached(self, idx, caches: list, start: int):
        """Forward ``idx`` at positions ``start..`` using and extending ``caches`` (KV per layer)."""
        h = self.blocks[0].embed(idx, start)
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
