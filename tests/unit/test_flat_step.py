"""[Note: flat step]: runs of contiguous parameters stepped as one tensor, exactly (no process group)."""

from __future__ import annotations

import copy

import pytest
import torch

from dataparallel.strategies.parts.flat_step import find_runs, install_flat_step
from dataparallel.strategies.parts.optimizer_layout import ELEMENTWISE

SHAPES = [(4, 3), (3,), (5, 5), (2,), (7,), (1,)]

# Every elementwise torch class, with options that make its state non-trivial.
CLASSES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    (torch.optim.Adamax, {"lr": 1e-2}),
    (torch.optim.NAdam, {"lr": 1e-2}),
    (torch.optim.RAdam, {"lr": 1e-2}),
    (torch.optim.ASGD, {"lr": 1e-2, "t0": 2}),
    (torch.optim.Rprop, {"lr": 1e-2}),
    (torch.optim.Adadelta, {"lr": 1.0}),
]


def laid(seed: int = 0):
    """Parameters laid end to end in one buffer (registration order reversed in memory, as
    DDP lays them), and per parameter its gradient view of one gradient buffer, same order."""
    torch.manual_seed(seed)
    values = [torch.randn(s) for s in SHAPES]
    total = sum(v.numel() for v in values)
    flat, grads = torch.zeros(total), torch.zeros(total)
    params, views, offset = [], [], 0
    for value in reversed(values):
        n = value.numel()
        p = torch.nn.Parameter(torch.empty(0))
        p.data = flat[offset : offset + n].view_as(value)
        p.data.copy_(value)
        params.append(p)
        views.append(grads[offset : offset + n].view_as(value))
        offset += n
    return params[::-1], views[::-1]


def plain(seed: int = 0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def train(cls, options, steps=8, skip=None, reload_at=None, replace_at=None):
    """Both optimizers through `steps` steps with a scheduler; returns (ours, theirs, optimizer)."""
    ours, views = laid()
    theirs = plain()
    mine = install_flat_step(cls(ours, **options))
    ref = cls(theirs, **options)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in (mine, ref)]
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, (p, q, view) in enumerate(zip(ours, theirs, views, strict=True)):
            if skip is not None and (step, i) == skip:
                p.grad = q.grad = None
                continue
            g = torch.randn(view.shape, generator=generator)
            view.copy_(g)
            p.grad = g.clone() if replace_at == (step, i) else view
            q.grad = g.clone()
        mine.step()
        ref.step()
        for s in schedulers:
            s.step()
        if reload_at == step:
            mine.load_state_dict(copy.deepcopy(mine.state_dict()))
    return ours, theirs, mine


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_every_elementwise_class_steps_flat_exactly():
    names = set()
    for cls, options in CLASSES:
        ours, theirs, mine = train(cls, options)
        flat = mine._dataparallel_flat_step
        assert flat.flat_steps == 8, cls.__name__  # every step went through the flat run
        assert len(flat.runs) == 1 and len(flat.runs[0].params) == len(SHAPES)
        assert max_diff(ours, theirs) <= 1e-6, cls.__name__
        names.add(cls)
    assert names == set(ELEMENTWISE)  # every class torch has that we call elementwise


def test_state_is_views_of_one_flat_state_and_same_bytes():
    ours, theirs, mine = train(torch.optim.AdamW, {"lr": 1e-2})
    state = [mine.state[p] for p in ours]
    storages = {s["exp_avg"].untyped_storage().data_ptr() for s in state}
    assert len(storages) == 1
    assert len({id(s["step"]) for s in state}) == 1 and float(state[0]["step"]) == 8.0
    elements = sum(p.numel() for p in ours)
    assert state[0]["exp_avg"].untyped_storage().nbytes() == 4 * elements
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    saved = mine.state_dict()
    assert sorted(saved["state"]) == list(range(len(SHAPES)))
    for index, p in enumerate(ours):
        assert saved["state"][index]["exp_avg_sq"].shape == p.shape
    assert saved["param_groups"][0]["params"] == ref.state_dict()["param_groups"][0]["params"]


