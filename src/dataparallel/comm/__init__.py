"""Collectives with byte accounting, traces, and gradient communication hooks."""

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
from .trace import Span

__all__ = [
    "Comm",
    "GradBucket",
    "HookState",
    "Span",
    "TraceEvent",
    "Tracer",
    "allreduce_hook",
    "bf16_compress_hook",
    "compressed_allreduce_hook",
    "fp16_compress_hook",
    "low_precision_hook",
    "reduce_hook",
    "reduce_scatter_hook",
]
