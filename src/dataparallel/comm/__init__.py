"""Collectives with byte accounting, traces, a watchdog, and gradient communication hooks."""

from .collectives import Comm, TraceEvent, Tracer
from .hooks import (
    GradBucket,
    HookState,
    allreduce_hook,
    bf16_compress_hook,
    compressed_allreduce_hook,
    fp16_compress_hook,
    low_precision_hook,
    reduce_hook,
    reduce_scatter_hook,
)
from .progress import CollectiveMismatch, Progress, watched
from .trace import Span
from .watchdog import Watchdog

__all__ = [
    "CollectiveMismatch",
    "Comm",
    "GradBucket",
    "HookState",
    "Progress",
    "Span",
    "TraceEvent",
    "Tracer",
    "Watchdog",
    "allreduce_hook",
    "bf16_compress_hook",
    "compressed_allreduce_hook",
    "fp16_compress_hook",
    "low_precision_hook",
    "reduce_hook",
    "reduce_scatter_hook",
    "watched",
]
