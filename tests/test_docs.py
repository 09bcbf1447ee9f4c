"""README stays a front door and no user-facing text names a tracker number (CONTRIBUTING.md): fast
checks, no processes."""

import re
from pathlib import Path

import click
import pytest

from conftest import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 230  # CONTRIBUTING.md: the front door's length; reference goes to docs/, figures to results/
# The word issue (or issues) and a number, with or without "#", or "#" and a number alone: a ticket a reader
# cannot look up. Not "r6.23" (PROTOCOL.md's revisions), not an HTML entity ("&#9632;").
TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|(?<![&\w])#\d+\b")


def _pages() -> list[Path]:
    return ([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "PROTOCOL.md"] + sorted((ROOT / "docs").rglob("*.md"))
            + sorted((ROOT / "results").rglob("*.md")))


def _hits(text: str, pattern: re.Pattern = TRACKER) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move reference to docs/ "
                                   "and measurements to results/ (CONTRIBUTING.md)")


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in readme] == []


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracker_numbers_in_pages(page):
    assert _hits(page.read_text()) == []


ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")  # in code, "#" and a number is often a colour or an entity


def test_no_tracker_numbers_in_source_comments_and_docstrings():
    """The same rule for the code: comments, docstrings and messages name the claim."""
    files = [f for d in ("protocol", "p2p", "blocks", "bench", "tests", "experiments", "scripts")
             for f in sorted((ROOT / d).rglob("*")) if f.suffix in (".py", ".sh")]
    found = {str(f.relative_to(ROOT)): _hits(f.read_text(), ISSUE) for f in files}
    assert {k: v for k, v in found.items() if v} == {}


def _helps(cmd: click.Command, name: str):
    yield name, " ".join([cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params])
    if isinstance(cmd, click.Group):
        for sub, c in cmd.commands.items():
            yield from _helps(c, f"{name} {sub}")


def test_no_tracker_numbers_in_help():
    found = {name: TRACKER.findall(text) for root, cmd in COMMANDS.items() for name, text in _helps(cmd, root)}
    assert {k: v for k, v in found.items() if v} == {}


OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _accepted(cmd: click.Command) -> set[str]:
    out = {"--help"} | {o for p in cmd.params for o in p.opts + p.secondary_opts if o.startswith("--")}
    if isinstance(cmd, click.Group):
        for c in cmd.commands.values():
            out |= _accepted(c)
    return out


def test_every_option_docs_name_is_accepted_by_a_command():
    """As tests/test_options.py checks README: an option a docs page names is a real one."""
    accepted = set().union(*(_accepted(c) for c in COMMANDS.values()))
    named = {p.name: set(OPTION.findall(p.read_text())) - accepted for p in sorted((ROOT / "docs").glob("*.md"))}
    assert {k: v for k, v in named.items() if v} == {}


def test_the_pattern():
    for bad in ("issue {}", "Issues {}", "(issue {}; details", "issue #{}", "see #{}."):
        assert TRACKER.search(bad.format(12)), bad
    for good in ("r6.23", "&#9632;", "PROTOCOL.md 7.1", "section 4", "tissue 3x"):
        assert not TRACKER.search(good), good
