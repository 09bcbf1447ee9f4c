"""The benchmarks' result files: stamped with the code version and the command
(``blocktrain.provenance`` says which code made a result), written atomically.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from blocktrain.provenance import PACKAGES, code_hash, code_version

__all__ = ["PACKAGES", "code_hash", "code_version", "stamped", "write_result"]


# Environment variables that change what a run computes or how fast (the math kernels, threads):
# part of the command, recorded where set.
COMPUTE_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "OPENBLAS_CORETYPE", "CUDA_VISIBLE_DEVICES")


def stamped(result: dict, argv: list[str] | None = None) -> dict:
    """``result`` with the code version, the command that made it and the compute environment
    variables that were set (``environment``)."""
    argv = sys.argv[1:] if argv is None else argv
    return {**result, "code_version": code_version(), "command": shlex.join(["bt-bench", *argv]),
            "environment": {k: os.environ[k] for k in COMPUTE_ENV if k in os.environ}}


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` (stamped) as JSON at ``path``, atomically (a crash leaves the old file)."""
    from blocktrain.blocks.checkpoint import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(stamped(result), indent=1).encode())
