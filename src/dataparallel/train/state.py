"""A run's state on one rank: what is built once, and its ledger (how far it has got).

Every part of the job reads it (the step's concerns in step.py, the loop, the callbacks, live
recovery); trainer.py builds it (`setup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import dataparallel as dp

from ..data.corpus import Corpus, TokenWindows
from ..data.loading import DataInfo
from ..data.packing import PackedWindows
from .config import RunConfig
from .gradient_watch import GradientWatch
from .ledger import Ledger
from .lr_schedule import WarmupCosine


@dataclass(kw_only=True)
class TrainState:
    """A run: what is built once (the configs, the world, the model and its optimizer, the
    data), and its ledger, how far it has got ([Note: the ledger] in ledger.py).

    The built part changes only when a live run regroups (`world`, `layout`: [Note: live
    recovery] in live/recovery.py); the ledger changes with every step.
    """

    config: RunConfig
    world: dp.World
    model: torch.nn.Module
    model_name: str  # a reference model's name, or the class name of the user's model
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    peak_lr: float
    train_windows: TokenWindows | PackedWindows
    val_windows: TokenWindows | PackedWindows
    corpus: Corpus | DataInfo  # what the records name: sha256, source, num_files, num_tokens
    layout: dp.Layout  # who reads which data, shards, counts the loss ([Note: layout])
    ledger: Ledger  # the step, the skips, the data position, ... ([Note: the ledger])
    scaler: torch.amp.GradScaler | None = None
    averager: dp.LocalSGD | None = None  # local SGD or DiLoCo (dp.compose), or None
    tracer: dp.Tracer = field(default_factory=dp.Tracer)  # on for --trace steps (tracing.py)
    composed: dp.Composed | None = None  # what dp.compose built (autocast, the recipe)
    source: object | None = None  # the Hugging Face directory of an hf:DIR model (models/hf.py)
    gradients: GradientWatch | None = None  # this rank's verdict before reduction ([Note: blame])

    @property
    def step(self) -> int:
        """Optimizer steps done (the ledger's: what callbacks read most)."""
        return self.ledger.step

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step over all ranks ([Note: uneven batches])."""
        train = self.config.train
        return train.global_batch or train.batch * train.accum * self.layout.data_size

    @property
    def data_rank(self) -> int:
        """Which slice of a step's samples this rank reads (its dp coordinate under --tp)."""
        return self.layout.data_rank(self.world.rank)

    @property
    def loss_weight(self) -> int:
        """1 where this rank's token and loss sums count in the sums over every rank, else 0
        (a tp row's peers hold the same: [Note: the job's mesh])."""
        return self.layout.loss_weight(self.world.rank)

    @property
    def last_step(self) -> int:
        """The step this session ends at (stop_after, or the end of the schedule)."""
        return self.config.train.stop_after or self.config.train.steps
