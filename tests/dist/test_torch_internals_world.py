"""The wrappers of torch_internals.py that need a process group, on a real world of two
(the rest: tests/unit/test_torch_internals.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dataparallel import torch_internals as ti

from .harness import run_world


def wrappers_on_a_world(world) -> dict:
    store = ti.default_store()
    store.set(f"rank{world.rank}", "here")
    dist.barrier()
    seen = store.get(f"rank{1 - world.rank}").decode()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=7))
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.arange(10.0).reshape(5, 2)
    tensor = distribute_tensor(whole, mesh, [Shard(0)])
    shape, offset = ti.local_shape_and_offset(whole.shape, mesh, [Shard(0)])
    local = tensor.to_local()
    return {
        "seen": seen,
        "timeout": ti.backend_timeout(group, torch.device("cpu")),
        "local": (shape, offset, tuple(local.shape)),
        "exact": torch.equal(whole[offset[0] : offset[0] + shape[0]], local),
    }


def test_the_wrappers_that_need_a_world():
    results = run_world(2, wrappers_on_a_world, timeout=120)
    assert [r["seen"] for r in results] == ["here", "here"]
    assert [r["timeout"] for r in results] == [timedelta(seconds=7)] * 2
    assert [r["local"] for r in results] == [((3, 2), (0, 0), (3, 2)), ((2, 2), (3, 0), (2, 2))]
    assert all(r["exact"] for r in results)
