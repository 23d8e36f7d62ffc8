"""Broadcast and all-gather of plain values between real ranks ([Note: nothing unpickled]):
what the heal, the config exchange and the other gathers send; a crafted pickle sent in their
place is refused and never runs."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from dataparallel.comm import Comm
from dataparallel.comm.plain import PlainError, all_gather_plain, broadcast_plain

from .harness import run_world


class WritesFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def exchange(world) -> dict:
    rank = world.rank
    snapshot = {
        "model": {"w": torch.arange(6.0).reshape(2, 3) + 10},
        "optimizer": {
            "state": {0: {"step": torch.tensor(2.0)}},
            "param_groups": [{"betas": (0.9, 0.99)}],
        },
        "last_record": None,
    }
    healed = broadcast_plain(snapshot if rank == 1 else None, src=1)
    configs = all_gather_plain({"rank": rank, "launch": {"out": "r" * (rank + 1)}})
    signatures = Comm().all_gather_object([("parameter:w", (2, 3), "torch.float32")])
    failures = []  # a value one rank cannot send fails every rank, at once
    for call in (
        lambda: broadcast_plain(object() if rank == 2 else None, src=2),
        lambda: all_gather_plain(object() if rank == 0 else rank),
    ):
        try:
            call()
        except PlainError as error:
            failures.append(str(error).split(":")[0])
    return {
        "w": healed["model"]["w"].tolist(),
        "step": healed["optimizer"]["state"][0]["step"].item(),
        "betas": healed["optimizer"]["param_groups"][0]["betas"],
        "configs": configs,
        "signatures": signatures,
        "failures": failures,
    }


def test_values_travel_between_ranks():
    results = run_world(3, exchange)
    assert len(results) == 3
    for got in results:
        assert got["w"] == [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]] and got["step"] == 2.0
        assert got["betas"] == (0.9, 0.99)
        assert got["configs"] == [{"rank": r, "launch": {"out": "r" * (r + 1)}} for r in range(3)]
        assert got["signatures"] == [[("parameter:w", (2, 3), "torch.float32")]] * 3
    assert [r["failures"] for r in results] == [
        ["rank 2 could not send its value (it says why)", "value"],
        ["rank 2 could not send its value (it says why)", "rank 0 of the group could not send its value (it says why)"],
        ["value", "rank 0 of the group could not send its value (it says why)"],
    ]


def send_crafted(world, path: str) -> list[str]:
    """Rank 0 sends a pickle that writes `path` where a heal and a config are expected, as a
    peer that is not ours would; the others must refuse it."""
    crafted = torch.frombuffer(bytearray(pickle.dumps(WritesFile(path))), dtype=torch.uint8)
    refused = []
    if world.rank == 0:  # the heal's two broadcasts: the length, then the bytes
        dist.broadcast(torch.tensor([crafted.numel()]), src=0)
        dist.broadcast(crafted, src=0)
    else:
        try:
            broadcast_plain(None, src=0)
        except PlainError as error:
            refused.append(f"heal: {error}")
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world.world_size)]
    mine = crafted if world.rank == 0 else torch.zeros(16, dtype=torch.uint8)
    if world.rank == 0:  # the config exchange's two all-gathers, the bytes crafted
        dist.all_gather(lengths, torch.tensor([mine.numel()]))
        longest = max(int(n.item()) for n in lengths)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in lengths]
        dist.all_gather(
            out, torch.cat([mine, torch.zeros(longest - mine.numel(), dtype=torch.uint8)])
        )
    else:
        try:
            all_gather_plain({"launch": {}})
        except PlainError as error:
            refused.append(f"config: {error}")
    return refused


def test_a_crafted_pickle_is_never_unpickled(tmp_path):
    target = tmp_path / "ran"
    results = run_world(3, send_crafted, str(target))
    assert [len(r) for r in results] == [0, 2, 2]
    assert not target.exists()


def plan_with_crafted(world, path: str) -> str:
    """DCP's planning exchanges pickles (torch's `*_object` collectives): rank 0 sends a crafted
    one while a save or a load plans (`plans_unpickled_safely`)."""
    from dataparallel.checkpoint.unpickling import plans_unpickled_safely

    out: list = [None] * world.world_size
    with plans_unpickled_safely():
        try:
            dist.all_gather_object(out, WritesFile(path) if world.rank == 0 else world.rank)
        except pickle.UnpicklingError as error:
            return str(error)
    return "unpickled"


def test_dcp_planning_never_runs_a_crafted_pickle(tmp_path):
    target = tmp_path / "ran"
    results = run_world(2, plan_with_crafted, str(target))
    assert results == ["refusing to load builtins.exec"] * 2
    assert not target.exists()
