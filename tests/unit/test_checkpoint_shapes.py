"""A flat run as the boxes of its tensor's true shape ([Note: chunks] in checkpoint/dcp.py):
exhaustively over small shapes and every run, the boxes tile the run in order, each is a
contiguous run itself, and there are at most 2(N-1)+1; and checkpoints written before (flat
tensors under "/" names) are still read, into either form."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dataparallel.checkpoint import Chunk, load_chunks, save_chunks, stored_tensors
from dataparallel.checkpoint.rectangles import rectangles

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
