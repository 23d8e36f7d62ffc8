"""The `dataparallel` subcommands: help from each command's docstring, one-line refusals."""

from __future__ import annotations

import argparse

import pytest

from dataparallel.cli import build_parser, main
from dataparallel.launch.command import add_command, refused
from dataparallel.launch.config import ConfigError

COMMANDS = ("train", "launch", "generate", "eval", "sample", "export", "plan", "join")
COMMANDS += ("leave", "cluster")


def _subparsers(parser: argparse.ArgumentParser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def test_every_command_has_its_help_and_description_from_its_docstring():
    action = _subparsers(build_parser())
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    assert tuple(helps) == COMMANDS
    for name in COMMANDS:
        parser = action.choices[name]
        assert helps[name] and "\n" not in helps[name], name
        assert helps[name][0].islower() and len(helps[name]) < 90, name
        assert parser.description, name
        assert parser.get_default("handler").__doc__.startswith(helps[name].split()[0]), name
    assert len(helps) == 10


def test_a_command_is_its_docstring_split_at_the_first_blank_line():
    def run(args):
        """do a thing
        in two lines

        What the thing does, at length.
        """
        return 7

    commands = argparse.ArgumentParser().add_subparsers(dest="command")
    parser = add_command(commands, "thing", run)
    assert parser.description == "What the thing does, at length."
    assert commands._choices_actions[0].help == "do a thing in two lines"
    assert parser.parse_args([]).handler(None) == 7


def test_a_command_without_a_docstring_is_refused_at_registration():
    commands = argparse.ArgumentParser().add_subparsers(dest="command")
    with pytest.raises(ValueError, match="'bare' needs a docstring"):
        add_command(commands, "bare", lambda args: 0)


def test_refused_prints_one_line_and_gives_status_2(capsys):
    code = refused("export", ConfigError("--out", "is missing", "give a folder"))
    assert code == 2
    assert (
        capsys.readouterr().err == "dataparallel export: error: --out: is missing; give a folder\n"
    )


def test_main_runs_the_command_the_parser_chose(capsys, tmp_path):
    missing = tmp_path / "none.py"
    assert main(["launch", str(missing)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"dataparallel launch: error: script: {missing} does not exist; give a Python script"
    ]
    assert main(["join", str(tmp_path), "--restarts", "-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["dataparallel join: error: --restarts: -1 is negative; give 0 or more"]
