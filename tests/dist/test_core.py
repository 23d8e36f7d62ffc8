"""The shared core across real ranks: the precision grid on 1-D and 2-D meshes, loss scaling.

Every strategy x {fp32, bf16 autocast, bf16 parameters with fp32 masters (reduced in bf16, or
in fp32), fp32 parameters reduced in bf16, fp16 parameters with a loss scaler} x {1-D, 2 x 2
mesh} trains a GPT for a few SGD steps on 4 ranks, against one process on the global batch
that computes in the same precision (low-precision parameters there too, fp32 masters beside
them). SGD, not Adam: Adam's update does not change when the gradient is scaled, so it would
hide a wrong mean. Tolerances: 1e-5 for fp32 (summation order only). Low precision: LOW_TOL of
how far the reference's parameters moved. A bf16 number has 8 bits of mantissa (relative
rounding 4e-3) and the N-rank run rounds partial sums the one-process run never forms, so the
gradients differ by a few roundings, and so do the updates made of them.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss

STEPS = 4
PER_RANK = 2
TOL = 1e-5
LOW_TOL = 0.02  # max |ours - reference| / max movement, for bf16/fp16 (module docstring)
SMALL = {"bucket_mb": 0.01, "first_bucket_mb": 0.002}
BF16, FP16 = torch.bfloat16, torch.float16


def policy(name: str, precision):
    if name == "ddp":
        return dp.DDP(precision=precision, **SMALL)
    if name == "zero1":
        return dp.ZeRO1(precision=precision, **SMALL)
    if name == "zero2":
        return dp.ZeRO2(precision=precision, **SMALL)
    return dp.ZeRO3(precision=precision)


PRECISIONS = {
    "fp32": None,
    "bf16-autocast": None,
    "bf16-params": dp.MixedPrecision(param_dtype=BF16),
    "bf16-params-fp32-reduce": dp.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32),
    "bf16-reduce": dp.MixedPrecision(reduce_dtype=BF16),
    "fp16-params": dp.MixedPrecision(param_dtype=FP16),
}


class Reference:
    """One process on the global batch, in `param_dtype` with fp32 masters when given."""

    def __init__(self, model_name, param_dtype, seed):
        self.model = build(model_name, seed)
        self.masters = [p.detach().clone() for p in self.model.parameters()]
        for m in self.masters:
            m.requires_grad_(True)
        if param_dtype is not None:
            self.model.to(param_dtype)
        self.initial = [m.detach().clone() for m in self.masters]
        self.opt = torch.optim.SGD(self.masters, lr=0.1, momentum=0.9)

    def step(self, model_name, x, y, step, n, autocast):
        with torch.autocast("cpu", BF16, enabled=autocast):
            loss = reference_loss(model_name, self.model, x, y, step, n)
        loss.float().backward()
        for m, p in zip(self.masters, self.model.parameters(), strict=True):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.masters, self.model.parameters(), strict=True):
                p.copy_(m)


@functools.cache
def reference_run(model_name: str, precision_name: str, n: int) -> Reference:
    """The Reference after STEPS steps on the global batches of n ranks: trained once per rank
    for every case of the same model and precision (the accumulation cases and every
    strategy and mesh share it; it does not depend on them)."""
    precision = PRECISIONS[precision_name]
    param_dtype = precision.param_dtype if precision is not None else None
    reference = Reference(model_name, param_dtype, seed=3)
    for step in range(STEPS):
        x, y = batch(model_name, step, PER_RANK * n)
        reference.step(model_name, x, y, step, n, precision_name == "bf16-autocast")
    return reference


def train(
    world, name, precision_name, mesh, model_name="transformer", accum: str | None = None
) -> tuple[float, float]:
    """max |ours - reference| over every parameter after STEPS steps, and the largest distance
    a reference parameter moved. `accum`: two micro-batches per step, the first backward under
    `no_sync` ("no_sync") or both synchronised ("sync")."""
    precision = PRECISIONS[precision_name]
    param_dtype = precision.param_dtype if precision is not None else None
    autocast = precision_name == "bf16-autocast"
    reference = reference_run(model_name, precision_name, world.world_size)
    model = dp.parallelize(build(model_name, 3 + world.rank), policy(name, precision), mesh=mesh)
    opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if param_dtype == FP16 else None
    n, rank = world.world_size, world.rank
    for step in range(STEPS):
        x, y = batch(model_name, step, PER_RANK * n)
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        if accum is not None:
            for micro_x, micro_y in zip(mine[0].chunk(2), mine[1].chunk(2), strict=True):
                sync = dp.no_sync(model) if accum == "no_sync" and micro_x is mine[0].chunk(2)[0] else contextlib.nullcontext()
                with sync:
                    loss = loss_fn(model_name, model, micro_x, micro_y, step, rank) / 2
                    loss.backward()
            opt.step()
            opt.zero_grad()
            continue
        with torch.autocast("cpu", BF16, enabled=autocast):
            loss = loss_fn(model_name, model, *mine, step, rank)
        if scaler is not None:
            scaler.scale(loss.float()).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.float().backward()
            opt.step()
        opt.zero_grad()
    ours = dp.full_state_dict(model)
    names = [k for k, _ in build(model_name, 0).named_parameters()]
    diff = max(
        (ours[k].float() - m.detach()).abs().max().item()
        for k, m in zip(names, reference.masters, strict=True)
    )
    moved = max(
        (m.detach() - m0).abs().max().item()
        for m, m0 in zip(reference.masters, reference.initial, strict=True)
    )
    return diff, moved


def against_fsdp2_hsdp(world, shard: int, mesh) -> dict:
    """ZeRO-2/3 on a (replicate, shard) mesh and FSDP2's fully_shard on the same 2-D DeviceMesh
    (HSDP), from the same weights on the same data: max |ours - theirs| after STEPS SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n, rank = world.world_size, world.rank
    device_mesh = init_device_mesh("cpu", (n // shard, shard), mesh_dim_names=("rep", "shard"))
    theirs = build("transformer", 3)
    for block in theirs.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(theirs, mesh=device_mesh)
    pairs = [(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9))]
    for name in ("zero2", "zero3"):
        ours = dp.parallelize(build("transformer", 3 + rank), policy(name, None), mesh=mesh)
        pairs.append((ours, dp.build_optimizer(ours, torch.optim.SGD, lr=0.1, momentum=0.9)))
    for step in range(STEPS):
        x, y = batch("transformer", step, PER_RANK * n)
        for model, opt in pairs:
            loss_fn("transformer", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank).backward()
            opt.step()
            opt.zero_grad()
    reference = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    out = {}
    for name, (model, _) in zip(("zero2", "zero3"), pairs[1:], strict=True):
        ours = dp.full_state_dict(model)
        out[name] = max((ours[k] - reference[k]).abs().max().item() for k in reference)
    return out


def grid(world) -> dict:
    out = {}
    mesh = dp.init_mesh(2)  # 2 x 2 on 4 ranks
    for name, diff in against_fsdp2_hsdp(world, 2, mesh).items():
        out[name, "fsdp2-hsdp", "2x2"] = (diff, 1.0)
    for name in ("zero1", "zero2", "zero3"):  # Adam's 8 bytes per parameter over S = 2, not 4
        model = dp.parallelize(build("transformer", 3), policy(name, None), mesh=mesh)
        opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
        x, y = batch("transformer", 0, PER_RANK)
        loss_fn("transformer", model, x, y, 0, 0).backward()
        opt.step()
        psi = sum(p.numel() for p in build("transformer", 3).parameters())
        out[name, "memory", "2x2"] = dp.memory_report(model, opt)["optimizer_state"] / (4 * psi)
    for precision_name in PRECISIONS:
        for name in ("ddp", "zero1", "zero2", "zero3"):
            out[name, precision_name, "1-D"] = train(world, name, precision_name, None)
            if name != "ddp":  # DDP is the S = 1 case: it takes no mesh
                out[name, precision_name, "2x2"] = train(world, name, precision_name, mesh)
    for accum in ("no_sync", "sync"):  # accumulation, in the buckets' dtype (fp32 for the 2nd)
        for precision_name in ("fp32", "bf16-params-fp32-reduce"):
            for name in ("ddp", "zero1", "zero2", "zero3"):
                for layout, mesh_or_none in (("1-D", None), ("2x2", mesh)):
                    if name == "ddp" and mesh_or_none is not None:
                        continue
                    key = (name, f"{precision_name} accum {accum}", layout)
                    out[key] = train(world, name, precision_name, mesh_or_none, accum=accum)
    return out


@functools.cache
def grid_results():
    return run_world(4, grid, timeout=600)


@pytest.mark.parametrize("precision_name", list(PRECISIONS))
def test_every_strategy_and_mesh_matches_one_process(precision_name):
    for results in grid_results():
        cases = {k: v for k, v in results.items() if k[1] == precision_name}
        assert len(cases) == 7, cases
        for diff, moved in cases.values():
            assert moved > 0.01, cases  # the parameters did move
            if precision_name == "fp32":
                assert diff < TOL, cases
            else:
                assert diff < LOW_TOL * moved, cases


@pytest.mark.parametrize("accum", ["no_sync", "sync"])
def test_accumulated_micro_batches_match_the_whole_batch(accum):
    for results in grid_results():
        cases = {k: v for k, v in results.items() if k[1].endswith(f"accum {accum}")}
        assert len(cases) == 14, cases
        for (_, precision_name, _), (diff, moved) in cases.items():
            tol = TOL if precision_name.startswith("fp32") else LOW_TOL * moved
            assert diff < tol, cases


def test_2x2_memory_is_sharded_over_the_shard_group():
    for results in grid_results():
        ratios = {k: v for k, v in results.items() if k[1] == "memory"}
        assert len(ratios) == 3 and all(abs(r - 1) < 0.05 for r in ratios.values()), ratios


def test_2x2_equals_fsdp2_hsdp():
    for results in grid_results():
        cases = {k: v[0] for k, v in results.items() if k[1] == "fsdp2-hsdp"}
        assert len(cases) == 2 and all(d < TOL for d in cases.values()), cases


def meshes(world) -> dict:
    """6 ranks as 3 x 2 and 2 x 3 (replicate x shard): ZeRO-2 and ZeRO-3, fp32, against one
    process and against FSDP2 on the same 2-D DeviceMesh."""
    out = {}
    for shard in (2, 3):
        mesh = dp.init_mesh(shard)
        for name in ("zero2", "zero3"):
            out[name, shard, "one process"] = train(world, name, "fp32", mesh)[0]
        for name, diff in against_fsdp2_hsdp(world, shard, mesh).items():
            out[name, shard, "fsdp2"] = diff
    return out


def test_six_ranks_as_2x3_and_3x2():
    for results in run_world(6, meshes, timeout=600):
        assert len(results) == 8 and all(d < TOL for d in results.values()), results


def scaling(world) -> dict:
    """torch.amp.GradScaler with fp16 parameters, and with fp32 parameters under fp16
    autocast; rank 1 injects an inf into one element of its local gradient."""
    out = {}
    for name, autocast in [(n, a) for n in ("ddp", "zero1", "zero2", "zero3") for a in (0, 1)]:
        precision = None if autocast else PRECISIONS["fp16-params"]
        model = dp.parallelize(build("mlp", 5), policy(name, precision))
        opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        first = next(model.parameters())
        poison = {"on": False}

        def inject(grad, poison=poison):
            if poison["on"] and world.rank == 1:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")  # one element: lands in one rank's shard
            return grad

        first.register_hook(inject)
        scales, skipped = [], []
        for step in range(5):
            poison["on"] = step == 2
            x, y = batch("mlp", step, 2 * world.world_size)
            n, rank = world.world_size, world.rank
            with torch.autocast("cpu", FP16, enabled=bool(autocast)):
                loss = loss_fn("mlp", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank)
            before_params = dp.full_state_dict(model)
            before_state = copy.deepcopy(dp.optimizer_state_dict(model, opt))
            scaler.scale(loss.float()).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if step == 2:
                after_params = dp.full_state_dict(model)
                after_state = dp.optimizer_state_dict(model, opt)
                skipped.append(
                    all(torch.equal(before_params[k], after_params[k]) for k in after_params)
                )
                skipped.append(_same_state(before_state, after_state))
                skipped.append(scaler.get_scale() == scale * 0.5)
            opt.zero_grad()
        out[name, "fp16 autocast" if autocast else "fp16 parameters"] = {
            "scales": scales,
            "skipped": skipped,
        }
    return out


def _same_state(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys():
        return False
    for index, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][index][key]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            if not same:
                return False
    return True


def test_loss_scaling_skips_together_and_backs_off():
    for results in run_world(2, scaling):
        assert len(results) == 8
        for name, r in results.items():
            # 2**8, doubled after 2 finite steps, halved at the inf, then doubled again
            assert r["scales"] == [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9], (name, r)
            assert r["skipped"] == [True, True, True], (name, r)


def conv_net(norm) -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        norm(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )


def norm_layers(world) -> dict:
    """A Hugging-Face-ResNet-like net (conv, BatchNorm) fed fp32 images, bf16 parameters, every
    strategy: SyncBatchNorm against one process with BatchNorm on the global batch; plain
    BatchNorm2d runs, its statistics stay fp32."""
    out = {}
    n, rank = world.world_size, world.rank
    bf16 = dp.MixedPrecision(param_dtype=BF16)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4 * n, 3, 6, 6, generator=g), torch.randn(4 * n, 3, generator=g))]
    data = data * 3
    reference = conv_net(torch.nn.BatchNorm2d)
    initial = [p.detach().clone() for p in reference.parameters()]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(reference.parameters(), initial))
    for norm_name, norm in (("sync", dp.SyncBatchNorm), ("plain", torch.nn.BatchNorm2d)):
        for name in ("ddp", "zero1", "zero2", "zero3"):
            model = dp.parallelize(conv_net(norm), policy(name, bf16))
            opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1)
            for x, y in data:
                pred = model(x.chunk(n)[rank])  # float32 images into a bf16 model
                torch.nn.functional.mse_loss(pred.float(), y.chunk(n)[rank]).backward()
                opt.step()
                opt.zero_grad()
            state = dp.full_state_dict(model)
            bn = model[1]
            entry = {
                "buffers": sorted({str(b.dtype) for b in bn.buffers() if b.is_floating_point()}),
                "finite": all(torch.isfinite(v).all() for v in state.values()),
            }
            if norm_name == "sync":
                ref = reference.state_dict()
                entry["diff"] = max((state[k] - ref[k]).abs().max().item() for k in ref)
            out[norm_name, name] = entry
    out["moved"] = moved
    return out


def test_batchnorm_under_bf16_parameters_stays_fp32():
    for results in run_world(2, norm_layers):
        moved = results.pop("moved")
        for (norm_name, name), entry in results.items():
            assert entry["buffers"] == ["torch.float32"] and entry["finite"], (name, entry)
            if norm_name == "sync":  # bf16 convolutions: a few roundings of the update
                assert entry["diff"] < 0.05 * moved, (name, entry, moved)
