"""A rank's own verdict on its gradients, taken before any reduction ([Note: blame] in blame.py)."""

from __future__ import annotations

import torch


class GradientWatch:
    """Notes whether any gradient this rank computed was not finite, before any reduction.

    A tensor hook on each trainable parameter sees each micro-step's gradient before it is
    accumulated into `.grad` (and so before a strategy's post-accumulate hook reduces it). The
    hook sums the gradient (one pass over it, in float32: an inf or a nan makes the sum
    non-finite); `nonfinite()` checks the step's sums at once. Parameters that a strategy
    replaces during backward (ZeRO-3's gathered views) may not reach the hook; the loss check
    in the trainer still names a rank whose own loss was not finite.
    """

    def __init__(self, model: torch.nn.Module):
        self.sums: list[torch.Tensor] = []
        self.handles = [p.register_hook(self._note) for p in model.parameters() if p.requires_grad]

    def _note(self, grad: torch.Tensor) -> None:
        self.sums.append(grad.detach().sum(dtype=torch.float32))

    def nonfinite(self) -> bool:
        """Whether a gradient since the last call held an inf or a nan; starts a new step."""
        sums, self.sums = self.sums, []
        return bool(sums) and not bool(torch.isfinite(torch.stack(sums).double().sum()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
