"""Which ranks of a shard group a dry run runs: the ones whose share of the layout differs
([Note: dry run of a plan] in dry_run.py). Pure arithmetic on the policy's own layouts."""

from __future__ import annotations

import torch


def layouts_of(policy, shapes, s: int) -> list:
    """The flat buffers the policy splits over its shard group ([Note: footprint])."""
    from ..strategies import DDP, ShardLayout, ZeRO3, bucket_layouts, dtypes

    if isinstance(policy, DDP) or s == 1:
        return []
    if isinstance(policy, ZeRO3):
        return [ShardLayout.pack(list(u), s) for u in (shapes.units or (shapes.numels,))]
    compute = dtypes(policy.precision, torch.float32)[0]
    mb = 1024 * 1024
    return bucket_layouts(
        shapes.numels, compute, int(policy.bucket_mb * mb), int(policy.first_bucket_mb * mb), s
    )


def role_ranks(policy, shapes, s: int) -> list[int]:
    """Shard-group ranks whose share differs ([Note: dry run of a plan]): the first, the last,
    the first whose shard holds padding, and the first that holds nothing of some parameter."""
    layouts = layouts_of(policy, shapes, s)
    found = {0, s - 1}
    padded = [
        (layout.end - 1) // layout.shard_numel + (0 if layout.end % layout.shard_numel else 1)
        for layout in layouts
        if layout.numel > layout.end
    ]
    if padded:
        found.add(min(min(padded), s - 1))
    empty = [empty_rank(layout) for layout in layouts]
    empty = [r for r in empty if r is not None]
    if empty:
        found.add(min(empty))
    return sorted(found)


def empty_rank(layout) -> int | None:
    """The first rank holding no element of some parameter of `layout`, if any."""
    shard = layout.shard_numel
    best = None
    for size, offset in zip(layout.sizes, layout.offsets, strict=True):
        if not size:
            continue
        first, last = offset // shard, (offset + size - 1) // shard
        candidate = 0 if first > 0 else (last + 1 if last + 1 < layout.world_size else None)
        if candidate is not None and (best is None or candidate < best):
            best = candidate
    return best


def chosen_roles(policy, shapes, s: int, ranks: list[int]):
    layouts = layouts_of(policy, shapes, s)
    for r in ranks:
        why = []
        if r == 0:
            why.append("first")
        if r == s - 1:
            why.append("last")
        if any(
            layout.numel > layout.end
            and (r + 1) * layout.shard_numel > layout.end
            and r * layout.shard_numel < layout.numel
            for layout in layouts
        ):
            why.append("padded")
        if any(
            not layout.pieces(r) or len(layout.pieces(r)) < len(layout.sizes) for layout in layouts
        ):
            why.append("holds none of a parameter")
        yield r, tuple(why) or ("middle",)
