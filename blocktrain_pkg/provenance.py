"""Which code made a result: stamped into every JSON file the benchmarks write and into bt-train's
results.json (a module of its own, below every layer, so the ML code can stamp too).

A figure measured on uncommitted code is not a result: each file says the commit (when the
package runs from a git checkout), whether the package's files differed from it (``dirty``),
a hash of the package's source whatever the install (``code_hash``: a reader can check a rerun
ran the same code), and the command line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
from pathlib import Path

import blocktrain

PACKAGES = ("protocol", "p2p", "blocks", "bench")


def _source_dirs() -> list[Path]:
    """The packages' source folders, found without importing them (the ML code stamps too)."""
    out = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(f"blocktrain.{name}")
        assert spec is not None and spec.submodule_search_locations, f"blocktrain.{name} is not installed"
        out.append(Path(list(spec.submodule_search_locations)[0]))
    return out


def code_hash() -> str:
    """sha256 (16 hex digits) over the package's Python files (subpackages included), by path and content."""
    h = hashlib.sha256()
    for d in _source_dirs():
        for f in sorted(d.rglob("*.py")):  # subpackages too (p2p/averaging, p2p/swarm)
            h.update(f"{d.name}/{f.relative_to(d).as_posix()}".encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict:
    """{"commit", "dirty", "code_hash"}; commit and dirty are None outside a git checkout."""
    root = Path(blocktrain.__file__).resolve().parent.parent
    commit = _git(["rev-parse", "HEAD"], root)
    dirty = None
    if commit is not None:
        status = _git(["status", "--porcelain", "--", *PACKAGES], root)
        dirty = bool(status) if status is not None else None
    return {"commit": commit, "dirty": dirty, "code_hash": code_hash()}
