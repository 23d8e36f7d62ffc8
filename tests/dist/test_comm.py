"""Pairwise reduce-scatter and all-gather ([Note: pairwise collectives]) against gloo's own."""

from __future__ import annotations

import pytest
import torch

from dataparallel.comm import Comm

from .harness import run_world

SIZES = (1, 7, 4096, 300_001)  # elements per rank's chunk


def pairwise_against_gloo(world) -> dict:
    rank, n = world.rank, world.world_size
    ours, gloo = Comm(pairwise=True), Comm(pairwise=False)
    out = {"tags": [], "completed_before_wait": [], "diffs": []}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for size in SIZES:
            x = torch.randn(size * n, generator=gen).to(dtype)
            want_sum = torch.empty(size, dtype=dtype)
            gloo.reduce_scatter(want_sum, x.clone())
            want_all = torch.empty(size * n, dtype=dtype)
            gloo.all_gather(want_all, x[:size] + rank)
            # Three in flight at once, waited for in reverse order, one of gloo's in between.
            apart = torch.empty(size, dtype=dtype)
            work_apart = ours.reduce_scatter(apart, x.clone(), async_op=True)
            y = x.clone()
            mine = y[rank * size : (rank + 1) * size]
            work_in_place = ours.reduce_scatter(mine, y, async_op=True)
            gathered = torch.full((size * n,), -1.0, dtype=dtype)
            work_gather = ours.all_gather(gathered, x[:size] + rank, async_op=True)
            total = torch.ones(3)
            gloo.all_reduce(total)
            works = (work_gather, work_in_place, work_apart)
            out["completed_before_wait"].append(any(w.is_completed() for w in works))
            for work in works:
                work.wait()
                assert work.is_completed()
            out["diffs"].append(
                {
                    "dtype": str(dtype),
                    "size": size,
                    "largest_term": x.double().abs().max().item(),
                    "apart": (apart.double() - want_sum.double()).abs().max().item(),
                    "in_place": (mine.double() - want_sum.double()).abs().max().item(),
                    "gather_equal": torch.equal(gathered, want_all),
                    "others_untouched": torch.equal(
                        torch.cat([y[: rank * size], y[(rank + 1) * size :]]),
                        torch.cat([x[: rank * size], x[(rank + 1) * size :]]),
                    ),
                    "all_reduce": total.tolist() == [n] * 3,
                }
            )
    out["tags"] = ours._tag
    # Bad sizes and dtypes are refused before anything is sent.
    out["refused"] = []
    for shard, full in (
        (torch.empty(3), torch.empty(3 * n + 1)),
        (torch.empty(3), torch.empty(3 * n, dtype=torch.float64)),
    ):
        for call in (ours.reduce_scatter, lambda s, f: ours.all_gather(f, s)):
            try:
                call(shard, full)
            except ValueError as exc:
                out["refused"].append(str(exc))
    # On a group that is not the world (ranks 0 and 2 of 3), group ranks differ from global.
    if n == 3:
        pair = torch.distributed.new_group([0, 2])
        if rank != 1:
            sub = Comm(pair, pairwise=True)
            full = torch.empty(4)
            sub.all_gather(full, torch.full((2,), float(rank)))
            x = torch.arange(4.0) + rank
            mine = torch.empty(2)
            sub.reduce_scatter(mine, x)
            out["subgroup"] = (full.tolist(), mine.tolist(), sub._global_ranks())
    cpu = torch.device("cpu")
    out["sharded_reduce"] = (ours.sharded_reduce(cpu), gloo.sharded_reduce(cpu))
    return out


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict]]:
    return {n: run_world(n, pairwise_against_gloo) for n in (2, 3)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_pairwise_collectives_equal_gloo_s(worlds, world_size):
    per_rank = [[case["largest_term"] for case in out["diffs"]] for out in worlds[world_size]]
    largest = [max(terms) for terms in zip(*per_rank, strict=True)]
    for out in worlds[world_size]:
        assert len(out["diffs"]) == 3 * len(SIZES), out["diffs"]  # 3 dtypes x the sizes
        for case, term in zip(out["diffs"], largest, strict=True):
            # Sums of two are exact. Three terms may round differently in another order: two
            # roundings, each at most half a unit in the last place of a partial sum.
            exact = world_size == 2 or case["dtype"] == "torch.float64"
            eps = 2.0**-8 if case["dtype"] == "torch.bfloat16" else 2.0**-24
            tol = 0.0 if exact else 2 * eps * world_size * term
            assert case["apart"] <= tol and case["in_place"] <= tol, case
            assert case["gather_equal"] and case["others_untouched"], case
            assert case["all_reduce"], case


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_takes_the_same_tags(worlds, world_size):
    tags = [out["tags"] for out in worlds[world_size]]
    assert tags == [3 * 3 * len(SIZES)] * world_size  # one per exchange, the same everywhere


def test_completion_is_known_only_once_waited_for(worlds):
    # gloo marks point-to-point work complete only in wait(): polling code must bound itself.
    assert not any(any(out["completed_before_wait"]) for out in worlds[2])


def test_bad_sizes_and_dtypes_are_refused_in_one_line(worlds):
    for out in worlds[2]:
        assert len(out["refused"]) == 4, out["refused"]
        for message in out["refused"]:
            assert "\n" not in message and "must hold world size 2 x the shard" in message
        assert out["refused"][0].startswith("Comm.reduce_scatter: the full tensor (7 x")
        assert out["refused"][1].startswith("Comm.all_gather:")
        assert "torch.float64" in out["refused"][2]


def test_a_subgroup_maps_its_ranks_to_global_ones(worlds):
    zero, _, two = worlds[3]
    assert zero["subgroup"] == ([0.0, 0.0, 2.0, 2.0], [2.0, 4.0], [0, 2])  # 0+2, 1+3
    assert two["subgroup"] == ([0.0, 0.0, 2.0, 2.0], [6.0, 8.0], [0, 2])  # 2+4, 3+5


def test_auto_reduces_by_scatter_when_pairwise(worlds):
    assert worlds[2][0]["sharded_reduce"] == ("reduce_scatter", "all_reduce")
