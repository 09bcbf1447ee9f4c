"""Linear kernels of other machines, for the batch-invariance tests: each is a deterministic
``F.linear`` whose rows differ in the last bits by something other than the row, as real math
libraries' do (MKL on an AVX-512/AMX Xeon computes F.linear over 4 rows otherwise than over
more). ``use(monkeypatch, kernel)`` installs one for everything that calls ``F.linear``
(``nn.Linear`` included); the exactness tests then hold on any machine's kernels, not only on
the one they were written on.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

REAL_LINEAR = F.linear


def _rounded_otherwise(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The same rows summed in another order (each half of the inner dimension apart, then
    added), as a kernel with another blocking of the sum does: last bits unlike the real one's."""
    h = x2.shape[1] // 2
    y = REAL_LINEAR(x2[:, :h], w[:, :h], b) + REAL_LINEAR(x2[:, h:], w[:, h:])
    return y


def by_shape(x, w, b=None):
    """Rows of a call with an odd number of rows are summed another way (another kernel for
    another shape): a row's bits follow how many rows share its call."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] % 2:
        return _rounded_otherwise(x2, w, b).view(*x.shape[:-1], w.shape[0])
    return REAL_LINEAR(x, w, b)


def by_place(x, w, b=None):
    """The last row of every call is summed another way (an edge of the kernel's register
    tile): a row's bits follow its place within its call."""
    x2 = x.reshape(-1, x.shape[-1])
    y = REAL_LINEAR(x2, w, b).clone()
    y[-1:] = _rounded_otherwise(x2[-1:], w, b)
    return y.view(*x.shape[:-1], w.shape[0])


class ByCall:
    """Every call perturbs its result by its own count (a kernel nothing makes reproducible)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, w, b=None):
        self.calls += 1
        y = REAL_LINEAR(x, w, b)
        return y + (self.calls % 7) * 1e-6 * y.abs().amax().clamp(min=1e-30)


def use(monkeypatch, kernel):
    monkeypatch.setattr(F, "linear", kernel)
