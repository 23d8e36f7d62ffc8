"""A subcommand of `dataparallel`: its parser made from its function, its bad input one line.

A command is a function `run(args) -> exit status` whose docstring is its help, as click reads
one: the first paragraph for `dataparallel --help`, the rest for `dataparallel NAME --help`.
`add_command` registers it (main() calls `args.handler(args)`); `refused` prints the one line
every command prints for bad input, `dataparallel NAME: error: <field>: <problem>; <fix>`, and
gives exit status 2, before anything is started or written.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable

Run = Callable[[argparse.Namespace], int]


def add_command(commands, name: str, run: Run, **options) -> argparse.ArgumentParser:
    """The parser of `dataparallel NAME` (flags still to add), its help from `run`'s docstring;
    `options` go to argparse (a description of its own, an epilog, a formatter)."""
    doc = inspect.getdoc(run)
    if not doc:
        raise ValueError(f"the command {name!r} needs a docstring: its help")
    summary, _, description = doc.partition("\n\n")
    summary = " ".join(summary.split())
    options = {"help": summary, "description": description or summary, **options}
    parser = commands.add_parser(name, **options)
    parser.set_defaults(handler=run)
    return parser


def refused(name: str, error: Exception) -> int:
    """Bad input, said on one line: exit status 2."""
    print(f"dataparallel {name}: error: {error}", file=sys.stderr)
    return 2
