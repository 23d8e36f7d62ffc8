"""No cache or run output is committed: a token cache (`.dpcache/`, data/cache.py), a run
directory (`runs/`) or a `.npy` array that no test names as its fixture (issue 43: 98 token
caches of the package's own sources came in with a merge).

The tracked files are listed once, when this module is collected: tests/unit/conftest.py
refuses a child process inside a unit test, and the test itself is pure logic over the list.
"""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_FOLDERS = {".dpcache", "runs"}  # a token cache; a run directory (cli.py default_out)
# The .npy files a test reads from the tree. None: every test writes its arrays under its
# temporary folder (tests/unit/test_data.py). A fixture added here is named by its path.
NPY_FIXTURES: frozenset[str] = frozenset()


def outputs(paths: list[str], fixtures: frozenset[str] = NPY_FIXTURES) -> list[str]:
    """The paths of `paths` (relative, with slashes) that are a cache or a run's output."""
    found = []
    for path in paths:
        parts = PurePosixPath(path).parts
        in_output = any(part in OUTPUT_FOLDERS for part in parts[:-1])
        if in_output or (path.endswith(".npy") and path not in fixtures):
            found.append(path)
    return found


def tracked_files() -> tuple[list[str], str]:
    """(the files git tracks in this checkout, "") or ([], why they cannot be listed)."""
    if not (ROOT / ".git").exists():  # a folder, or a file in a worktree
        return [], f"{ROOT} is not a git checkout"
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return [], f"git ls-files could not run ({error})"
    if listed.returncode != 0:
        return [], f"git ls-files failed: {listed.stderr.strip().splitlines()[0]}"
    return listed.stdout.split("\0")[:-1], ""


TRACKED, WHY_NOT = tracked_files()


def test_caches_and_run_outputs_are_recognised():
    paths = [
        "src/dataparallel/.dpcache/api.py.hf-d3d56e87464dac1f.0123.npy",
        "tests/e2e/data/corpus/.dpcache/engine_notes.md.bytes-v1.4567.npy",
        "runs/20261125-232311-gpt-tiny/metrics.jsonl",
        "examples/runs/small/config.toml",
        "tests/unit/ids.npy",
        "src/dataparallel/data/cache.py",
        ".ci/run",
        "docs/runs.md",
        "benchmarks/runs.py",
    ]
    assert outputs(paths) == paths[:5]
    assert outputs(paths, frozenset({"tests/unit/ids.npy"})) == paths[:4]


def test_no_cache_or_run_output_is_tracked():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    assert "pyproject.toml" in TRACKED and len(TRACKED) > 100  # the whole checkout was listed
    assert outputs(TRACKED) == [], "git rm them; .gitignore keeps .dpcache/ and runs/ out"
    assert sorted(NPY_FIXTURES - set(TRACKED)) == []  # a fixture named here is tracked
