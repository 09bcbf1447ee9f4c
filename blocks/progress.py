"""Progress people read: one display per long job, the same in every command.

Rules:
- On a terminal: a tqdm bar with the total, the rate and the time left. Not on a terminal (logs,
  CI): a plain line every ``every_s`` seconds and one at the end, with the same facts.
- ``bar(desc, total, unit)`` is a context manager with ``update(n)``, ``set_postfix_str(s)`` and
  ``n``; library code takes a bar factory and never prints.
"""

from __future__ import annotations

import sys
import time


class LineProgress:
    """Progress for logs: a plain line every ``every_s`` seconds, and one at the end."""

    def __init__(self, desc: str, total: int | None, unit: str = "step", every_s: float = 30.0, stream=None):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.n, self.postfix, self.t0 = 0, "", time.monotonic()
        self.last = self.t0

    def _line(self, done: bool = False) -> str:
        dt = time.monotonic() - self.t0
        rate = self.n / dt if dt > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        eta = (f", {((self.total - self.n) / rate):.0f} s left" if self.total and rate > 0 and not done else "")
        return (f"{self.desc}: {'done, ' if done else ''}{self.n}{of} {self.unit}s in {dt:.0f} s "
                f"({rate:.2f} {self.unit}/s{eta}){' ' + self.postfix if self.postfix else ''}")

    def update(self, k: int = 1):
        self.n += k
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(self._line(), file=self.stream, flush=True)

    def set_postfix_str(self, s: str):
        self.postfix = s

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        print(self._line(done=True), file=self.stream, flush=True)


def bar(desc: str, total: int | None, unit: str = "step"):
    """A progress display for ``total`` units (None: unknown): tqdm on a terminal, lines otherwise."""
    if not sys.stderr.isatty():
        return LineProgress(desc, total, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
