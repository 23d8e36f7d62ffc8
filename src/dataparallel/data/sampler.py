"""A distributed sampler: each rank's share of a shuffled epoch, resumable mid-epoch.

Every rank draws the same permutation (seeded by `seed + epoch`) and takes every
world_size-th index starting at its rank, so the shards are disjoint and, together, cover the
epoch. All shards have the same length, which is what keeps ranks from waiting on each other
at the end of an epoch: the tail is either padded by wrapping round to the start of the
permutation (`drop_last=False`, a few samples seen twice) or dropped (`drop_last=True`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch


class DistributedSampler:
    """Indices of this rank's shard of a dataset of `num_samples` samples.

    num_samples: dataset size (an int, or anything with `len()`).
    rank, world_size: this rank and the number of ranks sharing the data.
    seed: the base of the per-epoch shuffle; the same seed gives the same order everywhere.
    shuffle: False keeps dataset order (still sharded).
    drop_last: True drops the tail that does not divide by world_size; False pads by wrapping.
    """

    def __init__(
        self,
        num_samples: int | Sized,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        n = num_samples if isinstance(num_samples, int) else len(num_samples)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"DistributedSampler: rank={rank} must be in [0, world_size={world_size})"
            )
        if n < world_size:
            raise ValueError(
                f"DistributedSampler: {n} samples cannot be shared by {world_size} ranks; "
                "use fewer ranks or more data"
            )
        self.num_samples = n
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.position = 0  # indices of this epoch already handed out by this rank
        self._cached: tuple[int, torch.Tensor] | None = None  # (epoch, shard)
        total = (n // world_size) * world_size if drop_last else -(-n // world_size) * world_size
        self.shard_length = total // world_size

    def __len__(self) -> int:
        return self.shard_length

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (a new shuffle) from its beginning."""
        self.epoch = epoch
        self.position = 0

    def shard(self) -> torch.Tensor:
        """This rank's indices for the current epoch, in order (computed once per epoch)."""
        if self._cached is not None and self._cached[0] == self.epoch:
            return self._cached[1]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        total = self.shard_length * self.world_size
        if total > self.num_samples:  # pad by wrapping round
            order = order.repeat(-(-total // self.num_samples))
        self._cached = (self.epoch, order[:total][self.rank :: self.world_size])
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        indices = self.shard()
        while self.position < self.shard_length:
            index = int(indices[self.position])
            self.position += 1
            yield index

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where this rank stands: epoch and position in its shard.

        consumed: the number of this epoch's samples actually trained on, when it differs from
            what was handed out (a prefetching DataLoader runs ahead of training).
        """
        return {
            "epoch": self.epoch,
            "position": self.position if consumed is None else consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`: the next index is the one after the last trained."""
        for key in ("seed", "num_samples", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"DistributedSampler.load_state_dict: {key}={state[key]} in the checkpoint "
                    f"but {getattr(self, key)} now; resume with the same {key}"
                )
        self.epoch = state["epoch"]
        self.position = state["position"]
