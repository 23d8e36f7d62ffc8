"""The models and contenders of bench_step.py; a contender is `setup(model, world) -> Prepared`.

A setup wraps a freshly built model (same seed on every rank and for every contender) the way
its users would, builds fp32 AdamW (torch's defaults, lr 3e-4), and returns the step to time and
a way to count the bytes this rank holds. Peers are set up "as people use them": library
defaults, no tuning, so that a ratio against them compares against what one gets out of the box.

Memory is counted as distinct tensor storages (`tensor_bytes`): parameters, gradients and
optimizer state held between steps, not the transient peak inside a step (FSDP2's and ZeRO-3's
gathered parameters, activations), and not the process' resident size, which several contenders
sharing one process would blur.

With `--baseline REF`, `old-<name>` runs our contender `<name>` from the package of commit REF
(baseline.py), the same way through that package's own public API.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.models import GPT, MODEL_CONFIGS, GPTConfig, build_model
from dataparallel.strategies import POLICIES
from dataparallel.strategies.base import optimizer_state_tensors, tensor_bytes

LR = 3e-4


@dataclass
class Prepared:
    """A contender ready to run.

    step: one training step on (inputs, targets): zero_grad, forward, backward, optimizer step;
        returns the detached loss.
    memory: bytes this rank holds, as {"params", "grads", "optimizer_state"}.
    finish: waits for work a step left in flight (an overlapped parameter all-gather); the
        benchmark calls it, timed, before another contender runs.
    """

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    memory: Callable[[], dict[str, int]]
    finish: Callable[[], None] = lambda: None


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def plain_step(model, optimizer) -> Callable:
    # zero_grad comes first so that after a step the gradients are still there to be counted.
    # `mark(phase)` is called as each phase ends (bench_phases.py times them).
    def step(x, y, mark=lambda phase: None):
        optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")
        loss = lm_loss(model, x, y)
        mark("forward")
        loss.backward()
        mark("backward")
        optimizer.step()
        mark("step")
        return loss.detach()

    return step


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(params, optimizer, extra_grad_bytes: int = 0) -> dict[str, int]:
    params = list(params)
    return {
        "params": tensor_bytes(local(p.data) for p in params),
        "grads": tensor_bytes(local(p.grad) for p in params if p.grad is not None)
        + extra_grad_bytes,
        "optimizer_state": tensor_bytes(local(t) for t in optimizer_state_tensors(optimizer)),
    }


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


# -- the models -------------------------------------------------------------------------------
# dataparallel.models' GPTs, and one more: many small parameters and little arithmetic, so that
# a step is mostly the engine's per-parameter Python work (hooks, bucket and shard bookkeeping,
# the optimizer's loop over 388 tensors) rather than matrix products. Its step of 2 x 4 x 32
# tokens takes ~75 ms on one core of the 2-core VM, most of it per-operation overhead.
EXTRA_MODELS = {
    "gpt-deep-narrow": GPTConfig(n_layer=24, n_head=4, n_embd=64, block_size=32),  # ~1.22M
}
MODELS: dict[str, GPTConfig] = {
    **{name: c for name, c in MODEL_CONFIGS.items() if isinstance(c, GPTConfig)},
    **EXTRA_MODELS,
}


def bench_model(name: str) -> torch.nn.Module:
    """A fresh model by name (a key of MODELS), from the current torch seed."""
    return GPT(EXTRA_MODELS[name]) if name in EXTRA_MODELS else build_model(name)


# -- the contenders ---------------------------------------------------------------------------
def bound(model, world) -> Prepared:
    """The compute-only bound: every rank trains its own copy, no communication at all."""
    optimizer = adamw(model.parameters())
    return Prepared(plain_step(model, optimizer), lambda: held_bytes(model.parameters(), optimizer))


# Ours, by contender name: (strategy name, policy options, `parallelize` options). A table
# rather than closures over policy objects, so that `old-<name>` can build the same contender
# from the old package's own policy classes.
OURS: dict[str, tuple[str, dict, dict]] = {
    "ddp": ("ddp", {}, {}),
    "zero1": ("zero1", {}, {}),
    "zero1-overlap": ("zero1", {"overlap_param_gather": True}, {}),
    # gloo's own collectives instead of pairwise ones: all_reduce for the gradients, gloo's
    # all_gather for the parameters (what every stage did before [Note: pairwise collectives])
    "zero1-gloo": ("zero1", {}, {"pairwise": False}),
    "zero2": ("zero2", {}, {}),
    "zero2-overlap": ("zero2", {"overlap_param_gather": True}, {}),
    "zero2-gloo": ("zero2", {}, {"pairwise": False}),
    "zero3": ("zero3", {}, {}),
    "zero3-gloo": ("zero3", {}, {"pairwise": False}),
    # without the unit-order check ([Note: same units on every rank] in zero3/order.py): its cost
    "zero3-nocheck": ("zero3", {"check_order": "off"}, {}),
    # candidate defaults, measured in docs/zero3.md (#knobs-measured): every unit kept gathered
    # from its forward to its backward (one all-gather less per unit), and no prefetch
    "zero3-keep": ("zero3", {"reshard_after_forward": False}, {}),
    "zero3-noprefetch": ("zero3", {"prefetch": False}, {}),
    "zero3-prefetch2": ("zero3", {"prefetch": 2}, {}),
    # consecutive blocks grouped into units of at least this many parameters ([Note: grouped
    # units] in zero3/plan.py); gpt-deep-narrow's blocks hold ~50k each: 1 (the plan before
    # grouping), 2, 4 and 8 (the default) per unit
    "zero3-units0": ("zero3", {"min_unit_params": 0}, {}),
    "zero3-units100k": ("zero3", {"min_unit_params": 100_000}, {}),
    "zero3-units200k": ("zero3", {"min_unit_params": 200_000}, {}),
    "zero3-units400k": ("zero3", {"min_unit_params": 400_000}, {}),
    "zero3-units200k-keep": (
        "zero3",
        {"min_unit_params": 200_000, "reshard_after_forward": False},
        {},
    ),
}


def compile_blocks(model) -> None:
    """Compile each block in place (`Module.compile`): the form [Note: compile] in
    strategies/zero3/strategy.py recommends; a whole-model compile measures the same. Every
    round builds fresh models, each a recompile of the same code: dynamo's cache limit (8 per
    code object, then it silently runs eagerly) is raised so that every round is compiled."""
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    for block in model.blocks:
        block.compile()


def compiled(setup: Callable) -> Callable:
    """`setup` with the model's blocks compiled after it has wrapped the model."""

    def compiled_setup(model, world) -> Prepared:
        prepared = setup(model, world)
        compile_blocks(model)
        return prepared

    return compiled_setup


def ours(name: str, package=dp) -> Callable:
    """Our contender `name` (a key of OURS) through `package`'s public API: the current
    dataparallel, or an older one loaded by baseline.py."""
    strategy, policy_options, options = OURS[name]

    def setup(model, world) -> Prepared:
        policies = package.strategies.POLICIES
        if strategy not in policies:
            raise ValueError(f"{package.__name__} has no strategy {strategy!r}")
        policy = policies[strategy](**policy_options)
        package.parallelize(model, policy, group=world.group, **options)
        optimizer = package.build_optimizer(model, torch.optim.AdamW, lr=LR)
        # Older commits may lack finish_param_gather: nothing was left in flight then.
        finish = getattr(package, "finish_param_gather", lambda model: None)
        return Prepared(
            plain_step(model, optimizer),
            lambda: package.memory_report(model, optimizer),
            lambda: finish(model),
        )

    return setup


def old_contenders(package) -> dict[str, Callable]:
    """`old-<name>` for each of ours, run from `package` (the baseline's dataparallel)."""
    return {f"old-{name}": ours(name, package) for name in OURS}


def torch_ddp_buckets(model) -> int:
    # With the default gradient_as_bucket_view=False, torch's C++ reducer keeps flat buckets
    # as large as all gradients, beside the .grad tensors; they are not reachable from Python.
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def torch_ddp(model, world) -> Prepared:
    """torch.nn.parallel.DistributedDataParallel with its defaults (25 MiB buckets)."""
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=world.group)
    optimizer = adamw(wrapped.parameters())
    return Prepared(
        plain_step(wrapped, optimizer),
        lambda: held_bytes(model.parameters(), optimizer, torch_ddp_buckets(model)),
    )


def zero_redundancy(model, world) -> Prepared:
    """torch's ZeroRedundancyOptimizer over AdamW, with torch DDP for the gradients."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=world.group)
    optimizer = ZeroRedundancyOptimizer(
        wrapped.parameters(), optimizer_class=torch.optim.AdamW, process_group=world.group, lr=LR
    )

    # The optimizer state lives in the local optimizer `.optim`, over this rank's shard only.
    return Prepared(
        plain_step(wrapped, optimizer),
        lambda: held_bytes(model.parameters(), optimizer.optim, torch_ddp_buckets(model)),
    )


def fsdp2(model, world) -> Prepared:
    """FSDP2: `fully_shard` on each transformer block, then on the root (its documented use)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(world.group, world.device.type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model.parameters())
    return Prepared(plain_step(model, optimizer), lambda: held_bytes(model.parameters(), optimizer))


def deepspeed_zero(stage: int) -> Callable:
    """DeepSpeed's ZeRO stage `stage`, fp32, torch's AdamW as the client optimizer."""

    def setup(model, world) -> Prepared:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the benchmark runs on CPU, gloo
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend=dist.get_backend(world.group))
        # DeepSpeed's defaults otherwise, as people start from them; note that ZeRO-3 then
        # allocates its reduce bucket at reduce_bucket_size (5e8 elements, 1.9 GiB in fp32).
        config = {
            # DeepSpeed reads the batch size only for its own data loader and throughput logs;
            # the benchmark feeds the batches itself.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
        }
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters()), config=config
        )

        def step(x, y):
            loss = lm_loss(engine, x, y)
            engine.backward(loss)
            engine.step()  # steps the optimizer and zeroes the gradients
            return loss.detach()

        return Prepared(step, lambda: deepspeed_bytes(model, optimizer))

    return setup


def reachable_tensors(obj, depth: int = 3, seen: set | None = None) -> list[torch.Tensor]:
    """Tensors held by `obj`'s attributes, lists and dicts, `depth` levels down."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in reachable_tensors(child, depth - 1, seen)]


def deepspeed_bytes(model, zero_optimizer) -> dict[str, int]:
    """Best effort: DeepSpeed's flat buffers are private, so walk the ZeRO optimizer's tensors.

    params: the model's parameters (their ZeRO-3 partitions `ds_tensor` where partitioned);
    optimizer_state: the inner optimizer's state and its fp32 master partitions;
    grads: every other tensor the ZeRO optimizer holds (gradient partitions and buffers).
    """
    params = [getattr(p, "ds_tensor", p.data) for p in model.parameters()]
    inner = zero_optimizer.optimizer
    master = [p for g in inner.param_groups for p in g["params"]]
    state = optimizer_state_tensors(inner) + master
    everything = reachable_tensors(zero_optimizer) + params + state
    total, param_bytes = tensor_bytes(everything), tensor_bytes(params)
    state_bytes = tensor_bytes(params + state) - param_bytes
    return {
        "params": param_bytes,
        "grads": total - param_bytes - state_bytes,
        "optimizer_state": state_bytes,
    }


# -- the registry -----------------------------------------------------------------------------
CONTENDERS: dict[str, Callable] = {
    "bound": bound,
    "ddp": ours("ddp"),
    "torch-ddp": torch_ddp,
    "zero1": ours("zero1"),
    "zero-redundancy": zero_redundancy,
    "deepspeed-zero1": deepspeed_zero(1),
    "zero1-overlap": ours("zero1-overlap"),
    "zero1-gloo": ours("zero1-gloo"),
    "zero2": ours("zero2"),
    "zero2-overlap": ours("zero2-overlap"),
    "zero2-gloo": ours("zero2-gloo"),
    "deepspeed-zero2": deepspeed_zero(2),
    "zero3": ours("zero3"),
    "zero3-gloo": ours("zero3-gloo"),
    "zero3-nocheck": ours("zero3-nocheck"),
    "zero3-keep": ours("zero3-keep"),
    "zero3-noprefetch": ours("zero3-noprefetch"),
    "zero3-prefetch2": ours("zero3-prefetch2"),
    **{name: ours(name) for name in OURS if name.startswith("zero3-units")},
    "fsdp2": fsdp2,
    "deepspeed-zero3": deepspeed_zero(3),
    # torch.compile per block after wrapping, against the eager contender of the same name
    **{
        f"{name}-compiled": compiled(CONTENDER)
        for name, CONTENDER in (
            ("bound", bound),
            ("ddp", ours("ddp")),
            ("torch-ddp", torch_ddp),
            ("zero1", ours("zero1")),
            ("zero2", ours("zero2")),
            ("zero3", ours("zero3")),
            ("fsdp2", fsdp2),
        )
    },
}
# The old twins that `--contenders all` adds when there is a --baseline.
OLD_IN_ALL = ("old-ddp", "old-zero1", "old-zero2", "old-zero3")

# ours -> the peers it is compared with.
PEERS = {
    "ddp": ["torch-ddp"],
    "zero1": ["zero1-gloo", "zero-redundancy", "deepspeed-zero1"],
    "zero1-overlap": ["zero1", "zero-redundancy", "deepspeed-zero1"],
    "zero2": ["zero2-gloo", "deepspeed-zero2"],
    "zero2-overlap": ["zero2", "deepspeed-zero2"],
    "zero3": ["zero3-gloo", "fsdp2", "deepspeed-zero3"],
    **{f"{name}-compiled": [name] for name in ("ddp", "zero1", "zero2", "zero3")},
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def unavailable(name: str) -> str | None:
    """Why contender `name` cannot run here, or None when it can."""
    if name in ("zero1", "zero2", "zero3") and name not in POLICIES:
        return f"dataparallel has no strategy {name!r} yet (not in strategies.POLICIES)"
    if name == "zero-redundancy" and not _importable("torch.distributed.optim"):
        return "torch.distributed.optim is not available"
    if name == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            return f"torch.distributed.fsdp.fully_shard is not available ({exc})"
    if name.startswith("deepspeed-") and not _importable("deepspeed"):
        return "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"
    return None
