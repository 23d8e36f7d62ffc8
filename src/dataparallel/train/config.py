"""The configuration of a training run: five small sections, each a frozen dataclass.

Precedence, lowest first: the defaults below, a TOML file (`--config FILE.toml`), command-line
flags. Every field is documented in its class docstring ("name: text"); those texts are also
the `--help` of the flags and the comments of the resolved `config.toml` in the run directory,
so the three can never disagree.

A TOML file has one table per section, named as the attributes of `RunConfig`:

    [train]
    steps = 600
    batch = 16

Unknown sections or keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import dataparallel as dp

from ..launch.config import (  # noqa: F401 (imported from here by the train modules)
    ConfigError,
    LaunchConfig,
    field_docs,
    field_label,
    flag_name,
)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train.

    name: a reference model: gpt-tiny (~1M parameters), gpt-small (~3.3M), gpt-medium (~32M)
        or mlp; or hf:DIR, a Hugging Face causal LM saved by save_pretrained in DIR (its
        weights and tokenizer; needs `pip install "dataparallel[hf]"`, docs/workloads.md).
    init: for hf:DIR, "pretrained" (the weights in DIR) or "random" (DIR's config alone).
    lora: for hf:DIR, LoRA adapters through peft, e.g. "r=8,alpha=16,targets=q_proj,v_proj"
        (the base stays frozen; the export holds merged weights); "" for none.
    """

    name: str = "gpt-tiny"
    init: str = "pretrained"
    lora: str = ""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to train on.

    paths: files or folders to train on (folders are searched recursively), each read by its
        extension: .jsonl and .parquet (records with "text", "prompt"/"completion" or chat
        "messages"), .bin and .npy (token ids), anything else as text (docs/workloads.md);
        empty means the built-in corpus, the .py sources of this Python's standard library.
    block_size: tokens (bytes) per training window, the context length; at most the model's
        block_size (128 for gpt-tiny, 256 for gpt-small and gpt-medium).
    val_fraction: fraction of the corpus (its tail, in sorted file order) held out for
        validation.
    eval_windows: validation windows scored at each evaluation, spread evenly over the
        validation split; 0 scores all of them.
    token_dtype: the dtype of the ids in .bin token files (raw, with no header): "uint16",
        "uint32", or "auto": uint16 when the tokenizer's vocabulary fits (at most 65536 ids),
        else uint32. (.npy files carry their own dtype.)
    """

    paths: tuple[str, ...] = ()
    block_size: int = 128
    val_fraction: float = 0.05
    eval_windows: int = 256
    token_dtype: str = "auto"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule.

    optimizer: "adamw", "muon" (Muon on the hidden matrices, AdamW on the embeddings, the
        output head, norms and biases, one lr for both) or "adafactor" (docs/train.md).
    lr: peak learning rate (before linear scaling, if any).
    lr_scaling: "none", or "linear": the peak becomes lr x global_batch / lr_base_batch (the
        linear scaling rule of Goyal et al., 2017, for growing the batch with the world size).
    lr_base_batch: the global batch, in windows, at which `lr` was tuned (linear scaling only).
    warmup_steps: steps of linear warm-up from 0 to the peak learning rate.
    min_lr_ratio: the cosine decay ends at this fraction of the peak, at the last step.
    weight_decay: decoupled weight decay (AdamW's, Muon's, Adafactor's), applied to matrices and embeddings only (not to
        biases and norm weights).
    beta1: AdamW's first-moment decay (and Muon's AdamW groups').
    beta2: AdamW's second-moment decay (and Muon's AdamW groups').
    grad_clip: clip gradients to this global L2 norm (over all ranks); 0 turns clipping off.
    """

    optimizer: str = "adamw"
    lr: float = 2e-3
    lr_scaling: str = "none"
    lr_base_batch: int = 32
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop.

    steps: optimizer steps of the whole run (the LR schedule spans them).
    batch: windows per rank per micro-step (the micro-batch).
    global_batch: windows per optimizer step over all ranks; when set (> 0), batch is derived
        as global_batch / (accum x world size). When that divides, the resolved config records
        that batch (and 0 here); otherwise the ranks' micro-batches differ by at most one window,
        batch records the largest and this field stays set. 0: batch decides.
    accum: micro-steps accumulated per optimizer step (gradient accumulation).
    precision: "fp32"; "bf16" for bfloat16 autocast (on CPU and CUDA; weights, gradients
        and optimizer state stay fp32); "bf16-params" for bf16 parameters, gradients and
        communication with fp32 master weights and optimizer state; "fp16" for the same in
        float16 with dynamic loss scaling (torch.amp.GradScaler's defaults; a step whose
        gradients overflow is skipped on every rank and counted as `skipped_steps`).
    activation_checkpointing: recompute each block's activations in backward instead of
        keeping them from forward (each block of a reference GPT, each decoder layer of an
        hf:DIR model, LoRA too): less activation memory for about one more forward per step,
        on every strategy (`dp.checkpoint_activations`; docs/train.md).
    seed: seeds the model's initialisation and the data order; the same seed and world size
        give the same loss curve.
    eval_every: steps between validation passes (also at step 0 and at the end); 0: only at
        the end.
    log_every: steps between progress lines when the output is not a terminal, and between
        the train scalars `report_to`'s trackers get (metrics.jsonl has every step).
    checkpoint_every: steps between checkpoints for --resume (one is always written at the
        end); 0: only at the end. Each rank writes only what it holds (docs/faults.md).
    checkpoint_save: "async": training goes on while the files are written (the state is
        copied first, which is the only stall); "sync": training waits for the files.
    max_skips: a step with a non-finite loss or gradient is skipped on every rank and counted
        in `skipped_steps`; this many in a row stop the run, its last checkpoint kept.
    stop_after: stop after this step, as if interrupted, with a checkpoint to --resume from;
        the schedule still spans `steps`. 0: run all `steps`.
    trace: steps to trace, "FIRST-LAST" or one step ("10-12", "5"): each rank writes a
        Chrome/Perfetto trace of them to traces/rank<N>.json in the run directory (docs/train.md,
        "Reading a trace"). Empty: no trace.
    report_to: where the metrics also go, comma-separated: "tensorboard" (events under
        RUN/tensorboard), "wandb" (Weights & Biases, files under RUN/wandb), "mlflow" (the
        store $MLFLOW_TRACKING_URI, else RUN/mlruns); "none" for none of them (metrics.jsonl
        and the report are always written). Each gets the loss, learning rate, gradient norm,
        tokens/s and validation loss by optimizer step, the config as parameters and the
        report's plots; a --resume continues the same W&B and MLflow run (docs/train.md).
    """

    steps: int = 500
    batch: int = 16
    global_batch: int = 0
    accum: int = 1
    precision: str = dp.Recipe.precision  # the recipe's default, written there
    activation_checkpointing: bool = dp.Recipe.activation_checkpointing
    seed: int = 1337
    eval_every: int = 100
    log_every: int = 25
    checkpoint_every: int = 200
    checkpoint_save: str = "async"
    max_skips: int = 10
    stop_after: int = 0
    trace: str = ""
    report_to: tuple[str, ...] = ("tensorboard",)


def recipe_section(*names: str):
    """A config section of `dp.Recipe` fields: each field's type and default are the recipe's
    (written once, recipe.py); the class docstring holds their flags' --help texts."""
    recipe = {f.name: f for f in fields(dp.Recipe)}

    def build(cls: type) -> type:
        cls.__annotations__ = {name: recipe[name].type for name in names}
        for name in names:
            setattr(cls, name, recipe[name].default)
        return dataclass(frozen=True, kw_only=True)(cls)

    return build


