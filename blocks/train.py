"""Block trainers, the end-to-end trainer, schedules and evaluation.

Rules:
- A ``BlockTrainer`` owns block k's parameters and an optimizer over those alone. Blocks below
  it are frozen copies (``requires_grad=False``, no optimizer state) refreshed from their
  checkpoints; its input is computed under ``torch.no_grad()``: no gradient crosses blocks.
- Every trainer reads batches as a pure function of its step, so a restart from a checkpoint at
  step s continues with exactly the batches s, s+1, ...
- A schedule says, per block, when (in wall steps) it trains and with which learning rates; all
  schedules give every block the same number of optimizer steps on the same number of bytes.
- Draft phase: after its steps, the last block's draft model (``model.Drafter``) trains for
  ``draft_frac`` x ``steps`` more steps with everything else frozen (its own optimizer), on the chain's
  own next-byte distributions (self-distillation, ``draft_loss``): next-byte CE is unchanged.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from . import checkpoint as ckpt
from .data import ByteBatches, eval_windows
from .device import autocast, host_state, to_host
from .config import TrainConfig  # the config's home is config.py (imported from here too)
from .model import MASK_ID, Block, EndToEnd, KVCache, ModelConfig, lr_at


def wsd_plan(cfg: TrainConfig) -> tuple[int, int]:
    """(decay_start, decay_end) of warmup-stable-decay over ``cfg.steps``: the last ``decay_frac``
    of the steps decay (the one home of this rule; schedules that shift it say so)."""
    D = max(1, int(round(cfg.decay_frac * cfg.steps)))
    return cfg.steps - D, cfg.steps


def mask_tail(x: torch.Tensor, frac: float, step: int, seed: int) -> torch.Tensor:
    """Replace a random-length tail of a ``frac`` share of rows by MASK_ID (targets unchanged).

    Position t of a placeholder still predicts byte t+1, so prompt + (N-1) placeholders give N
    continuation bytes in one traversal.
    """
    if frac <= 0:
        return x
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + 17) % (1 << 62))
    B, T = x.shape
    rows = torch.rand(B, generator=g) < frac
    length = torch.randint(1, T, (B,), generator=g)
    pos = torch.arange(T)[None, :]
    masked = rows[:, None] & (pos >= (T - length)[:, None])
    return torch.where(masked, torch.full_like(x, MASK_ID), x)


def draft_masks(T: int, unroll: int) -> list[torch.Tensor]:
    """Attention of unrolled drafting step s (1-based) over the entries of steps 1..s, (T, s*T).

    Step 1 is teacher-forced (entry q: feature q-1, byte q; causal). Entry q of step s >= 2 reads
    step s-1's prediction at q-1 and byte q, as drafting s bytes past the last accepted token
    does: it sees step-1 entries up to q-s+1, the entry of step j at q-s+j (1 < j < s) and itself.
    """
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    masks = [k <= q]
    for s in range(2, unroll + 1):
        blocks = [k <= q - s + 1] + [k == q - s + j for j in range(2, s)] + [k == q]
        masks.append(torch.cat(blocks, dim=1))
    return masks


def draft_loss(block: Block, f: torch.Tensor, x: torch.Tensor, unroll: int = 1) -> tuple[torch.Tensor, list[float]]:
    """The draft model's objective on one batch: ``f`` (B, T, C) the block's output features
    (no gradient), ``x`` (B, T) the input bytes. At every unrolled step, KL from the block's own
    next-byte distribution to the draft's, plus a smooth-L1 pull of the predicted feature to the
    true one (EAGLE). Returns the loss and the KL per step (for logs)."""
    d = block.drafter
    assert d is not None, "this block has no draft model"
    B, T, C = f.shape
    with torch.no_grad():
        teacher = F.log_softmax(block.logits(f), dim=-1)  # (B, T, 256)
    caches = [KVCache(unroll * T) for _ in d.layers]
    prev = torch.cat([f.new_zeros(B, 1, C), f[:, :-1]], dim=1)  # entry q pairs feature q-1 with byte q
    total, kls = 0.0, []
    for s, mask in enumerate(draft_masks(T, unroll), start=1):
        u = d(prev, x, caches, mask.to(f.device))
        valid = slice(s - 1, T)  # entries q < s-1 have no step-(s-1) prediction before them
        logq = F.log_softmax(block.logits(u[:, valid]), dim=-1)
        kl = F.kl_div(logq, teacher[:, valid], log_target=True, reduction="batchmean") / (T - s + 1)
        reg = F.smooth_l1_loss(u[:, valid], f[:, valid])
        total = total + kl + reg
        kls.append(kl.item())
        prev = torch.cat([f.new_zeros(B, 1, C), u[:, :-1]], dim=1)
    return total / unroll, kls


def slot_batch(x: torch.Tensor, y: torch.Tensor, tcfg: TrainConfig, step: int, max_seq_len: int = 0):
    """The block objective's input for batch ``(x, y)``: ``(ids, targets, layout, weights)``.

    ``slot_branches`` > 0: every row keeps all its bytes (each predicts the next byte with its
    whole context) and gains that many branches of ``slot_len`` placeholders, each after a random
    byte a of the row: placeholder j sits at position a + j, sees bytes 0..a and the placeholders
    before it in its branch (nothing else sees it), and predicts byte a + j + 1, as prompt + N-1
    placeholders do in one traversal. Loss: next-byte mean CE + ``slot_weight`` x placeholder
    mean CE (``weights``). ``slot_branches`` == 0: the older masked tails (``mask_tail``), plain mean.
    ``position_shift``: row r's positions start at a random offset (all of them within
    ``max_seq_len``), so that every position embedding is trained.
    """
    B, T = x.shape
    shift = torch.zeros(B, 1, dtype=torch.long)
    if tcfg.position_shift:
        room = max_seq_len - T - (tcfg.slot_len if tcfg.slot_branches > 0 else 0)
        assert room >= 0, f"rows of {T} bytes (+ placeholders) do not fit in max_seq_len {max_seq_len}"
        gs = torch.Generator().manual_seed((tcfg.seed * 1_000_003 + step * 7919 + 31) % (1 << 62))
        shift = torch.randint(0, room + 1, (B, 1), generator=gs)
    if tcfg.slot_branches <= 0:
        layout = {"positions": torch.arange(T)[None] + shift} if tcfg.position_shift else None
        return mask_tail(x, tcfg.mask_frac, step, tcfg.seed), y, layout, None
    A, S = tcfg.slot_branches, tcfg.slot_len
    g = torch.Generator().manual_seed((tcfg.seed * 1_000_003 + step * 7919 + 29) % (1 << 62))
    anchor = torch.randint(0, T - 1, (B, A), generator=g).repeat_interleave(S, dim=1)  # (B, A*S)
    j = torch.arange(1, S + 1).repeat(A)  # offset of each placeholder
    branch = torch.arange(A).repeat_interleave(S)
    slot_pos = anchor + j
    ids = torch.cat([x, torch.full((B, A * S), MASK_ID, dtype=x.dtype)], dim=1)
    positions = torch.cat([torch.arange(T).expand(B, T), slot_pos], dim=1) + shift
    offsets = torch.cat([torch.zeros(B, T, dtype=torch.long), j.expand(B, A * S)], dim=1)
    valid = slot_pos <= T - 1  # byte a + j + 1 = y[a + j] exists in this window
    slot_tgt = torch.where(valid, y.gather(1, slot_pos.clamp(max=T - 1)), torch.full_like(slot_pos, -100))
    targets = torch.cat([y, slot_tgt], dim=1)
    n = T + A * S
    mask = torch.zeros(B, n, n, dtype=torch.bool)
    mask[:, :T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:, T:, :T] = torch.arange(T)[None, None, :] <= anchor[:, :, None]
    mask[:, T:, T:] = (branch[:, None] == branch[None, :]) & (j[None, :] <= j[:, None])
    n_slots = int(valid.sum())
    weights = torch.cat([torch.full((B, T), 1.0 / (B * T)),
                         valid.float() * (tcfg.slot_weight / max(1, n_slots))], dim=1)
    return ids, targets, {"positions": positions, "mask": mask[:, None], "offsets": offsets}, weights


def _split_layout(layout: dict | None, parts: int) -> list[dict | None]:
    if layout is None:
        return [None] * parts
    split = {k: v.tensor_split(parts) for k, v in layout.items()}
    return [{k: v[i] for k, v in split.items()} for i in range(parts)]


def _to(device: torch.device, x, y, layout, weights):
    """A batch (``slot_batch``'s four parts) on ``device``."""
    if device.type == "cpu":
        return x, y, layout, weights
    return (x.to(device), y.to(device), None if layout is None else {k: v.to(device) for k, v in layout.items()},
            None if weights is None else weights.to(device))


def _grad_pass(batch, parts: int, loss_of) -> float:
    """Forward and backward of one step's batch ``(x, y, layout, weights)`` in ``parts`` slices
    of rows, one after another (``loss_of(x, y, layout, weights)`` the slice's loss): the
    gradients accumulate in ``.grad`` to the batch's (a slice's mean loss weighs by its share of
    the rows; a weighted loss already holds the batch's weights). Returns the batch's loss."""
    x, y, layout, weights = batch
    assert 1 <= parts <= x.shape[0], f"{parts} slices for a batch of {x.shape[0]} rows"
    total = 0.0
    ws = weights.tensor_split(parts) if weights is not None else [None] * parts
    for xs, ys, ls, w in zip(x.tensor_split(parts), y.tensor_split(parts), _split_layout(layout, parts), ws):
        loss = loss_of(xs, ys, ls, w)
        share = 1.0 if w is not None else xs.shape[0] / x.shape[0]
        (loss * share).backward()
        total += loss.item() * share
    return total


def _adamw(params, cfg: TrainConfig):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95))


