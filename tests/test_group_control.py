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