def test_a_skipped_parameter_keeps_its_own_step_from_then_on():
    ours, theirs, mine = train(torch.optim.AdamW, {"lr": 1e-2}, skip=(4, 2))
    assert max_diff(ours, theirs) <= 1e-6
    steps = [float(mine.state[p]["step"]) for p in ours]
    assert steps == [8.0, 8.0, 7.0, 8.0, 8.0, 8.0]
    assert mine._dataparallel_flat_step.flat_steps == 4  # steps 0-3 flat, then per parameter
    assert len({id(mine.state[p]["step"]) for p in ours}) == len(SHAPES)


def test_a_loaded_state_is_adopted_again():
    for cls, options in CLASSES[2:5]:
        ours, theirs, mine = train(cls, options, reload_at=3)
        assert max_diff(ours, theirs) <= 1e-6, cls.__name__
        assert mine._dataparallel_flat_step.flat_steps == 8
        storages = {mine.state[p][next(iter(k for k in mine.state[p] if k != "step"))]
                    .untyped_storage().data_ptr() for p in ours}  # fmt: skip
        assert len(storages) == 1, cls.__name__


def test_a_replaced_gradient_steps_that_step_per_parameter():
    ours, theirs, mine = train(torch.optim.Adam, {"lr": 1e-2}, replace_at=(5, 1))
    assert max_diff(ours, theirs) <= 1e-6
    assert mine._dataparallel_flat_step.flat_steps == 7


def test_off_with_a_closure_or_a_later_pre_hook_or_capturable():
    ours, views = laid()
    optimizer = install_flat_step(torch.optim.SGD(ours, lr=0.1))
    for p, v in zip(ours, views, strict=True):
        v.fill_(1.0)
        p.grad = v
    optimizer.step(lambda: None)
    assert optimizer._dataparallel_flat_step.flat_steps == 0
    optimizer.step()
    assert optimizer._dataparallel_flat_step.flat_steps == 1
    seen = []
    optimizer.register_step_pre_hook(lambda o, a, k: seen.append(len(o.param_groups[0]["params"])))
    optimizer.step()
    assert optimizer._dataparallel_flat_step.flat_steps == 1 and seen == [len(SHAPES)]
    captured = install_flat_step(torch.optim.Adam(laid()[0], lr=0.1, capturable=True))
    assert captured._dataparallel_flat_step._applies((captured,), {}) is False


def test_runs_are_found_in_memory_order_and_break_at_gaps():
    ours, _ = laid()
    optimizer = torch.optim.SGD([{"params": ours[:3]}, {"params": ours[3:]}], lr=0.1)
    runs = find_runs(optimizer)
    assert [len(r.params) for r in runs] == [3, 3]  # one per group, never across groups
    separate = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    assert find_runs(torch.optim.SGD(separate, lr=0.1)) == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_and_the_step_leave_the_param_groups_whole(set_to_none):
    ours, views = laid()
    optimizer = install_flat_step(torch.optim.AdamW(ours, lr=0.1))
    for p, v in zip(ours, views, strict=True):
        p.grad = v
    optimizer.step()
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in ours]
    optimizer.zero_grad(set_to_none=set_to_none)
    assert all((p.grad is None) == set_to_none for p in ours)


def test_a_state_saved_while_flat_loads_with_a_step_count_per_parameter():
    """Saved while a run shared one `step`, copied as a checkpoint would be, loaded, then a
    step that skips one parameter: that parameter's count stays, the others' go on."""
    ours, views = laid()
    theirs = plain()
    mine = install_flat_step(torch.optim.AdamW(ours, lr=1e-2))
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for step in range(4):
        if step == 2:
            mine.load_state_dict(copy.deepcopy(mine.state_dict()))
        for i, (p, q, view) in enumerate(zip(ours, theirs, views, strict=True)):
            g = torch.randn(view.shape, generator=generator)
            if step == 2 and i == 4:
                p.grad = q.grad = None
                continue
            view.copy_(g)
            p.grad, q.grad = view, g.clone()
        mine.step()
        ref.step()
    assert [float(mine.state[p]["step"]) for p in ours] == [4.0, 4.0, 4.0, 4.0, 3.0, 4.0]
    assert max_diff(ours, theirs) <= 1e-6


