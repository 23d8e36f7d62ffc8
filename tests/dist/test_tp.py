"""Data parallelism over tensor-parallel models (docs/core.md, "Hybrid parallelism").

4 ranks as dp 2 x tp 2 (`init_device_mesh("cpu", (2, 2), ("dp", "tp"))`): a model split with
PyTorch's ColwiseParallel / RowwiseParallel on "tp", then `dp.parallelize(..., mesh=mesh["dp"])`
with every strategy, several AdamW steps clipped by a global norm that bites, against one process
on the global batch and against PyTorch's FSDP2 (`fully_shard` on mesh["dp"]) over the same
tensor-parallel model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dataparallel as dp

from .harness import run_world
from .models import GPT, GPTConfig
from .tp_net import ADAMW, Net, batch, layout, parallelize_module_, plan

STEPS = 4
PER_RANK = 4  # samples per data-parallel rank
MAX_NORM = 0.05  # below every step's norm here: clipping bites


def build(name: str) -> nn.Module:
    torch.manual_seed(7)
    if name == "net":
        return Net()
    config = GPTConfig(
        vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False, bias=False
    )
    return GPT(config)


def loss_of(name: str, model: nn.Module, x, y) -> torch.Tensor:
    out = model(x)
    if name == "net":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def reference(name: str, dp_size: int) -> tuple[dict, list[float]]:
    """One process on the global batch: the mean of the data-parallel ranks' chunk losses."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    norms = []
    for step in range(STEPS):
        x, y = batch(name, step, PER_RANK * dp_size)
        chunks = zip(x.chunk(dp_size), y.chunk(dp_size), strict=True)
        torch.stack([loss_of(name, model, cx, cy) for cx, cy in chunks]).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


def tensor_parallel(name: str, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    model = build(name)
    return parallelize_module(model, mesh["tp"], plan(name, model))


def train(name: str, model, opt, mesh, clip) -> list[float]:
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    norms = []
    for step in range(STEPS):
        x, y = batch(name, step, PER_RANK * dp_size)
        loss_of(name, model, x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]).backward()
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad()
    return norms


def full_diff(ours: dict, theirs: dict) -> float:
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].shape == theirs[k].shape, k
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


@torch.no_grad()
def clip_dtensors(model: nn.Module) -> float:
    """torch's clip over DTensor gradients on two meshes (("dp",) and ("dp", "tp")), which
    torch.nn.utils.clip_grad_norm_ refuses to stack: one norm per mesh, as torchtitan does."""
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    squares = [torch.nn.utils.get_total_norm(g).full_tensor() ** 2 for g in by_mesh.values()]
    total = torch.stack(squares).sum().sqrt()
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0).item()
    for grads in by_mesh.values():
        for g in grads:
            g.mul_(coef)
    return total.item()


def fsdp2(name: str, mesh) -> tuple[dict, list[float]]:
    """PyTorch's own composition: fully_shard on mesh["dp"] over the tensor-parallel model."""
    from torch.distributed.fsdp import fully_shard

    model = tensor_parallel(name, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    norms = train(name, model, opt, mesh, clip_dtensors)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}, norms


