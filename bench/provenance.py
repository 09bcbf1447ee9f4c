"""The benchmarks' result files: stamped with the code version and the command
(``blocktrain.provenance`` says which code made a result), written atomically.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from blocktrain.provenance import PACKAGES, code_hash, code_version

__all__ = ["PACKAGES", "code_hash", "code_version", "stamped", "write_result"]


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
