"""The layout's import rules (README, "Layout"), read from every module's imports (pure logic:
nothing is imported, the files are parsed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "dataparallel"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The dataparallel modules `path` imports, at any depth of the file (lazy imports too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dataparallel")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("dataparallel"):
                found.add(target)
                # `from . import x` and `from .pkg import mod` may name modules
                found |= {f"{target}.{alias.name}" for alias in node.names}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {t for t in imports_of(path) if t in modules} for name, path in modules.items()}


IMPORTS = graph()


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# (importer package, imported package): an import the README's rules forbid.
FORBIDDEN = [
    ("dataparallel.infer", "dataparallel.train"),  # inference never imports the job
    ("dataparallel.launch", "dataparallel.train"),  # the launcher imports neither
    ("dataparallel.launch", "dataparallel.infer"),
    ("dataparallel.checkpoint", "dataparallel.strategies"),  # checkpoints: the public API
    ("dataparallel.train", "dataparallel.strategies"),  # the job: the public API only
    ("dataparallel.infer", "dataparallel.strategies"),
    ("dataparallel.lightning", "dataparallel.strategies"),  # a front end: the public API only
    ("dataparallel.lightning", "dataparallel.train"),  # beside the job, not on it
    ("dataparallel.train", "dataparallel.lightning"),
    ("dataparallel.comm", "dataparallel.train"),  # collectives know no quorum
    ("dataparallel.comm", "dataparallel.strategies"),
    ("dataparallel.comm", "dataparallel.launch"),
    ("dataparallel.torch_internals", "dataparallel"),  # the bottom: torch's internals only
    # the parallel layout is pure arithmetic that every layer reads: it imports none of them
    ("dataparallel.strategies.parts.parallel_layout", "dataparallel"),
    ("dataparallel.plan", "dataparallel.train"),  # the planner reads the layout, not the job
]


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_a_layer_imports_nothing_the_readme_forbids(importer, imported):
    importers = [name for name in IMPORTS if under(name, importer)]
    assert importers, f"no module under {importer}: the rule would pass on nothing"
    broken = sorted(
        f"{name} -> {target}"
        for name in importers
        for target in IMPORTS[name]
        if under(target, imported)
    )
    assert broken == []


def test_strategies_are_reached_only_through_their_face():
    """Nothing outside strategies/ imports one of its modules but the package's face
    (strategies/__init__.py): the API, the features and the planner see what it exports."""
    outside = [name for name in IMPORTS if not under(name, "dataparallel.strategies")]
    readers = [name for name in outside if "dataparallel.strategies" in IMPORTS[name]]
    assert len(readers) >= 8, readers  # the API, compose, the EMA, the planner, ... read it
    broken = sorted(
        f"{name} -> {target}"
        for name in outside
        for target in IMPORTS[name]
        if under(target, "dataparallel.strategies") and target != "dataparallel.strategies"
    )
    assert broken == []


def test_features_hold_a_model_by_its_handle():
    """Checkpoints, the EMA and the live wing reach a parallelized model through
    `dp.handle_of` ([Note: the handle]), never the whole strategy."""
    src = PACKAGE.rglob("*.py")
    users = [p for p in src if "strategy_of" in p.read_text()]
    names = sorted(str(p.relative_to(PACKAGE)) for p in users)
    assert names == ["api.py", "strategies/handle.py"]


def test_the_rules_cover_every_layer_named():
    assert len(FORBIDDEN) == 15
    assert len(IMPORTS) > 140  # every module of the package was read


def test_no_module_imports_itself_back():
    """No circle of imports among the package's modules (a package's __init__ re-exporting its
    own modules is not a circle: it stands above them)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(IMPORTS[name]):
            if under(name, target) and PACKAGE.joinpath(*target.split(".")[1:]).is_dir():
                continue  # a module importing its own package's __init__ (re-exports)
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(IMPORTS):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_no_test_module_imports_another_or_the_benchmarks():
    """Shared test code lives in helper modules (harness.py, models.py, e2e/helpers.py, ...):
    no test module imports another, and none puts benchmarks/ on its path."""
    tests = PACKAGE.parents[1] / "tests"
    files = sorted(p for p in tests.rglob("*.py") if p != Path(__file__).resolve())
    assert len(files) > 100
    broken = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith(
                "test_"
            ):
                broken.append(f"{path.relative_to(tests)} imports {node.module}")
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[-1].startswith("test_")]
                broken += [f"{path.relative_to(tests)} imports {n}" for n in names]
        # a line that adds benchmarks/ (a forked script's own folder, put first in that child
        # as python puts it, warm_processes.py, is not the suite's path)
        for line in path.read_text().splitlines():
            if ("sys.path.insert" in line or "sys.path.append" in line) and "bench" in line:
                broken.append(f"{path.relative_to(tests)} puts benchmarks/ on sys.path")
    assert broken == []
