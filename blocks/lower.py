"""The input handoff: which checkpoints of blocks 0..k-1 feed block k's trainer.

Rules:
- One home for the refresh rule, whatever moves the checkpoints (a dict in one process, files
  between worker processes, streams between peers): sources ``offer`` the newest copy of a lower
  block they know (its content digest, step, tensors, whether it is final); ``install`` loads
  them into the trainer only when the set differs from the one in use.
- ``require_final``: the trainer waits for the final checkpoint of every lower block (the
  sequential schedule); otherwise any checkpoint will do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Copy:
    digest: object
    step: int
    tensors: dict
    final: bool


class LowerInputs:
    def __init__(self, k: int, require_final: bool = False):
        self.k, self.require_final = k, require_final
        self._offered: dict[int, _Copy] = {}
        self._installed: dict[int, object] = {}

    def offer(self, j: int, digest, step: int, tensors: dict, final: bool = False) -> None:
        if not 0 <= j < self.k:
            raise ValueError(f"block {self.k} has lower blocks 0..{self.k - 1}, not {j}")
        self._offered[j] = _Copy(digest, step, tensors, final)

    def digest(self, j: int):
        c = self._offered.get(j)
        return None if c is None else c.digest

    def ready(self) -> bool:
        return all(j in self._offered and (self._offered[j].final or not self.require_final) for j in range(self.k))

    def changed(self) -> bool:
        return self.ready() and any(self._installed.get(j) != self._offered[j].digest for j in range(self.k))

    def install(self, trainer) -> bool:
        """Give the trainer the offered lower blocks if they differ from those in use; True if so."""
        if self.k == 0 or not self.changed():
            return False
        trainer.set_lower([self._offered[j].tensors for j in range(self.k)], [self._offered[j].step for j in range(self.k)])
        self._installed = {j: self._offered[j].digest for j in range(self.k)}
        return True

    @property
    def steps(self) -> list[int]:
        return [self._offered[j].step for j in range(self.k) if j in self._offered]