class BlockTrainer:
    """Trains block ``k`` on its local objective over frozen lower blocks."""

    def __init__(self, mcfg: ModelConfig, tcfg: TrainConfig, k: int, data: torch.Tensor,
                 shard: int = 0, num_shards: int = 1, device: torch.device | str = "cpu", precision: str = "fp32"):
        self.mcfg, self.tcfg, self.k = mcfg, tcfg, k
        self.device, self.precision = torch.device(device), precision
        torch.manual_seed(tcfg.seed * 100 + k)
        self.block = Block(mcfg, k).to(self.device)  # built on the CPU: the same start on every device
        self.lower: list[Block] = []
        self.lower_steps: list[int] = []  # step of each lower checkpoint in use
        self.opt = _adamw(list(self.block.parameters()), tcfg)
        self.batches = ByteBatches(data, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed, shard=shard,
                                   num_shards=num_shards)
        self.step = 0  # optimizer steps taken
        self.lr_plan = wsd_plan(tcfg)  # (decay_start, decay_end); the staggered schedule sets its own

    def set_lower(self, states: list[dict], steps: list[int] | None = None):
        """Install frozen copies of blocks 0..k-1 from their state dicts (parameters only)."""
        assert len(states) == self.k, f"block {self.k} needs {self.k} lower blocks, got {len(states)}"
        if not self.lower:
            self.lower = [Block(self.mcfg, j).to(self.device) for j in range(self.k)]
            for b in self.lower:
                b.requires_grad_(False)
                b.eval()
        for b, sd in zip(self.lower, states):
            b.load_state_dict(sd)
        self.lower_steps = list(steps) if steps is not None else [0] * self.k

    def init_from_below(self, below: Block):
        """Identity start: the block computes, before its first step, what the block below's head
        computed (its layers add zero: ``identity_init``). The head below is taken whole: its
        layers, LayerNorm and output. The top block's head has no layers (the assembled model has
        the reference's depth): the layers of the head below become the block's first layers.
        (Before, only the LayerNorm and output were copied: a middle block started with a fresh
        head layer and the top block without the one below's, each a step back in CE.)"""
        src, dst = below.head, self.block.head
        extra = len(src.layers) - len(dst.layers)
        assert 0 <= extra <= len(self.block.layers), \
            f"head of {len(src.layers)} layer(s) below, {len(dst.layers)} here, {len(self.block.layers)} in the block"
        for mine, theirs in zip(self.block.layers, src.layers[:extra]):
            mine.load_state_dict(theirs.state_dict())
        for mine, theirs in zip(dst.layers, src.layers[extra:]):
            mine.load_state_dict(theirs.state_dict())
        dst.ln.load_state_dict(src.ln.state_dict())
        dst.lm.load_state_dict(src.lm.state_dict())

    @torch.no_grad()
    def lower_hidden(self, x: torch.Tensor, layout: dict | None = None) -> torch.Tensor:
        h = x.to(self.device)
        with autocast(self.device, self.precision):
            for b in self.lower:
                h = b.trunk(h, **(layout or {}))
        return h.detach()

    def lr(self) -> float:
        t = self.tcfg
        start, end = self.lr_plan
        return lr_at(self.step, t.steps, t.lr, t.warmup, start, end, t.lr_floor)

    def train_step(self, replicas: int = 1) -> float:
        """One optimizer step. ``replicas`` > 1: that many workers each take their own rows of the
        batch and their gradients are averaged before the step (synchronous same-block averaging,
        computed here in one process: the optimization is the same as one worker on the batch)."""
        loss = self.compute_grads(replicas)
        self.apply_grads()
        return loss

    def compute_grads(self, replicas: int = 1) -> float:
        """Forward and backward on this step's batch: the gradients are left in ``.grad``. The
        rows are computed in ``replicas`` x ``micro_batches`` slices (at most one per row)."""
        x, y = self.batches.batch(self.step)
        batch = _to(self.device, *slot_batch(x, y, self.tcfg, self.step, self.mcfg.max_seq_len))
        self.block.train()
        self.opt.zero_grad(set_to_none=True)
        assert 1 <= replicas <= x.shape[0], f"{replicas} workers for a batch of {x.shape[0]} rows"

        def loss_of(xs, ys, ls, w):
            inp = self.lower_hidden(xs, ls) if self.k > 0 else xs
            with autocast(self.device, self.precision):
                return self.block(inp, ys, ls, w)[1]
        return _grad_pass(batch, min(x.shape[0], replicas * self.tcfg.micro_batches), loss_of)

    def grads(self) -> torch.Tensor:
        """The gradients as one flat float32 CPU vector (parameter order): one transfer."""
        return to_host(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in self.block.parameters()]), pinned=True)

    def apply_grads(self, flat: torch.Tensor | None = None):
        """Clip and take the optimizer step, with ``flat`` (e.g. the group's average) as the
        gradients when given, else those that ``compute_grads`` left."""
        if flat is not None:
            flat = flat.to(self.device)  # one transfer
            pos = 0
            for p in self.block.parameters():
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[pos:pos + n].view_as(p))
                pos += n
            assert pos == flat.numel(), "gradient vector and parameters differ in size"
        for g in self.opt.param_groups:
            g["lr"] = self.lr()
        torch.nn.utils.clip_grad_norm_(self.block.parameters(), self.tcfg.grad_clip)
        self.opt.step()
        self.step += 1

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """This block's output on input bytes ``x`` (no gradient): what its draft model reads."""
        with torch.no_grad(), autocast(self.device, self.precision):
            return self.block.trunk(self.lower_hidden(x) if self.k > 0 else x.to(self.device)).float()

    def draft_phase(self) -> "DraftPhase":
        return DraftPhase(self.block, self.tcfg, self.batches, self.features, self.device, self.precision)

    def reset_optimizer(self) -> None:
        """The optimizer's moments and step counts start afresh (members that took local steps
        each hold their own; gradient rounds need one state on every member: p2p/swarm/auto.py)."""
        self.opt.state.clear()

    def checkpoint(self) -> ckpt.Checkpoint:
        names = {p: n for n, p in self.block.named_parameters()}
        return ckpt.Checkpoint(self.mcfg.to_dict(), self.k, self.step, host_state(self.block),
                               {k: to_host(v) for k, v in ckpt.optimizer_state(self.opt, names).items()},
                               data_position=self.step,
                               extra={"lower_steps": self.lower_steps, "train": self.tcfg.to_dict()})


    def restore(self, c: ckpt.Checkpoint):
        if c.block != self.k:
            raise ckpt.CheckpointError(f"checkpoint is for block {c.block}, this trainer trains block {self.k}")
        if ModelConfig.from_dict(c.config) != self.mcfg:
            raise ckpt.CheckpointError("checkpoint model config differs from this trainer's")
        self.block.load_state_dict(c.tensors)
        ckpt.load_optimizer_state(self.opt, dict(self.block.named_parameters()), c.optim)
        self.step = c.step

    def trainable_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state this trainer holds."""
        p = sum(t.numel() * t.element_size() for t in self.block.parameters())
        frozen = sum(t.numel() * t.element_size() for b in self.lower for t in b.parameters())
        return {"params": p, "grads": p, "optim_state": 2 * p, "frozen_params": frozen}


class EndToEndTrainer:
    """The reference, on the blocks' objective: the same masked-slot inputs (``mask_tail``) and,
    after its steps, the same draft phase for its last block's draft model."""

    def __init__(self, mcfg: ModelConfig, tcfg: TrainConfig, data: torch.Tensor,
                 device: torch.device | str = "cpu", precision: str = "fp32"):
        self.mcfg, self.tcfg = mcfg, tcfg
        self.device, self.precision = torch.device(device), precision
        torch.manual_seed(tcfg.seed * 100 + 99)
        self.model = EndToEnd(mcfg).to(self.device)
        self.opt = _adamw(list(self.model.parameters()), tcfg)
        self.batches = ByteBatches(data, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed)
        self.step = 0
        self.lr_plan = wsd_plan(tcfg)

    def lr(self) -> float:
        t = self.tcfg
        return lr_at(self.step, t.steps, t.lr, t.warmup, *self.lr_plan, t.lr_floor)

    def train_step(self) -> float:
        x, y = self.batches.batch(self.step)
        batch = _to(self.device, *slot_batch(x, y, self.tcfg, self.step, self.mcfg.max_seq_len))
        for g in self.opt.param_groups:
            g["lr"] = self.lr()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)

        def loss_of(xs, ys, ls, w):
            with autocast(self.device, self.precision):
                return self.model(xs, ys, layout=ls, weights=w)[1]
        loss = _grad_pass(batch, self.tcfg.micro_batches, loss_of)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        self.opt.step()
        self.step += 1
        return loss

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        with torch.no_grad(), autocast(self.device, self.precision):
            for b in self.model.blocks:
                x = b.trunk(x)
        return x.float()

    def draft_phase(self) -> "DraftPhase":
        return DraftPhase(self.model.blocks[-1], self.tcfg, self.batches, self.features, self.device, self.precision)

    def trainable_bytes(self) -> dict:
        p = sum(t.numel() * t.element_size() for t in self.model.parameters())
        return {"params": p, "grads": p, "optim_state": 2 * p, "frozen_params": 0}


