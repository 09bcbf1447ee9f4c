"""Every option README or a command's --help names is accepted by the command (README
once documented an --outer that no command took)."""

import re
from pathlib import Path

import click
import pytest

from conftest import COMMANDS as ROOTS  # the commands as installed, under the names README uses

OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _commands(cmd: click.Command, name: str):
    yield name, cmd
    if isinstance(cmd, click.Group):
        for sub, c in cmd.commands.items():
            yield from _commands(c, f"{name} {sub}")


COMMANDS = dict(c for n, root in ROOTS.items() for c in _commands(root, n))


def test_the_installed_commands_are_read():
    assert set(ROOTS) == {"bt-peer", "bt-bench", "bt-train", "bt-data"}


def _accepted(cmd: click.Command) -> set[str]:
    out = {"--help"}
    for p in cmd.params:
        out |= {o for o in p.opts + p.secondary_opts if o.startswith("--")}
    if isinstance(cmd, click.Group):
        for c in cmd.commands.values():
            out |= _accepted(c)
    return out


def test_every_option_readme_names_is_accepted_by_a_command():
    named = set(OPTION.findall((Path(__file__).resolve().parent.parent / "README.md").read_text()))
    accepted = set().union(*(_accepted(c) for c in COMMANDS.values()))
    assert named - accepted == set()


QUOTED = re.compile(r"`(bt-(?:peer|bench|train|data)(?: [a-z]+)?)([^`]*)`")


def _split(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text without quoted commands, [(quoted command, its arguments)])."""
    quoted = [(c if c in COMMANDS else c.split()[0], rest) for c, rest in QUOTED.findall(text)]
    return QUOTED.sub("", text), quoted


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_a_commands_help_names_is_accepted(name):
    """Options in a command's help are its own, except inside a quoted command line
    (`bt-peer serve --checkpoints DIR`), whose options that command must accept."""
    cmd = COMMANDS[name]
    own, quoted = _split(" ".join([cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]))
    assert set(OPTION.findall(own)) - _accepted(cmd) == set()
    for other, rest in quoted:
        assert set(OPTION.findall(rest)) - _accepted(COMMANDS[other]) == set(), other


def test_bad_arguments_are_refused_before_an_identity_is_created(tmp_path):
    """`start --block 99` printed `created identity ...`, then the error."""
    from click.testing import CliRunner

    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "k")
    r = CliRunner().invoke(ROOTS["bt-peer"], ["start", "--block", "99", "--swarm-key", str(tmp_path / "k"),
                                  "--identity", str(tmp_path / "id")])
    assert r.exit_code != 0 and "blocks 0..2" in r.output
    assert not (tmp_path / "id").exists() and "created identity" not in r.output


@pytest.mark.parametrize("command", [["start"], ["join", "127.0.0.1:1"], ["serve"]])
def test_a_block_the_model_does_not_have_gets_one_check_and_message_from_every_command(tmp_path, command):
    """`serve --block 7` said a file was missing (exit 1) where `start --block 7` named the blocks (exit 2)."""
    from click.testing import CliRunner

    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "k")
    r = CliRunner().invoke(ROOTS["bt-peer"], [*command, "--block", "7", "--swarm-key", str(tmp_path / "k"),
                                              "--identity", str(tmp_path / "id")])
    assert r.exit_code == 2, r.output
    assert "Invalid value for --block: the model has blocks 0..2, no block 7" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "id").exists()