def grid(world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name in ("net", "transformer"):
        expected, expected_norms = reference(name, 2)
        initial = build(name).state_dict()
        out[name, "reference", "moved"] = full_diff(expected, initial)
        theirs, their_norms = fsdp2(name, mesh)
        out[name, "fsdp2", "one process"] = full_diff(theirs, expected)
        for strategy in ("ddp", "zero1", "zero2", "zero3"):
            model = dp.parallelize(tensor_parallel(name, mesh), strategy, mesh=mesh["dp"])
            opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
            norms = train(name, model, opt, mesh, lambda m: dp.clip_grad_norm_(m, MAX_NORM))
            ours = dp.full_state_dict(model)
            out[name, strategy, "one process"] = full_diff(ours, expected)
            out[name, strategy, "fsdp2"] = full_diff(ours, theirs)
            out[name, strategy, "norms"] = max(
                abs(a - b) / b for a, b in zip(norms, expected_norms, strict=True)
            )
            out[name, strategy, "clipped"] = min(expected_norms) / MAX_NORM
            # AdamW's two moments, 8 bytes per element of the local tensors (tp halves the
            # split ones), over the dp ranks for the sharded strategies
            local = sum(p.numel() for p in model.parameters())
            held = dp.memory_report(model, opt)["optimizer_state"]
            share = 1 if strategy == "ddp" else 2
            out[name, strategy, "adam bytes"] = abs(held / (8 * local / share) - 1)
            whole = sum(t.numel() for t in expected.values())
            out[name, strategy, "local share"] = local / whole
    return out


def test_every_strategy_over_tensor_parallel_matches_one_process_and_fsdp2(four_ranks):
    results = [r["grid"] for r in four_ranks]
    for key, value in results[0].items():
        print(key, f"{value:.2e}")
    for rank_results in results:
        # per model: the reference's movement, FSDP2's diff, then 6 numbers per strategy
        assert len(rank_results) == 2 * (2 + 4 * 6), list(rank_results)
        for (name, strategy, against), value in rank_results.items():
            if against == "moved":
                assert value > 1e-3, name  # the steps moved the parameters
            elif against == "clipped":
                assert value > 2, (name, strategy)  # every step's norm is clipped
            elif against == "adam bytes":
                assert value < 0.05, (name, strategy, value)  # padding at most
            elif against == "local share":
                assert 0.5 < value < 0.8, (name, strategy, value)  # the MLPs are split
            elif against == "norms":
                assert value < 1e-5, (name, strategy, value)
            else:
                assert value <= 2e-5, (name, strategy, against, value)


def mesh_forms(world) -> dict:
    """The same data-parallel layout given four ways trains to the same weights."""
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = dp.init_mesh(2)
    forms = {
        "init_mesh": hsdp,
        "init_mesh.device_mesh": hsdp.device_mesh,
        "DeviceMesh (replicate, shard)": init_device_mesh(
            "cpu", (2, 2), mesh_dim_names=("replicate", "shard")
        ),
    }
    flat = {"no mesh": None, "1-D DeviceMesh": init_device_mesh("cpu", (4,))}
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    out = {}
    for strategy in ("zero2", "zero3"):
        for layout in (forms, flat):
            results = {}
            for form, given in layout.items():
                model = dp.parallelize(build("net"), strategy, mesh=given)
                opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
                train("net", model, opt, mesh, lambda m: dp.clip_grad_norm_(m, MAX_NORM))
                results[form] = dp.full_state_dict(model)
            first = next(iter(results.values()))
            for form, state in results.items():
                out[strategy, form] = full_diff(state, first)
    try:
        dp.parallelize(build("net"), "zero2", mesh=mesh)
    except ValueError as error:
        out["error"] = str(error)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:  # the tensor-parallel dimension given as the data-parallel one
        dp.parallelize(tensor_parallel("net", tp), "zero2", mesh=tp["tp"])
    except ValueError as error:
        out["overlap"] = str(error)
    return out


def test_mesh_takes_a_device_mesh_and_init_mesh_alike(four_ranks):
    results = [dict(r["mesh forms"]) for r in four_ranks]
    for rank_results in results:
        error = rank_results.pop("error")
        assert "pass its data-parallel part" in error and "('dp', 'tp')" in error
        assert "shares ranks" in rank_results.pop("overlap")
        assert len(rank_results) == 2 * (3 + 2), list(rank_results)  # 2 strategies x 5 forms
        for key, value in rank_results.items():
            assert value == 0.0, key  # the same groups: bit for bit


def three_dimensions(world) -> dict:
    """replicate 2 x shard 2 x tp 2 on 8 ranks: HSDP over the tensor-parallel model."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    data = mesh["replicate", "shard"]._flatten("dp")  # the data rank, for the batch slice
    slicing = {"dp": data, "tp": mesh["tp"]}
    expected, _ = reference("net", 4)
    out = {}
    for strategy in ("zero2", "zero3"):
        model = tensor_parallel("net", slicing)
        model = dp.parallelize(model, strategy, mesh=mesh["replicate", "shard"])
        opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
        train("net", model, opt, slicing, lambda m: dp.clip_grad_norm_(m, MAX_NORM))
        out[strategy] = full_diff(dp.full_state_dict(model), expected)
    return out


def test_replicate_shard_and_tensor_parallel_on_eight_ranks():
    results = run_world(8, three_dimensions, timeout=300)
    print(results[0])
    for rank_results in results:
        assert list(rank_results) == ["zero2", "zero3"], rank_results
        for strategy, value in rank_results.items():
            assert value <= 2e-5, (strategy, value)


def resharded(world, root: str) -> dict:
    """Save dp 2 x tp 2 (ZeRO-3 and ZeRO-2), load as dp 4 x tp 1, dp 1 x tp 4 and dp 2 x tp 2
    under other strategies: the whole weights and plain optimizer state, exactly."""
    from dataparallel.checkpoint import (
        check_same_model,
        load_state,
        model_shapes,
        save_chunks,
        state_chunks,
    )

    out = {}
    for source in ("zero3", "zero2"):
        model, opt = layout(world, 2, 2, source)
        x, y = batch("net", 0, 8)
        for step in range(2):
            x, y = batch("net", step, 8)
            dp_rank = world.rank // 2
            F.mse_loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank]).backward()
            dp.clip_grad_norm_(model, MAX_NORM)
            opt.step()
            opt.zero_grad()
        folder = f"{root}/{source}"
        save_chunks(state_chunks(model, opt, rank=world.rank), folder, world.group)
        weights = dp.full_state_dict(model)
        state = dp.optimizer_state_dict(model, opt)["state"]
        shapes = model_shapes(model)
        for dp_size, tp_size, strategy in ((4, 1, "zero2"), (1, 4, "zero3"), (2, 2, "ddp"),
                                           (4, 1, "zero3"), (2, 2, "zero1")):  # fmt: skip
            target, target_opt = layout(world, dp_size, tp_size, strategy, seed_shift=1)
            check_same_model(target, shapes)
            load_state(folder, target, target_opt, rank=world.rank, group=world.group)
            got = dp.full_state_dict(target)
            got_state = dp.optimizer_state_dict(target, target_opt)["state"]
            diff = full_diff(got, weights)
            for index, entry in state.items():
                for key, value in entry.items():
                    diff = max(diff, (got_state[index][key] - value).abs().max().item())
            out[f"{source} 2x2 -> {strategy} {dp_size}x{tp_size}"] = diff
    return out


def test_checkpoints_move_across_dp_and_tp_sizes(four_ranks):
    results = [r["resharded"] for r in four_ranks]
    print(results[0])
    for rank_results in results:
        assert len(rank_results) == 10
        assert max(rank_results.values()) == 0.0, rank_results


def compiled_blocks(world) -> dict:
    """Each block compiled (`block.compile()`) over the tensor-parallel net under ZeRO-3 (the
    strategy whose hooks change the parameters' storage between forwards; DDP compiles too,
    within 3.1e-7 of one process, left out to keep the test short)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.config.cache_size_limit = 64
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expected, _ = reference("net", 2)
    out = {}
    for strategy in ("zero3",):
        model = dp.parallelize(tensor_parallel("net", mesh), strategy, mesh=mesh["dp"])
        for block in model.blocks:
            block.compile()
        opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
        train("net", model, opt, mesh, lambda m: dp.clip_grad_norm_(m, MAX_NORM))
        out[strategy] = full_diff(dp.full_state_dict(model), expected)
    return out


def test_blocks_compiled_over_tensor_parallel(four_ranks):
    results = [r["compiled"] for r in four_ranks]
    print(results[0])
    for rank_results in results:
        assert list(rank_results) == ["zero3"], rank_results
        for strategy, value in rank_results.items():
            assert value <= 1e-4, (strategy, value)


def low_precision(world) -> dict:
    """bf16 parameters with fp32 masters and fp32 reduction over the tensor-parallel GPT: ours
    (ZeRO-2, ZeRO-3) against FSDP2 with the same MixedPrecisionPolicy on mesh["dp"]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16, fp32 = torch.bfloat16, torch.float32
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = tensor_parallel("transformer", mesh)
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(theirs, mesh=mesh["dp"], mp_policy=policy)
    opt = torch.optim.AdamW(theirs.parameters(), **ADAMW)
    train("transformer", theirs, opt, mesh, clip_dtensors)
    expected = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    moved = full_diff(expected, build("transformer").state_dict())
    out = {}
    precision = dp.MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)
    for strategy in (dp.ZeRO2(precision=precision), dp.ZeRO3(precision=precision)):
        model = dp.parallelize(tensor_parallel("transformer", mesh), strategy, mesh=mesh["dp"])
        opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
        train("transformer", model, opt, mesh, lambda m: dp.clip_grad_norm_(m, MAX_NORM))
        out[strategy.name] = full_diff(dp.full_state_dict(model), expected) / moved
    return out


def test_bf16_parameters_over_tensor_parallel_match_fsdp2(four_ranks):
    results = [r["low precision"] for r in four_ranks]
    print(results[0])
    for rank_results in results:
        assert list(rank_results) == ["zero2", "zero3"], rank_results
        for strategy, value in rank_results.items():
            assert value <= 0.02, (strategy, value)  # 2% of the movement, as docs/core.md


def _hooks_and_averagers(world) -> dict:
    """Compression and averagers act on the data-parallel dimension alone, as without TP."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}

    def run(policy, optimizer, averager=None):
        model = dp.parallelize(tensor_parallel("net", mesh), policy, mesh=mesh["dp"])
        opt = dp.build_optimizer(model, optimizer, lr=0.05)
        avg = averager(model, opt) if averager else None
        dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        for step in range(STEPS):
            x, y = batch("net", step, PER_RANK * dp_size)
            if avg is not None:  # each dp rank a replica: its own slice, no gradient reduction
                with dp.no_sync(model):
                    loss_of(
                        "net", model, x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
                    ).backward()
            else:
                loss_of(
                    "net", model, x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
                ).backward()
            opt.step()
            opt.zero_grad()
            if avg is not None:
                avg.step()
        return dp.full_state_dict(model), dp.wire_bytes(model)

    group = mesh["dp"].get_group()
    exact, exact_wire = run("ddp", torch.optim.SGD)
    int8, int8_wire = run(dp.DDP(comm_hook=dp.compression.build_hook("int8")), torch.optim.SGD)
    local, _ = run("ddp", torch.optim.SGD, lambda m, o: dp.LocalSGD(m, o, 1, group=group))
    streamed, _ = run(
        "ddp", torch.optim.SGD, lambda m, o: dp.DiLoCo(m, o, 2, group=group, fragments=2)
    )
    moved = full_diff(exact, build("net").state_dict())
    out["int8 vs exact"] = full_diff(int8, exact) / moved
    out["int8 wire"] = exact_wire / int8_wire
    out["local sgd vs ddp"] = full_diff(local, exact)
    out["streaming moved"] = full_diff(streamed, build("net").state_dict())
    return out


def test_compression_and_averagers_work_on_the_data_parallel_dimension(four_ranks):
    """int8 gradients over dp only (close to exact, fewer bytes on the wire); local SGD after
    every step with plain SGD inside equals DDP (the exactness anchor of averaging/local_sgd.py) over
    tensor parallelism; Streaming DiLoCo over it trains."""
    for r in [r["hooks"] for r in four_ranks]:
        assert r["int8 vs exact"] < 0.02, r
        # fewer bytes on the wire (2x here: on this tiny model int8's 1024-entry blocks are
        # mostly padding; tests/dist/test_wire.py measures the 4x of a larger one)
        assert 1.8 < r["int8 wire"] < 4.1, r
        assert r["local sgd vs ddp"] < 1e-6, r
        assert r["streaming moved"] > 1e-3, r


def _four_ranks(world, root: str) -> dict:
    """Every dp 2 x tp 2 case in one spawned world: one start-up instead of six (the compiled
    blocks last: they raise dynamo's cache limit for the process)."""
    return {
        "grid": grid(world),
        "mesh forms": mesh_forms(world),
        "resharded": resharded(world, root),
        "low precision": low_precision(world),
        "hooks": _hooks_and_averagers(world),
        "compiled": compiled_blocks(world),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return run_world(4, _four_ranks, str(root), timeout=900)
