"""Whole training runs: BlockTrain under a schedule (lockstep, in one process) and the reference.

Rules:
- ``train_blocktrain`` simulates K workers tick by tick: at wall step t every block whose plan
  covers t takes one optimizer step. Lower-block checkpoints are published and picked up every
  ``refresh_every`` wall steps (and when a block starts or finishes), as workers exchanging
  checkpoint files would.
- Curves record valid CE of every head of the current chain; the final figures are test CE.
- After the schedule, the last block's draft model trains for ``draft_steps`` (``train.DraftPhase``)
  on the final lower blocks; its FLOPs are reported apart (``draft_flops``).
- Progress goes to a callback so that CLIs choose how to show it; this module prints nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model import ModelConfig, draft_flops_per_token, train_flops_per_token
from .schedule import BlockPlan, make_plans
from .train import BlockTrainer, EndToEndTrainer, TrainConfig, eval_chain, eval_e2e, snapshot


@dataclass
class RunResult:
    name: str
    curve: list = field(default_factory=list)  # [(wall_step, [valid CE per head])]
    wall_steps: int = 0
    seconds: float = 0.0
    train_flops: float = 0.0
    draft_flops: float = 0.0  # the draft phase of the last block's draft model (not in train_flops)
    draft_curve: list = field(default_factory=list)  # [(draft step, [KL per unrolled step])]
    busy_fraction: float = 1.0  # share of worker-steps spent training (K workers x wall steps)
    workers_per_block: int = 1  # workers training each block at once (relay: K, same-block averaging)
    starts: list = field(default_factory=list)  # wall step at which each block starts training
    trainable_bytes: list = field(default_factory=list)
    blocks: list | None = None  # trained Blocks (BlockTrain) or None
    model: object = None  # trained EndToEnd (reference) or None


def train_blocktrain(mcfg: ModelConfig, tcfg: TrainConfig, schedule: str, train: torch.Tensor,
                     valid: torch.Tensor, progress=None, identity_start: bool = True,
                     device: torch.device | str = "cpu", precision: str = "fp32",
                     init: list[dict] | None = None) -> RunResult:
    """``init``: every block's state dict to start from (then no block starts from the one below);
    emptied once loaded, so that its tensors are not held through the run."""
    K, S = mcfg.n_blocks, tcfg.steps
    plans: list[BlockPlan] = make_plans(schedule, K, S, tcfg.decay_frac)
    trainers = [BlockTrainer(mcfg, tcfg, k, train, device=device, precision=precision) for k in range(K)]
    for tr, state in zip(trainers, init or ()):
        tr.block.load_state_dict(state)  # in the block's own dtype (a bf16 checkpoint trains in float32)
    started_from = init is not None
    if init:
        init.clear()
    for tr, p in zip(trainers, plans):
        tr.lr_plan = (p.decay_start, p.decay_end)
    published: list[dict | None] = [None] * K
    pub_step = [0] * K
    started = [False] * K
    wall = max(p.end(S) for p in plans)
    res = RunResult(f"blocktrain-{schedule}")
    t0 = time.perf_counter()

    def publish(k):
        published[k] = snapshot(trainers[k].block)
        pub_step[k] = trainers[k].step

    for k in range(K):
        publish(k)
    for t in range(wall):
        for k, (tr, p) in enumerate(zip(trainers, plans)):
            if not (p.start <= t < p.end(S)):
                continue
            if not started[k]:
                started[k] = True
                if k > 0 and identity_start and not started_from and schedule in ("sequential", "relay"):
                    tr.init_from_below(trainers[k - 1].block)
            if k > 0 and (t == p.start or t % tcfg.refresh_every == 0):
                tr.set_lower([published[j] for j in range(k)], pub_step[:k])
            tr.train_step(replicas=K if schedule == "relay" else 1)
            if t % tcfg.refresh_every == tcfg.refresh_every - 1 or tr.step == S:
                publish(k)
        if (t + 1) % tcfg.eval_every == 0 or t + 1 == wall:
            ces = eval_chain([tr.block for tr in trainers], valid, tcfg.seq_len, tcfg.eval_windows)
            res.curve.append((t + 1, ces))
        if progress:
            progress(t + 1, wall, res.curve[-1][1] if res.curve else None)
    last = trainers[-1]
    if tcfg.draft_steps and last.block.drafter is not None:
        if K > 1:
            last.set_lower([published[j] for j in range(K - 1)], pub_step[:K - 1])
        _draft_phase(last.draft_phase(), mcfg, tcfg, res, progress, wall)
    res.seconds = time.perf_counter() - t0
    res.wall_steps = wall
    tokens = S * tcfg.batch_size * tcfg.seq_len
    res.train_flops = float(sum(train_flops_per_token(mcfg, k, tcfg.seq_len) for k in range(K)) * tokens)
    res.busy_fraction = K * S / (K * wall)
    if schedule == "relay":  # K workers share each step: a block takes S/K wall steps, all busy
        res.wall_steps, res.busy_fraction = S, 1.0
        res.workers_per_block = K
        res.curve = [(t / K, ces) for t, ces in res.curve]
    res.trainable_bytes = [tr.trainable_bytes() for tr in trainers]
    res.starts = [p.start / (K if schedule == "relay" else 1) for p in plans]
    res.blocks = [tr.block for tr in trainers]
    return res


def train_e2e(mcfg: ModelConfig, tcfg: TrainConfig, train: torch.Tensor, valid: torch.Tensor,
              progress=None, device: torch.device | str = "cpu", precision: str = "fp32") -> RunResult:
    tr = EndToEndTrainer(mcfg, tcfg, train, device=device, precision=precision)
    res = RunResult("end-to-end")
    t0 = time.perf_counter()
    for t in range(tcfg.steps):
        tr.train_step()
        if (t + 1) % tcfg.eval_every == 0 or t + 1 == tcfg.steps:
            res.curve.append((t + 1, [eval_e2e(tr.model, valid, tcfg.seq_len, tcfg.eval_windows)]))
        if progress:
            progress(t + 1, tcfg.steps, res.curve[-1][1] if res.curve else None)
    if tcfg.draft_steps and tr.model.blocks[-1].drafter is not None:
        _draft_phase(tr.draft_phase(), mcfg, tcfg, res, progress, tcfg.steps)
    res.seconds = time.perf_counter() - t0
    res.wall_steps = tcfg.steps
    res.train_flops = float(train_flops_per_token(mcfg, None, tcfg.seq_len) * tcfg.steps * tcfg.batch_size * tcfg.seq_len)
    res.trainable_bytes = [tr.trainable_bytes()]
    res.model = tr.model
    return res


def _draft_phase(phase, mcfg: ModelConfig, tcfg: TrainConfig, res: RunResult, progress, done: int):
    for i in range(tcfg.draft_steps):
        kls = phase.train_step()
        if (i + 1) % tcfg.eval_every == 0 or i + 1 == tcfg.draft_steps:
            res.draft_curve.append((i + 1, kls))
        if progress:
            progress(done + i + 1, done + tcfg.draft_steps, res.curve[-1][1] if res.curve else None)
    res.draft_flops = float(draft_flops_per_token(mcfg, tcfg.seq_len, tcfg.draft_unroll)
                            * tcfg.draft_steps * tcfg.batch_size * tcfg.seq_len)
