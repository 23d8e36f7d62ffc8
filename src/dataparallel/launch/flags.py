"""The launcher's flags, shared by `dataparallel launch`, `generate` and `eval`.

They are fields of `LaunchConfig` (config.py), the [launch] section of the train config, with
the same names, help texts (the fields' documentation) and checks (`check_launch`) as
`dataparallel train`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from .config import LaunchConfig, check_launch, field_docs, flag_name

# The [launch] fields that every launched command takes as flags.
LAUNCHER_FIELDS = (
    "nproc",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "max_restarts",
    "threads",
    "collective_timeout",
    "check_collectives",
)
_TYPES = {"int": int, "float": float, "str": str}


def add_launcher_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Add the launcher's flags to `parser`; `defaults` replace the train config's defaults."""
    group = parser.add_argument_group("launcher")
    docs = field_docs(LaunchConfig)
    for f in fields(LaunchConfig):
        if f.name not in LAUNCHER_FIELDS:
            continue
        if f.type == "bool":
            extra = {"action": argparse.BooleanOptionalAction}
        else:
            extra = {"type": _TYPES[f.type], "metavar": f.name.upper()}
        default = (defaults or {}).get(f.name, f.default)
        group.add_argument(
            flag_name("launch", f.name),
            dest=f"launch.{f.name}",
            default=None,
            help=f"{docs[f.name]} (default: {default})".replace("%", "%%"),
            **extra,
        )


def launcher_config(args: argparse.Namespace, defaults: dict | None = None) -> LaunchConfig:
    """The [launch] section that the launcher flags given (else `defaults`) make, checked
    (ConfigError)."""
    given = {
        key.split(".", 1)[1]: value
        for key, value in vars(args).items()
        if key.startswith("launch.") and value is not None
    }
    launch = replace(LaunchConfig(), **{**(defaults or {}), **given})
    check_launch(launch)
    return launch
