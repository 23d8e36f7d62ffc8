"""plan/live_bytes.py ([Note: meta peak]): the peak of meta storages alive at once."""

from __future__ import annotations

import torch

from dataparallel.plan.live_bytes import LiveBytes


def test_peak_counts_live_storages_frees_and_resizes():
    held = torch.empty(1000, device="meta")  # 4,000 B made before the mode: noted by hand
    live = LiveBytes()
    live.note(held)
    with live:
        live.measuring = True
        a = torch.ones(500, device="meta")  # 2,000 B
        b = a * 2  # 2,000 B more: 8,000 B alive
        del a, b
        c = held + 1  # 4,000 B again: 8,000 B, not more
        c.untyped_storage().resize_(0)  # freed as ZeRO-3 frees a gathered unit
        d = held.view(10, 100).sum(0)  # 400 B
    assert live.peak == 8000
    assert live.live() == 4000 + 0 + 400
    del c, d
    assert live.live() == 4000


def test_nothing_measured_while_off():
    live = LiveBytes()
    with live:
        torch.ones(10_000, device="meta") * 2
    assert live.peak == 0
