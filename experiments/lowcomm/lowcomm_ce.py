"""Which low-communication round keeps the CE of every-step averaging? W workers train block 0
data-parallel (d 128, the relay's first block), their rounds computed by the swarm's own
``AveragingRound`` (the codec's encoding, error feedback and the robust aggregate, byte for byte
what travels), its messages handed from one member to another in this process instead of over
sockets. Every variant starts from the same weights and sees the same batches.

usage: python experiments/lowcomm/lowcomm_ce.py MODE [--workers W] [--steps S] [--every H]
           [--codec raw|topk|sign] [--density D] [--outer-lr A] [--outer-momentum M] [--overlap] [--seed N]
           [--attack none|flip|scale8|steer [--attack-from R]] [--exclude] [--cosines]
           [--dense-first N] [--batch-size B] [--curve N [--curve-windows K]]
MODE: grads (average gradients every step, then the AdamW step: today's swarm), params (H local
AdamW steps, then the pseudo-gradient start - now averaged and applied by an outer SGD step of
rate A: DiLoCo without momentum; with --codec topk the pseudo-gradient travels as the top D of
each chunk with error feedback: SparseLoCo-like; --overlap: each round is applied one phase late,
the next phase starting from the last averaged point minus the worker's own phase, so a round's
time on the wire hides behind the next phase's compute), alone (one worker, no rounds).
--attack: the last worker is malicious: every round it sends its vector negated or x8 (its own
parameters follow the group), or (steer, 4 workers or more) it answers last and sends, coordinate
by coordinate, the sign the first two members share where they agree and the reverse of the
third member's where they differ (with its own magnitudes): the attack a review modelled against
tests measured with the median, meant to make the third, honest, member look opposed; the JSON's ``named_rounds`` counts the rounds whose report (seen by
the first worker) named each member: rejected, a suspect, or opposed to the median (the pair
test over the last rounds, PairWindow, is counted by --exclude only). --exclude:
as the driver does (its rule 6, ``outliers_in_a_row``), a member the first worker names is left
out of every later round; ``excluded`` says when and why. --dense-first N (params): a round after
every step for the first N steps, then every H (a dense warm-up, as post-local SGD and 1-bit Adam
start). --curve N: the valid CE of the first worker's block (K validation windows) at the first
round's end at or after every N steps, with the bytes each worker had sent by then (``curve``:
[step, valid CE, bytes]) and the seconds of compute per step (``step_seconds``: the wall time of
the run less the curve's evaluations, over steps x workers, the workers taking turns on one core).
Prints one JSON line: the settings, test and valid CE of block 0's head (the whole validation
split in 128-byte windows, 2,000 test windows), bytes each worker sent in parts, seconds.
"""

import argparse
import json
import math
import sys
import time

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, TrainConfig, eval_chain
from blocktrain.p2p.averaging import AveragingRound, OuterOptimizer, RoundSpec, flatten
from blocktrain.p2p.averaging.driver import outliers_in_a_row
from blocktrain.p2p.averaging.robust import PairWindow, pair_cosines


def average(ids, vectors, rnd, codec, density, residuals, named=None, judge=None):
    """One robust round among the members; their results, residuals, and the bytes each sent.
    ``named`` (member -> rounds): counts the rounds in which the first member's report named each
    other member (rejected, a suspect, or opposed to the median). ``judge(round)``: the first
    member's round, after it ended (the driver's rule 6)."""
    spec = RoundSpec(codec=codec, aggregate="robust", density=density)
    rounds = [AveragingRound(me, 0, rnd, ids, v, spec, residual=res)
              for me, v, res in zip(ids, vectors, residuals)]
    by_id = dict(zip(ids, rounds))
    sent = dict.fromkeys(ids, 0)
    queue = [(me, p) for me, r in zip(ids, rounds) for p in r.start()]
    while queue:
        sender, part = queue.pop(0)
        sent[sender] += part.stored_bytes
        queue += [(part.peer, p) for p in by_id[part.peer].receive(sender, part.msg)]
    results = [r.result() for r in rounds]
    outs = [out for out, _ in results]
    if named is not None:
        rep = results[0][1]
        for p in {r["peer"] for r in rep.rejected} | set(rep.suspects) | set(rep.opposed) | set(rep.far):
            named[p] = named.get(p, 0) + 1
    if judge is not None:
        judge(rounds[0])
    assert all(torch.equal(outs[0], o) for o in outs), "the members ended the round with different bytes"
    return outs[0], [None if r.residual is None else r.residual.clone() for r in rounds], sent


