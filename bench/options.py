"""What the benchmarks' option checks share: their errors and the comma lists they parse.

A bench module checks a combination of options with a pure function that raises one of these
errors; ``bt-bench`` turns it into click's usage error with the same message, so the module can
be driven without click (from tests, experiments or another command).
"""

from __future__ import annotations


class OptionError(Exception):
    """Options that do not go together (``bt-bench`` reports a usage error)."""


class BadOption(OptionError):
    """One option's value is wrong: ``param_hint`` names the option (``bt-bench`` reports an
    invalid value for it; none: an invalid value of the command)."""

    def __init__(self, message: str, param_hint: str | None = None):
        super().__init__(message)
        self.param_hint = param_hint


def ints(text: str, name: str) -> list[int]:
    """A comma-separated list of integers given to option ``name`` (empty items skipped)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadOption(f"{text!r}: expected comma-separated integers", name) from None


def lo_hi(text: str, name: str) -> tuple[float, float]:
    """``LO,HI`` given to option ``name``, with 0 < LO <= HI."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise BadOption(f"{text!r}: expected LO,HI", name) from None
    if not 0 < lo <= hi:
        raise BadOption(f"{text!r}: expected 0 < LO <= HI", name)
    return lo, hi

