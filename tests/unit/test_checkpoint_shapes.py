"""A flat run as the boxes of its tensor's true shape ([Note: checkpoint chunks] in
checkpoint/dcp.py): exhaustively over small shapes and every run, the boxes tile the run in
order, each is a contiguous run itself, and there are at most 2(N-1)+1; and checkpoints written
before (flat tensors under "/" names) are still read, into either form."""

from __future__ import annotations

import gc
import itertools
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dataparallel.checkpoint import Chunk, load_chunks, save_chunks, stored_tensors
from dataparallel.checkpoint.dcp import ChunkSavePlanner
from dataparallel.checkpoint.rectangles import rectangles, stacked, tiles

SHAPES = [(), (1,), (5,), (3, 4), (1, 6), (2, 3, 4), (3, 1, 2), (2, 2, 2, 3), (2, 0, 3)]


def _flat_positions(shape, offsets, sizes) -> list[int]:
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    ranges = [range(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
    return [
        sum(i * st for i, st in zip(at, strides, strict=True)) for at in itertools.product(*ranges)
    ]


def test_every_run_of_every_small_shape_is_tiled_in_order_by_few_contiguous_boxes():
    cases = 0
    for shape in SHAPES:
        numel = math.prod(shape)
        for start in range(numel + 1):
            for stop in range(start, numel + 1):
                boxes = rectangles(shape, start, stop)
                covered = [p for o, s in boxes for p in _flat_positions(shape, o, s)]
                assert covered == list(range(start, stop)), (shape, start, stop)
                assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)
                for offsets, sizes in boxes:
                    assert all(o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True))
                cases += 1
    assert cases == 3 + 3 + 21 + 91 + 28 + 325 + 28 + 325 + 1  # (n+1)(n+2)/2 runs of n


def test_a_run_outside_the_tensor_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"run \[3, 13\) is outside a tensor of \(3, 4\)"):
        rectangles((3, 4), 3, 13)


def test_tiles_says_yes_to_every_split_into_runs_and_no_to_a_gap_an_overlap_or_a_stray_box():
    cases = 0
    for shape in [s for s in SHAPES if math.prod(s) and s]:
        numel = math.prod(shape)
        for cut in range(numel + 1):
            boxes = rectangles(shape, 0, cut) + rectangles(shape, cut, numel)
            assert tiles(shape, boxes[::-1]), (shape, cut)  # in any order
            if cut:  # the first run's last element again: an overlap; without it: a gap
                assert not tiles(shape, boxes + rectangles(shape, cut - 1, cut))
                assert not tiles(
                    shape, rectangles(shape, 0, cut - 1) + rectangles(shape, cut, numel)
                )
            cases += 1
    assert cases == 2 + 6 + 13 + 7 + 25 + 7 + 25
    assert not tiles((3, 4), [((0, 0), (3, 4)), ((0, 0), (0, 4))])  # an empty box
    assert not tiles((3, 4), [((0, 0), (3, 2)), ((0, 2), (3, 2))])  # two columns: no runs
    assert not tiles((3, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))])  # past the last row


def _rank_plans(world: int, shape=(200, 1000)) -> list:
    """Every rank's local plan of a matrix wider than tall split evenly over `world` ranks
    (most of a row each), and a scalar every rank writes (as Adam's `step`)."""
    numel, plans = math.prod(shape), []
    for rank in range(world):
        lo, hi = rank * numel // world, (rank + 1) * numel // world
        chunks = {"model/w": Chunk(torch.zeros(hi - lo), lo, numel, shape=torch.Size(shape))}
        chunks["optim/w/step"] = Chunk(torch.tensor(3.0))
        plans.append(ChunkSavePlanner(chunks).create_local_plan())
    return plans


def test_the_global_plan_is_dcps_checked_by_runs_without_comparing_boxes(monkeypatch):
    from torch.distributed.checkpoint import default_planner

    compared = []
    check = default_planner._check_box_overlap
    monkeypatch.setattr(
        default_planner, "_check_box_overlap", lambda *a: compared.append(1) or check(*a)
    )
    plans = _rank_plans(256)
    ours, metadata = ChunkSavePlanner({}).create_global_plan(plans)
    assert compared == [] and gc.isenabled()  # the collector, paused inside, is back
    theirs, expected = DefaultSavePlanner(flatten_state_dict=True).create_global_plan(plans)
    assert len(compared) > 20_000  # DCP's sweep along the rows: each box meets most others
    assert ours == theirs and metadata == expected
    assert metadata.planner_data == {
        "model.w": ("model", "w"),
        "optim.w.step": ("optim", "w", "step"),
    }
    items = [item.index.fqn for plan in ours for item in plan.items]
    assert items.count("optim.w.step") == 1  # written once, by one of the 256
    assert len(metadata.state_dict_metadata["model.w"].chunks) == items.count("model.w") == 448
    # A rank whose run overlaps its neighbour's: DCP's own check runs, and names it.
    bad = _rank_plans(2)
    item = bad[1].items[0]
    moved = replace(item.tensor_data.chunk, offsets=torch.Size([99, 0]))  # rank 0's last row
    bad[1].items[0] = replace(item, tensor_data=replace(item.tensor_data, chunk=moved))
    with pytest.raises(ValueError, match="global plan: key:model.w has overlapping chunks"):
        ChunkSavePlanner({}).create_global_plan(bad)
    # torch 2.11's check answers only True or False (the GPU machine's): the key is still named.
    from torch.distributed.checkpoint import default_planner

    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *a: False)
    with pytest.raises(ValueError, match="global plan: key:model.w has overlapping chunks"):
        ChunkSavePlanner({}).create_global_plan(bad)
    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *a: True)
    assert len(ChunkSavePlanner({}).create_global_plan(_rank_plans(2))[0]) == 2


