"""``bt-bench step``: one block worker's training step against a plain PyTorch loop that trains
the same model end to end on the same device, side by side in one run.

Rules:
- The plain loop is what one would write without BlockTrain: ``EndToEnd`` on the device, AdamW
  with the block worker's settings (read from its optimizer), the configured gradient clip, plain
  next-byte CE on a ``ByteBatches`` batch, under the same autocast. No machinery.
- The block worker is ``BlockTrainer.train_step`` for block k (every k of the model), its lower
  blocks frozen copies of fresh ``Block``s: its step is the real one (frozen forward below,
  placeholder branches and tree attention of its objective, the loss read back).
- FLOPs per step are counted, not taken from a formula: one step of each arm under
  ``FlopCounterMode`` (matrix products and attention; element-wise work is not counted). CPU
  attention (``_scaled_dot_product_flash_attention_for_cpu``) is not in torch's table: it is
  counted here with torch's own convention for attention (``ATTENTION_FLOPS``).
- Time: after one counted and ``WARMUP_STEPS`` untimed steps per arm, the arms take timed steps
  in turn (plain, block 0, block 1, ...), so that a slow spell of a shared machine hits them
  all; per arm the median. ``ratio`` = block FLOP/s / plain FLOP/s: the block worker's
  throughput per FLOP against the plain loop's.
- Memory: the gradient and optimizer-state bytes each arm holds after its steps (tensors
  counted, not a formula), against the budget ``end-to-end's / K + the block's head's``.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
from torch.utils.flop_counter import FlopCounterMode

from blocktrain.blocks.config import SIZES, ConfigError, JobConfig, ModelConfig, TrainConfig, load
from blocktrain.blocks.data import ByteBatches, load_split
from blocktrain.blocks.device import autocast, describe
from blocktrain.blocks.device import threads as torch_threads
from blocktrain.blocks.model import Block, EndToEnd
from blocktrain.blocks.train import BlockTrainer, slot_batch

from .report import verdict

# Untimed steps per arm before the timed ones (after the counted one): the first steps allocate
# the optimizer state and warm the allocator; two more keep them out of the medians.
WARMUP_STEPS = 2

NOTE = ("ratio = (block worker FLOPs/step / its median s/step) / (plain loop FLOPs/step / its median s/step), "
        "measured side by side in one run with the arms' steps interleaved; FLOPs counted by "
        "torch.utils.flop_counter (matrix products and attention, full attention matrices also where "
        "causal). On a shared machine, contention from other work inflates the noise of every figure.")


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward attention: Q K^T and P V, full matrices (torch's ``sdpa_flop`` convention)."""
    b, h, s_q, d = query_shape
    return 2 * (2 * b * h * s_q * key_shape[-2] * d)


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    """Backward attention: four products of the forward's size (torch's ``sdpa_backward_flop``)."""
    b, h, s_q, d = query_shape
    return 4 * (2 * b * h * s_q * key_shape[-2] * d)


# Attention kernels that torch's FLOP table lacks (the CPU one), by op.
ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


def counted_flops(fn) -> int:
    """FLOPs that ``fn()`` computes (matrix products and attention, forward and backward)."""
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
        fn()
    return int(counter.get_total_flops())


def configs(sizes: list[str], sets=(), batch: int | None = None, seq: int | None = None):
    """``[(size, ModelConfig, TrainConfig)]``: each named size with the ``--set`` items and the
    batch shape applied. Raises ConfigError on an unknown size or key."""
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        raise ConfigError(f"size(s) {', '.join(unknown) or '(none)'}: expected names among {', '.join(SIZES)}")
    out = []
    for size in sizes:
        job = load(JobConfig(), sets=sets, size=size, **{"train.batch_size": batch, "train.seq_len": seq})
        out.append((size, job.model, job.train))
    return out


