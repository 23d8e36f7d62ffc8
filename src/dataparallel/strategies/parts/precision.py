"""The mixed-precision policy every strategy takes, and the casts it implies at the forward.

[Note: mixed precision] One policy, the same fields for DDP, ZeRO-1/2 and ZeRO-3 (FSDP2's
`MixedPrecisionPolicy` is the peer):
- parameters are held for compute in `param_dtype`; when that is narrower than the model's own
  dtype (bf16 or fp16 on an fp32 model), the strategy keeps fp32 master weights in its shards
  (the whole model, for DDP) and the optimizer and its state live on the masters;
- gradients are accumulated (under `no_sync`) and reduced in `reduce_dtype`: when it is wider
  than `param_dtype` the buckets hold it and each gradient is added in; when narrower, the
  buckets hold the parameters' dtype and only the wire carries `reduce_dtype`
  (`low_precision_hook`); the reduced gradient is kept in the masters' dtype;
- floating inputs are cast to `param_dtype` on the way into the model (and into each ZeRO-3
  unit), floating outputs to `output_dtype` on the way out;
- normalisation layers with running statistics (every `_BatchNorm`, our `SyncBatchNorm`
  included) stay in fp32, parameters and buffers, and run in fp32: their input is cast up and
  their output back to `param_dtype`. That is the AMP convention and FSDP2's: statistics summed
  over a batch in bf16 lose the digits the running averages need.
float16 overflows where bf16 does not: train it with a loss scaler (`torch.amp.GradScaler`
works with every strategy's optimizer; [Note: found inf] in round.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...torch_internals import BatchNormBase, tree_map

FLOATS = (None, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Which dtypes a strategy computes, reduces and returns in ([Note: mixed precision]).

    param_dtype: the dtype forward and backward compute with; None keeps the model's own.
        Narrower than the model's dtype, the strategy keeps fp32 master weights for the
        optimizer.
    reduce_dtype: the dtype gradients are accumulated and reduced in; None is `param_dtype`
        (or the model's dtype).
    output_dtype: the dtype the model's floating outputs are cast to; None leaves them.
    cast_forward_inputs: cast the floating tensors passed to the model (and to each ZeRO-3
        unit) to `param_dtype`, so an fp32 batch feeds a bf16 model.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value not in FLOATS:
                raise ValueError(
                    f"MixedPrecision: {field}={value!r} must be None, torch.float32, "
                    "torch.bfloat16 or torch.float16"
                )

    def compute_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or model_dtype

    def masters(self, model_dtype: torch.dtype) -> torch.dtype | None:
        """The master weights' dtype for parameters of `model_dtype`, or None (no masters)."""
        compute = self.compute_dtype(model_dtype)
        if compute != model_dtype and compute.itemsize < model_dtype.itemsize:
            return model_dtype
        return None

    def bucket_dtype(self, compute: torch.dtype) -> torch.dtype:
        """What gradient buckets hold: the wider of the compute and reduce dtypes."""
        reduce = self.reduce_dtype or compute
        return reduce if reduce.itemsize > compute.itemsize else compute

    def wire_dtype(self, compute: torch.dtype) -> torch.dtype | None:
        """A dtype narrower than the bucket's to send gradients in, or None."""
        reduce = self.reduce_dtype or compute
        return reduce if reduce.itemsize < self.bucket_dtype(compute).itemsize else None


FULL = MixedPrecision()


def is_norm(module: nn.Module) -> bool:
    """Normalisation layers held and run in fp32 ([Note: mixed precision])."""
    return isinstance(module, BatchNormBase)


def cast_floats(tree, dtype: torch.dtype | None):
    """Every floating tensor of a nest of args cast to `dtype` (None: unchanged)."""
    if dtype is None:
        return tree

    def cast(t):
        if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast, tree)


def install_casts(
    model: nn.Module, policy: MixedPrecision, compute: torch.dtype, held: torch.dtype
) -> list:
    """Forward hooks for the policy's casts: inputs to `compute` at the model, outputs to
    `output_dtype`, and `held` (the model's own dtype, the masters') around every
    normalisation layer when the policy computes in a narrower one. Returns the handles (none
    for a policy that changes nothing)."""
    handles = []
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        handles.append(
            model.register_forward_pre_hook(
                lambda m, args, kwargs: cast_floats((args, kwargs), compute), with_kwargs=True
            )
        )
    if policy.output_dtype is not None:
        handles.append(
            model.register_forward_hook(lambda m, a, out: cast_floats(out, policy.output_dtype))
        )
    if policy.masters(held) is not None:
        for module in model.modules():
            if is_norm(module):
                handles.append(
                    module.register_forward_pre_hook(lambda m, args: cast_floats(args, held))
                )
                handles.append(
                    module.register_forward_hook(lambda m, a, out: cast_floats(out, compute))
                )
    return handles


def norm_params(model: nn.Module) -> set[int]:
    """ids of the parameters of normalisation layers (held in fp32)."""
    return {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}


def check_precision(policy, who: str) -> MixedPrecision:
    """The policy's `precision` field, checked and resolved ([Note: full precision]).

    [Note: full precision] A policy's `precision=None` means full precision: the model's own
    dtype, no masters, no casts. It is mapped to `MixedPrecision()` (FULL) here, once, by each
    policy's `__post_init__` (DDP, ZeRO1/2, ZeRO3), which keeps the result in its field; the
    strategies, policy resolution and the footprints then read a `MixedPrecision`, never None.
    """
    if policy is None:
        return FULL
    if not isinstance(policy, MixedPrecision):
        raise ValueError(
            f"{who}: precision={policy!r} must be a dataparallel.MixedPrecision or None"
        )
    return policy


@dataclass(frozen=True)
class Precision:
    """What a precision name means, for the engine (`dp.Recipe.precision`, `dp.compose`) and
    the planner alike: one table, `PRECISIONS`; the byte counts follow from the dtypes.

    policy: the strategy's `MixedPrecision`, or None (the model's own fp32 parameters).
    autocast: the forward's autocast dtype, or None.
    scaling: whether a loss scaler runs (`torch.amp.GradScaler`, for fp16).
    """

    policy: MixedPrecision | None
    autocast: torch.dtype | None = None
    scaling: bool = False

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter the strategy computes with (its buckets' parameters)."""
        return self._compute.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient value in the buckets and on the wire."""
        if self.policy is None:
            return self._compute.itemsize
        return self.policy.bucket_dtype(self._compute).itemsize

    @property
    def masters(self) -> bool:
        """Whether fp32 master weights are kept beside the parameters (for the optimizer)."""
        return self.policy is not None and self.policy.masters(torch.float32) is not None

    @property
    def _compute(self) -> torch.dtype:
        return self.policy.compute_dtype(torch.float32) if self.policy else torch.float32


# --precision name -> what it means ([Note: mixed precision]); fp32 models throughout
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(None),
    "bf16": Precision(None, autocast=torch.bfloat16),  # fp32 weights, gradients and state
    "bf16-params": Precision(MixedPrecision(param_dtype=torch.bfloat16)),
    "fp16": Precision(MixedPrecision(param_dtype=torch.float16), scaling=True),
}
