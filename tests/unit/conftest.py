"""tests/unit holds pure logic: a test here that starts a process group or a child process fails
at once with a line saying where it belongs (tests/dist for a world, even of one rank;
tests/e2e for processes). The guard is on from a unit test's setup (module fixtures included)
to the end of its teardown, and off for the other folders' tests in the same session."""

import subprocess

import pytest
import torch.distributed as dist

_GUARDED = ((dist, "init_process_group"), (subprocess.Popen, "__init__"))
_saved: list = []


def _refused(*args, **kwargs):
    raise AssertionError(
        "a unit test started a process group or a child process: it belongs in tests/dist "
        "(a world, even of one rank) or tests/e2e (processes)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not _saved:
        _saved.extend(getattr(owner, name) for owner, name in _GUARDED)
        for owner, name in _GUARDED:
            setattr(owner, name, _refused)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if _saved:
            for (owner, name), original in zip(_GUARDED, _saved, strict=True):
                setattr(owner, name, original)
            _saved.clear()
