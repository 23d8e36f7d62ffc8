"""An older commit of dataparallel beside the current one, for the `old-*` contenders.

    python benchmarks/bench_step.py --baseline HEAD~1 --contenders ddp,old-ddp,bound

`checkout(ref)` makes (or reuses) a detached git worktree of `ref` under the temp directory,
`load(path)` imports that worktree's `src/dataparallel` under the name `dataparallel_baseline`.
Both versions then run in one process, in one world, on the one default process group: the old
code's `parallelize` builds its own `Comm` objects on the group it is given, and needs no
`init()` of its own. Only the package is old; the models, data and timing are the current ones.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PACKAGE = "dataparallel_baseline"
REPO = Path(__file__).resolve().parents[1]


class BaselineError(Exception):
    """The baseline cannot be had; the message is one line, for the command line."""


def git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)


def resolve(ref: str) -> str:
    """The full hash of the commit `ref` names (a branch, a tag, HEAD~1, a hash)."""
    done = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if done.returncode != 0:
        raise BaselineError(f"--baseline {ref!r}: no such commit in {REPO}")
    return done.stdout.strip()


def checkout(ref: str) -> Path:
    """A worktree of `ref` at /tmp/dp-baseline-<hash>, made on first use and reused after."""
    commit = resolve(ref)
    path = Path(tempfile.gettempdir()) / f"dp-baseline-{commit[:12]}"
    if path.exists():
        # Reuse it only if it still is that commit, untouched: it is the reference.
        head = git("rev-parse", "HEAD", cwd=path).stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", cwd=path).stdout.strip()
        if head != commit or dirty:
            raise BaselineError(
                f"--baseline {ref!r}: {path} exists but is not a clean checkout of "
                f"{commit[:12]}; remove it (git worktree remove --force {path})"
            )
        return path
    # --force: a worktree deleted by hand (a /tmp cleaned at boot) stays registered in the
    # repository, and git would refuse the same path again without it.
    done = git("worktree", "add", "--detach", "--force", str(path), commit)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "unknown error"
        raise BaselineError(f"--baseline {ref!r}: git worktree add failed: {reason}")
    return path


def load(path: Path) -> ModuleType:
    """The package of worktree `path`, imported (once per process) as `dataparallel_baseline`."""
    init = Path(path) / "src" / "dataparallel" / "__init__.py"
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None:
        if Path(loaded.__file__) != init:
            raise BaselineError(f"{PACKAGE} is already loaded from {loaded.__file__}")
        return loaded
    if not init.exists():
        raise BaselineError(f"baseline: {init} does not exist (a commit before src/dataparallel?)")
    spec = importlib.util.spec_from_file_location(
        PACKAGE, init, submodule_search_locations=[str(init.parent)]
    )
    package = importlib.util.module_from_spec(spec)
    # Registered before it runs: its relative imports (`from .comm import Comm`) look their
    # parent up in sys.modules, and so resolve inside the old package, not the current one.
    sys.modules[PACKAGE] = package
    before = set(sys.modules)
    try:
        spec.loader.exec_module(package)
    except Exception as exc:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        raise BaselineError(f"baseline: importing {init.parent} failed: {exc!r}") from exc
    # An absolute `import dataparallel...` in the old code reaches the current package and
    # mixes the two versions. Caught when it loads a module (not when it reuses a loaded one).
    leaked = sorted(n for n in set(sys.modules) - before if n.split(".")[0] == "dataparallel")
    if leaked:
        raise BaselineError(f"baseline: the old package imports the current one: {leaked}")
    return package
