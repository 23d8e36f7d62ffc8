"""What a plan is asked about: the world, the precision policy, the optimizer, the batch and
the communication options, each checked with a one-line error naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from ..averaging.streaming import (
    OUTER_COMPRESS,
    RECIPE,
    Streaming,
    check_streaming,
    short_run_recipe,
)
from ..strategies import Layout, LayoutError
from .errors import PlanError

# name -> (compute/param bytes, gradient bytes on the wire and in buckets, fp32 masters,
# autocast). What dataparallel/compose.py's PRECISIONS mean for the strategies' allocations.
PRECISIONS = {
    "fp32": (4, 4, False, False),
    "bf16": (4, 4, False, True),  # bf16 autocast: fp32 weights, gradients, state
    "bf16-params": (2, 2, True, False),
    "fp16": (2, 2, True, False),
}
# bytes of optimizer state per parameter (fp32): Adam's two moments, SGD's momentum buffer.
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd": 4}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "diloco")
COMPRESSORS = ("none", "powersgd", "topk", "int8", "fp8", "bf16")
LAYOUTS = ("dataparallel", "zero-paper")


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything but the model and the hardware.

    ranks: N, ranks in the job.
    precision: "fp32", "bf16" (autocast), "bf16-params" or "fp16" (dataparallel/compose.py, PRECISIONS).
    optimizer_bytes: bytes of optimizer state per parameter (adam/adamw 8, sgd 4).
    micro_batch: samples per rank per forward.
    accumulation: micro-batches per optimizer step.
    strategies: which strategies to plan (default: all).
    shard_sizes: shard sizes S to plan for the sharded strategies; None: every divisor of N.
    compress: a compressor for the cross-replica all-reduce ("none", "powersgd", "topk",
        "int8", "fp8", "bf16"); DDP's all-reduce counts as cross-replica.
    compress_arg: PowerSGD's rank r, or top-k's ratio rho.
    diloco_steps: H, inner steps between DiLoCo's outer all-reduces (of each fragment).
    fragments: F, the parts of the model synchronised in turn, each every H steps; RECIPE
        (-1): what `dataparallel train --diloco H` picks ([Note: the DiLoCo recipe] in
        averaging/streaming.py: 4 where that divides H); 1: the paper's DiLoCo.
    overlap: tau, inner steps each fragment's outer all-reduce runs behind; RECIPE: the
        recipe's (1 where the fragments leave room); 0: none.
    outer_compress: outer gradients on the wire, as `dataparallel train --outer-compress`
        spells it: "recipe" (int4, the default), "fp32", "bf16", "int8", "fp8" or "int4".
    activation_checkpointing: keep only each block's input and recompute the rest in
        backward (one more forward of compute).
    layout: "dataparallel" counts bytes as our strategies allocate them; "zero-paper" as
        Table 1 of Rajbhandari et al. 2020 does (model states only: 16-bit gradients and no
        fp32 gradient slice, no buckets).
    bucket_mb: gradient bucket MiB of DDP, ZeRO-1 and ZeRO-2; None: each policy's own
        default (25, 25 and 4).
    tp: tensor-parallel ranks T: the strategies run over ranks / T data-parallel ranks on the
        part of the model a rank holds ([Note: planner tensor parallelism]); 1: none.
    """

    ranks: int
    precision: str = "fp32"
    optimizer_bytes: float = 8.0
    micro_batch: int = 1
    accumulation: int = 1
    strategies: tuple[str, ...] = STRATEGIES
    shard_sizes: tuple[int, ...] | None = None
    compress: str = "none"
    compress_arg: float = 0.0
    diloco_steps: int = 100
    fragments: int = RECIPE
    overlap: int = RECIPE
    outer_compress: str = "recipe"
    activation_checkpointing: bool = False
    layout: str = "dataparallel"
    bucket_mb: float | None = None
    tp: int = 1

    def __post_init__(self):
        _count("--tp", self.tp, "give tensor-parallel ranks >= 1 (1: none)")
        _count(
            "--ranks",
            self.ranks,
            "give a positive number of ranks (or --nodes and --ranks-per-node)",
        )
        self.parallel_layout()  # --tp against --ranks ([Note: layout])
        _count("--micro-batch", self.micro_batch, "give samples per rank per forward, >= 1")
        _count("--accumulation", self.accumulation, "give micro-batches per step, >= 1")
        _count("--diloco-steps", self.diloco_steps, "give inner steps per outer step, >= 1")
        self.streaming()  # checks --fragments, --overlap and --outer-compress
        if self.precision not in PRECISIONS:
            raise PlanError(
                "--precision", f"unknown precision {self.precision!r}",
                f"choose one of {', '.join(PRECISIONS)}",
            )  # fmt: skip
        if not self.optimizer_bytes >= 0:
            raise PlanError(
                "--optimizer", f"{self.optimizer_bytes} bytes of state per parameter",
                "give adam, adamw, sgd or a number of bytes >= 0",
            )  # fmt: skip
        for name in self.strategies:
            if name not in STRATEGIES:
                raise PlanError(
                    "--strategy", f"unknown strategy {name!r}",
                    f"choose among {', '.join(STRATEGIES)}",
                )  # fmt: skip
        for s in self.shard_sizes or ():
            _count("--shard-size", s, f"give a divisor of --ranks {self.ranks}")
            self.parallel_layout(s)
        if self.compress not in COMPRESSORS:
            raise PlanError(
                "--compress", f"unknown compressor {self.compress!r}",
                f"choose one of {', '.join(COMPRESSORS)}",
            )  # fmt: skip
        if self.compress == "powersgd" and not (self.compress_arg >= 1):
            raise PlanError("--compress", "powersgd needs a rank", "write powersgd:4")
        if self.compress == "topk" and not 0 < self.compress_arg <= 1:
            raise PlanError("--compress", "topk needs a ratio in (0, 1]", "write topk:0.01")
        if self.layout not in LAYOUTS:
            raise PlanError(
                "--layout", f"unknown layout {self.layout!r}", f"choose {' or '.join(LAYOUTS)}"
            )
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise PlanError("--bucket-mb", f"{self.bucket_mb} MiB", "give a size > 0")

    def streaming(self) -> Streaming:
        """DiLoCo's streaming settings, as `dataparallel train --diloco H` resolves them."""
        if self.outer_compress not in OUTER_COMPRESS[:1] + OUTER_COMPRESS[2:]:
            raise PlanError(
                "--outer-compress", f"unknown format {self.outer_compress!r}",
                f"choose one of {', '.join(OUTER_COMPRESS[:1] + OUTER_COMPRESS[2:])}",
            )  # fmt: skip
        for field, value, least in (("--fragments", self.fragments, 1),
                                    ("--overlap", self.overlap, 0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < RECIPE:
                raise PlanError(field, f"must be an integer >= {least}, got {value!r}",
                                "give a count, or leave it out for the recipe's")  # fmt: skip
        settings = short_run_recipe(self.diloco_steps, self.fragments, self.overlap,
                                    self.outer_compress, warmup=0)  # fmt: skip
        try:
            check_streaming(self.diloco_steps, settings.fragments, settings.overlap, 0.5)
        except ValueError as error:
            field = "--overlap" if "overlap=" in str(error) else "--fragments"
            raise PlanError(field, str(error).removeprefix("diloco: "),
                            "see docs/compression.md, Streaming DiLoCo") from None  # fmt: skip
        return settings

    def parallel_layout(self, shard_size: int = 0, strategy: str = "zero3") -> Layout:
        """The layout a candidate trains on ([Note: layout] in
        strategies/parts/parallel_layout.py): --ranks, --tp, its shard size, DiLoCo's replicas
        averaged; a `PlanError` naming the flag when the degrees do not fit."""
        return plan_layout(self.ranks, self.tp, shard_size, strategy)

    @property
    def param_bytes(self) -> int:
        return PRECISIONS[self.precision][0]

    @property
    def grad_bytes(self) -> int:
        return PRECISIONS[self.precision][1]

    @property
    def masters(self) -> bool:
        return PRECISIONS[self.precision][2]

    @property
    def autocast(self) -> bool:
        return PRECISIONS[self.precision][3]


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
        raise PlanError(
            "--optimizer", f"unknown optimizer {name!r}",
            f"choose {', '.join(OPTIMIZERS)} or bytes of state per parameter (e.g. 12)",
        )  # fmt: skip
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
