"""The in-process link shaper: one-way delay, jitter, rate and loss, per direction.

Rules:
- A frame leaves when the link is free (frames queue behind each other), occupies it for its
  serialization time at ``rate_mbit``, then arrives ``delay_ms`` (+ jitter) later. Arrivals
  never reorder, as on one TCP connection.
- ``loss`` is the chance that a frame is lost once: TCP then retransmits it after an RTO of
  ``max(200 ms, 2 x one-way delay x 2)``, holding every later frame behind it (head-of-line).
- The shaper only computes times; the connection hands each frame to the link as soon as the
  link's send buffer has room and writes it at its arrival time, so frames pipeline as on a real
  link. Sleeping can only make a frame later than its bound, never earlier.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

MIN_RTO_S = 0.2  # Linux's TCP_RTO_MIN


@dataclass(frozen=True)
class LinkSpec:
    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # uniform extra delay in [0, jitter_ms]
    rate_mbit: float = 0.0  # 0 = unlimited
    loss: float = 0.0  # per-frame loss probability (recovered by a retransmission)

    def __post_init__(self):
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_mbit < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"bad link spec {self}: delays and rate must be >= 0, loss in [0, 1)")

    @property
    def shaped(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.rate_mbit or self.loss)

    def serialization_s(self, nbytes: int) -> float:
        return nbytes * 8 / (self.rate_mbit * 1e6) if self.rate_mbit else 0.0

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """``"delay=25,jitter=2,rate=100,loss=0.001"`` (ms, ms, Mbit/s, probability)."""
        keys = {"delay": "delay_ms", "jitter": "jitter_ms", "rate": "rate_mbit", "loss": "loss"}
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            k, _, v = part.partition("=")
            if k not in keys or not v:
                raise ValueError(f"bad link spec item {part!r}; expected delay=MS,jitter=MS,rate=MBIT,loss=P")
            kw[keys[k]] = float(v)
        return cls(**kw)


@dataclass
class LinkShaper:
    """Departure/arrival times for the frames of one direction of one connection."""

    spec: LinkSpec
    rng: random.Random = field(default_factory=random.Random)
    _free_at: float = 0.0  # when the link finishes serializing the previous frame
    _last_arrival: float = 0.0

    def schedule(self, now: float, nbytes: int) -> float:
        """The arrival time of a frame of ``nbytes`` handed to the link at ``now``."""
        s = self.spec
        depart = max(now, self._free_at) + s.serialization_s(nbytes)
        self._free_at = depart
        arrive = depart + s.delay_ms / 1e3 + (self.rng.uniform(0, s.jitter_ms) / 1e3 if s.jitter_ms else 0.0)
        if s.loss and self.rng.random() < s.loss:
            arrive += max(MIN_RTO_S, 4 * s.delay_ms / 1e3)
        arrive = max(arrive, self._last_arrival)  # one TCP stream: no reordering
        self._last_arrival = arrive
        return arrive

    def busy_until(self) -> float:
        """When the link finishes serializing what it has been given."""
        return self._free_at

    def lower_bound(self, nbytes: int) -> float:
        """The least time a frame of ``nbytes`` can take on an idle link."""
        return self.spec.serialization_s(nbytes) + self.spec.delay_ms / 1e3


def load_topology(path: str | Path) -> dict:
    """A topology file: ``{"default": "delay=25,rate=100", "links": {"HOST:PORT": "delay=50"}}``.

    Keys of ``links`` are remote addresses or peer ids; the spec applies to frames we send them.
    """
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"topology {path}: {e}") from None
    if not isinstance(raw, dict) or set(raw) - {"default", "links"}:
        raise ValueError(f"topology {path}: expected keys 'default' and 'links'")
    out: dict = {"default": LinkSpec.parse(raw.get("default", "")), "links": {}}
    for k, v in (raw.get("links") or {}).items():
        out["links"][k] = LinkSpec.parse(v)
    return out