class PlainLoop:
    """The plain PyTorch training step of ``EndToEnd``: next-byte CE, backward, clip, AdamW."""

    def __init__(self, mcfg: ModelConfig, tcfg: TrainConfig, data: torch.Tensor, device: torch.device,
                 precision: str, like: torch.optim.Optimizer):
        self.tcfg, self.device, self.precision = tcfg, device, precision
        torch.manual_seed(tcfg.seed * 100 + 99)
        self.model = EndToEnd(mcfg).to(device)
        params = list(self.model.parameters())
        decay = like.param_groups[0]["weight_decay"]
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=tcfg.lr, betas=like.defaults["betas"], eps=like.defaults["eps"])
        self.batches = ByteBatches(data, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed)
        self.step = 0

    def train_step(self) -> torch.Tensor:
        x, y = self.batches.batch(self.step)
        x, y = x.to(self.device), y.to(self.device)
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.device, self.precision):
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        self.opt.step()
        self.step += 1
        return loss.detach()


def held_bytes(params, opt: torch.optim.Optimizer) -> int:
    """Bytes of the gradients of ``params`` and of ``opt``'s state for them, as held now."""
    total = 0
    for p in params:
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        total += sum(t.numel() * t.element_size() for t in opt.state.get(p, {}).values() if torch.is_tensor(t))
    return total


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(step, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


@contextmanager
def _cuda_peak(device: torch.device, into: dict):
    """On CUDA: the peak allocated bytes while the body ran (absolute: every arm's resident
    tensors included), and that peak above what was allocated when it began."""
    if device.type != "cuda":
        into.update(cuda_max_allocated_bytes=None, cuda_step_peak_extra_bytes=None)
        yield
        return
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    yield
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    into.update(cuda_max_allocated_bytes=peak, cuda_step_peak_extra_bytes=peak - base)


def _figures(flops: int, seconds: list[float], tokens: int, bytes_per_step: int) -> dict:
    med = statistics.median(seconds)
    return {"flops_per_step": flops, "seconds_per_step": med, "seconds": seconds, "flops_per_s": flops / med,
            "bytes_per_s": bytes_per_step / med, "tokens_per_step": tokens}


def measure(size: str, mcfg: ModelConfig, tcfg: TrainConfig, data: torch.Tensor, device: torch.device,
            precision: str, steps: int, log=lambda line: None) -> dict:
    """One size: the plain loop and the block worker of every block, measured side by side."""
    K = mcfg.n_blocks
    workers = []
    for k in range(K):
        w = BlockTrainer(mcfg, tcfg, k, data, device=device, precision=precision)
        if k > 0:
            torch.manual_seed(1000 + k)
            w.set_lower([Block(mcfg, j).state_dict() for j in range(k)])
        workers.append(w)
    plain = PlainLoop(mcfg, tcfg, data, device, precision, like=workers[0].opt)
    arms = [("plain", plain.train_step)] + [(f"block {k}", w.train_step) for k, w in enumerate(workers)]

    flops: dict[str, int] = {}
    cuda: dict[str, dict] = {name: {} for name, _ in arms}
    for name, step in arms:
        flops[name] = counted_flops(step)
        log(f"{size}: {name}: {flops[name] / 1e9:,.2f} GFLOP/step (counted)")
    for i in range(WARMUP_STEPS):
        for name, step in arms:
            if i == 0:
                with _cuda_peak(device, cuda[name]):
                    step()
            else:
                step()
    seconds: dict[str, list[float]] = {name: [] for name, _ in arms}
    for i in range(steps):
        for name, step in arms:
            seconds[name].append(_timed(step, device))
        log(f"{size}: timed round {i + 1}/{steps}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in seconds.items()))

    x, y = plain.batches.batch(0)
    bytes_per_step = x.numel()  # training bytes per step, the same for every arm
    slot_tokens = slot_batch(x, y, tcfg, 0, mcfg.max_seq_len)[0].numel()  # with the placeholder branches
    e2e_params = list(plain.model.parameters())
    e2e_held = held_bytes(e2e_params, plain.opt)
    row = _figures(flops["plain"], seconds["plain"], bytes_per_step, bytes_per_step)
    out = {"size": size, "model": mcfg.to_dict(),
           "train": {"batch_size": tcfg.batch_size, "seq_len": tcfg.seq_len, "slot_branches": tcfg.slot_branches,
                     "slot_len": tcfg.slot_len},
           "params": sum(p.numel() for p in e2e_params),
           "plain": {**row, "grad_optim_bytes": e2e_held, **cuda["plain"]}, "blocks": []}
    for k, w in enumerate(workers):
        name = f"block {k}"
        r = _figures(flops[name], seconds[name], slot_tokens, bytes_per_step)
        head = list(w.block.head.parameters()) if w.block.head is not None else []
        budget = e2e_held / K + held_bytes(head, w.opt)
        mine = held_bytes(list(w.block.parameters()), w.opt)
        declared = w.trainable_bytes()
        out["blocks"].append({
            "block": k, **r, "ratio": r["flops_per_s"] / out["plain"]["flops_per_s"],
            "params": sum(p.numel() for p in w.block.parameters()), "head_params": sum(p.numel() for p in head),
            "grad_optim_bytes": mine, "grad_optim_budget_bytes": budget, "within_budget": mine <= budget,
            "grad_optim_vs_end_to_end": mine / e2e_held,
            "grad_optim_bytes_declared": declared["grads"] + declared["optim_state"], **cuda[name]})
    out["ratio_min"] = min(b["ratio"] for b in out["blocks"])
    return out


def run(sizes: list[tuple[str, ModelConfig, TrainConfig]], device: torch.device, precision: str, steps: int,
        threads: int, log=lambda line: None) -> dict:
    """Every size of ``sizes`` (``configs``), on ``device`` with ``threads`` torch threads."""
    with torch_threads(threads):
        data = load_split("train")
        results = [measure(name, m, t, data, device, precision, steps, log) for name, m, t in sizes]
    return {"benchmark": "step", "device": describe(device, precision), "precision": precision, "threads": threads,
            "steps": steps, "warmup_steps": WARMUP_STEPS, "sizes": results,
            "targets": {"ratio >= 0.95 at every size (CPU)": all(s["ratio_min"] >= 0.95 for s in results),
                        "grad+optim within end-to-end/K + head": all(b["within_budget"]
                                                                     for s in results for b in s["blocks"])},
            "note": NOTE}


def report(result: dict) -> list[str]:
    """``bt-bench step``'s report of ``run``'s result: a row per arm of every size, then each
    target's verdict."""
    lines = [f"{result['device']}, {result['threads']} thread(s), median of {result['steps']} timed step(s) per arm",
             f"{'size':<6} {'arm':<8} {'GFLOP/step':>10} {'s/step':>8} {'GFLOP/s':>8} {'bytes/s':>9} "
             f"{'ratio':>6} {'grad+optim MB':>13} {'budget MB':>9}"]
    for s in result["sizes"]:
        p = s["plain"]
        lines.append(f"{s['size']:<6} {'plain':<8} {p['flops_per_step'] / 1e9:>10.2f} {p['seconds_per_step']:>8.3f} "
                     f"{p['flops_per_s'] / 1e9:>8.2f} {p['bytes_per_s']:>9,.0f} {'':>6} "
                     f"{p['grad_optim_bytes'] / 1e6:>13.1f}")
        for b in s["blocks"]:
            lines.append(f"{s['size']:<6} {'block ' + str(b['block']):<8} {b['flops_per_step'] / 1e9:>10.2f} "
                         f"{b['seconds_per_step']:>8.3f} {b['flops_per_s'] / 1e9:>8.2f} {b['bytes_per_s']:>9,.0f} "
                         f"{b['ratio']:>6.3f} {b['grad_optim_bytes'] / 1e6:>13.1f} "
                         f"{b['grad_optim_budget_bytes'] / 1e6:>9.1f}{'' if b['within_budget'] else ' OVER'}")
    return lines + [f"target {name}: {verdict(met)}" for name, met in result["targets"].items()]
