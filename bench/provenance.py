"""Which code made a result, stamped into every JSON file the benchmarks write.

A figure measured on uncommitted code is not a result: each file says the commit (when the
package runs from a git checkout), whether the package's files differed from it (``dirty``),
a hash of the package's source whatever the install (``code_hash``: a reader can check a rerun
ran the same code), and the command line.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import blocktrain

PACKAGES = ("protocol", "p2p", "blocks", "bench")


def _source_dirs() -> list[Path]:
    import blocktrain.bench
    import blocktrain.blocks
    import blocktrain.p2p
    import blocktrain.protocol
    return [Path(m.__file__).parent for m in (blocktrain.protocol, blocktrain.p2p, blocktrain.blocks, blocktrain.bench)]


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


def stamped(result: dict, argv: list[str] | None = None) -> dict:
    """``result`` with the code version and the command that made it."""
    argv = sys.argv[1:] if argv is None else argv
    return {**result, "code_version": code_version(), "command": shlex.join(["bt-bench", *argv])}


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` (stamped) as JSON at ``path``, atomically (a crash leaves the old file)."""
    from blocktrain.blocks.checkpoint import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(stamped(result), indent=1).encode())