class DraftPhase:
    """The draft phase of ``block``'s draft model: ``tcfg.draft_steps`` steps with its own
    optimizer, on the batches after the block's own ``tcfg.steps`` (``features(x)``: the
    block's frozen output), every other parameter untouched."""

    def __init__(self, block: Block, tcfg: TrainConfig, batches: ByteBatches, features,
                 device: torch.device | str = "cpu", precision: str = "fp32"):
        assert block.drafter is not None, f"block {block.index} has no draft model"
        self.block, self.tcfg, self.batches, self.features = block, tcfg, batches, features
        self.device, self.precision = torch.device(device), precision
        self.opt = _adamw(list(block.drafter.parameters()), tcfg)
        self.step = 0

    def train_step(self) -> list[float]:
        """One step; returns the KL per unrolled drafting step."""
        t = self.tcfg
        x, _ = self.batches.batch(t.steps + self.step)
        decay = int(t.draft_steps * (1 - t.decay_frac))
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, t.draft_steps, t.lr, t.warmup, decay, t.draft_steps, t.lr_floor)
        self.block.eval()  # the trunk and head run frozen
        self.block.drafter.train()
        with autocast(self.device, self.precision):
            loss, kls = draft_loss(self.block, self.features(x), x.to(self.device), t.draft_unroll)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.block.drafter.parameters(), t.grad_clip)
        self.opt.step()
        self.block.zero_grad(set_to_none=True)  # gradients passed through the frozen head
        self.step += 1
        return kls


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def eval_chain(blocks: list[Block], data: torch.Tensor, seq_len: int, max_windows: int | None = None,
               batch: int = 16) -> list[float]:
    """CE (nats/byte) of every block's head along the chain 0..len(blocks)-1 (on the blocks' device,
    in float32; the windows turn to int64 a batch at a time)."""
    x, y = eval_windows(data, seq_len, max_windows)
    tot = [0.0] * len(blocks)
    dev = _device_of(blocks[0])
    for i in range(0, x.shape[0], batch):
        h, yb = x[i:i + batch].to(dev).long(), y[i:i + batch].to(dev).long()
        for j, b in enumerate(blocks):
            b.eval()
            h = b.trunk(h)
            if b.head is not None:
                lg = b.logits(h)
                tot[j] += F.cross_entropy(lg.flatten(0, 1), yb.flatten(), reduction="sum").item()
    n = y.numel()
    return [t / n for t in tot]


