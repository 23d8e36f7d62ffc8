"""How DiLoCo's outer gradients travel between the replicas: fp32, bf16, or int8 / fp8 / int4
with per-block scales and error feedback (compression/quantize.py)."""

from __future__ import annotations

import torch

from ..comm import Comm
from ..compression.quantize import Quantize
from .flat import Reduced


class OuterWire:
    """The sum of a flat outer gradient over the replicas, as a future (`Reduced`).

    comm: the replicas' group (a live run rebinds it in place).
    compress: None (fp32), "bf16", "int8", "fp8" or "int4".
    """

    def __init__(self, comm: Comm, compress: str | None):
        self.comm, self.compress = comm, compress
        # Each replica's own error feedback, one residual per key (fragment, warm-up, final).
        self.quantize = Quantize(compress) if compress in ("int8", "fp8", "int4") else None

    def all_reduce(self, flat: torch.Tensor, key: str) -> Reduced:
        """The sum of `flat` over the replicas (`wait()` gives it); `key` names its residual."""
        if self.comm.world_size == 1:
            return Reduced(None, lambda: flat)
        if self.quantize is not None:
            return self.quantize.reduce(self.comm, key, flat, None)
        if self.compress == "bf16":
            low = flat.to(torch.bfloat16)
            work = self.comm.all_reduce(low, async_op=True)
            return Reduced(work, lambda: low.float())
        work = self.comm.all_reduce(flat, async_op=True)
        return Reduced(work, lambda: flat)
