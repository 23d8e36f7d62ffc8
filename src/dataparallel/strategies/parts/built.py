"""The optimizers `build_optimizer` made for one sharded model, and what each holds.

[Note: built optimizers] A model may have several optimizers (Muon on the hidden matrices and
AdamW on the rest, two `dp.build_optimizer` calls as with PyTorch's DDP): each is built on its
groups' pieces or owned masters, with its own owners ([Note: whole parameters] in owners.py)
and its own torch calls ([Note: torch's own calls] in torch_calls.py). The strategy asks this
list what it needs across all of them: the owners whose gradients a round collects, the
masters the geometry describes, the user's groups of one optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...comm import Comm
from .owners import Owners, share_groups
from .torch_calls import OptimizerCalls


@dataclass(eq=False)
class Built:
    """One optimizer built for a sharded model.

    optimizer: the user's optimizer.
    user_groups: per param group, the model's parameters as the user passed them.
    reads: per param group, what its update reads ([Note: optimizer layout]).
    owners: the owners of its whole-parameter groups (None: flat shards only).
    calls: its torch calls.
    """

    optimizer: torch.optim.Optimizer
    user_groups: list[list[nn.Parameter]]
    reads: list[str]
    owners: Owners | None = None
    calls: OptimizerCalls | None = None
    step: object = field(default=None)  # the strategy's step hooks for it (ZeRO-1/2)

    def after_step(self, comm: Comm) -> None:
        """The owners' new values into the shards, and the owners' group values to every rank
        ("group" and "all" layouts)."""
        if self.owners is not None:
            self.owners.send_values()
            share_groups(self.optimizer, self.owners.group_owners, comm)


class BuiltOptimizers:
    """Every optimizer built for one model, in the order they were built."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.all: list[Built] = []
        self.owned_of: dict = {}  # id(parameter) -> its Owned, across optimizers

    def add(self, built: Built) -> None:
        self.all.append(built)
        self.relay_owners()

    def relay_owners(self) -> None:
        """After owners were made (again): one lookup across every optimizer, updated in place
        (`HeldGrads` keeps a reference to it)."""
        self.owned_of.clear()
        for built in self.all:
            if built.owners is not None:
                self.owned_of.update({id(o.param): o for o in built.owners.owned})

    def of(self, optimizer: torch.optim.Optimizer) -> Built:
        for built in self.all:
            if built.optimizer is optimizer:
                return built
        raise ValueError(
            f"{self.strategy}: this optimizer was not built by dataparallel.build_optimizer "
            "for this model"
        )

    def owners(self) -> list[Owners]:
        return [b.owners for b in self.all if b.owners is not None]

    def masters(self) -> dict[int, nn.Parameter | None]:
        """id(parameter) -> its master on this rank (None where another rank owns it)."""
        return {i: m for owners in self.owners() for i, m in owners.masters().items()}

    def taken(self) -> set[int]:
        """Ids of the model parameters some optimizer steps."""
        return {id(p) for b in self.all for g in b.user_groups for p in g}

    def collect_grads(self, used: set[int]) -> None:
        for owners in self.owners():
            owners.collect_grads(used)

    def verdict(self, nonfinite: bool) -> None:
        """The round's found-inf agreement, to every optimizer's carrier."""
        for built in self.all:
            if built.calls is not None:
                built.calls.found_inf.verdict(nonfinite)


def check_new_groups(groups: list[dict], built: BuiltOptimizers) -> None:
    """One line when a parameter of the new optimizer's groups is in two of them, or already
    in an optimizer built before."""
    ids = [id(p) for g in groups for p in g["params"]]
    if len(ids) != len(set(ids)):
        raise ValueError("build_optimizer: a parameter appears in two param groups")
    if set(ids) & built.taken():
        raise ValueError(
            "build_optimizer: a parameter is already stepped by an optimizer built for this "
            "model; give each optimizer its own parameters"
        )
