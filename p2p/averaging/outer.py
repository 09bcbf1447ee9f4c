"""The outer step: what a round's average moves, and the flat vector a round averages.

A round averages one flat float32 vector (``flatten`` of a block's parameters, or of their
pseudo-gradient); ``unflatten_`` writes one back. ``OuterOptimizer`` is DiLoCo's outer step: the
averaged pseudo-gradient (start - now) moves the round's start point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blocktrain.blocks.device import to_host


def flatten(params) -> torch.Tensor:
    """The parameters as one flat float32 CPU vector (on an accelerator: one transfer, into pinned
    memory from CUDA: ``to_host``), what a round sends."""
    if not params:
        return torch.empty(0)
    return to_host(torch.cat([p.detach().reshape(-1).float() for p in params]), pinned=True)


def unflatten_(params, vec: torch.Tensor):
    """Write ``vec`` back into ``params`` (on their device: one transfer)."""
    if params:
        vec = vec.to(params[0].device)
    pos = 0
    for p in params:
        k = p.numel()
        p.data.copy_(vec[pos:pos + k].view_as(p))
        pos += k
    assert pos == vec.numel(), "vector and parameters differ in size"


@dataclass
class OuterOptimizer:
    """DiLoCo's outer step: pseudo-gradient = start - now, averaged; SGD or Nesterov momentum."""
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    _buf: torch.Tensor | None = None

    def step(self, start: torch.Tensor, avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
        g = avg_pseudo_grad
        if self.momentum:
            self._buf = g.clone() if self._buf is None else self._buf.mul_(self.momentum).add_(g)
            g = g + self.momentum * self._buf if self.nesterov else self._buf
        return start - self.lr * g
