"""ZeRO-1/2's shards, and the plain torch.optim optimizer built over this rank's shards.

[Note: sharded step] Each bucket's slice that this rank owns is one `Shard`; the part of one
parameter inside it is a piece. The optimizer is the user's optimizer class built over one
tensor per piece (`Shard.tensors`: views into the slice, or into its fp32 master), one param
group per user param group, so LR schedulers and param-group hyperparameters work unchanged. A
step pre-hook hands each piece its part of the reduced gradient (`Shard.grad`, kept by the
strategy, see zero.py), a post-hook writes the updated slice into the flat parameter buffer
and all-gathers the buffers, so every rank's model holds the new full parameters when `step()`
returns (with `overlap_param_gather`, by the time the next forward reads them:
param_gather.py). An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) computes on
a piece exactly what it computes on that part of the whole parameter, its per-parameter
scalars (Adam's `step`) included; one that looks across a tensor (per-parameter norms,
factored moments, closures over the full model) sees a flat piece instead (docs/zero.md).
One tensor per piece rather than one per slice costs at most about a millisecond a step:
torch's AdamW (its default for-loop implementation on CPU) over 1.65M elements took 4.1-5.4 ms
split into 52 tensors and 4.1 ms as 2 (10.3 ms in a run where glibc handed the 2 tensors'
3 MB temporaries out as fresh pages). A parameter of zero elements has no piece, so it gets no
optimizer state (a plain optimizer keeps an empty one).

[Note: skipped parameters] In single-process training a parameter whose .grad is None is
skipped by the step: no weight decay, no momentum, no `step` count. The pieces of a parameter
that no rank used since the last zero_grad get no .grad, so the optimizer skips them the same
way, exactly. Padding belongs to no piece: it stays zero.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .buckets import Bucket, BucketSpec
from .param_gather import ParamGather
from .sharding import Piece, ShardLayout

# State keys that torch optimizers keep as one number per parameter, not one per element.
SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


class Shard:
    """This rank's slice of one bucket: parameters, reduced gradient, the optimizer's tensors.

    bucket: the gradient bucket (its buffer may be absent between rounds, [Note: lazy buckets]).
    flat: the flat parameter buffer, in the compute dtype; the model's parameters are views.
    own: this rank's slice of `flat`.
    param: what the optimizer updates: `own` itself, or an fp32 master copy of it in mixed
        precision; `tensors` are the optimizer's views into it, one per piece.
    grad: the reduced gradient of this slice (compute dtype), None when there is none.
    grad_store: ZeRO-2's buffer for `grad`, allocated at the first reduction and kept, so that
        every step reuses its memory instead of allocating (and page-faulting) a new one.
    optimized: whether the optimizer steps it (False for parameters outside every group).
    """

    def __init__(
        self,
        bucket: Bucket,
        flat: torch.Tensor,
        layout: ShardLayout,
        rank: int,
        master: torch.Tensor | None,
        optimized: bool,
    ):
        self.bucket = bucket
        self.flat = flat
        self.layout = layout
        self.start, self.stop = layout.shard_range(rank)
        self.own = flat[self.start : self.stop]
        self.param = self.own if master is None else master
        self.grad: torch.Tensor | None = None
        self.grad_store: torch.Tensor | None = None
        self.optimized = optimized
        self.pieces: list[Piece] = layout.pieces(rank)
        # planned positions (the reducer's parameter indices) of the pieces' parameters
        self.piece_indices = [bucket.spec.param_indices[p.param] for p in self.pieces]
        # what the optimizer steps: one leaf tensor per piece, a view into `param`
        self.tensors = [
            torch.nn.Parameter(self.param[p.shard_start : p.shard_start + p.numel])
            for p in self.pieces
        ]

    def reduced_slice(self) -> torch.Tensor:
        """This rank's slice of the bucket's gradient buffer (valid after its reduction)."""
        return self.bucket.buffer[self.start : self.stop]

    def keep_grad(self, reduced: torch.Tensor) -> torch.Tensor:
        """`reduced` copied into `grad_store` (ZeRO-2, where the bucket is freed next)."""
        if self.grad_store is None:
            self.grad_store = torch.empty_like(reduced)
        return self.grad_store.copy_(reduced)

    def hand_grads(self, has_grad: list[bool]) -> None:
        """Give each piece its part of `grad` as .grad, or None where the step must skip it
        ([Note: skipped parameters])."""
        grad = None if self.grad is None else self.grad.to(self.param.dtype)  # no copy if same
        for piece, tensor, index in zip(self.pieces, self.tensors, self.piece_indices, strict=True):
            if grad is None or not has_grad[index]:
                tensor.grad = None
            else:
                tensor.grad = grad[piece.shard_start : piece.shard_start + piece.numel]

    def drop_grads(self) -> None:
        for tensor in self.tensors:
            tensor.grad = None


@torch.no_grad()
def flatten_bucket(
    spec: BucketSpec,
    params: list[torch.nn.Parameter],
    values: dict[int, torch.Tensor],
    rank: int,
    world_size: int,
    master_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, ShardLayout, torch.Tensor | None]:
    """Lay `params` end to end in a new flat buffer and make them views into it.

    Returns the buffer, its layout and, with `master_dtype`, this rank's master slice. `values`
    (id(param) -> tensor) replaces a parameter's current value: the fp32 masters when the
    parameters themselves are bf16.
    """
    layout = ShardLayout(tuple(p.numel() for p in params), spec.offsets, spec.numel, world_size)
    flat = torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device)
    full = [values.get(id(p), p.detach()).reshape(-1) for p in params]
    master = None
    if master_dtype is not None:
        master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=spec.device)
        for piece in layout.pieces(rank):
            part = full[piece.param][piece.start : piece.stop]
            master[piece.shard_start : piece.shard_start + piece.numel].copy_(part)
    for p, offset, value in zip(params, spec.offsets, full, strict=True):
        flat[offset : offset + p.numel()].copy_(value)
        p.data = flat[offset : offset + p.numel()].view_as(p)
    return flat, layout, master


def gather_full_params(
    shards: list[Shard], comm: Comm, master_dtype: torch.dtype | None
) -> dict[int, torch.Tensor]:
    """id(param) -> its full value from the masters; {} without masters. Collective."""
    if master_dtype is None:
        return {}  # the model's parameters are the exact values, whole on every rank
    out = {}
    for shard in shards:
        full = torch.empty(shard.layout.numel, dtype=master_dtype, device=shard.own.device)
        if comm.world_size > 1:
            comm.all_gather(full, shard.param)
        else:
            full.copy_(shard.param)
        for p, offset in zip(shard.bucket.params, shard.bucket.spec.offsets, strict=True):
            out[id(p)] = full[offset : offset + p.numel()].view_as(p)
    return out


@torch.no_grad()
def load_masters(shards: list[Shard], values: dict[int, torch.Tensor]) -> None:
    """Set every master slice from full values (id(param) -> tensor)."""
    for shard in shards:
        for piece in shard.pieces:
            value = values[id(shard.bucket.params[piece.param])]
            part = value.reshape(-1)[piece.start : piece.stop]
            shard.param[piece.shard_start : piece.shard_start + piece.numel].copy_(part)


def sharded_optimizer_class(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`base` with a zero_grad that also clears the gradients the strategy keeps per shard.

    The shards' gradients live outside the optimizer's tensors between backward and step
    (mixed precision keeps them in bf16, the optimizer wants fp32), so `zero_grad` must reach
    them; torch offers no zero_grad hook, hence a subclass (cached: one per base class).
    """
    if base not in _CLASSES:

        def zero_grad(self, set_to_none: bool = True) -> None:
            base.zero_grad(self, set_to_none)
            self.zero_shard_grads(set_to_none)

        name = f"Sharded{base.__name__}"
        _CLASSES[base] = type(
            name,
            (base,),
            {"zero_grad": zero_grad, "__doc__": base.__doc__, "__qualname__": name},
        )
    return _CLASSES[base]


