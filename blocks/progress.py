"""Progress people read: one display per long job, the same in every command.

Rules:
- On a terminal: a tqdm bar with the total, the rate and the time left. Not on a terminal (logs,
  CI): a plain line every ``every_s`` seconds and one at the end, with the same facts.
- ``bar(desc, total, unit)`` is a context manager with ``update(n)``, ``set_postfix_str(s)`` and
  ``n``; library code takes a bar factory and never prints.
- A job of unequal steps gives ``work``: (steps, cost of each) in order; then the time left is
  ``Eta``'s, from the cost of the steps left, and says how sure it is.
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
                 threads: int | None = None, work=None):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.n, self.postfix, self.t0 = 0, "", time.monotonic()
        self.last, self.last_n, self.last_cpu = self.t0, 0, time.process_time()
        self.threads = threads if threads is not None else _threads()
        self.eta = Eta(work, self.t0, self.last_cpu, self.threads) if work is not None else None

    def line(self, done: bool = False) -> str:
        """The line this progress prints now (``done``: the last one); the rate since the previous
        line is measured from here on."""
        now = time.monotonic()
        dt, window = now - self.t0, now - self.last
        rate = self.n / dt if dt > 0 else 0.0
        recent = (self.n - self.last_n) / window if window > 0 and self.n > self.last_n else rate
        cpu = (time.process_time() - self.last_cpu) / window if window > 1.0 else None
        self.last, self.last_n, self.last_cpu = now, self.n, time.process_time()
        of = f"/{self.total}" if self.total else ""
        eta = (f", {((self.total - self.n) / recent):.0f} s left" if self.total and recent > 0 and not done else "")
        if self.eta is not None:  # the time left by the work left, and how sure it is
            return (f"{self.desc}: {'done, ' if done else ''}{self.n}{of} {self.unit}s in {dt:.0f} s"
                    + ("" if done else f", {self.eta.text()}") + (f"; {self.postfix}" if self.postfix else ""))
        if self.unit == "byte":  # counts and rates of bytes in MiB: 298.3 MiB/s, not 312802441.18 byte/s
            return (f"{self.desc}: {'done, ' if done else ''}{_mib(self.n)}" + (f" of {_mib(self.total)}" if self.total else "")
                    + f" in {dt:.0f} s ({_mib(rate)}/s{eta}){' ' + self.postfix if self.postfix else ''}")
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
        if self.eta is not None:
            self.eta.observe(self.n, time.monotonic(), time.process_time())
        if time.monotonic() - self.last >= self.every_s:
            print(self.line(), file=self.stream, flush=True)

    def set_postfix_str(self, s: str):
        self.postfix = s

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        print(self.line(done=True), file=self.stream, flush=True)


class Eta:
    """The time a job has left, and how sure that is.

    ``segments`` is the job's work in order: (steps, cost of each step), in any unit (bt-train
    gives estimated FLOPs, so a step of the end-to-end model weighs what it costs beside a block's).
    The estimate is the work left over the rate of the last ``window_s`` seconds (the average
    until a window has passed). It is sure when the rates of the last ``windows`` windows agree
    within ``SPREAD``; otherwise, or when this process got less than half the CPU it asks for
    (``threads`` cores; 0: the work runs in other processes, not judged), the text gives the range
    those rates imply and why: on a busy machine a single figure swings between runs of lines.
    Pure: every reading takes ``now`` and the process's CPU seconds (tests pass their own).
    """

    SPREAD = 1.25  # fastest / slowest window rate above which the estimate is given as a range

    def __init__(self, segments, now: float, cpu: float = 0.0, threads: int = 1, window_s: float = 60.0,
                 windows: int = 5):
        self.segments = [(int(n), float(c)) for n, c in segments if n > 0]
        self.total = sum(n * c for n, c in self.segments)
        self.threads, self.window_s, self.windows = threads, window_s, windows
        self.t0 = now
        self.samples = [(now, 0.0, cpu)]  # (time, work done, CPU seconds), about 8 a window, the latest last

    def work(self, steps: float) -> float:
        """The work of the first ``steps`` steps."""
        done, left = 0.0, steps
        for n, c in self.segments:
            done += min(n, max(left, 0)) * c
            left -= n
        return done

    def observe(self, steps: float, now: float, cpu: float = 0.0):
        w = self.work(steps)
        if len(self.samples) > 1 and now - self.samples[-2][0] < self.window_s / 8:
            self.samples[-1] = (now, w, cpu)  # the latest reading replaces one taken moments ago
        else:
            self.samples.append((now, w, cpu))
        horizon = now - (self.windows + 1) * self.window_s
        while len(self.samples) > 2 and self.samples[1][0] < horizon:
            self.samples.pop(0)

    def _at(self, t: float) -> tuple[float, float, float]:
        """The last sample taken at or before ``t`` (the first if none)."""
        best = self.samples[0]
        for s in self.samples:
            if s[0] > t:
                break
            best = s
        return best

    def _rates(self) -> list[float]:
        """Work per second in each whole window back from the latest reading, the latest window first."""
        now = self.samples[-1][0]
        out = []
        for j in range(self.windows):
            hi, lo = self._at(now - j * self.window_s), self._at(now - (j + 1) * self.window_s)
            if now - (j + 1) * self.window_s < self.samples[0][0] or hi[0] <= lo[0]:
                break
            out.append((hi[1] - lo[1]) / (hi[0] - lo[0]))
        return out

    def estimate(self) -> tuple[float, float, float, str] | None:
        """(seconds left, the least, the most, why it is unsure or ""), None before any work is done."""
        now, w, cpu = self.samples[-1]
        left = max(self.total - w, 0.0)
        if w <= 0 or now <= self.t0:
            return None
        rates = [r for r in self._rates() if r > 0] or [w / (now - self.t0)]
        eta = left / rates[0]
        lo, hi = left / max(rates), left / min(rates)
        why = []
        start = self._at(now - self.window_s)
        if self.threads and now - start[0] > 1.0:
            share = (cpu - start[2]) / (now - start[0])
            if share < 0.5 * self.threads:  # were the machine free, it could be this much faster
                lo = min(lo, eta * max(share, 0.05) / self.threads)
                why.append(f"the machine is busy: this process got {share:.0%} of a core, asks for {self.threads}")
        if max(rates) > self.SPREAD * min(rates):
            why.append(f"the rate changed {max(rates) / min(rates):.1f}x within the last "
                       f"{_duration(len(rates) * self.window_s)}")
        return eta, min(lo, eta), max(hi, eta), "; ".join(why)

    def text(self) -> str:
        e = self.estimate()
        if e is None:
            return "time left: after the first steps"
        eta, lo, hi, why = e
        if not why:
            return f"about {_duration(eta)} left"
        if hi - lo < 0.1 * eta + 1:  # unsure, but nothing to go on yet: say so
            return f"about {_duration(eta)} left, unsure ({why})"
        return f"about {_duration(eta)} left, {_duration(lo)} to {_duration(hi)} ({why})"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _duration(s: float) -> str:
    s = round(s)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{round(s / 60)} min"
    return f"{s // 3600} h {round(s % 3600 / 60):02d} min"


def _threads() -> int:
    """The threads torch computes with, if torch is loaded (else 1)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 1


