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


def trace(resized_by_hand: bool, model_name: str) -> LiveBytes:
    """A model's meta forward, loss and backward, measured as plan/model.py's transient trace
    does, with the sum over every live storage per operator or kept as it goes."""
    from dataparallel.models import MODEL_CONFIGS, build_model
    from dataparallel.plan.model import drop_grad, lm_run

    with torch.device("meta"):
        model = build_model(model_name)
    live = LiveBytes(resized_by_hand=resized_by_hand)
    for p in model.parameters():
        live.label(p, "model states")
    hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in model.parameters()]
    config = MODEL_CONFIGS[model_name]
    with live:
        live.measuring = True
        live.tag = "forward and loss"
        loss = lm_run(config.block_size, 2, config.vocab_size, None)(model)
        live.tag = "backward"
        loss.backward()
    for hook in hooks:
        hook.remove()
    return live


def test_the_sum_kept_as_it_goes_equals_the_sum_over_every_storage():
    cases = 0
    for model_name in ("gpt-tiny", "gpt-small"):
        every, kept = trace(True, model_name), trace(False, model_name)
        assert every.peak > 0 and kept.peak == every.peak, (model_name, every.peak, kept.peak)
        assert kept.peak_terms() == every.peak_terms(), model_name
        assert len(kept.peak_terms()) >= 3  # model states, forward and loss, backward
        assert kept.live() == every.live()  # what is left: the model states
        cases += 1
    assert cases == 2


def test_kept_as_it_goes_counts_deaths_and_reused_addresses():
    held = torch.empty(1000, device="meta")
    live = LiveBytes(resized_by_hand=False)
    live.note(held)
    with live:
        live.measuring = True
        a = torch.ones(500, device="meta")  # 2,000 B
        b = a * 2  # 8,000 B alive with `held`
        del a, b
        c = held + 1  # 4,000 B again: 8,000 B, not more
        d = held.view(10, 100).sum(0)  # 400 B: 8,400 B
        del c
        e = torch.ones(100, device="meta")  # 400 B
    assert live.peak == 8400
    assert live.live() == 4000 + 400 + 400
    assert sum(live.peak_terms().values()) == 8400
    del d, e
    assert live.live() == 4000
