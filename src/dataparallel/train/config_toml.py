"""A run's configuration as TOML and as plain mappings: read with every value checked, written
with each field's documentation as its comment (the sections are in config.py)."""

from __future__ import annotations

import difflib
import json
import textwrap
from dataclasses import fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the `tomli` package
    import tomli as tomllib

from .config import SECTIONS, ConfigError, RunConfig, field_docs, flag_name


def _coerce(section: str, name: str, kind, value, where: str):
    """Check a TOML value's type against the field; ints are accepted for floats."""
    label = f"{section}.{name}"
    ok = {
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "tuple[str, ...]": isinstance(value, list | tuple)
        and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        expected = {"tuple[str, ...]": "a list of strings"}.get(kind, f"a {kind}")
        raise ConfigError(
            label, f"{value!r} in {where} is not {expected}", f"write {label} as {expected}"
        )
    if kind == "float":
        return float(value)
    if kind == "tuple[str, ...]":
        return tuple(value)
    return value


def apply_mapping(config: RunConfig, mapping: dict, where: str) -> RunConfig:
    """Override `config` with a {section: {field: value}} mapping (from TOML), checking names
    and types."""
    changes: dict[str, dict] = {}
    for section, values in mapping.items():
        if section not in SECTIONS or not isinstance(values, dict):
            close = difflib.get_close_matches(str(section), SECTIONS, n=1)
            hint = f"did you mean [{close[0]}]?" if close else f"sections are {', '.join(SECTIONS)}"
            raise ConfigError(f"[{section}]", f"unknown section in {where}", hint)
        known = {f.name: f.type for f in fields(SECTIONS[section])}
        for name, value in values.items():
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = (
                    f"did you mean {section}.{close[0]}?"
                    if close
                    else f"keys are {', '.join(known)}"
                )
                raise ConfigError(f"{section}.{name}", f"unknown key in {where}", hint)
            changes.setdefault(section, {})[name] = _coerce(
                section, name, known[name], value, where
            )
    return config.replace(**changes)


def load_toml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """`base` (default: the defaults) overridden by the TOML file at `path`."""
    label = "--config"
    try:
        with open(path, "rb") as handle:
            mapping = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(label, f"{path} does not exist", "give the path of a TOML file") from None
    except OSError as error:
        raise ConfigError(
            label, f"cannot read {path} ({error.strerror})", "check the path"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(label, f"{path} is not valid TOML ({error})", "fix the file") from None
    return apply_mapping(base or RunConfig(), mapping, str(path))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's string escapes (\\, \", \n, \uXXXX...) are all valid in a TOML basic string.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(config: RunConfig, header: str = "") -> str:
    """The config as TOML text, each field preceded by its documentation as a comment."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for section, cls in SECTIONS.items():
        values = getattr(config, section)
        docs = field_docs(cls)
        lines += ["", f"[{section}]"]
        for f in fields(cls):
            doc = f"{docs.get(f.name, '')} ({flag_name(section, f.name)})"
            lines += textwrap.wrap(
                doc, 98, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
            )
            lines.append(f"{f.name} = {_toml_value(getattr(values, f.name))}")
    return "\n".join(lines).lstrip("\n") + "\n"
