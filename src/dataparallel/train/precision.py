"""What `--precision` means: a strategy's MixedPrecision policy, autocast, and loss scaling.

- "fp32": everything in fp32.
- "bf16": bfloat16 autocast; weights, gradients and optimizer state stay fp32.
- "bf16-params": bf16 parameters, activations, gradients and communication, fp32 masters and
  optimizer state ([Note: mixed precision] in strategies/parts/precision.py).
- "fp16": the same in float16, with dynamic loss scaling by `torch.amp.GradScaler` (its
  defaults: 2**16, x2 after 2,000 finite steps, x0.5 on an overflow). An overflowing step is
  skipped on every rank together: no parameter, optimizer state or LR-schedule position moves.
"""

from __future__ import annotations

import torch

import dataparallel as dp

# name -> (MixedPrecision for the strategy or None, autocast dtype or None, loss scaling)
PRECISIONS: dict[str, tuple] = {
    "fp32": (None, None, False),
    "bf16": (None, torch.bfloat16, False),
    "bf16-params": (dp.MixedPrecision(param_dtype=torch.bfloat16), None, False),
    "fp16": (dp.MixedPrecision(param_dtype=torch.float16), None, True),
}


def strategy_policy(strategy: str, precision: str, comm_hook=None):
    """The named strategy's policy with the precision's MixedPrecision (and a communication
    hook, for --compress)."""
    from ..strategies import POLICIES

    return POLICIES[strategy](precision=PRECISIONS[precision][0], comm_hook=comm_hook)


def autocast_dtype(precision: str) -> torch.dtype | None:
    return PRECISIONS[precision][1]


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A loss scaler with torch's defaults for "fp16", else None."""
    return torch.amp.GradScaler(device.type) if PRECISIONS[precision][2] else None
