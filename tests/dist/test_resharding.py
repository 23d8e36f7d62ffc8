"""Sharded checkpoints on real ranks: every (world size, strategy) writes, every other reads.

The grid: worlds of 1, 2, 3 and 4 ranks train a small model with AdamW under DDP, ZeRO-1,
ZeRO-2, ZeRO-3 (and, on 4 ranks, ZeRO-2 and ZeRO-3 on a 2 x 2 mesh) and save through
`checkpoint.state_chunks`; then every world loads every checkpoint under every strategy, and
the whole parameters and the plain optimizer state must equal what was saved, exactly (fp32).
A second test stops and resumes runs with compression state (PowerSGD, int8 and top-k error
feedback) and DiLoCo between synchronisations, in the same layout: the continuation must be
bit-identical to the run that never stopped.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.checkpoint import load_state, save_chunks, state_chunks
from dataparallel.compression import hook as compression

from .harness import run_world
from .regression import data
from .tied_model import build, parallelize, plain
from .tiny_trainer import TEXT, trained_samples

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
MESHED = ["zero2@2x2", "zero3@2x2"]


def strategies(world_size: int) -> list[str]:
    return STRATEGIES + (MESHED if world_size == 4 else [])


def save_all(world, root: str) -> list[str]:
    """Train 3 steps under each strategy and save; rank 0 keeps what was saved, in plain form,
    in root/saved-<n>.pt (tensors do not travel back through the harness's queue)."""
    saved = {}
    for name in strategies(world.world_size):
        model = build(0)
        optimizer = parallelize(model, name)
        for step in range(3):
            x, y = data(step, world.rank, 6)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        chunks = state_chunks(model, optimizer, rank=world.rank)
        save_chunks(chunks, f"{root}/{world.world_size}-{name}", world.group)
        saved[f"{world.world_size}-{name}"] = plain(model, optimizer)
    if world.rank == 0:
        torch.save(saved, f"{root}/saved-{world.world_size}.pt")
    return sorted(saved)


def load_all(world, root: str, sources: list[str], targets: list[str]) -> dict:
    """Load each source checkpoint under each target strategy; the largest difference from
    what was saved."""
    saved = {}
    for n in (1, 2, 3, 4):
        saved.update(torch.load(f"{root}/saved-{n}.pt", weights_only=True))
    worst = {}
    for source in sources:
        weights, state = saved[source]
        for name in targets:
            model = build(1)  # other initial values: everything must come from the checkpoint
            optimizer = parallelize(model, name)
            load_state(f"{root}/{source}", model, optimizer, rank=world.rank, group=world.group)
            got_weights, got_state = plain(model, optimizer)
            diff = max((got_weights[k] - weights[k]).abs().max().item() for k in weights)
            for index, entry in state.items():
                for key, value in entry.items():
                    diff = max(diff, (got_state[index][key] - value).abs().max().item())
            worst[f"{source} -> {world.world_size}-{name}"] = diff
    return worst


def test_every_layout_loads_every_checkpoint_exactly(tmp_path):
    """N -> M x strategy -> strategy for N, M in 1..3 (144 loads), and the 2 x 2 meshes both
    ways: loaded on 1..3 ranks under every strategy, and loading 2- and 3-rank checkpoints."""
    saved = []
    for n in (1, 2, 3, 4):
        saved += run_world(n, save_all, str(tmp_path))[0]
    assert len(saved) == 4 * 4 + 2
    flat = [s for s in saved if not s.startswith("4-")]
    meshed = [f"4-{m}" for m in MESHED]
    results = {}
    for m in (1, 2, 3):
        results.update(run_world(m, load_all, str(tmp_path), flat + meshed, STRATEGIES)[0])
    into_mesh = ["2-zero2", "3-ddp", "3-zero3", *meshed]
    results.update(run_world(4, load_all, str(tmp_path), into_mesh, [*MESHED, "zero3"])[0])
    assert len(results) == 3 * 14 * 4 + 5 * 3
    assert max(results.values()) == 0.0, {k: v for k, v in results.items() if v}


def _policy(name: str):
    small = {"bucket_mb": 0.002, "first_bucket_mb": 0.001}
    hooks = {
        "powersgd": lambda: compression.build_hook("powersgd:rank=2,start=1"),
        "int8": lambda: compression.build_hook("int8"),
        "topk": lambda: compression.build_hook("topk:ratio=0.2,momentum=0.9"),
    }
    strategy, _, hook = name.partition("+")
    hook_fn = hooks[hook]() if hook else None
    if strategy == "ddp":
        return dp.DDP(comm_hook=hook_fn, **small)
    if strategy == "zero2":
        return dp.ZeRO2(comm_hook=hook_fn, **small)
    return dp.ZeRO3(comm_hook=hook_fn)


def _session(world, name, folder, start, steps, load, save_at=None):
    """Train steps start..start+steps (loading `folder` first when `load`); the final weights."""
    diloco = name.startswith("diloco")
    model = build(0 if not load else 1)
    if diloco:
        mesh = dp.init_mesh(2)
        dp.parallelize(model, dp.ZeRO2(bucket_mb=0.002), group=mesh.shard_group)
    else:
        dp.parallelize(model, _policy(name))
    optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    averager = None
    if diloco:
        outer = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        averager = dp.DiLoCo(
            model, optimizer, 2, group=mesh.replicate_group, outer_optimizer=outer, compress="int8"
        )
    prefix = f"replica{world.rank // 2}/" if diloco else ""
    if load:
        load_state(
            folder, model, optimizer, averager, rank=world.rank, group=world.group, prefix=prefix
        )
    for step in range(start, start + steps):
        x, y = data(step, world.rank, 6)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if averager is not None:
            averager.step()
        if save_at == step + 1:
            chunks = state_chunks(model, optimizer, averager, rank=world.rank, prefix=prefix)
            save_chunks(chunks, folder, world.group)
    return dp.full_state_dict(model)


def stop_and_resume(world, root: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        folder = f"{root}/{name}"
        whole = _session(world, name, folder, 0, 6, load=False, save_at=3)
        resumed = _session(world, name, folder, 3, 3, load=True)
        out[name] = max((whole[k] - resumed[k]).abs().max().item() for k in whole)
    return out


def test_compression_state_survives_a_resume_bit_for_bit(tmp_path):
    names = ["ddp+powersgd", "zero2+int8", "zero3+topk"]
    result = run_world(2, stop_and_resume, str(tmp_path), names)[0]
    assert result == dict.fromkeys(names, 0.0)


def test_diloco_resumes_between_synchronisations_bit_for_bit(tmp_path):
    """Saved at step 3 of DiLoCo every 2 (replicas apart), ZeRO-2 inside 2 x 2."""
    result = run_world(4, stop_and_resume, str(tmp_path), ["diloco"])
    assert [r["diloco"] for r in result] == [0.0] * 4


def train_and_count(world, run_dir: str, strategy: str, steps: int, resume: bool) -> list[int]:
    """The trainer on a tiny corpus: `steps` steps (after resuming run_dir when `resume`), a
    checkpoint at the end; every sample index any rank trained on, in order."""
    from dataparallel.data.corpus import Corpus
    from dataparallel.train.config import RunConfig
    from dataparallel.train.trainer import setup

    config = RunConfig().replace(
        data={"block_size": 16, "eval_windows": 4, "val_fraction": 0.2},
        train={"steps": 10, "batch": 12 // world.world_size, "seed": 3},
        optim={"warmup_steps": 0},
        launch={"nproc": world.world_size, "strategy": strategy, "out": run_dir},
    )
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    corpus = Corpus(tokens=tokens, num_files=1, sha256="test", source="test")
    return trained_samples(world, setup(config, world, corpus), run_dir, steps, resume)


def test_the_trainer_resumed_on_another_world_size_trains_on_every_sample_once(tmp_path):
    """5 steps on 2 ranks (ZeRO-2), then 5 on 3 ranks (DDP), a global batch of 12 over a
    corpus of 74 training windows: the 120 samples are the first epoch whole and 46 distinct
    samples of the second."""
    run_dir = str(tmp_path / "run")
    first = run_world(2, train_and_count, run_dir, "zero2", 5, False)[0]
    second = run_world(3, train_and_count, run_dir, "ddp", 5, True)[0]
    taken = first + second
    epoch = len(set(taken))
    assert len(taken) == 120 and epoch == 74
    assert sorted(taken[:epoch]) == list(range(epoch))
    assert len(set(taken[epoch:])) == len(taken) - epoch
