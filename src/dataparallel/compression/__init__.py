"""Gradient compression as communication hooks, for replicated and sharded gradients alike.

    hook = dp.compression.CompressedHook(dp.compression.PowerSGD(rank=4), start=10)
    dp.parallelize(model, dp.ZeRO2(comm_hook=hook))
    dp.parallelize(model, dp.DDP(comm_hook=dp.compression.build_hook("topk:ratio=0.01")))

One algorithm per file: powersgd.py, topk.py, quantize.py (int8, fp8); feedback.py is the
error feedback they share; hook.py decides where in a strategy's reduction they act; live.py
keeps their state right under live recovery (a rewound step, a healed replacement).
"""

from .feedback import ErrorFeedback
from .hook import COMPRESSORS, SPEC_HELP, CompressedHook, build_hook, parse_spec
from .powersgd import PowerSGD, orthogonalize, plan_matrices
from .quantize import Quantize
from .topk import TopK

__all__ = [
    "COMPRESSORS",
    "SPEC_HELP",
    "CompressedHook",
    "ErrorFeedback",
    "PowerSGD",
    "Quantize",
    "TopK",
    "build_hook",
    "orthogonalize",
    "parse_spec",
    "plan_matrices",
]