_CLASSES: dict[type, type] = {}


class ShardedStep:
    """The step hooks of [Note: sharded step] and [Note: skipped parameters].

    The all-gather that follows the update is `gather`'s, over the optimized shards: within
    `step()`, or, given `overlap_with` (the model), overlapped with its next forward, whose
    modules get the hooks that wait ([Note: overlapped parameter gather] in param_gather.py).
    """

    def __init__(self, shards: list[Shard], comm: Comm, has_grad: list[bool], overlap_with=None):
        self.shards = [s for s in shards if s.optimized]
        self.has_grad = has_grad  # the strategy's list, updated in place each round
        buckets = [(s.flat, s.own) for s in self.shards]
        self.gather = ParamGather(buckets, comm, overlap=overlap_with is not None)
        if overlap_with is not None:
            self.gather.attach(overlap_with)

    def before(self, optimizer, args, kwargs) -> None:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            # The closure's backward would refill the shards after their gradients were handed
            # to the optimizer, which would then read stale ones.
            raise ValueError(
                "step(closure) is not supported with ZeRO-1/2: run forward and backward, "
                "then call step() without a closure"
            )
        self.gather.finish()  # the slices this step updates must be whole and settled
        for shard in self.shards:
            shard.hand_grads(self.has_grad)

    def after(self, optimizer, args, kwargs) -> None:
        for shard in self.shards:
            shard.drop_grads()
            if shard.param is not shard.own:
                shard.own.copy_(shard.param)  # fp32 master -> compute dtype
        self.gather.start()  # every rank's updated slices into every rank's flat buffers


def _elementwise(state: dict, param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in state.items()
        if torch.is_tensor(v) and v.shape == param.shape and k not in SCALAR_STATE_KEYS
    }


# -- optimizer state in the form of a plain optimizer over the model's parameters ------------


