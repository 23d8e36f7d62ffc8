"""DiLoCo: the outer step of [Note: averaging] (local_sgd.py), streamed by fragments.

[Note: streaming DiLoCo] Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) spreads
DiLoCo's outer step over time: the held tensors are split into F fragments of about equal size
(consecutive tensors, `split_fragments`), and fragment p has its outer step at the steps s with
(s + p H / F) mod H = 0, so each is synchronised every H steps and one of them every H / F
steps: the link carries 1/F of the model at a time, and the peak bandwidth falls F-fold. With
`overlap` tau > 0 the fragment's all-reduce is started asynchronously and applied tau inner
steps later, hidden behind their compute; the fragment then continues from alpha x its local
values (which moved during those steps) + (1 - alpha) x the outer step's result (`mix`). The
outer optimizer keeps one state per anchor, and a fragment's step moves only its anchors. Outer
gradients may travel in 4 bits with error feedback (`compress="int4"`). Since the replicas
are apart between a fragment's outer steps (and, mixed, after them), `finish()` ends a run on
their average. Settings and the measured recipe that `--diloco H` uses: streaming.py ([Note:
the DiLoCo recipe]). Exactness anchor (tests/dist/test_streaming.py): F = 1, tau = 0 is
DiLoCo, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..api import finish_param_gather, refresh_params
from ..compression.feedback import keyed_tensors, load_keyed_tensors
from .flat import Reduced, flatten, unflatten
from .local_sgd import LocalSGD
from .outer_step import OuterStep
from .outer_wire import OuterWire
from .schedule import FragmentSchedule
from .streaming import OUTER_FORMATS, check_streaming, split_fragments

__all__ = ["DiLoCo"]


class DiLoCo(LocalSGD):
    """DiLoCo's outer step every `every` steps ([Note: averaging]), streamed by fragments
    ([Note: streaming DiLoCo]).

    model, optimizer, every, group, tracer: as for LocalSGD.
    outer_optimizer: builds the outer optimizer from a list of tensors (any torch.optim class,
        e.g. `partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`, the default).
    compress: how outer gradients travel: None (fp32), "bf16", "int8", "fp8" or "int4" (the
        last three with per-block scales and error feedback, compression/quantize.py).
    fragments: F, the parts of the model synchronised in turn, each every `every` steps and
        staggered by every / F steps (F must divide `every`); 1 is DiLoCo itself.
    overlap: tau, inner steps a fragment's outer all-reduce runs behind before it is applied
        (0: applied at once; below every / F, so one reduction is in flight at a time).
    mix: alpha, with overlap > 0: the fragment continues from alpha x its local values +
        (1 - alpha) x the outer step's result (the inner steps taken meanwhile are kept in
        part); with overlap 0 it takes the outer result (there are no such steps).
    warmup: the first `warmup` steps average the replicas after every step, one fragment a
        step in turn (F = 1: all of it; in fp32 the parameters, compressed their movement in
        the outer format); the anchors start from the average, and the fragments' schedule
        counts from the end of the warm-up.
    """

    name = "diloco"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int,
        group: dist.ProcessGroup | None = None,
        outer_optimizer: Callable | None = None,
        compress: str | None = None,
        tracer=None,
        *,
        fragments: int = 1,
        overlap: int = 0,
        mix: float = 0.5,
        warmup: int = 0,
    ):
        if compress not in OUTER_FORMATS:
            raise ValueError(
                f"diloco: compress={compress!r} must be None, 'bf16', 'int8', 'fp8' or 'int4'"
            )
        check_streaming(every, fragments, overlap, mix)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"diloco: warmup={warmup!r} must be an integer >= 0 (steps)")
        super().__init__(model, optimizer, every, group, tracer)
        self.compress, self.fragments, self.overlap, self.mix = compress, fragments, overlap, mix
        self.warmup = warmup
        self.schedule = FragmentSchedule(every, fragments, warmup)
        self.parts = split_fragments([t.numel() for t in self.tensors], fragments)
        self.outer_step = OuterStep(self.tensors, outer_optimizer, OuterWire(self.comm, compress))
        # What the state methods below read, by their names: the same objects.
        self.anchors, self.outer = self.outer_step.anchors, self.outer_step.optimizer
        self.quantize = self.outer_step.wire.quantize  # the outer residuals (None: no feedback)
        self.pending: tuple[int, int, object] | None = None  # (fragment, due step, reduction)
        self.synced = [0] * fragments  # the step each fragment was last synchronised at
        self.reduced = 0  # the step the last reduction was applied at (`at_boundary`)

    def step(self) -> bool:
        """Call after each optimizer step; True when a fragment started or finished its outer
        step here ([Note: streaming DiLoCo])."""
        self.steps += 1
        if self.schedule.warming_up(self.steps):
            return self._warm_up()
        due = self.pending is not None and self.pending[1] == self.steps
        starting = self.schedule.starting(self.steps)
        if not due and not starting:
            return False
        finish_param_gather(self.model)
        with torch.no_grad():
            if due:
                self._finish()
            for fragment in starting:
                self._start(fragment)
                if self.overlap == 0:
                    self._finish()
        refresh_params(self.model)
        return True

    def _warm_up(self) -> bool:
        """A warm-up step: one fragment in turn (with F = 1, every tensor) averaged over the
        replicas, its anchors set to the average."""
        finish_param_gather(self.model)
        fragment = self.schedule.warm_fragment(self.steps)
        with torch.no_grad():
            self._average(f"warmup{fragment}" if self.fragments > 1 else "warmup", fragment)
        refresh_params(self.model)
        return True

    def finish(self) -> bool:
        """Call once after the last step: the run ends on one model, the replicas' average
        ([Note: streaming DiLoCo]); a reduction in flight is applied first. Nothing is sent
        when every fragment was synchronised at this very step. True when it averaged."""
        if self.pending is None and all(s == self.steps for s in self.synced):
            return False
        finish_param_gather(self.model)
        with torch.no_grad():
            if self.pending is not None:
                self._finish()
            self._average("final")
        refresh_params(self.model)
        return True

    def _average(self, key: str, fragment: int | None = None) -> None:
        """The replicas' mean of a fragment (None: of every tensor), as `OuterStep.average`."""
        part = range(len(self.tensors)) if fragment is None else self.parts[fragment]
        self.outer_step.average(part, key)
        for p in range(self.fragments) if fragment is None else (fragment,):
            self.synced[p] = self.steps
        self.reduced = self.steps

    def _starts(self, fragment: int, step: int) -> bool:
        return self.schedule.starts(fragment, step)

    def _start(self, fragment: int) -> None:
        """Start the fragment's outer gradient on its way; it is applied `overlap` steps later."""
        key = "outer" if self.fragments == 1 else f"outer{fragment}"  # its own residual
        reduction = self.outer_step.gradient(self.parts[fragment], key)
        self.pending = (fragment, self.steps + self.overlap, reduction)

    def _finish(self) -> None:
        """Apply the reduced outer gradient in flight (`OuterStep.apply`)."""
        fragment, _, reduction = self.pending
        self.pending = None
        flat = reduction.wait()
        self.reduced = self.steps
        self.outer_step.apply(self.parts[fragment], flat, self.overlap, self.mix)
        if not self.overlap or self.mix == 0.0:  # mixed with local values: still apart
            self.synced[fragment] = self.steps

    def state_dict(self) -> dict:
        """As LocalSGD's ([Note: averager state]): per held tensor its anchor and outer
        optimizer state, this rank's outer residuals as "local", and the schedule's
        bookkeeping. A reduction in flight is waited for and kept as "pending" entries of its
        fragment's tensors (the same on every replica), applied when it falls due."""
        pending = {}
        if self.pending is not None:
            fragment, due, reduction = self.pending
            flat = reduction.wait()
            self.pending = (fragment, due, Reduced(None, lambda: flat))
            values = [torch.empty_like(self.anchors[i]) for i in self.parts[fragment]]
            unflatten(flat, values)
            pending = dict(zip(self.parts[fragment], values, strict=True))
        tensors = [
            {
                "anchor": anchor.detach(),
                **self.outer.state.get(anchor, {}),
                **({"pending": pending[i]} if i in pending else {}),
            }
            for i, anchor in enumerate(self.anchors)
        ]
        local = keyed_tensors(self.quantize.stores()) if self.quantize is not None else {}
        schedule = {"synced": list(self.synced), "reduced": self.reduced}
        return {"steps": self.steps, "tensors": tensors, "local": local, "schedule": schedule}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """As LocalSGD's; a state without "schedule" (a checkpoint's) leaves the schedule's
        bookkeeping as it is."""
        super().load_state_dict(state)
        steps, pending = self.steps, {}
        self.outer.state.clear()
        for i, (anchor, entries) in enumerate(zip(self.anchors, state["tensors"], strict=True)):
            for key, value in entries.items():
                if key == "anchor":
                    anchor.copy_(value.view_as(anchor))
                elif key == "pending":
                    pending[i] = value.view_as(anchor).clone()
                else:  # the outer optimizer's; a scalar (Adam's step) as it is
                    shaped = value if value.dim() == 0 else value.view_as(anchor)
                    self.outer.state[anchor][key] = shaped.to(anchor.device, copy=True)
        self.pending = None
        if pending:  # the fragment whose reduction was in flight, due `overlap` after its start
            fragment = next(p for p, part in enumerate(self.parts) if part and part[0] in pending)
            started = max(
                s
                for s in range(self.warmup + 1, steps + 1)
                if self._starts(fragment, s - self.warmup)
            )
            flat = flatten([pending[i] for i in self.parts[fragment]])
            self.pending = (fragment, started + self.overlap, Reduced(None, lambda: flat))
        if "schedule" in state:
            self.synced = list(state["schedule"]["synced"])
            self.reduced = state["schedule"]["reduced"]
        if self.quantize is not None and "local" in state:
            load_keyed_tensors(self.quantize.stores(), state["local"])

    # -- live recovery ([Note: live averaging] in train/live/rewind.py) -----------------------------
    def at_boundary(self) -> bool:
        """A reduction was applied at this step and none is in flight (every step of the
        warm-up; the start of each fragment's window, or its end under overlap)."""
        return self.pending is None and self.reduced == self.steps

    @torch.no_grad()
    def adopt(self, shared: dict) -> None:
        """Take a live replica's `shared()` ([Note: averager state]); the held tensors then
        start from the anchors (the source's own inner progress on fragments not yet
        synchronised is not this replica's to keep; its own outer residuals are kept)."""
        self.load_state_dict(shared)
        for tensor, anchor in zip(self.tensors, self.anchors, strict=True):
            tensor.copy_(anchor.detach().to(tensor.dtype))
        refresh_params(self.model)