# the [sync] section: the dp.Recipe fields of how the replicas synchronise, in this order
SYNC_FIELDS = (
    "compress",
    "local_sgd",
    "diloco",
    "outer_lr",
    "outer_momentum",
    "outer_compress",
    "fragments",
    "overlap",
    "mix",
    "outer_warmup",
)


@recipe_section(*SYNC_FIELDS)
class SyncConfig:
    """How the ranks synchronise: exact by default; compressed, or every few steps, over slow
    links (docs/compression.md says when each pays).

    compress: send gradients compressed: "powersgd" (low-rank, for matrix-heavy models, the
        most bytes saved for the least CPU; rank 32 unless given, e.g. "powersgd:rank=4,
        start=10": under AdamW rank 4 lost 8% of DDP's loss on a short run, rank 32 0.6%),
        "topk:ratio=0.01" (the largest 1%,
        with error feedback), "int8" or "fp8" (a quarter of the bytes, nearly exact), "bf16"
        or "fp16" (half, no state); "start" is the step before which gradients travel
        uncompressed. Works with every strategy; on a 2-D mesh only the cross-replica stage
        is compressed. Empty: exact.
    local_sgd: average the replicas' parameters every this many steps instead of reducing
        gradients each step (local SGD); 0: off.
    diloco: DiLoCo every this many steps: all-reduce the replicas' movement since the last
        synchronisation and apply it with an outer Nesterov SGD; 0: off. Streamed as the
        measured recipe says (docs/compression.md: 4 fragments, overlap 1, int4, a streamed
        warm-up as long as the learning rate's or a tenth of the run, the run ending on the
        replicas' average)
        unless the fields below are given;
        --fragments 1 --overlap 0 --outer-warmup 0 --outer-compress fp32 is the paper's
        DiLoCo. With local_sgd or diloco a replica is one rank, or --shard-group ranks that
        train together with the chosen strategy.
    outer_lr: DiLoCo's outer learning rate; -1: chosen for the run from the replicas, H and
        --optimizer (docs/compression.md, "The outer learning rate"; the first lines and
        `dataparallel plan` print it). The DiLoCo paper's is 0.7.
    outer_momentum: DiLoCo's outer Nesterov momentum; 0: plain SGD; -1: chosen with the
        learning rate (the paper's is 0.9).
    outer_compress: how DiLoCo's outer gradients travel: "recipe" (int4), "fp32" (or ""),
        "bf16", or "int8" / "fp8" / "int4" (with error feedback).
    fragments: Streaming DiLoCo: the model in this many fragments, each synchronised every
        --diloco H steps, staggered by H / fragments steps (it must divide H); 1: DiLoCo;
        -1: the recipe's (4, else 2 or 1, whichever divides H with 2 steps between).
    overlap: Streaming DiLoCo: inner steps a fragment's outer all-reduce runs behind before
        it is applied (below H / fragments); 0: at once; -1: the recipe's (1 where allowed).
    mix: Streaming DiLoCo with --overlap: the fragment continues from mix x its local values
        + (1 - mix) x the outer step's result (0.5 in the paper).
    outer_warmup: DiLoCo: the first this many steps average the replicas after every step
        (synchronous warm-up: one fragment a step, in turn, sent as --outer-compress says);
        the outer steps start after it; -1: the recipe's (the longer of --warmup-steps, the
        learning rate's warm-up, and a tenth of --steps).
    """


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run; each attribute is one section (one TOML table).

    model: which model.
    data: what text.
    optim: optimizer and LR schedule.
    train: the loop.
    launch: the processes.
    sync: how the ranks synchronise.
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    launch: LaunchConfig = LaunchConfig()
    sync: SyncConfig = SyncConfig()

    @property
    def world_size(self) -> int:
        return self.launch.nproc * self.launch.nnodes

    @property
    def layout(self) -> dp.Layout:
        """The run's parallel layout ([Note: layout] in dataparallel): --nproc x --nnodes ranks,
        --tp, --shard-group, the strategy, an averager; a `ConfigError` naming the flag when
        the degrees do not fit. `dp.compose` builds the same one from the run's recipe."""
        launch, sync = self.launch, self.sync
        try:
            return dp.Layout(
                self.world_size,
                launch.tp,
                launch.shard_group,
                sharded=launch.strategy != "ddp",
                averaged=bool(sync.local_sgd or sync.diloco),
            )
        except dp.LayoutError as error:
            where = LAYOUT_FIELDS[error.field]
            raise ConfigError(field_label(*where), error.problem, error.fix) from None

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step: train.global_batch when set, else batch x accum x data
        ranks."""
        if self.train.global_batch:
            return self.train.global_batch
        return self.train.batch * self.train.accum * self.layout.data_size

    def replace(self, **changes: dict) -> RunConfig:
        """A copy with some fields of some sections changed: replace(train={"steps": 5})."""
        sections = {
            name: dataclasses.replace(getattr(self, name), **values)
            for name, values in changes.items()
        }
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, dict]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in fields(self)}


# dp.Layout field -> the config's (section, field) that gives it
LAYOUT_FIELDS = {
    "world": ("launch", "nproc"),
    "tp": ("launch", "tp"),
    "shard_size": ("launch", "shard_group"),
}

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "launch": LaunchConfig,
    "sync": SyncConfig,
}