def _describe(state: dict, param: torch.Tensor) -> dict:
    """What a piece's state holds, small enough to all-gather as an object."""
    elementwise = _elementwise(state, param)
    scalars = {}
    for key, value in state.items():
        if key in elementwise:
            continue
        if torch.is_tensor(value):
            if value.dim() > 0 and key not in SCALAR_STATE_KEYS:
                raise ValueError(
                    f"optimizer_state_dict: state {key!r} of shape {list(value.shape)} is not "
                    "elementwise; sharded checkpoints hold elementwise state only (docs/zero.md)"
                )
            value = value.detach().cpu().clone()
        scalars[key] = value
    return {
        "has_state": bool(state),
        "elementwise": {k: v.dtype for k, v in elementwise.items()},
        "scalars": scalars,
    }


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer,
    shards: list[Shard],
    comm: Comm,
    user_groups: list[list[torch.nn.Parameter]],
) -> dict:
    """The state_dict a plain optimizer over `user_groups` would return. Collective: every rank
    passes its optimized shards, in bucket order.

    Elementwise state is laid into each slice, all-gathered per bucket and cut back into
    parameters; scalars (Adam's `step`) come from the piece of the rank that owns each
    parameter's first element. CPU tensors.
    """
    plain_index = {id(p): i for i, p in enumerate(p for g in user_groups for p in g)}
    local = [[_describe(optimizer.state.get(t, {}), t) for t in s.tensors] for s in shards]
    everyone = comm.all_gather_object(local) if comm.world_size > 1 else [local]
    state: dict[int, dict] = {}
    for k, shard in enumerate(shards):
        infos = [everyone[rank][k] for rank in range(comm.world_size)]  # per rank, per piece
        dtypes = {
            key: dtype
            for pieces in infos
            for info in pieces
            for key, dtype in info["elementwise"].items()
        }
        full = {}
        for key, dtype in sorted(dtypes.items()):
            local_part = torch.zeros(shard.own.numel(), dtype=dtype, device=shard.own.device)
            for piece, tensor in zip(shard.pieces, shard.tensors, strict=True):
                value = optimizer.state.get(tensor, {}).get(key)
                if torch.is_tensor(value) and value.shape == tensor.shape:
                    local_part[piece.shard_start : piece.shard_start + piece.numel].copy_(value)
            full[key] = torch.empty(shard.layout.numel, dtype=dtype, device=shard.own.device)
            if comm.world_size > 1:
                comm.all_gather(full[key], local_part)
            else:
                full[key].copy_(local_part)
        spec = shard.bucket.spec
        described = {  # (rank, parameter position) -> that rank's piece's description
            (rank, piece.param): info
            for rank in range(comm.world_size)
            for piece, info in zip(shard.layout.pieces(rank), infos[rank], strict=True)
        }
        for position, (param, offset) in enumerate(
            zip(shard.bucket.params, spec.offsets, strict=True)
        ):
            info = described.get((shard.layout.owner(position), position))
            if info is None or not info["has_state"]:
                continue  # never stepped (or holds no element: nothing to keep)
            entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in info["scalars"].items()}
            for key in info["elementwise"]:
                entry[key] = (
                    full[key][offset : offset + param.numel()].view_as(param).to("cpu", copy=True)
                )
            state[plain_index[id(param)]] = entry
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": []}
        for group in optimizer.param_groups
    ]
    for group, params in zip(param_groups, user_groups, strict=True):
        group["params"] = [plain_index[id(p)] for p in params]
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    shards: list[Shard],
    user_groups: list[list[torch.nn.Parameter]],
    state: dict,
) -> None:
    """Load a plain optimizer's state_dict (as `gather_optimizer_state` returns) into the
    pieces: each takes its part of its parameter's elementwise state, and its scalars."""
    groups = state["param_groups"]
    sizes = [len(g) for g in user_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise ValueError(
            f"load_optimizer_state_dict: the state has param groups of sizes "
            f"{[len(g['params']) for g in groups]}, this optimizer {sizes}; build it with the "
            "same param groups"
        )
    saved = {
        id(param): state["state"][index]
        for group, params in zip(groups, user_groups, strict=True)
        for index, param in zip(group["params"], params, strict=True)
        if index in state["state"]
    }
    piece_of = {
        id(tensor): (shard, piece)
        for shard in shards
        for piece, tensor in zip(shard.pieces, shard.tensors, strict=True)
    }
    ours: dict = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in groups[g].items() if k != "params"}
        indices = []
        for tensor in group["params"]:
            shard, piece = piece_of[id(tensor)]
            entry = _piece_state(shard.bucket.params[piece.param], piece, saved)
            if entry:
                ours["state"][index] = entry
            indices.append(index)
            index += 1
        ours["param_groups"].append({**hyper, "params": indices})
    optimizer.load_state_dict(ours)


def _piece_state(param: torch.nn.Parameter, piece: Piece, saved: dict) -> dict:
    """A piece's state: its part of `param`'s elementwise state, copies of the scalars (a
    shared `step` tensor would be incremented once per piece)."""
    param_state = saved.get(id(param))
    if not param_state:
        return {}
    elementwise = _elementwise(param_state, param)
    entry = {
        k: v.clone() if torch.is_tensor(v) else v
        for k, v in param_state.items()
        if k not in elementwise
    }
    for key, value in elementwise.items():
        entry[key] = value.detach().reshape(-1)[piece.start : piece.stop].clone()
    return entry