class _TqdmWithEta:
    """A tqdm bar whose time left is ``Eta``'s (tqdm's own assumes steps of equal cost)."""

    def __init__(self, desc: str, total: int, unit: str, threads: int | None, work):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " + unit
                                   + "s [{elapsed}{postfix}]")
        now = time.monotonic()
        self.eta = Eta(work, now, time.process_time(), threads if threads is not None else _threads())
        self.postfix, self.shown = "", now

    n = property(lambda self: self.bar.n)

    def update(self, k: int = 1):
        self.bar.update(k)
        now = time.monotonic()
        self.eta.observe(self.bar.n, now, time.process_time())
        if now - self.shown >= 1.0:
            self._show()

    def set_postfix_str(self, s: str):
        self.postfix = s
        self._show()

    def _show(self):
        self.shown = time.monotonic()
        self.bar.set_postfix_str(self.eta.text() + (f"; {self.postfix}" if self.postfix else ""))

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def bar(desc: str, total: int | None, unit: str = "step", threads: int | None = None, work=None):
    """A progress display for ``total`` units (None: unknown): tqdm on a terminal, lines otherwise
    (``threads``: as LineProgress; 0 for a job whose work runs in other processes; ``work``: the
    cost of its steps, as Eta takes them, for a time left that weighs them)."""
    if not sys.stderr.isatty():
        return LineProgress(desc, total, unit, threads=threads, work=work)
    if work is not None and total:
        return _TqdmWithEta(desc, total, unit, threads, work)
    from tqdm import tqdm

    scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "byte" else {"unit": unit}  # MiB/s
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, smoothing=0.1, **scale)
