"""A compressor as a communication hook, for every strategy; and the `--compress` spec.

[Note: where compression acts] A compressor reduces a bucket through the one reduction
interface ([Note: reduction interface] in comm/hooks.py), so DDP, ZeRO-1/2 and ZeRO-3 all take
it. It acts on the stage that crosses the slow link:
- without a 2-D mesh, on the whole reduction: DDP's buckets are summed approximately and kept
  whole; a sharded strategy's bucket is summed approximately and this rank keeps its shard
  (quantisation does that as a quantised reduce-scatter). The error-feedback residual has the
  bucket's size: it is the sender's error ([Note: error feedback]).
- on a 2-D mesh (shard within a host, replicate across hosts), the reduction inside the shard
  group stays exact (fast links) and only the reduced shard is compressed across replicas: its
  payload and its residual are 1/S of the bucket, sharded like the gradients.
Before `start` reduction rounds (one per optimizer step), buckets travel uncompressed: early
gradients change fast, and PowerSGD's warm start needs a few steps to find its subspace.
"""

from __future__ import annotations

import torch

from ..comm.hooks import Chain, HookState, reduce_hook
from .feedback import keyed_tensors, load_keyed_tensors
from .powersgd import PowerSGD
from .quantize import Quantize
from .topk import TopK


class CompressedHook:
    """`hook(state, bucket) -> future` that reduces through `compressor` ([Note: where
    compression acts]).

    compressor: a PowerSGD, TopK or Quantize (anything with `reduce` and `state_tensors`).
    start: reduction rounds sent uncompressed first (the step before which, from 0).
    """

    def __init__(self, compressor, start: int = 0):
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"{compressor.name}: start={start!r} must be an integer >= 0")
        self.compressor, self.start = compressor, start
        self.rounds = 0  # reduction rounds begun, counting the current one
        self._seen: set[int] = set()
        self.__name__ = f"{compressor.name}_hook"

    def _count_round(self, index: int) -> None:
        """A round ends when a bucket comes again (buckets reduce once per round, in any order)."""
        if index in self._seen or not self._seen:
            self._seen.clear()
            self.rounds += 1
        self._seen.add(index)

    def __call__(self, state: HookState, bucket):
        self._count_round(bucket.index)
        if self.rounds <= self.start:
            return reduce_hook(state, bucket)
        replicate = state.replicate
        if replicate is None or replicate.world_size == 1:
            key = (bucket.index, "all")
            return self.compressor.reduce(
                state.comm, key, bucket.buffer, bucket.shard, bucket.shapes
            )
        window = bucket.shard or (0, bucket.buffer.numel())
        exact = reduce_hook(HookState(state.comm), bucket)  # inside the shard group

        def across(part: torch.Tensor):
            key = (bucket.index, "replicas")
            return self.compressor.reduce(
                replicate, key, part.view(-1), None, bucket.shapes, window
            )

        return Chain(exact, across)

    def counters(self) -> tuple[int, frozenset[int]]:
        """(rounds, the buckets seen in the current round): where the hook stands."""
        return self.rounds, frozenset(self._seen)

    def load_counters(self, counters: tuple[int, frozenset[int]]) -> None:
        """Stand where `counters()` said (a rewound step; a replacement: no bucket seen)."""
        rounds, seen = counters
        self.rounds, self._seen = int(rounds), set(seen)

    def state_tensors(self) -> list[torch.Tensor]:
        """What the compressor keeps between steps (residuals, warm-start factors)."""
        return self.compressor.state_tensors()

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(plain data, named tensors): this rank's compression state, for a checkpoint."""
        return {"rounds": self.rounds}, keyed_tensors(self.compressor.stores())

    def load_state_dict(self, data: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Continue from `state_dict()`'s output."""
        self.rounds = int(data["rounds"])
        self._seen.clear()
        load_keyed_tensors(self.compressor.stores(), tensors)


# --compress NAME:key=value,...  -> (class, {option: type}, default options)
COMPRESSORS = {
    "powersgd": (PowerSGD, {"rank": int, "start": int, "min_rate": float, "seed": int}),
    "topk": (TopK, {"ratio": float, "momentum": float, "start": int}),
    "int8": (Quantize, {"block": int, "start": int}),
    "fp8": (Quantize, {"block": int, "start": int}),
}
# What a spec leaves out. PowerSGD under AdamW (docs/compression.md, "Compression under Adam"):
# on gpt-tiny's 300 steps rank 4 lost 8.2% of DDP's validation loss, rank 8 3.0%, rank 16 1.1%,
# rank 32 0.6% (with or without 10 exact steps first; exact steps help rank 4 only); on
# gpt-small's 2,000 steps rank 16 lost 3.3%, rank 32 0.8%: rank 32 is within 3% on both.
SPEC_DEFAULTS = {"powersgd": {"rank": 32}}
SPEC_HELP = (
    "powersgd (rank 32 unless given) | powersgd:rank=4,start=10 | topk:ratio=0.01 | int8 | fp8 "
    "| bf16 | fp16"
)


def parse_spec(spec: str) -> tuple[str, dict]:
    """'powersgd:rank=4,start=10' -> ('powersgd', {'rank': 4, 'start': 10}); ValueError names
    the bad part."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name in ("bf16", "fp16"):
        if rest:
            raise ValueError(f"{name} takes no options, got {rest!r}")
        return name, {}
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; use {SPEC_HELP}")
    kinds = COMPRESSORS[name][1]
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in kinds:
            raise ValueError(f"{name}: unknown option {item!r}; options are {', '.join(kinds)}")
        try:
            options[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"{name}: {key}={value!r} is not a {kinds[key].__name__}") from None
    return name, options


def build_hook(spec: str):
    """The communication hook a `--compress` spec names (bf16/fp16: a cast, no feedback)."""
    from ..comm.hooks import low_precision_hook

    name, options = parse_spec(spec)
    if name in ("bf16", "fp16"):
        return low_precision_hook(torch.bfloat16 if name == "bf16" else torch.float16)
    options = {**SPEC_DEFAULTS.get(name, {}), **options}
    start = options.pop("start", 0)
    if name == "powersgd":
        if "min_rate" in options:
            options["min_compression_rate"] = options.pop("min_rate")
        compressor = PowerSGD(**options)
    elif name == "topk":
        if "ratio" not in options:
            raise ValueError(
                "topk: give ratio, the fraction of entries sent (e.g. topk:ratio=0.01)"
            )
        compressor = TopK(**options)
    else:
        compressor = Quantize(name, **options)
    return CompressedHook(compressor, start)
