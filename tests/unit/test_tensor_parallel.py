"""Pure parts of hybrid parallelism: where a run of a local tensor lies in the whole tensor."""

from __future__ import annotations

import pytest
import torch

from dataparallel.strategies.parts.tensor_parallel import flat_runs

BOXES = [
    ((6, 8), (6, 4), (0, 4)),  # RowwiseParallel's weight: a column block, a part per row
    ((6, 8), (3, 8), (3, 0)),  # ColwiseParallel's weight: whole rows, one part
    ((4, 6, 5), (4, 3, 5), (0, 3, 0)),
    ((4, 6, 5), (2, 6, 2), (2, 0, 3)),
    ((7,), (3,), (4,)),  # a sharded bias
    ((5, 6), (5, 6), (0, 0)),  # replicated: the whole
]


@pytest.mark.parametrize("whole,local,offset", BOXES)
def test_every_run_of_a_box_maps_to_its_elements_of_the_whole(whole, local, offset):
    elements = torch.arange(torch.Size(whole).numel())
    box = elements.view(whole)[
        tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
    ].reshape(-1)
    for start in range(box.numel()):
        for stop in range(start, box.numel() + 1):
            got = torch.full((stop - start,), -1)
            for at, where, length in flat_runs(whole, local, offset, start, stop):
                got[at : at + length] = elements[where : where + length]
            assert torch.equal(got, box[start:stop]), (start, stop)


def test_whole_rows_are_one_part_and_column_blocks_one_per_row():
    assert flat_runs((6, 8), (3, 8), (3, 0), 0, 24) == [(0, 24, 24)]
    assert len(flat_runs((6, 8), (6, 4), (0, 4), 0, 24)) == 6
