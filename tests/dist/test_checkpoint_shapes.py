"""Checkpoints in the ecosystem's shape, on real ranks: PyTorch's own `dcp_to_torch_save` on
a checkpoint of every strategy gives the model's state dict (its "model" entry), which a fresh
plain model loads strictly and which equals `dp.full_state_dict`; the optimizer's tensors come
by parameter name in the parameter's shape ([Note: checkpoint chunks] in checkpoint/dcp.py).

One world of 4 ranks: DDP, ZeRO-1/2/3 on 4 ranks and ZeRO-2/3 on a 2 x 2 mesh with a GPT
whose embedding and head are tied (so a flat shard cuts matrices mid-row), and ZeRO-2/3 over
tensor parallelism (dp 2 x tp 2, column- and row-split weights)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import dataparallel as dp
from dataparallel.checkpoint import save_chunks, state_chunks

from . import models
from .harness import run_world
from .tp_net import Net, batch, layout

CASES = ["ddp", "zero1", "zero2", "zero3", "zero2@2x2", "zero3@2x2", "zero2+tp", "zero3+tp"]


def _trained(world, case: str):
    """The model and optimizer of `case` after 2 steps of AdamW."""
    strategy, _, form = case.partition("@")
    if case.endswith("+tp"):
        model, optimizer = layout(world, 2, 2, strategy.removesuffix("+tp"))
        x, y = batch("net", 0, 8)
        chunk = world.rank // 2
        x, y = x.chunk(2)[chunk], y.chunk(2)[chunk]
        loss = lambda: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731
    else:
        model = models.build("tied", 0)
        dp.parallelize(model, strategy, mesh=dp.init_mesh(2) if form else None)
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        x, y = models.batch("tied", 0, 8)
        x, y = x.chunk(4)[world.rank], y.chunk(4)[world.rank]
        loss = lambda: models.loss_fn("tied", model, x, y, 0, world.rank)  # noqa: E731
    for _ in range(2):
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _fresh(case: str):
    return Net() if case.endswith("+tp") else models.build("tied", 1)


def grid(world, root: str) -> dict:
    """Per case: (strict load's missing + unexpected keys, max |torch.load - full_state_dict|
    over the model, max |stored moment - ours| over the optimizer, keys whose shape differs)."""
    out = {}
    for case in CASES:
        model, optimizer = _trained(world, case)
        folder = f"{root}/{case}"
        save_chunks(state_chunks(model, optimizer, rank=world.rank), folder, world.group)
        weights = dp.full_state_dict(model)
        state = dp.optimizer_state_dict(model, optimizer)["state"]
        if world.rank != 0:
            continue
        dcp_to_torch_save(folder, f"{folder}.pt")
        stored = torch.load(f"{folder}.pt", weights_only=True)
        fresh = _fresh(case)
        result = fresh.load_state_dict(stored["model"], strict=False)
        keys = len(result.missing_keys) + len(result.unexpected_keys)
        got = fresh.state_dict()
        diff = max((got[k] - weights[k]).abs().max().item() for k in weights)
        names = [n for n, _ in fresh.named_parameters()]  # the optimizer's order
        moments = 0.0
        shapes = 0
        for index, entry in state.items():
            for key, value in entry.items():
                ours = stored["optim"][names[index]][key]
                shapes += ours.shape != value.shape
                moments = max(moments, (ours - value).abs().max().item())
        out[case] = (keys, diff, moments, shapes)
    return out


def test_every_strategy_through_dcp_to_torch_save_loads_strictly_and_equals_full_state(
    tmp_path,
):
    results = run_world(4, grid, str(tmp_path), timeout=300)[0]
    print(results)
    assert len(results) == len(CASES) == 8
    assert results == {case: (0, 0.0, 0.0, 0) for case in CASES}, results


def _write_flat_format(model, optimizer, folder: str) -> None:
    """A checkpoint as the flat format wrote it (before true shapes; built by hand here, by
    one process): each tensor 1-D under "model/<param>", "buffer/<name>",
    "optim/<param>/<key>" (scalars 0-d), no nesting."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    weights = dp.full_state_dict(model)
    state = dp.optimizer_state_dict(model, optimizer)["state"]
    if torch.distributed.get_rank() != 0:
        return
    params = dict(model.named_parameters())
    flat = {}
    for name, tensor in weights.items():
        flat[f"{'model' if name in params else 'buffer'}/{name}"] = tensor.reshape(-1).clone()
    names = list(params)
    for index, entry in state.items():
        for key, value in entry.items():
            value = value.reshape(()) if value.dim() == 0 else value.reshape(-1)
            flat[f"optim/{names[index]}/{key}"] = value.clone()
    dcp.save(
        flat,
        storage_writer=dcp.FileSystemWriter(folder),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )


def flat_format(world, root: str) -> dict:
    """A flat-format checkpoint of ZeRO-1 on 4 ranks, loaded under each strategy: the largest
    difference from what was written, over the weights and the optimizer state."""
    from dataparallel.checkpoint import load_state

    from .tied_model import build, parallelize
    from .tied_model import plain as plain_state

    model = build(0)
    optimizer = parallelize(model, "zero1")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(world.rank))
    model(x).square().mean().backward()
    optimizer.step()
    folder = f"{root}/flat"
    _write_flat_format(model, optimizer, folder)
    torch.distributed.barrier()
    weights, state = plain_state(model, optimizer)
    out = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        target = build(1)
        target_optimizer = parallelize(target, name)
        load_state(folder, target, target_optimizer, rank=world.rank, group=world.group)
        got, got_state = plain_state(target, target_optimizer)
        diff = max((got[k] - weights[k]).abs().max().item() for k in weights)
        for index, entry in state.items():
            for key, value in entry.items():
                diff = max(diff, (got_state[index][key] - value).abs().max().item())
        out[name] = diff
    return out


def test_a_checkpoint_of_the_flat_format_resumes_under_every_strategy(tmp_path):
    results = run_world(4, flat_format, str(tmp_path), timeout=300)[0]
    assert results == {"ddp": 0.0, "zero1": 0.0, "zero2": 0.0, "zero3": 0.0}, results