@torch.no_grad()
def eval_e2e(model: EndToEnd, data: torch.Tensor, seq_len: int, max_windows: int | None = None,
             batch: int = 16) -> float:
    model.eval()
    x, y = eval_windows(data, seq_len, max_windows)
    tot = 0.0
    dev = _device_of(model)
    for i in range(0, x.shape[0], batch):
        lg, _ = model(x[i:i + batch].to(dev).long())
        tot += F.cross_entropy(lg.flatten(0, 1), y[i:i + batch].to(dev).long().flatten(), reduction="sum").item()
    return tot / y.numel()


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def eval_continuation(forward, data: torch.Tensor, prompt_len: int, n_bytes: int, max_windows: int = 64,
                      one_traversal: bool = True) -> dict:
    """CE and byte accuracy of N continuation bytes after a P-byte prompt.

    ``one_traversal``: prompt + N-1 placeholders, one forward (BlockTrain serving).
    Otherwise: teacher-forced next-byte CE/accuracy on the same N positions (what byte-by-byte
    decoding scores on each byte given the true prefix).
    """
    T = prompt_len + n_bytes
    x, _ = eval_windows(data, T, max_windows)
    x = x_full = x.long()
    prompt, truth = x_full[:, :prompt_len], x_full[:, prompt_len:]
    if one_traversal:
        ids = torch.cat([prompt, torch.full((x.shape[0], n_bytes - 1), MASK_ID, dtype=torch.long)], 1)
        logits = forward(ids)[:, prompt_len - 1:]
    else:
        logits = forward(x_full[:, :-1])[:, prompt_len - 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), truth.flatten()).item()
    acc = (logits.argmax(-1) == truth).float().mean().item()
    return {"ce": ce, "byte_accuracy": acc, "windows": int(x.shape[0]), "prompt_len": prompt_len, "n_bytes": n_bytes}


@torch.no_grad()
def eval_generation(generate, data: torch.Tensor, prompt_len: int, n_bytes: int, max_windows: int = 64) -> dict:
    """Byte accuracy of free-running greedy decoding (``generate(prompt, n)``) against the truth."""
    x, _ = eval_windows(data, prompt_len + n_bytes, max_windows)
    x = x.long()
    out = generate(x[:, :prompt_len], n_bytes)
    return {"byte_accuracy": (out == x[:, prompt_len:]).float().mean().item(), "windows": int(x.shape[0]),
            "prompt_len": prompt_len, "n_bytes": n_bytes}


def snapshot(block: Block) -> dict:
    return {k: v.detach().clone() for k, v in block.state_dict().items()}

