"""The held tensors as one flat fp32 vector, and an async reduction of it: what every averager
sends ([Note: averaging] in local_sgd.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class Reduced:
    """An async collective (None: done already) and what its result is once waited for."""

    def __init__(self, work, result: Callable[[], torch.Tensor]):
        self.work, self.result = work, result

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.result()


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
