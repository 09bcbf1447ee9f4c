"""What README's blocks create in the repository root, run as printed, is ignored by git: the swarm
key and the identity files are secrets, and `git add -A` after the walkthrough must not commit them."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Options naming what a command creates: a file, or a directory ("/"); `assemble --out` is a directory.
CREATES = {"--out": "", "--identity": "", "--swarm-key": "", "--work-dir": "/"}


def _created(script: str) -> set[str]:
    """The paths (directories with a trailing /) that the shell ``script`` creates where it runs."""
    out = set()
    for line in script.splitlines():
        line = line.split("#", 1)[0]
        directory_out = "/" if line.startswith("bt-peer assemble") else ""
        for opt, value in re.findall(r"(--[a-z-]+) (\S+)", line):
            if opt in CREATES:
                out.add(value + (directory_out if opt == "--out" else CREATES[opt]))
        out |= set(re.findall(r"> ?([\w.-]+)", line))  # 2> peer0.log
    return out


def _readme_blocks() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    return dict(re.findall(r"<!-- (\w+) -->\s*```bash\n(.*?)```", text, re.S))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_what_the_readme_blocks_create_in_the_repository_root_is_ignored_and_nothing_tracked_is():
    blocks = _readme_blocks()
    assert {"walkthrough", "shipped"} <= set(blocks)
    created = set().union(*(_created(b) for b in blocks.values()))
    # the parse found the secrets and the outputs the walkthrough is known to write
    assert {"swarm.key", "id0", "id1", "id2", "me", "s0", "w0/", "model/", "peer0.log"} <= created, created
    r = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(created)],
                       cwd=ROOT, capture_output=True, text=True)
    missed = [line.split("\t")[-1] for line in r.stdout.splitlines() if line.startswith("::")]
    assert not missed, f"not ignored by .gitignore: {missed}"
    tracked = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked == [], f"tracked files that .gitignore would ignore: {tracked}"
