"""What the sharded strategies (ZeRO-1/2 and ZeRO-3) answer alike: each holds its flat shards in
`shard_holders()` (buckets, units: each with `.shard` and `.params`) and its optimizers in
`self.built` ([Note: built optimizers] in parts/built.py); the clip, the owners' runs and the
plain state dict read them, whatever holds them."""

from __future__ import annotations

import torch
from torch import nn

from .base import Strategy
from .parts.clip import clip_shards_
from .parts.geometry import local_optimizer_state


class ShardedStrategy(Strategy):
    """A strategy whose optimizers step this rank's shards (`built`, `shard_holders`)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm: each rank's shard norms, combined over the shard group; a
        parameter owned whole counted once, by its owner's gradient."""
        shards = [(h.shard, h.params) for h in self.shard_holders()]
        params = list(self.model.parameters())
        owners = self.built.owners()
        owned = [g for o in owners for g in o.grads()]
        managed = frozenset(i for o in owners for i in o.masters())
        comm = self.groups.shard
        return clip_shards_(shards, params, max_norm, norm_type, comm, owned, managed)

    def owned_runs(self) -> list:
        return [run for owners in self.built.owners() for run in owners.runs()]

    def user_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        return self.built.of(optimizer).user_groups

    def _to_local(self, optimizer, state: dict) -> dict:
        """[Note: torch's own calls]: a plain state dict as this rank's."""
        built = self.built.of(optimizer)
        return local_optimizer_state(self.geometry(optimizer), optimizer, built.user_groups, state)
