"""README's swarm walkthrough and shipped-model block run as printed (on a tiny model, with free
ports), on a machine this test loads itself (a user's machine is often busy)."""

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

from blocktrain.bench.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
# Appended to every training peer's command: the walkthrough's model, tiny, so the test takes a minute.
TINY = ("--steps 6 --set model.d_model=32 --set model.n_head=2 --set train.batch_size=4 --set train.seq_len=32 "
        "--set train.warmup=1")


def _block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {name} -->\s*```bash\n(.*?)```\s*<!-- /{name} -->", text, re.S)
    assert m, f"README has no {name} block"
    return m.group(1)


def _walkthrough() -> str:
    return _block("walkthrough")


# Processes that spin while a README block runs: with the block's own peers, more runnable
# processes than the 2 cores CI has. Each ends by itself after LOAD_BOUND_S if the test dies first.
LOAD_PROCESSES = 2
LOAD_BOUND_S = 900


@contextlib.contextmanager
def _cpu_load():
    """LOAD_PROCESSES busy loops for as long as the block runs, stopped by their ids however it ends."""
    spin = f"import time\nend = time.monotonic() + {LOAD_BOUND_S}\nwhile time.monotonic() < end:\n    pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(LOAD_PROCESSES)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def _run_bash(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """README's commands under ``bash -e``, output to files (background jobs inherit them: a pipe
    would keep us waiting on a job that outlived a failed command). Whatever way bash ends, the
    jobs it left are stopped (a trap), and on a timeout its whole process group."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    guarded = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    with open(cwd / "stdout.txt", "w+") as out, open(cwd / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(["bash", "-e", "-c", guarded], cwd=cwd, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # our own session: only what this test started
            proc.wait(30)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


def _walkthrough_script() -> str:
    script = _walkthrough()
    for port in ("7000", "7100", "8000"):
        script = script.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    lines = []
    for line in script.splitlines():
        if line.startswith(("bt-peer start", "bt-peer join")):
            head, _, tail = line.partition(" 2>")
            line = f"{head} {TINY} 2>{tail}"
        lines.append(line)
    return "\n".join(lines)


def _shipped(tmp_path: Path):
    """README's shipped-model block as printed, in ``tmp_path``: three peers serve the model the
    package ships and generate prints text (exact mode)."""
    script = _block("shipped").replace("127.0.0.1:7200", f"127.0.0.1:{free_port()}")
    r = _run_bash(script, tmp_path, 300)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("t*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    assert "[exact: 64 bytes in" in r.stderr
    words = r.stdout.split()
    assert len(words) >= 5 and sum(w.isalpha() for w in words) >= 4, r.stdout  # words, not noise


def test_readme_walkthrough_then_the_shipped_block_run_as_printed_on_a_loaded_machine(tmp_path):
    """The walkthrough on a fresh clone, then the shipped-model block in the same directory (its
    swarm key and client identity exist by then), each under ``bash -e``, beside LOAD_PROCESSES
    spinning processes."""
    with _cpu_load():
        r = _run_bash(_walkthrough_script(), tmp_path, 600)
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
        assert "assembled model: test CE" in r.stdout and (tmp_path / "model" / "assembled.json").exists()
        # assemble waits for the last block's draft phase too (the next line kills the peers)
        assert "draft step 4/4" in (tmp_path / "peer2.log").read_text()
        out = r.stdout.split("wrote model/assembled.json", 1)[1]
        assert len(out.strip("\n")) >= 16, "generate printed no continuation"  # a 6-step model: any bytes
        assert "[exact: 64 bytes in" in r.stderr
        _shipped(tmp_path)


def test_readme_serves_the_shipped_model_as_printed_on_its_own_on_a_loaded_machine(tmp_path):
    """A fresh clone, README's serving block as printed, on its own (it once assumed the
    walkthrough's swarm key), beside LOAD_PROCESSES spinning processes."""
    with _cpu_load():
        _shipped(tmp_path)
