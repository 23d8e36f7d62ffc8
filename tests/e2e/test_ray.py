"""Ray Train (docs/clusters.md, "Ray Train"): real `ray[train]`, its `TorchTrainer` with 2 CPU
workers, runs both recipes of the docs and each ends where our own runs end:

- the CLI recipe, `dataparallel.cli.main(["train", ...])` in the training function (Ray runs it
  on a thread of its own: [Note: signals on the main thread] in launch/preemption.py), ends
  with the weights and losses of the same command under our launcher (`--nproc 2`);
- the API recipe, `dp.init()` (which adopts the process group Ray made), `dp.parallelize` and
  `dp.build_optimizer`, trains as one process on the global batch, on every strategy.

A trial, not a suite test: about a minute of Ray's start and its workers (and 80 MB of wheels
for CI), so it runs only when asked, `make test-ray` (which installs `ray[train]` into the
venv), or `DATAPARALLEL_TEST_RAY=1 pytest tests/e2e/test_ray.py` with ray installed. The
suite keeps what makes the recipe work without Ray: no signal handler off the main thread
(tests/unit/test_preemption.py). The training functions take what they need in their config
and call only torch, dataparallel and this module's functions: Ray pickles them by value (this
module is not importable in Ray's workers).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

import dataparallel
from dataparallel.models import GPT, GPTConfig

from .helpers import REFERENCE_ARGS, corpus_copy, curve

# Ray is imported by the fixture, not at collection (2-3 s in each process of the suite).
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("DATAPARALLEL_TEST_RAY") != "1",
        reason="a trial: make test-ray (or DATAPARALLEL_TEST_RAY=1 with ray[train] installed)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason='needs ray: pip install "ray[train]"'
    ),
]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# No biases: the attention's key bias has an exactly zero true gradient, whose rounding noise
# AdamW's normalization turns into steps of the order of lr.
SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "bias": False}
STEPS, GLOBAL_BATCH, LR = 10, 8, 1e-3


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> Path:
    """One TorchTrainer run on 2 CPU workers of a local Ray (its workers import this checkout's
    dataparallel) whose training function runs the API recipe, then the CLI recipe (one start
    of Ray and of its workers for both): the folder they wrote."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    folder = tmp_path_factory.mktemp("ray")
    args = list(REFERENCE_ARGS)
    del args[args.index("--nproc") : args.index("--nproc") + 2]  # Ray's WORLD_SIZE says it
    config = {
        "strategies": list(STRATEGIES),
        "out": str(folder),
        "args": ["--data", str(corpus_copy(folder)), *args, "--out", str(folder / "run")],
    }
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = [str(Path(dataparallel.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        trainer = TorchTrainer(
            both_recipes,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(folder), name="dataparallel"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    return folder


def both_recipes(config: dict) -> None:
    """The training function: the API recipe first (it leaves Ray's process group as it found
    it), then the CLI's (whose run ends with `dp.destroy()`)."""
    api_recipe(config)
    cli_recipe(config)


def cli_recipe(config: dict) -> None:
    """docs/clusters.md's CLI recipe: the training function runs `dataparallel train`."""
    import dataparallel.cli

    code = dataparallel.cli.main(["train", *config["args"]])
    if code != 0:
        raise RuntimeError(f"dataparallel train exited {code}")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch of token windows and their next tokens."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SHAPE["block_size"] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizer, rank: int = 0, world_size: int = 1) -> None:
    """STEPS AdamW steps of `model` on this rank's share of each global batch."""
    share = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(share * rank, share * (rank + 1))
        F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def api_recipe(config: dict) -> None:
    """docs/clusters.md's API recipe, on each strategy; rank 0 saves the whole weights."""
    import torch.distributed as dist

    import dataparallel as dp

    adopted = dist.is_initialized()  # Ray made the group before calling us
    world = dp.init()
    for strategy in config["strategies"]:
        torch.manual_seed(0)
        model = dp.parallelize(GPT(GPTConfig(**SHAPE)), strategy)
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=LR)
        train(model, optimizer, world.rank, world.world_size)
        weights = dp.full_state_dict(model)
        if world.is_main:
            saved = {"adopted": adopted, "world_size": world.world_size, "weights": weights}
            torch.save(saved, Path(config["out"]) / f"{strategy}.pt")


def test_the_cli_recipe_ends_as_our_launcher_does(ray_run, reference_run):
    """REFERENCE_ARGS (12 steps, accumulation, validation, checkpoints) under Ray against the
    same command under our launcher (--nproc 2): the same losses and weights."""
    ours, out = reference_run[0], ray_run / "run"
    expected, got = load_file(ours / "model.safetensors"), load_file(out / "model.safetensors")
    assert got.keys() == expected.keys() and len(got) > 0
    difference = max((got[k] - expected[k]).abs().max().item() for k in expected)
    ray_curve, our_curve = curve(out), curve(ours)
    assert len(ray_curve["train_loss"]) == 12 and sorted(ray_curve["val_loss"]) == [0, 6, 12]
    losses = 0.0
    for kind in ("train_loss", "val_loss"):
        assert ray_curve[kind].keys() == our_curve[kind].keys()
        losses = max(losses, *(abs(ray_curve[kind][s] - v) for s, v in our_curve[kind].items()))
    print(f"ray parity: cli: max |weight diff| {difference:.1e}, max |loss diff| {losses:.1e}")
    assert difference <= 1e-5 and losses <= 1e-5, (difference, losses)
    checkpoints = sorted(p.name for p in (out / "checkpoint").glob("step-*"))
    assert checkpoints == ["step-000006", "step-000012"]


def test_the_api_recipe_trains_as_one_process_on_the_global_batch(ray_run):
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**SHAPE))
    train(reference, torch.optim.AdamW(reference.parameters(), lr=LR))
    expected = reference.state_dict()
    differences = {}
    for strategy in STRATEGIES:
        saved = torch.load(ray_run / f"{strategy}.pt")
        assert saved["adopted"] and saved["world_size"] == 2, strategy
        weights = saved["weights"]
        assert weights.keys() == expected.keys(), strategy
        differences[strategy] = max(
            (weights[k] - v).abs().max().item() for k, v in expected.items()
        )
    shown = ", ".join(f"{name} {d:.1e}" for name, d in differences.items())
    print(f"ray parity: api, {STEPS} steps: max |param diff| from one process: {shown}")
    assert len(differences) == len(STRATEGIES) == 4
    assert max(differences.values()) <= 1e-5, differences


def test_the_package_does_not_import_ray():
    """Ray is the user's: importing dataparallel, its command and its worker imports none of it."""
    code = (
        "import sys, dataparallel, dataparallel.cli, dataparallel.train.worker\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'pandas'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
