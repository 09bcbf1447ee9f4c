"""A member speaks only for itself: what one key holder's word about others, or a state it crafts,
can make the group do (PROTOCOL.md sections 7.1 and 7.2, r7)."""

from __future__ import annotations

import pytest
import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import Block
from blocktrain.p2p.swarm.checks import StateCheck
from blocktrain.p2p.swarm.schedule import Schedule
from blocktrain.p2p.swarm.store import OUTER_MOMENTUM

MC = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)


def _check(relay: bool = True) -> StateCheck:
    return StateCheck(MC, Schedule(k=0, n_blocks=2, S=10, H=1, relay=relay), as_tensor(read_split("valid")), 32)


def _state(block: int = 0, step: int = 5, gstep: int | None = 5, rnd: int = 7, optim: dict | None = None):
    extra = {"round": rnd} if gstep is None else {"gstep": gstep, "round": rnd}
    return ckpt.Checkpoint(MC.to_dict(), block, step, Block(MC, block).state_dict(), optim=optim or {}, extra=extra)


def _adam(block: int = 0, step: float = 5.0) -> dict:
    out = {}
    for n, t in Block(MC, block).state_dict().items():
        out.update({f"{n}.exp_avg": torch.zeros_like(t), f"{n}.exp_avg_sq": torch.zeros_like(t),
                    f"{n}.step": torch.tensor(step)})
    return out


def test_a_state_whose_every_number_is_in_range_is_taken():
    n = sum(t.numel() for t in Block(MC, 0).state_dict().values())
    _check().state(_state(optim={**_adam(), OUTER_MOMENTUM: torch.zeros(n)}), {}, at=7)
    _check().state(_state(step=10, gstep=10), {}, at=7)  # the block's last step
    _check().state(_state(optim=_adam(step=60.0)), {}, at=7)  # AdamW's count past S: failed params rounds


@pytest.mark.parametrize("state, why", [
    (lambda: _state(step=10**15, gstep=5), "implausible step"),  # adopted before: only gstep was checked
    (lambda: _state(step=10**15, gstep=None), "implausible step"),
    (lambda: _state(step=-1, gstep=5), "implausible step"),
    (lambda: _state(step=5, gstep=15), "global step"),  # block 0's steps are 0..10
    (lambda: _state(step=5, gstep=5.0), "global step"),
    (lambda: _state(rnd=10**15), "implausible round"),
    (lambda: _state(optim=_adam(step=1e15)), "optimizer step count"),
    (lambda: _state(optim={**_adam(), "tok.weight.exp_avg_sq": torch.full((257, 32), -1.0)}), "negative moment"),
    (lambda: _state(optim={**_adam(), "tok.weight.exp_avg": torch.zeros(3)}), "shape"),
    (lambda: _state(optim={**_adam(), "nothing.exp_avg": torch.zeros(3)}), "not of this block"),
    (lambda: _state(optim={OUTER_MOMENTUM: torch.zeros(3)}), "outer momentum"),
])
def test_a_crafted_number_in_the_group_state_is_refused(state, why):
    assert "tok.weight" in Block(MC, 0).state_dict()
    with pytest.raises(ValueError, match=why):
        _check().state(state(), {}, at=7)


def test_the_global_step_lies_in_the_block_the_state_is_of():
    top = _state(block=1, step=5, gstep=15)
    _check().state(top, {0: Block(MC, 0).state_dict()}, at=7)
    with pytest.raises(ValueError, match="global step"):
        _check().state(_state(block=1, step=5, gstep=5), {0: Block(MC, 0).state_dict()}, at=7)


def _trainer(tmp_path, n: int = 5):
    """In-memory peers 01..0n on block 0 (tests/fakes.py); the last one's trainer, a member of a
    group of two with the one before it, round 5."""
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.group import State
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
    from fakes import FakeNet
    net = FakeNet()
    peers = [net.peer(i + 1, blocks=(0,)) for i in range(n)]
    tc = TrainConfig(steps=8, batch_size=2, seq_len=16, warmup=1, draft_frac=0)
    sc = SwarmConfig(schedule="parallel", round_timeout_s=60, eval_windows=2)
    sp = SwarmTrainer(peers[-1], TrainerSpec(0, PeerJob(MC, tc, sc), tmp_path), as_tensor(read_split("valid")),
                      as_tensor(read_split("valid")))
    sp.prepare()
    sp.group.state, sp.group.round, sp.group.joined = State.TRAINING, 5, {peers[-2].id: 1}
    return sp, peers


def _status(sp, sender, size: int, sponsor: str) -> None:
    from blocktrain.protocol import BlockUpdate
    meta = {"phase": "status", "scope": sp.scope, "size": size, "sponsor": sponsor}
    sp.membership.on_control(BlockUpdate(block=0, round=5, meta=meta), None, sender.id)


