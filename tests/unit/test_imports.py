"""`is_dtensor` without DTensor's module ([Note: imported when used] in
strategies/parts/tensor_parallel.py); a real DTensor parameter is told apart in tests/dist/test_tp.py
(`localize_parameters` replaces each one, or tensor-parallel parity fails)."""

from __future__ import annotations

import torch

from dataparallel.strategies.parts.tensor_parallel import is_dtensor


def test_plain_values_are_not_dtensors():
    cases = [torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), None, 3]
    assert [is_dtensor(value) for value in cases] == [False] * 4
