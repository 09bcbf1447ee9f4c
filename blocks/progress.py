"""Progress people read: one display per long job, the same in every command.

Rules:
- On a terminal: a tqdm bar with the total, the rate and the time left. Not on a terminal (logs,
  CI): a plain line every ``every_s`` seconds and one at the end, with the same facts.
- ``bar(desc, total, unit)`` is a context manager with ``update(n)``, ``set_postfix_str(s)`` and
  ``n``; library code takes a bar factory and never prints.
"""

from __future__ import annotations

import os
import sys
import time


class LineProgress:
    """Progress for logs: a plain line every ``every_s`` seconds, and one at the end. Each line
    gives the average rate and, apart from it, the rate since the last line (the time left comes
    from that one: a job slowed by other work would otherwise look hung), and says when this
    process got less than half the CPU it asks for (``threads`` cores): the machine is busy. A job
    whose work runs in other processes (``threads=0``) says so when the load average is above the
    machine's cores instead."""

    def __init__(self, desc: str, total: int | None, unit: str = "step", every_s: float = 30.0, stream=None,
                 threads: int | None = None):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.n, self.postfix, self.t0 = 0, "", time.monotonic()
        self.last, self.last_n, self.last_cpu = self.t0, 0, time.process_time()
        self.threads = threads if threads is not None else _threads()

    def _line(self, done: bool = False) -> str:
        now = time.monotonic()
        dt, window = now - self.t0, now - self.last
        rate = self.n / dt if dt > 0 else 0.0
        recent = (self.n - self.last_n) / window if window > 0 and self.n > self.last_n else rate
        cpu = (time.process_time() - self.last_cpu) / window if window > 1.0 else None
        self.last, self.last_n, self.last_cpu = now, self.n, time.process_time()
        of = f"/{self.total}" if self.total else ""
        eta = (f", {((self.total - self.n) / recent):.0f} s left" if self.total and recent > 0 and not done else "")
        now_rate = f", now {recent:.2f}" if not done and abs(recent - rate) > 0.05 * max(rate, 1e-9) else ""
        busy = ""
        if self.threads == 0 and not done and window > 1.0:  # the work is in other processes
            load, cores = os.getloadavg()[0], os.cpu_count() or 1
            busy = f"; machine busy: load {load:.1f} on {cores} cores, this job's processes included" if load > cores else ""
        elif cpu is not None and not done and cpu < 0.5 * self.threads:
            busy = f"; machine busy: this process got {cpu:.0%} of a core, asks for {self.threads}"
        return (f"{self.desc}: {'done, ' if done else ''}{self.n}{of} {self.unit}s in {dt:.0f} s "
                f"({rate:.2f} {self.unit}/s{now_rate}{eta}{busy}){' ' + self.postfix if self.postfix else ''}")

    def update(self, k: int = 1):
        self.n += k
        if time.monotonic() - self.last >= self.every_s:
            print(self._line(), file=self.stream, flush=True)

    def set_postfix_str(self, s: str):
        self.postfix = s

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        print(self._line(done=True), file=self.stream, flush=True)


def _threads() -> int:
    """The threads torch computes with, if torch is loaded (else 1)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 1


def bar(desc: str, total: int | None, unit: str = "step", threads: int | None = None):
    """A progress display for ``total`` units (None: unknown): tqdm on a terminal, lines otherwise
    (``threads``: as LineProgress; 0 for a job whose work runs in other processes)."""
    if not sys.stderr.isatty():
        return LineProgress(desc, total, unit, threads=threads)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
