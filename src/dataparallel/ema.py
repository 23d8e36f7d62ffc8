"""An exponential moving average of a parallelized model's weights, held as the model is held.

[Note: sharded EMA] An EMA is elementwise: each element of the average follows its own element
of the weights. So each rank averages exactly what it holds ([Note: geometry] in
strategies/parts/geometry.py): whole parameters under DDP, its flat shards' pieces under
ZeRO-1/2/3 (the fp32 masters under mixed precision), and the average is the one process's,
element for element, at 1/N of its memory under the sharded strategies. The rule is PyTorch's
`AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`: the first `update()` copies
the weights, each later one moves the average towards them by `1 - decay`
(`torch._foreach_lerp_`, the same kernel, through torch_internals.py). It works on every strategy; under ZeRO-3, where a
plain copy of the model is refused ([Note: model copies] in strategies/model_copy.py), it is the
way to an EMA. Its whole weights come out with `full_state_dict()` (collective), or in place in
the model for an evaluation with `with ema.applied(): ...`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from .api import handle_of
from .strategies import Geometry, HeldPiece, geometry_full_state_dict, to_local
from .torch_internals import foreach_copy_, foreach_lerp_


class EMA:
    """The EMA of `model`'s parameters, sharded as `model` is ([Note: sharded EMA]).

    model: a parallelized model (any strategy). Build the EMA after `build_optimizer` (which may
        lay the parameters out again) and call `update()` after each `optimizer.step()`.
    decay: the weight of the old average, in [0, 1] (`get_ema_multi_avg_fn`'s).

    Every rank builds and updates it (not collective: each rank averages what it holds);
    `full_state_dict`, `state_dict` and `applied` are collective over the model's ranks.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA: decay={decay} must be in [0, 1] (e.g. 0.999)")
        self.model = model
        self.handle = handle_of(model)
        self.decay = float(decay)
        self.n_averaged = 0
        self.averages = [p.value.detach().clone() for p in self._pieces()]

    def _held(self) -> Geometry:
        """What this rank holds now ([Note: geometry]), checked against the averages."""
        self.handle.finish_param_gather()
        geometry = self.handle.geometry()
        averages = getattr(self, "averages", None)
        shapes = [p.value.shape for p in geometry.pieces]
        if averages is not None and shapes != [a.shape for a in averages]:
            raise ValueError(
                "EMA: the model's parameters were laid out again since the EMA was built "
                "(build_optimizer with param groups); build the EMA after build_optimizer"
            )
        return geometry

    def _pieces(self) -> tuple[HeldPiece, ...]:
        return self._held().pieces

    @torch.no_grad()
    def update(self) -> None:
        """Average the current weights in (after `optimizer.step()`); no collective."""
        current = [p.value for p in self._pieces()]
        if self.n_averaged == 0:
            _copy_into(self.averages, current)
        elif current:
            foreach_lerp_(self.averages, current, 1.0 - self.decay)
        self.n_averaged += 1

    def _geometry(self) -> Geometry:
        """The model's geometry with the averages in place of the weights."""
        geometry = self._held()
        pieces = zip(geometry.pieces, self.averages, strict=True)
        return replace(geometry, pieces=tuple(replace(p, value=a) for p, a in pieces))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged model on CPU under the plain model's keys, on every rank (buffers: the
        model's current ones, as `AveragedModel` without `use_buffers` does not average them
        either). Collective over the model's ranks."""
        return geometry_full_state_dict(self.model, self._geometry())

    def state_dict(self) -> dict:
        """{"decay", "n_averaged", "weights": `full_state_dict()`}: whole tensors, so it loads
        into an EMA of any strategy and world size. Collective."""
        return {
            "decay": self.decay,
            "n_averaged": self.n_averaged,
            "weights": self.full_state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Take what `state_dict` returned (from any strategy or world size); no collective."""
        if state["decay"] != self.decay:
            raise ValueError(
                f"EMA.load_state_dict: the state has decay={state['decay']}, this EMA "
                f"{self.decay}; build the EMA with the decay it was saved with"
            )
        weights, entries = state["weights"], self.model.state_dict(keep_vars=True)
        for piece, average in zip(self._pieces(), self.averages, strict=True):
            if piece.name not in weights:
                raise ValueError(f"EMA.load_state_dict: no weights for '{piece.name}'")
            whole = to_local(entries[piece.name], weights[piece.name]).reshape(-1)
            average.copy_(whole[piece.offset : piece.offset + average.numel()])
        self.n_averaged = int(state["n_averaged"])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the model holds the averaged weights (evaluate, export); after it,
        its own again, exactly (the optimizer's tensors are restored, not recomputed).
        Collective where the strategy's `refresh_params` is (ZeRO-1/2's all-gather)."""
        held = [p.value for p in self._pieces()]
        saved = [value.clone() for value in held]
        _copy_into(held, self.averages)
        self.handle.refresh()
        try:
            yield
        finally:
            _copy_into([p.value for p in self._pieces()], saved)
            self.handle.refresh()


@torch.no_grad()
def _copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if targets:
        foreach_copy_(targets, sources)