async def test_a_status_counts_only_the_members_that_say_so_themselves(tmp_path):
    """A key holder outside our group of 2 claims a group of 3 (sponsor 00..00, then itself): we do
    not yield (before r7 the group yielded at once, and to a forger sending it every 0.5 s for good);
    the third such claim names it. Two peers that each say they are in the group of sponsor 01..
    (which ranks above ours) make us yield; one of them alone does not."""
    sp, (a, b, x, _, _) = _trainer(tmp_path)
    try:
        _status(sp, x, 3, "00" * 32)
        _status(sp, x, 3, x.id)
        assert not sp.membership.rejoin and sp.group.members() == sorted([sp.peer.id, "04" * 32])
        _status(sp, x, 3, x.id)
        named = [e for e in sp.group.events if e["event"] == "named"]
        assert [e["peer"] for e in named] == [x.id] and "1 say so themselves" in named[0]["why"]
        _status(sp, a, 2, a.id)
        assert not sp.membership.rejoin  # a group of one, as far as anyone else says
        _status(sp, b, 2, a.id)
        assert sp.membership.rejoin and "yielding" in sp.group.events[-1]["why"]
        assert a.id not in sp.membership.outsiders.unvouched  # vouched for in the end: its count starts again
    finally:
        for p in sp.peer.net.peers.values():
            await p.stop()


@pytest.mark.parametrize("claim", ["mismatched", "departed"])
async def test_a_member_that_names_an_honest_one_in_every_part_costs_nothing_and_is_named(tmp_path, monkeypatch,
                                                                                           claim):
    """Four trainers (robust rounds); the last one lists the first (H0) in meta ``mismatched`` (or
    ``departed``) of every part it sends, and otherwise trains honestly. Before r7 the others
    failed round after round (mismatched: rule 9's count restarts at every change of members) or
    left H0 waiting out every round's deadline (departed). Now every member finishes its block in
    the one group, with no failed round, and the members the forger sends parts to name it."""
    import asyncio

    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.averaging import flatten
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
    from fakes import FakeNet
    net = FakeNet()
    peers = [net.peer(i + 1, blocks=(0,)) for i in range(4)]
    sc = SwarmConfig(schedule="parallel", round_timeout_s=20, join_timeout_s=1, eval_windows=2, min_group=4)
    tc = TrainConfig(steps=12, batch_size=2, seq_len=16, warmup=1, draft_frac=0)
    data = as_tensor(read_split("valid"))
    sps = [SwarmTrainer(p, TrainerSpec(0, PeerJob(MC, tc, sc), tmp_path / f"w{i}"), data, data)
           for i, p in enumerate(peers)]
    from blocktrain.p2p.averaging.pieces import Roster
    h0, forger = peers[0].id, sps[3]
    own = Roster.meta  # what every part relays: the forger's also names H0
    monkeypatch.setattr(Roster, "meta", lambda r: {**own(r), claim: [h0]} if r.me == forger.peer.id else own(r))
    tasks = [asyncio.ensure_future(sp.run()) for sp in sps]
    try:
        reps = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in peers:
            await p.stop()
    for i, (rep, sp) in enumerate(zip(reps[:3], sps[:3])):
        assert rep["state"] == "done" and rep["step"] == rep["steps"] and rep["failed_rounds"] == []
        named = [e["peer"] for e in sp.averager.events if e["event"] == "named"]
        # H0 always sees it (named itself in a part of its own view); another member, for a
        # departure, only where H0's part came after the claim (a race of two connections)
        assert named == [forger.peer.id] if i == 0 or claim == "mismatched" else set(named) <= {forger.peer.id}
    ends = [flatten(sp.params()) for sp in sps]
    assert all(torch.equal(ends[0], e) for e in ends[1:])


def test_a_member_that_changes_the_members_itself_earns_no_new_failed_rounds():
    """Rule 9 (r7): a member whose parts carry another group fails at most MISMATCH_ROUNDS rounds
    per change of members; one that leaves and is admitted again after every 2 failed rounds
    (before r7: 2 more every time) fails MISMATCH_TOTAL in MISMATCH_WINDOW_S in all, then departs
    every round; the window over, it is judged anew. Changes others make (members departing at a
    partition, one after another) earn an honest member its rounds at each, whatever the total."""
    from types import SimpleNamespace

    from blocktrain.p2p.averaging.driver import (MISMATCH_ROUNDS, MISMATCH_TOTAL, MISMATCH_WINDOW_S,
                                                 mismatches_within_allowance)

    def rounds(state, cycles, views, t0=0.0):
        failed = 0
        for cycle in range(cycles):
            for i, ids in enumerate(views(cycle)):
                r = SimpleNamespace(mismatched={"x"} if "x" in ids else set())
                failed += bool(mismatches_within_allowance(r, ids, state, now=t0 + cycle * 10 + i))
        return failed
    state: dict = {}  # x leaves (a round without it), is admitted again, mismatches twice: 10 times
    readmitted = lambda c: [["a", "b"]] + [["a", "b", "x"]] * MISMATCH_ROUNDS  # noqa: E731
    assert rounds(state, 10, readmitted) == MISMATCH_TOTAL
    r = SimpleNamespace(mismatched={"x"})
    assert mismatches_within_allowance(r, ["a", "b"], state, now=MISMATCH_WINDOW_S + 200.0) == ["x"]
    honest: dict = {}  # c and d depart and come back around x, which mismatches twice after each change
    others = lambda c: [["a", "b", "c", "x"] if c % 2 else ["a", "b", "x"]] * MISMATCH_ROUNDS  # noqa: E731
    assert rounds(honest, 10, others) == 10 * MISMATCH_ROUNDS