def set_params(block, vec):
    i = 0
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(vec[i:i + p.numel()].view_as(p))
            i += p.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["grads", "params", "alone"])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--codec", default="raw")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attack", choices=["none", "flip", "scale8", "steer"], default="none",
                    help="the last worker sends its vector negated (flip) or x8 (scale8) every round, or (steer) "
                         "steers against the third member")
    ap.add_argument("--exclude", action="store_true",
                    help="as the driver does (rule 6): a member the first member names is left out of later rounds "
                         "(every member computes every sign piece from the same parts, so all name it alike)")
    ap.add_argument("--cosines", action="store_true",
                    help="record each member's cosine with the median, and the upper median of its cosines with the "
                         "others' updates, in every round (as the first member saw it)")
    ap.add_argument("--dense-first", type=int, default=0,
                    help="params: a round after every step for the first N steps, then every --every steps")
    ap.add_argument("--batch-size", type=int, default=None, help="train.batch_size (default: TrainConfig's)")
    ap.add_argument("--curve", type=int, default=0,
                    help="the valid CE at the first round's end at or after every N steps (0: none)")
    ap.add_argument("--curve-windows", type=int, default=200, help="validation windows of a --curve point")
    ap.add_argument("--attack-from", type=int, default=0,
                    help="the attacker sends honest vectors before this round (an attacker that waits until the "
                         "members' updates are noisy)")
    a = ap.parse_args()
    if a.exclude and a.overlap:
        ap.error("--exclude is for rounds without --overlap")
    from blocktrain.bench.provenance import code_version
    version = code_version()  # stamped as the run starts: edits made while it runs are not its code
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    data, valid, test = (as_tensor(read_split(s)) for s in ("train", "valid", "test"))
    mc = ModelConfig(d_model=128)
    tc = TrainConfig(steps=a.steps, seed=a.seed, **({"batch_size": a.batch_size} if a.batch_size else {}))
    W = 1 if a.mode == "alone" else a.workers
    all_trs = [BlockTrainer(mc, tc, 0, data, shard=i, num_shards=W) for i in range(W)]
    for t in all_trs[1:]:
        t.block.load_state_dict(all_trs[0].block.state_dict())
    trs = all_trs
    all_ids = [chr(ord("a") + i) * 64 for i in range(W)]
    all_residuals: list = [None] * W
    named: dict = {}
    excluded: dict = {}  # member -> (round, why), with --exclude
    streak: dict = {}
    window = PairWindow() if a.mode == "params" else None  # as the driver: optimizer steps only

    cosines: dict = {}  # --cosines: member -> its cosine with the median, round by round (the first member's view)
    pairwise: dict = {}  # --cosines: member -> the upper median of its cosines with the others', round by round
    windowed: dict = {}  # --cosines: the same over the driver's window of rounds (PairWindow), where it has one

    def judge(r):
        if a.cosines:
            mm = r._agree.get(None, 0.0)
            for p, (dot, xx) in ((p, v) for p, v in r._agree.items() if p is not None and p != all_ids[0]):
                cosines.setdefault(p[:1], []).append(round(dot / math.sqrt(xx * mm), 4) if xx > 0 and mm > 0 else None)
            for p, c in pair_cosines(r.pairs, set(r.live())).items():
                pairwise.setdefault(p[:1], []).append(round(c, 4))
        for pid, why in outliers_in_a_row(r, all_ids[0], streak, window):
            if a.exclude and pid not in excluded:
                excluded[pid] = (r.round, why)
        if a.cosines:
            for p, c in (window.figures(set(r.live())) if window else {}).items():
                windowed.setdefault(p[:1], []).append(round(c, 4))

    def attacked(vs):
        if a.attack == "none" or all_ids[-1] not in ids or rnd < a.attack_from:
            return vs
        if a.attack == "steer":  # answers last, knowing the others' parts: see the docstring
            if len(vs) < 4:
                return vs
            agree = torch.sign(vs[0]) == torch.sign(vs[1])
            return vs[:-1] + [torch.where(agree, torch.sign(vs[0]), -torch.sign(vs[2])) * vs[-1].abs()]
        return vs[:-1] + [vs[-1] * (-1.0 if a.attack == "flip" else 8.0)]
    outer = OuterOptimizer(a.outer_lr, a.outer_momentum, a.outer_momentum > 0)
    sent = dict.fromkeys(all_ids, 0)
    curve: list = []  # --curve: [step, valid CE, bytes per worker so far]
    eval_s, next_point = 0.0, a.curve

    def round_end(s):  # a round ends after step s (0-based)
        return (s + 1) % a.every == 0 or s + 1 == a.steps or s < a.dense_first
    t0 = time.perf_counter()
    rnd = 0
    start = flatten(list(trs[0].block.parameters())).clone()
    phase_start, pending = [start] * W, None  # --overlap: each worker's phase start; the round in flight
    for s in range(a.steps):
        active = [i for i in range(W) if all_ids[i] not in excluded]
        ids = [all_ids[i] for i in active]
        residuals = [all_residuals[i] for i in active]
        trs = [all_trs[i] for i in active]
        if a.mode == "grads":
            for t in trs:
                t.compute_grads()
            rnd += 1
            avg, residuals, got = average(ids, attacked([t.grads() for t in trs]), rnd, a.codec, a.density, residuals,
                                         named, judge)
            for t in trs:
                t.apply_grads(avg)
        else:
            for t in trs:
                t.train_step()
            if a.mode == "params" and a.overlap and round_end(s):
                # the round of this phase is on the wire during the next phase: apply the previous
                # round's average to the global point g, start the next phase from g minus our own
                # (not yet averaged) phase (an eager update); the last phase waits for both
                rnd += 1
                deltas = [ps - flatten(list(t.block.parameters())) for ps, t in zip(phase_start, trs)]
                if pending is not None:
                    start = outer.step(start, pending)
                pending, residuals, got = average(ids, attacked(deltas), rnd, a.codec, a.density, residuals, named,
                                                  judge)
                if s + 1 == a.steps or rnd == 1:  # the swarm waits for a group's first round and its last
                    start, pending = outer.step(start, pending), None
                    phase_start = [start] * W
                else:
                    phase_start = [start - a.outer_lr * d for d in deltas]
                for t, ps in zip(trs, phase_start):
                    set_params(t.block, ps)
            elif a.mode == "params" and round_end(s):
                rnd += 1
                deltas = [start - flatten(list(t.block.parameters())) for t in trs]
                avg, residuals, got = average(ids, attacked(deltas), rnd, a.codec, a.density, residuals, named,
                                              judge)
                start = outer.step(start, avg)
                for t in trs:
                    set_params(t.block, start)
            else:
                got = {}
        for i, res in zip(active, residuals):
            all_residuals[i] = res
        for k, v in got.items():
            sent[k] += v
        if a.curve and s + 1 >= next_point and (a.mode != "params" or round_end(s)):
            te = time.perf_counter()
            curve.append([s + 1, round(eval_chain([trs[0].block], valid, 128, a.curve_windows)[-1], 4),
                          sum(sent.values()) / W])
            eval_s += time.perf_counter() - te
            next_point += a.curve
        if (s + 1) % 100 == 0:
            print(f"step {s + 1}/{a.steps}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    step_seconds = round((time.perf_counter() - t0 - eval_s) / (a.steps * W), 4)
    block = trs[0].block
    print(json.dumps({**vars(a), "workers": W, "code_version": version,
                      "command": "python experiments/lowcomm/lowcomm_ce.py " + " ".join(sys.argv[1:]), "valid_ce": eval_chain([block], valid, 128)[-1],
                      "test_ce": eval_chain([block], test, 128, 2000)[-1],
                      "bytes_sent_per_worker": sum(sent.values()) / W, "rounds": rnd,
                      "named_rounds": {p[:1]: k for p, k in sorted(named.items())},
                      "excluded": {p[:1]: {"round": r, "why": w} for p, (r, w) in sorted(excluded.items())},
                      **({"cosines": cosines, "pair_cosines": pairwise, "window_cosines": windowed} if a.cosines else {}),
                      **({"curve": curve} if a.curve else {}),
                      "step_seconds": step_seconds,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
