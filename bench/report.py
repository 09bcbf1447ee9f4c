"""What the benchmarks' reports share: the word for a target's verdict."""

from __future__ import annotations


def verdict(ok: bool) -> str:
    """How a report says whether a target was met."""
    return "met" if ok else "MISSED"
