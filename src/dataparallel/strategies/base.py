"""What every strategy shares: the model check at wrap time, optimizer validation, the protocol.

A strategy is attached to the model by `dataparallel.parallelize` and reached through the
module-level functions of `dataparallel.api`; the trainer never sees strategy internals.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch import nn

from ..comm import Comm
from ..comm.dry import storage_key
from .parts import geometry as geo
from .parts.geometry import Geometry
from .parts.held_grads import clip_grad_value_, grad_norms, held_runs


def model_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter and buffer, in registration order."""
    entries = [
        ("parameter:" + n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()
    ]
    entries += [("buffer:" + n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return entries


def first_mismatch(signatures: list[list[tuple]]) -> str | None:
    """Describe the first entry where some rank's signature differs from rank 0's, or None."""
    reference = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        for position in range(max(len(reference), len(sig))):
            mine = reference[position] if position < len(reference) else None
            theirs = sig[position] if position < len(sig) else None
            if mine != theirs:
                where = (mine or theirs)[0]
                return (
                    f"{where.split(':', 1)[0]} '{where.split(':', 1)[1]}' differs across ranks: "
                    f"rank 0 has {_describe(mine)}, rank {rank} has {_describe(theirs)}"
                )
    return None


def _describe(entry) -> str:
    if entry is None:
        return "nothing at that position"
    name, shape, dtype = entry
    return f"{name.split(':', 1)[1]} shape {list(shape)} {dtype.removeprefix('torch.')}"


def verify_same_model(model: nn.Module, comm: Comm) -> None:
    """Fail on every rank, with one clear error, when the ranks hold different models.

    Signatures are all-gathered, so every rank sees the same mismatch and raises the same
    error, instead of some ranks hanging in the broadcast that follows. First only a digest
    of each (every rank reads N digests, not N signatures: gpt-small's took 1 s of CPU at
    4,096 ranks); the signatures themselves only when the digests differ, to name what does.
    """
    if comm.world_size == 1:
        return
    signature = model_signature(model)
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    if len(set(comm.all_gather_object(digest))) == 1:
        return
    problem = first_mismatch(comm.all_gather_object(signature))
    if problem:
        raise ValueError(
            f"parallelize: {problem}; build the same model (same config and dtype) on every rank"
        )


def check_optimizer_params(model: nn.Module, param_groups) -> None:
    """Raise if any optimizer parameter is not a parameter of `model`."""
    owned = {id(p) for p in model.parameters()}
    for group in param_groups:
        params = group["params"] if isinstance(group, dict) else [group]
        for p in params:
            if id(p) not in owned:
                raise ValueError(
                    f"build_optimizer: a parameter of shape {list(p.shape)} does not belong to "
                    "the parallelized model; build the optimizer from this model's parameters"
                )


def normalize_param_groups(model: nn.Module, params) -> list[dict]:
    """The optimizer's param groups: `params` (tensors or dicts) or every trainable parameter."""
    if params is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in params]
    else:
        groups = [{"params": params}]
    check_optimizer_params(model, groups)
    return groups


def broadcast_model(model: nn.Module, comm: Comm) -> None:
    """Give every rank rank 0's parameters and buffers (one collective per dtype)."""
    broadcast_values([p.data for p in model.parameters()] + list(model.buffers()), comm)


def broadcast_values(tensors: list[torch.Tensor], comm: Comm) -> None:
    """Give every rank rank 0's values of `tensors`, in place (one collective per dtype)."""
    if comm.world_size > 1 and tensors:
        comm.broadcast_tensors(tensors, src=0)


def broadcast_buffers(module: nn.Module, buffers: list[torch.Tensor], comm: Comm) -> None:
    """At a training forward, give every rank rank 0's buffers (BatchNorm statistics).

    Only in train() mode (callers check grad mode), so an evaluation that runs on one rank
    alone never waits for the others.
    """
    if module.training and buffers and comm.world_size > 1:
        comm.broadcast_tensors(buffers, src=0)


class Strategy:
    """The protocol every strategy implements (a base with the shared pieces).

    name: the strategy's registry name ("ddp", "zero1", ...).
    groups: the sharded strategies' `Groups` (world, shard, replicate); None for DDP, which
        talks through `comm` alone.
    """

    name = "base"
    # Whether a parameter at rest is a placeholder rather than its value (ZeRO-3): a plain
    # copy of the model is then refused ([Note: model copies] in model_copy.py).
    placeholders_at_rest = False

    def __init__(self, model: nn.Module, comm: Comm, groups=None):
        self.model = model
        self.comm = comm
        self.groups = groups
        self.sync_enabled = True
        self.hook = None  # the communication hook the strategy reduces gradients with
        self.reducer = None  # the bucketed strategies' GradientReducer (DDP, ZeRO-1/2)

    # -- the calls the public API forwards ---------------------------------------------------
    def build_optimizer(
        self, optimizer_cls, params=None, *, reads: str | list[str] = "element", **kwargs
    ) -> torch.optim.Optimizer:
        """The user's optimizer for this strategy; `reads` (per param group, or one for all):
        what its update of one element reads, which decides its layout ([Note: optimizer
        layout] in parts/optimizer_layout.py)."""
        raise NotImplementedError

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Accept an optimizer the user built; strategies that shard it refuse."""
        raise ValueError(
            f"build_optimizer: strategy {self.name!r} builds its own sharded optimizer; pass the "
            "optimizer class and its arguments instead of a built optimizer"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no communication until the context exits."""
        previous = self.sync_enabled
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(previous)

    def _set_sync(self, enabled: bool) -> None:
        self.sync_enabled = enabled
        if self.reducer is not None:
            self.reducer.sync_enabled = enabled

    def finish_param_gather(self) -> None:
        """Wait for parameter communication still in flight (none, unless a strategy says so)."""

    def refresh_params(self) -> None:
        """The optimizer's parameters were changed outside `step()` (an averager, a checkpoint
        load): bring the model's parameters up to date. Nothing to do where the model's
        parameters are the ones the optimizer updates (DDP)."""

    def rebind(self, group) -> None:
        """Train over `group` from now on, with the state held as it is (a live run's next
        generation, train/live/recovery.py). Only strategies whose ranks hold the same state can:
        a sharded one would have to move its shards."""
        raise ValueError(
            f"strategy {self.name!r} cannot move to another group; live recovery covers ddp"
        )

    def comms(self) -> list[Comm]:
        """Every Comm the strategy sends through, each once (for byte counts)."""
        return self.groups.comms() if self.groups is not None else [self.comm]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise NotImplementedError

    # -- the reduced gradient where it lives ([Note: sharded gradients]) ----------------------
    def shard_holders(self) -> list | None:
        """What holds the flat shards (ZeRO-1/2's buckets, ZeRO-3's units: each with `.shard`
        and `.params`); None where every rank holds the model's `.grad` whole (DDP)."""
        return None

    def reduced_runs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the run of its reduced gradient this rank holds)."""
        holders = self.shard_holders()
        if holders is None:
            return [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        return held_runs(holders) + self.owned_runs()

    def owned_runs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, its whole reduced gradient) for the parameters this rank owns
        ([Note: optimizer layout] in parts/optimizer_layout.py); none without whole-parameter groups."""
        return []

    def clip_grad_value_(self, clip_value: float) -> None:
        clip_grad_value_([grad for _, grad in self.reduced_runs()], clip_value)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        comm = self.groups.shard if self.shard_holders() is not None else None
        names = geo.parameter_names(self.model)
        return grad_norms(self.reduced_runs(), names, norm_type, comm)

    # -- what this rank holds, and every plain form of it ([Note: geometry]) --------------------
    def geometry(self, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
        """What this rank holds of each parameter, and what `optimizer` keys it by."""
        raise NotImplementedError

    def user_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        """The model parameters of `optimizer`'s param groups, as the user passed them."""
        return [list(g["params"]) for g in optimizer.param_groups]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.finish_param_gather()
        return geo.full_state_dict(self.model, self.geometry())

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.finish_param_gather()
        geo.load_full_state_dict(self.model, self.geometry(), state_dict)
        self.refresh_params()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        groups = self.user_groups(optimizer)
        return geo.optimizer_state_dict(self.geometry(optimizer), optimizer, groups)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        groups = self.user_groups(optimizer)
        geo.load_optimizer_state_dict(self.geometry(optimizer), optimizer, groups, state)

    def working_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters, gradients) the strategy computes with now: the model's parameters or
        the buffers they view, gathered units, gradient buckets and stores."""
        raise NotImplementedError

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds: what it computes with, and from the geometry what it holds
        beside that (fp32 masters under mixed precision, which count as optimizer state, the
        ZeRO paper's K = 12 bytes per parameter, and are also reported on their own)."""
        params, grads = self.working_tensors()
        working = {storage_key(t) for t in params if t is not None}
        held = [p.value for p in self.geometry(optimizer).pieces]
        # A shard holding only padding has no piece, yet its data is allocated (at 4,096 ranks
        # the last ranks' shards of a small bucket: the dry run found it, docs/plan.md).
        held += [h.shard.data for h in self.shard_holders() or () if h.shard is not None]
        masters = [t for t in held if storage_key(t) not in working]
        state = optimizer_state_tensors(optimizer) if optimizer is not None else []
        return {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(grads),
            "optimizer_state": tensor_bytes(state + masters),
            "master_params": tensor_bytes(masters),
            **hook_state_report(self.hook),
        }

    def stateful_hook(self):
        """The communication hook, when it keeps state between steps (compression), else None."""
        return self.hook if hasattr(self.hook, "state_dict") else None


def hook_state_report(hook) -> dict[str, int]:
    """{"compression": bytes} when the communication hook keeps state between steps (error
    feedback residuals, PowerSGD's factors), else nothing."""
    tensors = getattr(hook, "state_tensors", None)
    return {"compression": tensor_bytes(tensors())} if tensors is not None else {}


def tensor_bytes(tensors) -> int:
    """Bytes held by distinct storages among `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