def test_shards_of_a_matrix_are_stored_in_its_shape_and_read_back_in_any_runs(tmp_path):
    whole = torch.arange(35.0).reshape(5, 7)
    flat = whole.reshape(-1)
    boxes = Chunk(flat[9:30].clone(), 9, 35, shape=(5, 7)).parts()
    assert [(list(s.offsets), list(s.sizes)) for _, s in boxes] == [
        ([1, 2], [1, 5]),
        ([2, 0], [2, 7]),
        ([4, 0], [1, 2]),
    ]
    assert torch.equal(torch.cat([t.reshape(-1) for t, _ in boxes]), flat[9:30])
    save_chunks({"model/w": Chunk(whole.clone())}, tmp_path / "whole", None)
    assert stored_tensors(tmp_path / "whole") == {"model/w": (torch.Size([5, 7]), torch.float32)}
    for a, b in [(0, 35), (3, 4), (6, 29), (14, 21)]:
        dest = Chunk(torch.zeros(b - a), a, 35, shape=(5, 7))
        load_chunks({"model/w": dest}, tmp_path / "whole", None)
        assert torch.equal(dest.tensor, flat[a:b])
    matrix = torch.zeros(5, 7)
    load_chunks({"model/w": Chunk(matrix)}, tmp_path / "whole", None)
    assert torch.equal(matrix, whole)


def test_a_checkpoint_of_the_flat_format_is_still_read(tmp_path):
    """Written as today's main wrote it: 1-D tensors under "/" names, no nesting."""
    whole = torch.arange(12.0).reshape(3, 4)
    dcp.save(
        {"model/w": whole.reshape(-1).clone(), "buffer/b": torch.ones(2)},
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    stored = stored_tensors(tmp_path)
    assert stored == {
        "model/w": (torch.Size([12]), torch.float32),
        "buffer/b": (torch.Size([2]), torch.float32),
    }
    run = Chunk(torch.zeros(5), 6, 12, shape=(3, 4))
    matrix = torch.zeros(3, 4)
    load_chunks({"model/w": run, "buffer/b": Chunk(torch.zeros(2))}, tmp_path, None)
    load_chunks({"model/w": Chunk(matrix)}, tmp_path, None)
    assert run.tensor.tolist() == [6.0, 7.0, 8.0, 9.0, 10.0]
    assert torch.equal(matrix, whole)


def test_column_blocks_are_one_box_and_read_back_in_rows(tmp_path):
    """A tensor-parallel local tensor of columns 3..6 of a 5 x 7 matrix: one run per row, one
    box (`stacked`), written in one process and read back whole and as other runs."""
    whole = torch.arange(35.0).reshape(5, 7)
    local = whole[:, 3:7].contiguous().reshape(-1)
    runs = tuple((4 * row, 7 * row + 3, 4) for row in range(5))
    chunk = Chunk(local.clone(), numel=35, runs=runs, shape=(5, 7))
    boxes = chunk.parts()
    assert [(list(s.offsets), list(s.sizes)) for _, s in boxes] == [([0, 3], [5, 4])]
    assert torch.equal(boxes[0][0], whole[:, 3:7])
    left = Chunk(whole[:, :3].contiguous().reshape(-1), numel=35, shape=(5, 7),
                 runs=tuple((3 * row, 7 * row, 3) for row in range(5)))  # fmt: skip
    assert [list(s.sizes) for _, s in left.parts()] == [[5, 3]]
    save_chunks({"model/w": left, "model/v": Chunk(whole.clone())}, tmp_path, None)
    save_chunks({"model/w": chunk}, tmp_path / "right", None)  # the other rank, alone
    matrix = torch.zeros(5, 7)
    load_chunks({"model/w": Chunk(matrix)}, tmp_path / "right", None)
    assert torch.equal(matrix[:, 3:], whole[:, 3:]) and not matrix[:, :3].any()
    rows = Chunk(torch.zeros(10), 9, 35, shape=(5, 7))  # elements 9..18: parts of 2 rows
    load_chunks({"model/w": rows}, tmp_path / "right", None)
    expected = whole.reshape(-1)[9:19].clone()
    expected[(torch.arange(9, 19) % 7) < 3] = 0
    assert torch.equal(rows.tensor, expected)


def test_stacked_joins_only_boxes_that_are_one_after_another_in_both():
    cases = [  # (boxes, joined sizes)
        ([(0, (0, 2), (1, 3)), (3, (1, 2), (1, 3))], [(2, 3)]),  # rows of one column block
        ([(0, (0, 2), (1, 3)), (4, (1, 2), (1, 3))], [(1, 3), (1, 3)]),  # a gap in the buffer
        ([(0, (0, 2), (1, 3)), (3, (2, 2), (1, 3))], [(1, 3), (1, 3)]),  # a row skipped
        ([(0, (0, 2), (1, 3)), (3, (1, 1), (1, 3))], [(1, 3), (1, 3)]),  # another column
        ([(0, (0, 0), (1, 5)), (5, (1, 0), (2, 5))], [(3, 5)]),  # a row and whole rows
        ([(0, (), ())], [()]),  # a 0-d tensor
    ]
    for boxes, sizes in cases:
        assert [s for _, _, s in stacked(boxes)] == sizes, boxes
    assert len(cases) == 6
