"""The trainer's data order: shuffled epochs laid end to end, read by a global sample count.

[Note: global sample position] Where a run stands in its data is one number, `consumed`: the
global samples handed out so far, over all ranks and epochs. Epoch e is a permutation of the
dataset seeded by `seed + e`, and the epochs follow each other with no padding and no drop, so
sample position g is `permutation(g // n)[g % n]`. A step of a global batch of B over W ranks
takes the next B positions, rank r every W-th of them starting at r (the same interleaving as
`DistributedSampler`'s shards, so in the first epoch the two agree). When W does not divide B,
ranks 0 .. B % W - 1 take one position more than the others (`share`): the B positions are
still each taken once. Nothing here depends on W except which rank reads which position, so a
run resumed with another number of ranks continues at `consumed` and, as long as the global
batch stays the same, trains on exactly the samples the original run would have: none skipped,
none repeated (tests/dist/test_resharding.py and tests/unit/test_checkpoint.py count them).
"""

from __future__ import annotations

import torch


def share(total: int, part: int, parts: int) -> int:
    """How many of `total` items part `part` of `parts` gets when the parts differ by at most
    one: total // parts, and one more for the first total % parts parts."""
    return total // parts + (part < total % parts)


def split_evenly(items: list, parts: int) -> list[list]:
    """`items` cut in order into `parts` runs whose lengths differ by at most one (the longer
    ones first)."""
    out, first = [], 0
    for part in range(parts):
        size = share(len(items), part, parts)
        out.append(items[first : first + size])
        first += size
    return out


class SampleStream:
    """Epochs of a seeded shuffle of `num_samples` samples, read by global position.

    num_samples: dataset size.
    seed: the base of each epoch's shuffle (epoch e uses seed + e).
    consumed: global samples already handed out (where a resumed run continues).
    """

    def __init__(self, num_samples: int, *, seed: int = 0, consumed: int = 0):
        if num_samples < 1:
            raise ValueError(f"SampleStream: num_samples={num_samples} must be at least 1")
        self.num_samples, self.seed, self.consumed = num_samples, seed, consumed
        self._cached: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def _order(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._cached = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._cached[1]

    def at(self, position: int) -> int:
        """The sample at global position `position`."""
        return int(self._order(position // self.num_samples)[position % self.num_samples])

    def take(self, per_rank: int, rank: int, world_size: int) -> list[int]:
        """Rank `rank`'s `per_rank` samples of the next step of `world_size` ranks; every rank
        calls it once per step, so `consumed` advances by `per_rank x world_size` on each."""
        return self.take_share(per_rank * world_size, rank, world_size)

    def take_share(self, global_batch: int, rank: int, world_size: int) -> list[int]:
        """Rank `rank`'s share of the next `global_batch` samples, split over `world_size`
        ranks as evenly as they go (`share`); every rank calls it once per step, so `consumed`
        advances by `global_batch` on each."""
        if not 0 <= rank < world_size:
            raise ValueError(f"SampleStream: rank={rank} must be in [0, {world_size})")
        first = self.consumed + rank
        count = share(global_batch, rank, world_size)
        out = [self.at(first + k * world_size) for k in range(count)]
        self.consumed += global_batch
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data has {key}={state[key]}, this run's {getattr(self, key)}"
                    f"; resume with the same data and seed"
                )
        self.consumed = int(state["consumed"])