class ReadsItsOwnAttributes(torch.optim.SGD):
    """A third-party class (pytorch_optimizer's Lion reads `self.maximize`) whose step reads an
    instance attribute that torch's `__getstate__` leaves out of a copy."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr)
        self.sign_only = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign() if self.sign_only else p.grad, alpha=-group["lr"])


def test_a_class_that_reads_its_own_attributes_steps_flat():
    ours, theirs, mine = train(ReadsItsOwnAttributes, {"lr": 0.1})
    assert mine._dataparallel_flat_step.flat_steps == 8
    assert max_diff(ours, theirs) <= 1e-6


def test_optimizer_state_dict_gives_each_parameter_its_own_scalars():
    """nanoGPT's `torch.save(optimizer.state_dict())` under DDP, loaded into a plain optimizer
    in one process: a shared `step` would be counted once per parameter there."""
    ours, theirs, mine = train(torch.optim.AdamW, {"lr": 1e-2}, steps=3)
    saved = mine.state_dict()
    steps = [entry["step"] for entry in saved["state"].values()]
    assert len(steps) == len(SHAPES) and len({id(s) for s in steps}) == len(SHAPES)
    assert all(float(s) == 3.0 for s in steps)
    assert mine.state[ours[0]]["step"] is mine.state[ours[1]]["step"]  # the run's own: shared
    plain_opt = torch.optim.AdamW(theirs, lr=1e-2)
    plain_opt.load_state_dict(copy.deepcopy(saved))
    for p in theirs:
        p.grad = torch.ones_like(p)
    plain_opt.step()
    assert [float(plain_opt.state[p]["step"]) for p in theirs] == [4.0] * len(SHAPES)


# [Note: the fused flat step]: an optimizer built fused=True steps each run through one call of
# torch's fused kernel, GradScaler's unscaling and overflow skip included.
FUSED = [c for c in CLASSES if c[0] in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                        torch.optim.Adagrad)]  # fmt: skip


def test_a_fused_optimizer_steps_each_run_in_one_fused_call(monkeypatch):
    calls = []
    real = torch._fused_adamw_

    def counted(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counted)
    ours, theirs, mine = train(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, steps=4)
    assert calls[::2] == [1, 1, 1, 1]  # ours: the run's one flat tensor per step
    assert calls[1::2] == [len(SHAPES)] * 4  # the plain fused optimizer: every parameter
    assert mine._dataparallel_flat_step.flat_steps == 4 and max_diff(ours, theirs) <= 1e-6


def test_every_fused_class_steps_flat_as_its_plain_fused_self():
    assert len(FUSED) == 5  # SGD twice, Adam, AdamW, Adagrad
    for cls, options in FUSED:
        ours, theirs, mine = train(cls, {**options, "fused": True})
        assert mine._dataparallel_flat_step.flat_steps == 8, cls.__name__
        assert max_diff(ours, theirs) <= 1e-6, cls.__name__


def test_a_fused_flat_step_under_grad_scaler_unscales_and_skips_an_overflow():
    """GradScaler hands a fused class its scale and found-inf for the step (no unscale_ of its
    own): the flat run must get them too, or it would step on scaled gradients."""
    ours, views = laid()
    theirs = plain()
    mine = install_flat_step(torch.optim.AdamW(ours, lr=1e-2, fused=True))
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for scaler in scalers:
        scaler.scale(torch.ones(()))  # the scale is made at the first scale(loss)
    generator = torch.Generator().manual_seed(4)
    for step in range(4):
        for p, q, view in zip(ours, theirs, views, strict=True):
            view.copy_(torch.randn(view.shape, generator=generator) * 1024.0)
            if step == 2:
                view[..., 0] = float("inf")  # an overflow: this step is skipped on both
            p.grad, q.grad = view, view.clone()
        before = [p.detach().clone() for p in ours]
        for scaler, optimizer in zip(scalers, (mine, ref), strict=True):
            scaler.step(optimizer)
            scaler.update()
        moved = max_diff(ours, before)
        assert (moved == 0.0) == (step == 2), (step, moved)
        assert max_diff(ours, theirs) <= 1e-6, step
    assert mine._dataparallel_flat_step.flat_steps == 4
    assert [float(mine.state[p]["step"]) for p in ours] == [3.0] * len(SHAPES)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0
