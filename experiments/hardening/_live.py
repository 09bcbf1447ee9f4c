"""What the live-peer measurement scripts of this folder share: the `bt-peer` they start, the tiny
model, the processes they started (stopped by pid at the end), their results and where they go.

    from _live import BT_PEER, TINY, STARTED, RESULTS, out, provenance, stop, finish
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BT_PEER = str(Path(sys.executable).parent / "bt-peer")
TINY = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=3", "--set", "model.n_blocks=3",
        "--set", "batch_size=4", "--set", "seq_len=32", "--set", "warmup=1", "--set", "swarm.eval_windows=2",
        "--set", "train.draft_frac=0"]
STARTED: list[subprocess.Popen] = []  # every process a script starts: stopped by pid in finish()
RESULTS: dict = {"machine": f"{os.cpu_count()} cores, loopback"}


def out(key, value):
    RESULTS[key] = value
    print(json.dumps({key: value}), flush=True)


def provenance() -> dict:
    """The code measured: HEAD, and the uncommitted changes to the runtime, if any (by hash)."""
    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout  # noqa: E731
    dirty = git("status", "--porcelain", "--", "p2p", "protocol", "blocks").split("\n")
    return {"git_head": git("rev-parse", "HEAD").strip(), "uncommitted_runtime_files": [l[3:] for l in dirty if l],
            "uncommitted_diff_sha256": hashlib.sha256(git("diff", "HEAD", "--", "p2p", "protocol", "blocks").encode())
            .hexdigest()[:16]}


def stop(p: subprocess.Popen):
    """SIGTERM (after SIGCONT, in case it is stopped), then SIGKILL if it does not go."""
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def finish(t0: float, json_path: str, tmp: Path):
    """Stop what was started, write the results, remove the temporary folder (KEEP_TMP=1 keeps it)."""
    for p in STARTED:
        stop(p)
    RESULTS["seconds"] = round(time.monotonic() - t0, 1)
    Path(json_path).write_text(json.dumps(RESULTS, indent=1) + "\n")
    if os.environ.get("KEEP_TMP"):
        print(f"kept {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
