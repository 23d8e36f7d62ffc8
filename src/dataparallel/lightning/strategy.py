"""`DataParallelStrategy`: a LightningModule trained by the engine under Lightning's Trainer.

[Note: the Lightning strategy] Lightning's own DDP strategy gives us the processes and the
process group: its launcher for `python train.py` with `devices=N`, or the processes that
torchrun, Slurm or our `dataparallel launch` made (Lightning's cluster environment), and
`init_process_group` from it (a group made before, by `dp.init()` or Ray, is used as it is).
Its `reduce`, `barrier`, `broadcast` and `all_gather` are kept. What runs on the engine:
- the model: the LightningModule goes under a thin wrapper (`Wrapped`, its keys under
  "module.") that `dp.compose` parallelizes as the recipe says; every step goes through the
  wrapper's forward (Lightning's forward redirection, as it does with torch's DDP), so the
  engine's hooks around the step run once, whatever the module calls inside `training_step`;
- the optimizers: `configure_optimizers`' are built again on what each rank holds ([Note:
  Lightning's optimizers] in optimizers.py), the schedulers follow them;
- accumulation: Lightning's `accumulate_grad_batches` runs the steps before the last under
  `dp.no_sync` (the strategy's `block_backward_sync`), so each optimizer step reduces once;
- precision and clipping: [Note: Lightning's precision] in precision.py;
- an averager (local_sgd, diloco) steps after each optimizer step;
- checkpoints: [Note: Lightning's checkpoints] in checkpoints.py.
Recovery: "restart" is Lightning's own (a restarted worker resumes with `ckpt_path="last"`);
live recovery needs the job's loop (`dataparallel train --recovery live`) and is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import dataparallel as dp

from .checkpoints import (
    PREFIX,
    hyper_parameters,
    load_hyper_parameters,
    load_module_state,
    module_state,
    read_folder,
    write_file,
    write_folder,
)
from .optimizers import build_again, build_each, point_schedulers
from .precision import precision_plugin, recipe_precision

_WRAPPED = "_dataparallel_wrapped"  # the LightningModule's wrapper, kept across fit/validate
RECOVERY = ("restart",)


class Wrapped(nn.Module):
    """The module the engine parallelizes: the LightningModule under "module"."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class DataParallelStrategy(DDPStrategy):
    """Train a LightningModule on the engine ([Note: the Lightning strategy]).

    strategy: "ddp", "zero1", "zero2", "zero3" or a policy object (`dp.ZeRO3(wrap=...)`).
    precision: the recipe's "fp32", "bf16", "bf16-params" or "fp16"; None: Trainer's
        precision, "32-true" (fp32) or "bf16-mixed" (bf16).
    recovery: "restart" (torchrun or Slurm restart the workers, which resume from
        `ckpt_path="last"`); live recovery is the job's only.
    reads: what the optimizer's update of one element reads ([Note: optimizer layout]), for a
        class the engine does not know; None: the engine's choice.
    recipe: the rest of `dp.Recipe` by name (shard_size, compress, local_sgd, diloco,
        activation_checkpointing, compile, ...), but not tp (Lightning's sampler gives every
        rank its own data).
    The other arguments are Lightning's DDPStrategy's (the launcher, the process group).
    """

    strategy_name = "dataparallel"

    def __init__(
        self,
        strategy="ddp",
        *,
        precision: str | None = None,
        recovery: str = "restart",
        reads: str | None = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: str = "popen",
        **recipe,
    ):
        if recovery not in RECOVERY:
            raise ValueError(
                f"DataParallelStrategy: recovery={recovery!r} is not supported under Lightning; "
                "use 'restart' (Lightning's loop owns the step: for live recovery run "
                "dataparallel train --recovery live)"
            )
        # not tp: Lightning's sampler splits the data over every rank, tp peers need the same
        fields = set(dp.Recipe.__dataclass_fields__) - {"strategy", "precision", "tp"}
        unknown = sorted(set(recipe) - fields)
        if unknown:
            raise TypeError(
                f"DataParallelStrategy: unknown argument {unknown[0]!r}; the recipe's are "
                + ", ".join(sorted(fields))
            )
        self.recipe = dp.Recipe(strategy=strategy, precision=precision or "fp32", **recipe)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._forward_redirection = _ForwardRedirection()
        self.precision_given, self.reads = precision, reads
        self.composed: dp.Composed | None = None
        self.loaded_folder = False  # the last ckpt_path was a sharded folder, loaded already

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name in dp.STRATEGIES:
            strategy_registry.register(  # the registry's own `strategy=`: our first argument
                f"dataparallel_{name}",
                partial(cls, name),
                description=f"dataparallel's {name} (DataParallelStrategy({name!r}))",
            )

    # -- the processes ------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"DataParallelStrategy: the process group has {dist.get_world_size()} ranks, "
                f"Trainer(devices=..., num_nodes=...) makes {self.world_size}; make them agree"
            )

    # -- the model and its optimizers ---------------------------------------------------------
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        precision = recipe_precision(self.precision_plugin, self.precision_given)
        recipe = replace(self.recipe, precision=precision)
        module = self.lightning_module
        wrapped = getattr(module, _WRAPPED, None)
        fresh = wrapped is None
        if fresh:  # a parallelized one stays where its buffers are
            module.to(self.root_device)
            wrapped = Wrapped(module)
            object.__setattr__(module, _WRAPPED, wrapped)  # not a submodule: no cycle
            wrapped.recipe = recipe
        elif wrapped.recipe != recipe:
            raise ValueError(
                f"DataParallelStrategy: this LightningModule was parallelized under "
                f"{wrapped.recipe.strategy!r}/{wrapped.recipe.precision!r}, not "
                f"{recipe.strategy!r}/{recipe.precision!r}; use the same strategy, or fit a "
                "fresh module resuming with ckpt_path"
            )
        scaler = None
        if trainer.state.fn == TrainerFn.FITTING:
            plain, configs = _init_optimizers_and_lr_schedulers(module)
            if fresh and any(isinstance(o, _MockOptimizer) for o in plain):
                dp.parallelize(wrapped, recipe.policy())  # manual or no optimizer: the model
            elif not any(isinstance(o, _MockOptimizer) for o in plain):
                self.composed, built = self._build(wrapped, recipe, plain, module, fresh)
                point_schedulers(configs, plain, built)
                plain = built
                scaler = self.composed.scaler
            self.optimizers, self.lr_scheduler_configs = plain, configs
        elif fresh:
            dp.parallelize(wrapped, recipe.policy())
        self.model = wrapped
        self.precision_plugin = precision_plugin(recipe, wrapped, scaler, self.root_device.type)
        self.recipe_in_use = recipe

    def _build(self, wrapped, recipe, plain, module, fresh):
        if fresh:
            return build_again(wrapped, recipe, plain, module, self.reads)
        # A module parallelized before (a fit or validate of another Trainer): under DDP new
        # optimizers on the same model; ZeRO's shards belong to the first optimizer built.
        if recipe.local_sgd or recipe.diloco or dp.geometry(wrapped).group is not None:
            raise ValueError(
                "DataParallelStrategy: this LightningModule was parallelized by another "
                "Trainer (fit or validate) under ZeRO or an averager, whose layout holds its "
                "shards; fit a fresh module, resuming with ckpt_path"
            )
        built = build_each(wrapped, plain, module, self.reads)
        device = self.root_device.type
        scaler = torch.amp.GradScaler(device) if dp.PRECISIONS[recipe.precision].scaling else None
        return dp.Composed(wrapped, built[0], None, None, scaler, recipe), built

    def model_to_device(self) -> None:
        if getattr(self.lightning_module, _WRAPPED, None) is None:  # not yet parallelized
            self.lightning_module.to(self.root_device)

    @contextmanager
    def block_backward_sync(self):
        """The micro-steps before the last of an accumulation: no gradient reduction."""
        with dp.no_sync(self.model):
            yield

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.composed is not None and self.composed.averager is not None:
            self.composed.averager.step()
        return output

    def teardown(self) -> None:
        """Lightning's teardown without moving the model to the CPU: a parallelized model's
        parameters are views of the engine's buffers, which `.cpu()` would replace."""
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ([Note: Lightning's checkpoints]) ----------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def folders(self) -> bool:
        """Whether a training checkpoint is a sharded folder (ranks hold different state)."""
        averaged = self.composed is not None and self.composed.averager is not None
        return averaged or dp.geometry(self.model).group is not None

    def layout(self) -> dict:
        """What the ranks' own state depends on, and the replicas an averager keeps (the
        composed `dp.Layout`'s saved replicas)."""
        recipe = self.recipe_in_use
        replicas, replica = 1, 0
        if self.composed is not None:
            layout = self.composed.layout
            replicas, replica = layout.saved_replicas, layout.saved_replica_of(self.global_rank)
        strategy = recipe.strategy if isinstance(recipe.strategy, str) else repr(recipe.strategy)
        fields = {**recipe.__dict__, "strategy": strategy}
        recipe = repr(fields)
        return {
            "world_size": self.world_size,
            "recipe": recipe,
            "replicas": replicas,
            "replica": replica,
        }

    def lightning_module_state_dict(self) -> dict:
        return module_state(self.model)

    def optimizer_state(self, optimizer) -> dict:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if self.folders():  # the tensors in the folder, each rank's part; the groups' values here
            return {"param_groups": hyper_parameters(optimizer)}
        return dp.optimizer_state_dict(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(
                "DataParallelStrategy.save_checkpoint: storage_options is not supported; "
                "the strategy writes the file or folder itself"
            )
        path = Path(filepath)
        if "optimizer_states" in checkpoint and self.folders():
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"DataParallelStrategy.save_checkpoint: a sharded checkpoint holds one "
                    f"optimizer, this run has {len(self.optimizers)}; make them one (param "
                    "groups may name their own class) or save with weights_only=True"
                )
            prefix, layout, averager = self._place()
            model, optimizer, rank = self.model, self.optimizers[0], self.global_rank
            write_folder(checkpoint, path, model, optimizer, averager, rank, prefix, layout)
            return
        if self.is_global_zero:
            write_file(checkpoint, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(checkpoint_path)
        self.loaded_folder = path.is_dir()
        if not self.loaded_folder:
            return torch.load(path, map_location="cpu", weights_only=bool(weights_only))
        prefix, layout, averager = self._place()
        model, optimizer, rank = self.model, self.optimizers[0], self.global_rank
        return read_folder(path, model, optimizer, averager, rank, prefix, layout)

    def _place(self) -> tuple[str, dict, object]:
        """(this rank's name prefix in a folder, the layout it is written in, the averager)."""
        layout = self.layout()
        prefix = f"replica{layout.pop('replica')}/" if layout["replicas"] > 1 else ""
        return prefix, layout, self.composed.averager if self.composed else None

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self.loaded_folder:
            load_module_state(self.model, checkpoint["state_dict"], strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        states = checkpoint["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=True):
            if self.loaded_folder:  # the tensors are loaded: the groups' values (lr, ...)
                load_hyper_parameters(optimizer, state["param_groups"])
            else:
                dp.load_optimizer_state_dict(self.model, optimizer, state)


__all__ = ["PREFIX", "DataParallelStrategy", "Wrapped"]
