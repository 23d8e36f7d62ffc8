"""The recipe: what `dp.compose` is asked for (tensor parallelism, activation checkpointing,
compile, strategy, mesh, precision, compression, averager), and every rule on it, in one home
([Note: one home for the recipe's rules]).

`Recipe` checks its fields on construction and `check_recipe` the rules that need the model,
each raising a `RecipeError` that names its field; `dataparallel train` maps the field to its
flag (train/sync.py) and writes no rule of its own. compose.py builds what a recipe says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .activation_checkpointing import check_checkpointable
from .averaging.outer_settings import CHOSEN, OuterSettings, choose_outer
from .averaging.streaming import (
    OUTER_COMPRESS,
    RECIPE,
    Streaming,
    check_streaming,
    short_run_recipe,
)
from .compression import SPEC_HELP, PowerSGD, build_hook, parse_spec
from .strategies import DDP, POLICIES, PRECISIONS, Layout, LayoutError, resolve_policy

# PRECISIONS: a precision's name -> its `Precision` (strategies/parts/precision.py), the one
# table the engine and the planner read
STRATEGIES = tuple(POLICIES)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What to compose ([Note: composition]). Every field but `compile` has a CLI flag, most
    of the same name (train/sync.py FIELDS: `tp` is --tp, `shard_size` --shard-group).

    tp: tensor-parallel ranks: above 1, `compose` splits the model over a "tp" dimension of
        that many ranks with the model's own plan (its `tensor_parallel_plan(tp)`, which the
        reference GPT has) and runs everything below over the "dp" dimension; 1: off.
    activation_checkpointing: recompute each block's activations in backward
        (`dp.checkpoint_activations`: a Hugging Face model's decoder layers, else every child
        of an `nn.ModuleList`).
    compile: `torch.compile` each block (as `checkpoint_activations` selects them; the whole
        model when it has none), as torchtitan does: a block's forward is one graph under
        every strategy ([Note: compile] in strategies/zero3/strategy.py).

    strategy: "ddp", "zero1", "zero2", "zero3", or a policy object (`dp.ZeRO3(wrap=...)`),
        whose precision and communication hook this recipe's fields replace.
    shard_size: ranks per shard group: a 2-D replicate x shard mesh (HSDP) when it is between
        1 and the world size; 0 shards over every rank. With an averager: the ranks of one
        replica (0 or 1: every rank is its own replica).
    precision: "fp32"; "bf16" (autocast, fp32 weights); "bf16-params" (bf16 parameters and
        communication, fp32 masters and optimizer state); "fp16" (the same in float16, with
        dynamic loss scaling by `torch.amp.GradScaler`).
    compress: a compressor spec for the cross-replica gradient reduction ("powersgd:rank=4",
        "topk:ratio=0.01", "int8", "fp8", "bf16"); "" for none.
    local_sgd: average the replicas' parameters every H optimizer steps (0: off).
    diloco: DiLoCo every H optimizer steps (0: off), with an outer Nesterov SGD of
        `outer_lr` and `outer_momentum`, streamed as the recipe says unless the fields below
        are given ([Note: the DiLoCo recipe] in averaging/streaming.py).
    outer_lr, outer_momentum: DiLoCo's outer learning rate and Nesterov momentum (0: plain
        SGD); CHOSEN (-1): chosen for the run from the replicas, H and the inner optimizer
        (`outer`; [Note: the outer learning rate] in averaging/outer_settings.py).
    outer_compress: DiLoCo's outer gradients on the wire: "recipe" (the recipe's: "int4"),
        "" or "fp32", "bf16", "int8", "fp8" or "int4".
    fragments, overlap, mix: Streaming DiLoCo ([Note: streaming DiLoCo] in averaging/diloco.py): F
        fragments synchronised in turn, each outer all-reduce applied `overlap` inner steps
        later, the fragment then mixed as mix x local + (1 - mix) x the outer result;
        fragments and overlap RECIPE (-1): the recipe's for H.
    outer_warmup: DiLoCo's first steps that average the replicas after every step; RECIPE
        (-1): the recipe's, the longer of `lr_warmup` and run_steps / 10. Fragments 1,
        overlap 0, outer_warmup 0 and "fp32" are DiLoCo as in the paper.
    lr_warmup: the learning rate's warm-up steps (what the recipe's DiLoCo warm-up lasts at
        least; `dataparallel train` gives its --warmup-steps).
    run_steps: the run's optimizer steps (0: not known); the recipe's DiLoCo warm-up lasts a
        tenth of them when that is longer than `lr_warmup` (`dataparallel train` gives --steps).
    elastic: the replicas may change while training (`dataparallel train --recovery live`):
        with a shard_size above 1 the 2-D mesh is built even with one replica, and built
        elastic, so that `dp.rebind` can move the model to the next generation's mesh.
    """

    tp: int = 1
    activation_checkpointing: bool = False
    compile: bool = False
    strategy: object = "ddp"
    shard_size: int = 0
    precision: str = "fp32"
    compress: str = ""
    local_sgd: int = 0
    diloco: int = 0
    outer_lr: float = CHOSEN
    outer_momentum: float = CHOSEN
    outer_compress: str = "recipe"
    fragments: int = RECIPE
    overlap: int = RECIPE
    mix: float = 0.5
    outer_warmup: int = RECIPE
    lr_warmup: int = 30
    run_steps: int = 0
    elastic: bool = False

    def __post_init__(self):
        # [Note: one home for the recipe's rules] Every rule on these fields is here (and, for
        # the ones that need the model, in `check_recipe`), raising a `RecipeError` that names
        # its field; `dataparallel train` maps the field to its flag (train/sync.py FIELDS)
        # and writes no rule of its own on [sync]. (Its checks of --strategy and --precision
        # as choices, train/checks.py, run first, in the words its tests pin.)
        if isinstance(self.strategy, str) and self.strategy not in POLICIES:
            _bad("strategy", f"{self.strategy!r} is unknown", f"choose one of {STRATEGIES}")
        if self.precision not in PRECISIONS:
            _bad(
                "precision", f"{self.precision!r} is unknown", f"choose one of {tuple(PRECISIONS)}"
            )
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            _bad("tp", f"{self.tp!r} is not an integer >= 1", "give 1 (off) or more ranks")
        for name in ("activation_checkpointing", "compile"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, f"{getattr(self, name)!r} is not True or False", "give a bool")
        if self.shard_size < 0:
            _bad("shard_size", f"{self.shard_size} is negative", "give 0 (off) or more")
        for name in ("local_sgd", "diloco"):
            if getattr(self, name) < 0:
                _bad(name, f"{getattr(self, name)} is below 1", "give H >= 1 steps, or 0 for off")
        if self.local_sgd and self.diloco:
            _bad(
                "diloco",
                "local SGD and DiLoCo are both asked for",
                "choose one: {local_sgd} H or {diloco} H",
            )
        if not (self.outer_lr > 0 or self.outer_lr == CHOSEN):
            _bad("outer_lr", f"{self.outer_lr} is not positive", "use e.g. 0.7, or -1 for chosen")
        if not (0 <= self.outer_momentum < 1 or self.outer_momentum == CHOSEN):
            _bad(
                "outer_momentum",
                f"{self.outer_momentum} is outside [0, 1)",
                "use e.g. 0.9, 0 for plain SGD, or -1 for chosen",
            )
        if self.outer_compress not in OUTER_COMPRESS:
            _bad(
                "outer_compress",
                f"{self.outer_compress!r} is unknown",
                "choose recipe, fp32, bf16, int8, fp8 or int4",
            )
        if self.outer_compress not in ("recipe", "") and not self.diloco:
            _bad(
                "outer_compress",
                "only DiLoCo has outer gradients",
                "add {diloco} H, or drop {outer_compress}",
            )
        self._check_streaming()
        self._check_compress()

    def _check_streaming(self) -> None:
        """fragments, overlap, mix and outer_warmup against diloco ([Note: streaming DiLoCo])."""
        if not self.diloco:
            for name, off in (("fragments", 1), ("overlap", 0), ("outer_warmup", 0)):
                if getattr(self, name) not in (RECIPE, off):
                    _bad(
                        name,
                        "only DiLoCo streams fragments",
                        f"add {{diloco}} H, or drop {{{name}}}",
                    )
        for name, fix in (
            ("lr_warmup", "give the LR's warm-up steps"),
            ("run_steps", "give the run's steps, or 0"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _bad(name, f"{value!r} is not an integer >= 0", fix)
        if not self.diloco:
            return
        if self.outer_warmup < RECIPE:
            _bad(
                "outer_warmup",
                f"{self.outer_warmup} is negative",
                "give N >= 0, or -1 for the recipe's",
            )
        streaming = self.streaming
        try:
            check_streaming(self.diloco, streaming.fragments, streaming.overlap, self.mix)
        except ValueError as error:
            text = str(error).removeprefix("diloco: ")
            _bad(text.split("=", 1)[0], text, "see docs/compression.md")  # the field it names

    def _check_compress(self) -> None:
        """compress: a spec the compressors accept, and only where gradients cross replicas."""
        if not self.compress:
            return
        if self.averaging:
            _bad(
                "compress",
                "gradients are reduced only inside a replica under local SGD or DiLoCo",
                "drop {compress}; compress DiLoCo's outer gradients with {outer_compress}",
            )
        try:
            parse_spec(self.compress)
            build_hook(self.compress)  # the compressors check their own options
        except ValueError as error:
            _bad("compress", str(error), f"write it as {SPEC_HELP}")

    @property
    def streaming(self) -> Streaming:
        """DiLoCo's streaming settings, the recipe's where not given ([Note: the DiLoCo
        recipe])."""
        return short_run_recipe(
            self.diloco,
            self.fragments,
            self.overlap,
            self.outer_compress,
            self.outer_warmup,
            self.lr_warmup,
            self.run_steps,
        )

    def outer(self, replicas: int, inner: str = "adamw") -> OuterSettings:
        """DiLoCo's outer settings over `replicas` replicas under the `inner` optimizer
        ("adamw", "muon"): `outer_lr` and `outer_momentum` where given, the table's where
        CHOSEN ([Note: the outer learning rate] in averaging/outer_settings.py)."""
        s = self.streaming
        streamed = s.fragments > 1 or s.overlap > 0
        return choose_outer(
            replicas, self.diloco, inner, self.outer_lr, self.outer_momentum, streamed
        )

    @property
    def averaging(self) -> bool:
        return bool(self.local_sgd or self.diloco)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision].autocast

    def layout(self, world_size: int) -> Layout:
        """The parallel layout this recipe gives a world of `world_size` ranks ([Note: layout]
        in strategies/parts/parallel_layout.py); a `RecipeError` naming `tp` or `shard_size`
        when the degrees do not fit it."""
        sharded = not isinstance(resolve_policy(self.strategy), DDP)
        try:
            return Layout(world_size, self.tp, self.shard_size, sharded, self.averaging)
        except LayoutError as error:
            raise RecipeError(error.field, error.problem, error.fix) from None

    def policy(self):
        """The strategy's policy with this recipe's precision and communication hook."""
        hook = build_hook(self.compress) if self.compress else None
        policy = resolve_policy(self.strategy)
        return replace(policy, precision=PRECISIONS[self.precision].policy, comm_hook=hook)


class RecipeError(ValueError):
    """A recipe that cannot compose: `field` (a `Recipe` field), the problem and the fix.

    The problem and the fix name other fields as "{name}": `str(error)` spells them as the
    recipe's fields ("Recipe.diloco: ...; choose one: local_sgd H or diloco H"), `spelled`
    as a caller's (`dataparallel train` gives its flags: "--local-sgd H or --diloco H").
    """

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem_text, self.fix_text = field, problem, fix
        problem, fix = self.spelled({})
        super().__init__(f"Recipe.{field}: {problem}; {fix}")

    def spelled(self, names: dict[str, str]) -> tuple[str, str]:
        """The problem and the fix, each "{field}" written as names[field] (else field)."""
        spell = _Names(names)
        return self.problem_text.format_map(spell), self.fix_text.format_map(spell)


class _Names(dict):
    def __missing__(self, key: str) -> str:
        return key


def _bad(field_name: str, problem: str, fix: str) -> None:
    raise RecipeError(field_name, problem.replace("{", "{{").replace("}", "}}"), fix)


def check_recipe(recipe: Recipe, model: nn.Module, world_size: int | None = None) -> None:
    """The recipe's rules that need the model, or the world's size when given (a `RecipeError`
    naming the field); `compose` calls it first, `dataparallel train` before it launches (on
    the model built on the meta device: only dtypes and shapes are read)."""
    _check_transforms(recipe, model, world_size)
    if not recipe.compress:
        return
    name, options = parse_spec(recipe.compress)
    if name in ("bf16", "fp16") and recipe.precision in ("bf16-params", "fp16"):
        dtype = recipe.precision.removesuffix("-params")
        raise RecipeError(
            "compress",
            f"gradients are already {dtype} under {{precision}} {recipe.precision}",
            "drop {compress}, or compress further with int8, topk or powersgd",
        )
    if name == "powersgd" and "rank" in options:
        # the default rank is cut to each matrix's smaller side; a rank asked for is checked
        rank = options["rank"]
        largest = PowerSGD.largest_rank([p.shape for p in model.parameters()])
        if rank > largest:
            raise RecipeError(
                "compress",
                f"rank={rank} exceeds what any gradient matrix of the model allows "
                f"(at most {largest}, its smaller side)",
                f"use rank <= {largest}",
            )


def _check_transforms(recipe: Recipe, model: nn.Module, world_size: int | None) -> None:
    """tp and shard_size against the world, tp against the model's plan; activation_checkpointing against its blocks."""
    if world_size is not None:
        recipe.layout(world_size)  # tp and shard_size against the world ([Note: layout])
    if recipe.tp > 1:
        plan = getattr(model, "tensor_parallel_plan", None)
        if not callable(plan):
            _bad(
                "tp",
                f"{type(model).__name__} has no tensor-parallel plan",
                "give it a tensor_parallel_plan(tp) method (parallelize_module's plan), or "
                "split it yourself and compose over mesh['dp']",
            )
        try:
            plan(recipe.tp)
        except ValueError as error:
            _bad("tp", str(error), "use a divisor of them")
    if recipe.activation_checkpointing:
        try:
            check_checkpointable(model)
        except ValueError as error:
            problem = str(error).removeprefix("checkpoint_activations: ").split("; ")[0]
            fix = "drop it, or name the blocks: dp.checkpoint_activations(model, blocks=...)"
            _bad("activation_checkpointing", problem, fix)


def check_tp_mesh(recipe: Recipe, mesh) -> None:
    """`Recipe.tp` against the DeviceMesh `compose` splits over: a ("dp", "tp") mesh whose "tp"
    dimension has tp ranks (a 1-D mesh is the "dp" dimension of a model split beforehand)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != ("dp", "tp"):
        _bad(
            "tp",
            f"the mesh given is {names or f'{mesh.ndim}-D, unnamed'}, not ('dp', 'tp')",
            "pass the ('dp', 'tp') DeviceMesh, or none (compose builds it), or drop {tp} to "
            "compose over mesh['dp'] a model split beforehand",
        )
    if mesh["tp"].size() != recipe.tp:
        _bad(
            "tp",
            f"{recipe.tp} differs from the mesh's 'tp' size {mesh['tp'].size()}",
            "give the mesh's size",
        )
