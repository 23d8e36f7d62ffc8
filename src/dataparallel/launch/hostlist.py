"""Slurm's compressed lists, expanded in pure Python: host lists and tasks per node.

    expand_hostlist("node[01-03,07],gpu-a[1-2]")
        -> ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]
    expand_tasks_per_node("2(x3),1") -> [2, 2, 2, 1]

A host list is names separated by commas at the top level; a name may hold bracketed ranges
(`lo-hi`, zero padding kept from `lo`) and single numbers separated by commas, and several
brackets multiply (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2), as `scontrol show hostnames`
prints them. `scontrol` is asked only when the text is beyond this syntax and it is installed.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess

from .config import ConfigError


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without its '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' without its ']'")
    parts.append(text[start:])
    return parts


def _expand_range(body: str) -> list[str]:
    """The numbers of one bracket's body (`01-03,07`), as text with their padding."""
    numbers: list[str] = []
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"[{body}] is not numbers and ranges")
        if not dash:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"{item} runs backwards")
        numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return numbers


def _expand_name(name: str) -> list[str]:
    """One top-level entry: literal pieces and bracketed ranges, multiplied out."""
    pieces: list[list[str]] = []
    rest = name
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        pieces += [[head], _expand_range(body)]
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(text: str, field: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a Slurm host list, in order; ConfigError naming `field` when the text
    is not a host list (after asking `scontrol show hostnames`, if it is installed)."""
    try:
        hosts = [host for part in _split_top(text.strip()) for host in _expand_name(part)]
        if hosts and all(hosts):
            return hosts
        problem = "holds an empty name"
    except ValueError as error:
        problem = str(error)
    scontrol = shutil.which("scontrol")
    if scontrol:  # a syntax beyond ours: Slurm's own reading
        done = subprocess.run(
            [scontrol, "show", "hostnames", text], capture_output=True, text=True, check=False
        )
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    raise ConfigError(
        field, f"{text!r} is not a host list ({problem})", "give names like node[01-03,07]"
    )


def expand_tasks_per_node(text: str, field: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """The tasks on each node of Slurm's `2(x3),1` (three nodes of 2, one of 1)."""
    counts: list[int] = []
    for item in text.strip().split(","):
        count, _, repeat = item.partition("(x")
        if not count.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            raise ConfigError(field, f"{text!r} is not tasks per node", "give counts like 2(x3),1")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts
