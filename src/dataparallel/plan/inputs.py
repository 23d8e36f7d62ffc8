"""What a plan is asked about: the recipe (`dp.Recipe`, whose rules are the engine's), the
world, the optimizer, the batch and the candidates, each checked with a one-line error naming
the flag."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..averaging import OuterSettings
from ..compression import COMPRESSORS as ENGINE_COMPRESSORS
from ..recipe import Recipe, RecipeError
from ..strategies import POLICIES, PRECISIONS, Layout, LayoutError, Precision
from .errors import PlanError

# bytes of optimizer state per parameter (fp32): Adam's two moments, SGD's momentum buffer.
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd": 4}
# the candidates: the engine's strategies, and DiLoCo (ZeRO-3 inside averaged replicas)
STRATEGIES = (*POLICIES, "diloco")
# the engine's compressors, fp16 counted as bf16 (the same two bytes a value)
COMPRESSORS = ("none", *ENGINE_COMPRESSORS, "bf16")
LAYOUTS = ("dataparallel", "zero-paper")
DILOCO_STEPS = 100  # DiLoCo's H when the recipe gives none
# a Recipe field -> the planner's flag, where the two are not spelled alike
FLAGS = {"diloco": "--diloco-steps"}


def flag_of(name: str) -> str:
    """The `dataparallel plan` flag of a `dp.Recipe` field."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def plan_recipe(**fields) -> Recipe:
    """The `dp.Recipe` the planner is asked about, its `RecipeError` as a `PlanError` naming
    the planner's flag ([Note: one home for the recipe's rules] in dataparallel/recipe.py)."""
    try:
        return Recipe(**fields)
    except RecipeError as error:
        raise recipe_error(error) from None


def recipe_error(error: RecipeError) -> PlanError:
    problem, fix = error.spelled({name: flag_of(name) for name in Recipe.__dataclass_fields__})
    return PlanError(flag_of(error.field), problem, fix)


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything but the model and the hardware: the recipe, the world and the candidates.

    ranks: N, ranks in the job.
    recipe: what the job would compose (`dp.Recipe`, each rule there): its precision, tp
        (tensor-parallel ranks T: the strategies run over N / T data-parallel ranks on the part
        of the model a rank holds, [Note: planner tensor parallelism]) and
        activation_checkpointing (one more forward of compute); for the DiLoCo candidates its
        diloco H (inner steps between outer all-reduces of each fragment; DILOCO_STEPS when
        0), fragments, overlap and outer_compress, resolved as `dataparallel train --diloco H`
        resolves them ([Note: the DiLoCo recipe] in averaging/streaming.py).
    optimizer_bytes: bytes of optimizer state per parameter (adam/adamw 8, sgd 4).
    micro_batch: samples per rank per forward.
    accumulation: micro-batches per optimizer step.
    strategies: which candidates to plan (default: all of STRATEGIES).
    shard_sizes: shard sizes S to plan for the sharded strategies; None: every divisor of N.
    compress: a compressor for the cross-replica all-reduce of the candidates without an
        averager (COMPRESSORS); DDP's all-reduce counts as cross-replica.
    compress_arg: PowerSGD's rank r, or top-k's ratio rho.
    layout: "dataparallel" counts bytes as our strategies allocate them; "zero-paper" as
        Table 1 of Rajbhandari et al. 2020 does (model states only: 16-bit gradients and no
        fp32 gradient slice, no buckets).
    bucket_mb: gradient bucket MiB of DDP, ZeRO-1 and ZeRO-2; None: each policy's own
        default (25, 25 and 4).
    inner: the inner optimizer's row of DiLoCo's outer settings, "adamw" or "muon" ([Note:
        the outer learning rate] in averaging/outer_settings.py).
    """

    ranks: int
    recipe: Recipe = Recipe(diloco=DILOCO_STEPS)
    optimizer_bytes: float = 8.0
    micro_batch: int = 1
    accumulation: int = 1
    strategies: tuple[str, ...] = STRATEGIES
    shard_sizes: tuple[int, ...] | None = None
    compress: str = "none"
    compress_arg: float = 0.0
    layout: str = "dataparallel"
    bucket_mb: float | None = None
    inner: str = "adamw"

    def __post_init__(self):
        _count(
            "--ranks",
            self.ranks,
            "give a positive number of ranks (or --nodes and --ranks-per-node)",
        )
        self.parallel_layout()  # --tp against --ranks ([Note: layout])
        _count("--micro-batch", self.micro_batch, "give samples per rank per forward, >= 1")
        _count("--accumulation", self.accumulation, "give micro-batches per step, >= 1")
        self.streaming()  # the DiLoCo candidates' recipe: --fragments, --overlap, ...
        if not self.optimizer_bytes >= 0:
            fix = "give adam, adamw, sgd or a number of bytes >= 0"
            raise PlanError(
                "--optimizer", f"{self.optimizer_bytes} bytes of state per parameter", fix
            )
        _choose("--strategy", self.strategies, STRATEGIES)
        for s in self.shard_sizes or ():
            _count("--shard-size", s, f"give a divisor of --ranks {self.ranks}")
            self.parallel_layout(s)
        _choose("--compress", (self.compress,), COMPRESSORS)
        if self.compress == "powersgd" and not (self.compress_arg >= 1):
            raise PlanError("--compress", "powersgd needs a rank", "write powersgd:4")
        if self.compress == "topk" and not 0 < self.compress_arg <= 1:
            raise PlanError("--compress", "topk needs a ratio in (0, 1]", "write topk:0.01")
        _choose("--layout", (self.layout,), LAYOUTS)
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise PlanError("--bucket-mb", f"{self.bucket_mb} MiB", "give a size > 0")

    def streaming(self):
        """DiLoCo's streaming settings, as `dataparallel train --diloco H` resolves them."""
        try:
            return replace(self.recipe, diloco=self.diloco_steps, compress="").streaming
        except RecipeError as error:
            raise recipe_error(error) from None

    def outer(self, shard_size: int) -> OuterSettings:
        """DiLoCo's outer settings for the candidate over replicas of `shard_size` ranks, as
        `dataparallel train` resolves them (given, or chosen for the run)."""
        replicas = self.parallel_layout(shard_size, "diloco").replicas
        return replace(self.recipe, diloco=self.diloco_steps).outer(replicas, self.inner)

    def parallel_layout(self, shard_size: int = 0, strategy: str = "zero3") -> Layout:
        """The layout a candidate trains on ([Note: layout] in
        strategies/parts/parallel_layout.py): --ranks, --tp, its shard size, DiLoCo's replicas
        averaged; a `PlanError` naming the flag when the degrees do not fit."""
        return plan_layout(self.ranks, self.tp, shard_size, strategy)

    # the recipe's fields the planner reads, by the names it reads them
    precision = property(lambda self: self.recipe.precision)
    tp = property(lambda self: self.recipe.tp)
    activation_checkpointing = property(lambda self: self.recipe.activation_checkpointing)
    diloco_steps = property(lambda self: self.recipe.diloco or DILOCO_STEPS)

    @property
    def numbers(self) -> Precision:
        """The precision's entry in the one table (`dp.PRECISIONS`): its byte counts."""
        return PRECISIONS[self.precision]

    param_bytes = property(lambda self: self.numbers.param_bytes)
    grad_bytes = property(lambda self: self.numbers.grad_bytes)
    masters = property(lambda self: self.numbers.masters)
    autocast = property(lambda self: self.numbers.autocast is not None)

    @property
    def compute(self) -> torch.dtype:
        """The dtype parameters are held in for compute (fp32 under fp32 and bf16 autocast)."""
        if self.precision == "fp16":
            return torch.float16
        return torch.float32 if self.param_bytes == 4 else torch.bfloat16


def _choose(flag: str, given, known) -> None:
    for name in given:
        if name not in known:
            raise PlanError(flag, f"unknown value {name!r}", f"choose one of {', '.join(known)}")


def plan_layout(ranks: int, tp: int = 1, shard_size: int = 0, strategy: str = "zero3") -> Layout:
    """The `dp.Layout` of `strategy` on --ranks, --tp and --shard-size (DiLoCo's replicas
    averaged); a `PlanError` naming the flag when the degrees do not fit."""
    try:
        return Layout(ranks, tp, shard_size, strategy != "ddp", strategy == "diloco")
    except LayoutError as error:
        flag = {"world": "--ranks", "tp": "--tp", "shard_size": "--shard-size"}[error.field]
        raise PlanError(flag, error.problem, error.fix) from None


def _count(field: str, value, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(field, f"must be a positive integer, got {value!r}", fix)


def optimizer_bytes(name: str) -> float:
    """Bytes of state per parameter for an optimizer name or a number."""
    if name in OPTIMIZERS:
        return float(OPTIMIZERS[name])
    try:
        value = float(name)
    except ValueError:
        value = -1.0
    if not value >= 0:
        known = ", ".join(OPTIMIZERS)
        fix = f"choose {known} or bytes of state per parameter (e.g. 12)"
        raise PlanError("--optimizer", f"unknown optimizer {name!r}", fix)
    return value


def parse_compress(text: str) -> tuple[str, float]:
    """The `dataparallel train --compress` spec ("powersgd:rank=4,start=10", "topk:ratio=0.01",
    "int8", "fp8", "bf16"; compression/hook.py parses it), or the short "powersgd:4" /
    "topk:0.01", or "none" -> (kind, PowerSGD's rank or top-k's ratio, else 0)."""
    from ..compression import SPEC_HELP, parse_spec
    from ..compression.hook import SPEC_DEFAULTS

    kind, _, rest = text.partition(":")
    if kind == "none" and not rest:
        return "none", 0.0
    if rest and "=" not in rest:  # the short form
        if kind not in ("powersgd", "topk"):
            raise PlanError("--compress", f"{kind!r} takes no number", f"write {SPEC_HELP}")
        try:
            return kind, float(rest)
        except ValueError:
            raise PlanError("--compress", f"{rest!r} is not a number", "write powersgd:4") from None
    try:
        kind, options = parse_spec(text)
    except ValueError as error:
        raise PlanError("--compress", str(error), f"write {SPEC_HELP}") from None
    if kind == "fp16":
        kind = "bf16"  # the same two bytes a value
    options = {**SPEC_DEFAULTS.get(kind, {}), **options}  # what the train run would use
    return kind, float(options.get("rank", 1) if kind == "powersgd" else options.get("ratio", 0))
