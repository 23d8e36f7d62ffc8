"""Hooks the compiler does not trace ([Note: compile] in strategies/zero3/strategy.py).

Every hook a strategy registers on a module (the start of a round, ZeRO-3's gathers and frees,
ZeRO-1/2's wait for an overlapped parameter gather) calls collectives and changes the
strategy's state. Traced by `torch.compile`, its state would become guards (a recompile each
time it changes) and its collectives graph breaks in the middle of the user's code; opaque, the
compiler stops at the hook, runs it eagerly and compiles what lies between hooks. Hooks that
run in backward (gradient hooks, ZeRO-3's pre- and post-backward) are not wrapped: autograd
runs them eagerly, outside any compiled frame.
"""

from __future__ import annotations

import torch


def opaque(fn):
    """`fn`, and every function it calls, run eagerly even inside a compiled region."""
    return torch.compiler.disable(fn, recursive=True)
