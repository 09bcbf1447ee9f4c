"""README's swarm walkthrough runs as printed (on a tiny model, with free ports)."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Appended to every training peer's command: the walkthrough's model, tiny, so the test takes a minute.
TINY = ("--steps 6 --set model.d_model=32 --set model.n_head=2 --set train.batch_size=4 --set train.seq_len=32 "
        "--set train.warmup=1")


def _walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- walkthrough -->\s*```bash\n(.*?)```\s*<!-- /walkthrough -->", text, re.S)
    assert m, "README has no walkthrough block"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_walkthrough_runs_as_printed(tmp_path):
    script = _walkthrough()
    for port in ("7000", "7100", "8000"):
        script = script.replace(f"127.0.0.1:{port}", f"127.0.0.1:{_free_port()}")
    lines = []
    for line in script.splitlines():
        if line.startswith(("bt-peer start", "bt-peer join")):
            head, _, tail = line.partition(" 2>")
            line = f"{head} {TINY} 2>{tail}"
        lines.append(line)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    assert "assembled model: test CE" in r.stdout and (tmp_path / "model" / "assembled.json").exists()
    out = r.stdout.split("wrote model/assembled.json", 1)[1]
    assert len(out.strip("\n")) >= 16, "generate printed no continuation"  # a 6-step model: any bytes
    assert "[exact: 64 bytes in" in r.stderr
