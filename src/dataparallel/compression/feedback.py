"""Error feedback: what compression left out of one exchange is added to the next.

[Note: error feedback] A compressor sends C(x) instead of x. Alone, the part it drops is lost
for good and biases training (top-k never sends small coordinates; rounding to int8 always
errs the same way on a slowly moving gradient). With error feedback (Seide et al. 2014, Karimireddy
et al. 2019) each sender keeps the residual r = (x + r_old) - C(x + r_old) and adds it to the
next tensor it compresses under the same key, so everything is sent eventually and the sum
over steps of what was sent tracks the sum of the true gradients. The invariant, exact for
top-k (disjoint supports) and for quantisation (the difference of two floats within a factor
2 of each other is exact, Sterbenz):

    sent + new residual == came in + old residual

Keys name one compressed stream: (bucket index, stage). A residual has the size of what its
sender compresses: a whole bucket for a 1-D reduction (it is the sender's own error, which no
other rank can hold for it), the rank's shard when compression acts on the cross-replica stage
of a 2-D mesh, so there it is sharded like the gradients (docs/compression.md).
"""

from __future__ import annotations

import ast

import torch


class ErrorFeedback:
    """Residuals per key; `correct` before compressing, `remember` after."""

    def __init__(self):
        self.residuals: dict[object, torch.Tensor] = {}

    def correct(self, key, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` plus the residual left under `key` (in place; the first time, as is)."""
        residual = self.residuals.get(key)
        if residual is not None:
            if residual.shape != tensor.shape:
                raise ValueError(
                    f"ErrorFeedback: the residual of {key!r} has {residual.numel()} elements but "
                    f"the tensor has {tensor.numel()}; one key must always name one stream"
                )
            tensor.add_(residual.to(tensor.dtype))
        return tensor

    def remember(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> bool:
        """Keep what `sent` left out of `corrected` for the next exchange under `key`; False
        when that was not finite and was dropped instead."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != corrected.shape:
            residual = corrected - sent
        else:
            torch.sub(corrected, sent, out=residual)
        return self.keep(key, residual)

    def keep(self, key, residual: torch.Tensor) -> bool:
        """Store a residual (top-k computes its own: the unsent entries). One that is not
        finite (an overflowing fp16 step, which the loss scaler skips on every rank) is
        dropped: fed back, it would poison every later step. Returns whether it was kept."""
        if not torch.isfinite(residual.sum()):
            self.residuals.pop(key, None)
            return False
        self.residuals[key] = residual
        return True

    def tensors(self) -> list[torch.Tensor]:
        return list(self.residuals.values())


def keyed_tensors(stores: dict[str, dict]) -> dict[str, torch.Tensor]:
    """A compressor's per-key state as flat names, "residual/(3, 'all')", for a checkpoint.
    Keys are tuples of ints and strings, so their repr reads back with `ast.literal_eval`."""
    return {f"{name}/{key!r}": t for name, store in stores.items() for key, t in store.items()}


def load_keyed_tensors(stores: dict[str, dict], tensors: dict[str, torch.Tensor]) -> None:
    """Replace the state in `stores` by what `keyed_tensors` named."""
    for store in stores.values():
        store.clear()
    for full, tensor in tensors.items():
        name, _, key = full.partition("/")
        if name not in stores:
            raise ValueError(f"compression state {full!r} does not belong to this compressor")
        stores[name][ast.literal_eval(key)] = tensor
