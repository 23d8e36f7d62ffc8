"""Edge cases at scale on the fake process group ([Note: dry run] in comm/dry.py), each
asserting numbers: a parameter smaller than the world, fewer ZeRO-3 units than ranks, a
tensor-parallel degree that does not divide a layer, and the job's uneven micro-batches
across 1,000 ranks; and the `--dry-run` command's one-line refusals and its `--json`."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.cli import main
from dataparallel.data.stream import SampleStream, split_evenly
from dataparallel.models import build_model
from dataparallel.plan.dry_engine import traced_collectives
from dataparallel.plan.dry_render import render
from dataparallel.plan.dry_roles import layouts_of
from dataparallel.plan.dry_run import dry_run
from dataparallel.plan.errors import PlanError


@pytest.fixture(autouse=True)
def no_world_left():
    """The dry run starts its fake group in this process: a world of one an earlier test module
    left behind (test_api's did, and every dry-run test failed in the full suite) goes first."""
    dp.destroy()


def test_a_parameter_smaller_than_the_world():
    """gpt-small's norms and biases (256 elements) over 4,096 ranks: most ranks hold nothing of
    them; ZeRO-2's last ranks hold shards of padding only, whose fp32 masters are allocated
    all the same (memory_report missed them before the dry run found it)."""
    result = dry_run("gpt-small", ranks=4096, strategy="zero2", precision="bf16-params",
                     seq_len=16, peak=False)  # fmt: skip
    assert result.differences() == [], render(result)
    policy, shapes = _planned("zero2", "bf16-params")
    layouts = layouts_of(policy, shapes, 4096)
    assert len(layouts) == 3  # 25 MB buckets of bf16
    assert (
        sum(1 for n in shapes.numels if n < 4096) == 42
    )  # norms, biases, position embedding rows...
    roles = {run.role.shard_rank: run for run in result.runs}
    assert sorted(roles) == [0, 4078, 4095]
    last = roles[4095]
    assert last.held["master_params"] == sum(layout.shard_numel for layout in layouts) * 4 == 3220
    assert last.held["optimizer_state"] == 3220  # masters only: no piece, no Adam state
    assert "padded" in last.role.why and roles[0].held["optimizer_state"] == 9660


def _planned(strategy: str, precision: str):
    """The planner's policy and parameter shapes of gpt-small over 4,096 ranks."""
    from dataparallel.plan import plan
    from dataparallel.plan.strategies import policy_of

    p = plan("gpt-small", ranks=4096, strategies=[strategy], shard_sizes=[4096],
             precision=precision, seq_len=16)  # fmt: skip
    return policy_of(p.rows[0].candidate, p.inputs), p.model.param_shapes


def test_fewer_zero3_units_than_ranks():
    """gpt-small has 5 ZeRO-3 units (the root and 4 blocks) for 4,096 ranks: each rank holds
    ceil(unit / 4096) elements of each, the last ranks padding of some."""
    result = dry_run("gpt-small", ranks=4096, strategy="zero3", seq_len=16, peak=False)
    assert result.differences() == [], render(result)
    units = _planned("zero3", "fp32")[1].units
    assert len(units) == 5
    shard = sum(-(-sum(unit) // 4096) for unit in units)
    for run in result.runs:
        assert run.held["params"] == run.held["grads"] == shard * 4
    gathered, calls = result.runs[0].collectives[("all_gather", 4096)]
    padded = [-(-sum(unit) // 4096) * 4096 for unit in units]
    assert calls == 8 and gathered == (2 * sum(padded) - padded[0] - padded[-1]) * 4


def test_a_tp_degree_that_does_not_divide_a_layer_is_one_line():
    with pytest.raises(PlanError, match=r"^--tp: 3 does not divide the model's 4 heads; give a "):
        dry_run("gpt-small", ranks=12, strategy="zero3", tp=3, seq_len=16)
    with pytest.raises(PlanError, match=r"^--tp: 16 does not divide the model's 8 key/value"):
        dry_run("llama-8b", ranks=64, strategy="zero3", tp=16, seq_len=16)


def test_uneven_micro_batches_across_1000_ranks_pair_their_collectives():
    """A global batch of 2,500 windows, accum 2, over 1,000 ranks ([Note: uneven batches] in
    train/trainer.py): ranks 0..499 take 3 windows (micro-batches of 2 and 1), ranks 500..999
    take 2 (1 and 1). On the fake group, rank 0 and rank 999 run DDP's and ZeRO-3's step with
    their own micro-batches: the same collectives, of the same sizes, in the same number."""
    stream = SampleStream(10_000, seed=0)
    shares = [len(SampleStream(10_000, seed=0).take_share(2500, r, 1000)) for r in range(1000)]
    assert sum(shares) == 2500 and shares[0] == 3 and shares[999] == 2
    assert [len(p) for p in split_evenly(stream.take_share(2500, 0, 1000), 2)] == [2, 1]
    for strategy in ("ddp", "zero3"):
        seen = {}
        for rank in (0, 999):
            sizes = [len(p) for p in split_evenly(list(range(shares[rank])), 2)]
            seen[rank] = _step_collectives(strategy, rank, sizes)
        assert seen[0] == seen[999], strategy
        # DDP: its 2 buckets all-reduced once; ZeRO-3's first step: 3 units (the root and
        # gpt-tiny's 4 blocks of 250k parameters two by two, min_unit_params' default) gathered
        # in each micro-step's forward and again in backward (9: the last unit stays
        # gathered), 3 reduce-scatters in the last micro-step only
        assert {k: calls for k, (_, calls) in seen[0].items()} == {
            "ddp": {("all_reduce", 1000): 2},
            "zero3": {("all_gather", 1000): 9, ("reduce_scatter", 1000): 3},
        }[strategy]


def _step_collectives(strategy: str, rank: int, micro: list[int]) -> dict:
    from dataparallel.comm import Tracer

    dp.init_fake(1000, rank)
    try:
        with torch.device("meta"):
            model = build_model("gpt-tiny")
        tracer = Tracer(enabled=False)
        model = dp.parallelize(model, strategy, tracer=tracer)
        opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
        tracer.enabled = True  # the step's collectives only (not parallelize's broadcast)
        for k, size in enumerate(micro):
            tokens = torch.zeros(size, 16, dtype=torch.long, device="meta")
            with dp.no_sync(model) if k < len(micro) - 1 else _nothing():
                F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        out, _ = traced_collectives(tracer)
        del model, opt
        return out
    finally:
        dp.destroy()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_dry_run_command_refuses_bare_counts_and_runs(capsys):
    assert main(["plan", "--dry-run", "--params", "7e9", "--ranks", "8", "--strategy",
                 "zero3"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines() == [
        "dataparallel plan: error: --params: a bare parameter count names no architecture to "
        "run; give --model NAME with --dry-run"
    ]
    assert main(["plan", "--dry-run", "--model", "gpt-tiny", "--ranks", "8", "--strategy",
                 "zero3", "--optimizer", "12"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip() == (
        "dataparallel plan: error: --optimizer: '12': bytes per parameter name no optimizer to "
        "run; give one of adam, adamw, sgd"
    )
    assert main(["plan", "--dry-run", "--model", "gpt-tiny", "--ranks", "64", "--strategy",
                 "zero2", "--shard-size", "8", "--seq-len", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "agrees: held bytes and collectives equal the plan" in out
    assert "reduce_scatter        8" in out


def test_dry_run_json_is_the_plans_json_with_the_roles_beside_it(capsys):
    """`--dry-run --json`: `plan --json`'s fields, its row of the candidate as it prints it,
    and one entry per role with the engine's bytes beside the plan's. gpt-tiny (1,058,400
    parameters, fp32, AdamW) under ZeRO-2 on shard groups of 8 of 64 ranks: each rank holds
    every parameter, 1/8 of the gradients and of AdamW's 8 bytes per parameter."""
    argv = ["plan", "--model", "gpt-tiny", "--ranks", "64", "--strategy", "zero2",
            "--shard-size", "8", "--seq-len", "16", "--json"]  # fmt: skip
    assert main(argv) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main([*argv, "--dry-run"]) == 0
    got = json.loads(capsys.readouterr().out)
    fields = ("model", "params", "ranks", "tp", "hardware")
    assert {k: got[k] for k in fields} == {k: planned[k] for k in fields}
    assert (got["model"], got["params"], got["ranks"], got["tp"]) == ("gpt-tiny", 1058400, 64, 1)
    assert got["rows"] == [row for row in planned["rows"] if row["label"] == "zero2 S=8"]
    dry = got["dry_run"]
    assert dry["label"] == "zero2 S=8" and dry["agrees"] is True and dry["differences"] == []
    assert dry["peak_compared"] is False and dry["peak_tolerance"] == 0.01
    none = "holds none of a parameter"  # its shard of a bucket covers only some parameters
    assert [(r["rank"], r["shard_rank"], r["why"]) for r in dry["roles"]] == [
        (0, 0, ["first", none]),
        (7, 7, ["last", none]),
    ]
    held = {"params": 4 * 1058400, "grads": 4 * 1058400 // 8, "optimizer_state": 1058400,
            "master_params": 0}  # fmt: skip
    sent = {("all_gather", 8): 4233600, ("all_reduce", 8): 529200, ("reduce_scatter", 8): 4233600}
    for role in dry["roles"]:
        assert role["held_bytes"] == role["planned_bytes"] == held
        assert got["rows"][0]["held_bytes"] == sum(held.values())
        assert {
            (c["kind"], c["group_size"]): c["engine_bytes"] for c in role["collectives"]
        } == sent
        assert all(c["engine_bytes"] == c["plan_bytes"] for c in role["collectives"])
        assert role["peak_bytes"] == sum(t["engine_bytes"] for t in role["peak_terms"])
        assert role["peak_bytes"] > sum(held.values())
        assert sum(t["plan_bytes"] for t in role["peak_terms"]) == pytest.approx(
            got["rows"][0]["peak_bytes"], abs=4
        )
        assert set(role["seconds"]) == {"parallelize", "build_optimizer", "first step", "step"}
