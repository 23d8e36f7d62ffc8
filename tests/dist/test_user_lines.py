"""The scripts users bring, against one process on the global batch, on every strategy.

The ecosystem's optimizers and PyTorch's own lines, unmodified (issue 38):
- optimizers whose step reads a statistic over every parameter: pytorch_optimizer's Prodigy
  (its step size d sums over all the parameters) and `GlobalScale` below, undeclared (the
  engine's exact default, [Note: optimizer layout]), 12 steps, the parameters within 1e-5 and
  the statistic itself (Prodigy's `d`, GlobalScale's `scale`) on every rank within 1e-5
  relative of one process's;
- schedule-free (`schedulefree.AdamWScheduleFree`), declared elementwise and not: the model's
  logits in eval mode after `optimizer.eval()` and in train mode after `optimizer.train()`
  ([Note: torch's own calls]);
- nanoGPT's checkpoint lines: rank 0 `torch.save`s `{'model': model.state_dict(), 'optimizer':
  optimizer.state_dict()}`; saved under DDP they resume exactly in one process (plain AdamW)
  and under every strategy (`model.load_state_dict`, `optimizer.load_state_dict` after
  building); under ZeRO the lines that cannot be exact refuse in one line, and nothing saved
  or loaded holds a NaN;
- two `build_optimizer` calls on one model (Muon on the hidden matrices, AdamW on the rest)
  equal the one-call `GroupedOptimizer` and one process;
- an unmodified GradScaler where ranks own nothing (Prodigy's one owner, on 2 ranks and on 4),
  with an inf on one rank at step 1: every rank skips it together.
A 2 x 2 mesh (4 ranks, shard groups of 2) runs the group-statistic optimizers and schedule-free.
"""

from __future__ import annotations

import io
import math
import warnings
from functools import cache

import pytest
import torch
from torch import nn

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss, strategy

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
schedulefree = pytest.importorskip("schedulefree")

MODEL, PER_RANK, TOL = "transformer", 4, 1e-5
FLAT = ("ddp", "zero1", "zero2", "zero3")
MESH = ("zero1-2d", "zero2-2d", "zero3-2d")


class GlobalScale(torch.optim.Optimizer):
    """A user's optimizer whose step size is a statistic over every parameter of every group:
    momentum SGD whose update is divided by the RMS of all the gradients (kept, as Prodigy keeps
    its d, in the first group under "scale"). Declares nothing."""

    def __init__(self, params, lr=0.02, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = sum(float(g.double().pow(2).sum()) for g in grads)
        count = sum(g.numel() for g in grads)
        scale = math.sqrt(total / max(count, 1)) + 1e-8
        self.param_groups[0]["scale"] = scale
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] / scale)


STATISTICS = {  # name -> (class, its arguments, the group key of its statistic, declared)
    "prodigy": (lambda: pytorch_optimizer.Prodigy, {"lr": 3.0}, "d", {}),  # d grows by step 12
    "global_scale": (lambda: GlobalScale, {"lr": 0.002}, "scale", {}),
    # one param group: what its update reads is its group, declared so
    "global_scale-group": (lambda: GlobalScale, {"lr": 0.002}, "scale", {"reads": "group"}),
}


def step_once(world, model, opt, step: int, reference: bool, scaler=None, poison=False):
    """One step on the global batch (`reference`) or on this rank's chunk of it."""
    n, rank = world.world_size, world.rank
    x, y = batch(MODEL, step, PER_RANK * n)
    if reference:
        loss = reference_loss(MODEL, model, x, y, step, n)
    else:
        loss = loss_fn(MODEL, model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank)
    if poison:
        loss = loss * float("inf")
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


def diff(model, reference: nn.Module) -> float:
    full = dp.full_state_dict(model) if hasattr(model, "_dataparallel_strategy") else model
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


# -- 1. a statistic over every parameter ------------------------------------------------------
def statistics(world, names) -> dict:
    out = {}
    for opt_name, (cls, kwargs, key, declared) in STATISTICS.items():
        reference = build(MODEL, 0)
        ref_opt = cls()(reference.parameters(), **kwargs)
        for step in range(12):
            step_once(world, reference, ref_opt, step, True)
        expected = ref_opt.param_groups[0][key]
        for name in names:
            policy, options = strategy(name)
            model = dp.parallelize(build(MODEL, 0), policy, **options)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                opt = dp.build_optimizer(model, cls(), **kwargs, **declared)
            for step in range(12):
                step_once(world, model, opt, step, False)
            got = opt.param_groups[0][key]
            out[opt_name, name] = {
                "params": diff(model, reference),
                "statistic": abs(float(got) - float(expected)) / abs(float(expected)),
                "moved": float(expected) != float(ref_opt.defaults.get(key, -1.0)),
                "said": [str(w.message) for w in said],
            }
    return out


# -- 2. schedule-free -------------------------------------------------------------------------
def logits(world, model) -> torch.Tensor:
    x, _ = batch(MODEL, 99, PER_RANK * world.world_size)
    with torch.no_grad():
        return model(x).float()


def trained_then_swapped(world, model, opt, reference: bool) -> tuple:
    """Schedule-free's recipe: `train()`, 6 steps, then the logits in eval mode after
    `optimizer.eval()` and in train mode after `optimizer.train()`."""
    opt.train()
    for step in range(6):
        step_once(world, model, opt, step, reference)
    opt.eval()
    model.eval()
    in_eval = logits(world, model)
    opt.train()
    model.train()
    return in_eval, logits(world, model)


def schedule_free(world, names) -> dict:
    kwargs = {"lr": 1e-2, "warmup_steps": 2}
    reference = build(MODEL, 0)
    ref_opt = schedulefree.AdamWScheduleFree(reference.parameters(), **kwargs)
    ref_eval, ref_train = trained_then_swapped(world, reference, ref_opt, True)
    out = {}
    for name in names:
        for declared in ({}, {"elementwise": True}):
            policy, options = strategy(name)
            model = dp.parallelize(build(MODEL, 0), policy, **options)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the unknown class's one line: tested above
                opt = dp.build_optimizer(
                    model, schedulefree.AdamWScheduleFree, **kwargs, **declared
                )
            got_eval, got_train = trained_then_swapped(world, model, opt, False)
            out["schedulefree" + ("-elementwise" if declared else ""), name] = {
                "eval": (got_eval - ref_eval).abs().max().item(),
                "train": (got_train - ref_train).abs().max().item(),
                "apart": (ref_eval - ref_train).abs().max().item(),  # the swap changes them
            }
    return out


# -- 3. nanoGPT's checkpoint lines ------------------------------------------------------------
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def saved_by_rank0(world, model, opt) -> bytes | None:
    """nanoGPT: `if master_process: torch.save({'model': ..., 'optimizer': ...}, path)`; the
    bytes (broadcast to every rank) or None when a line refused."""
    data, error = None, None
    if world.rank == 0:
        try:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            data = buffer.getvalue()
        except RuntimeError as refused:
            error = str(refused)
    shared = [data, error]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared


def finite(tree) -> bool:
    if torch.is_tensor(tree):
        return not tree.is_floating_point() or bool(torch.isfinite(tree).all())
    if isinstance(tree, dict):
        return all(finite(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(finite(v) for v in tree)
    return True


def nanogpt(world, names) -> dict:
    reference = build(MODEL, 0)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for step in range(6):
        step_once(world, reference, ref_opt, step, True)
    out = {}
    # Saved under DDP after 3 steps: resumed in one process with a plain AdamW, and under each
    # strategy through torch's own load lines.
    model = dp.parallelize(build(MODEL, 0), strategy("ddp")[0])
    opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
    for step in range(3):
        step_once(world, model, opt, step, False)
    saved, _ = saved_by_rank0(world, model, opt)

    def loaded() -> dict:  # torch's loads keep the file's tensors: one fresh copy per resume
        return torch.load(io.BytesIO(saved), weights_only=True)

    checkpoint = loaded()
    plain = build(MODEL, 5)
    plain.load_state_dict(checkpoint["model"])
    plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
    plain_opt.load_state_dict(checkpoint["optimizer"])
    for step in range(3, 6):
        step_once(world, plain, plain_opt, step, True)
    out["resume-one-process", "ddp"] = {"params": diff(plain.state_dict(), reference)}
    out["resume-one-process", "ddp"]["finite"] = finite(loaded())
    for name in names:
        policy, options = strategy(name)
        again = dp.parallelize(build(MODEL, 5), policy, **options)
        again_opt = dp.build_optimizer(again, torch.optim.AdamW, **ADAMW)
        checkpoint = loaded()
        again.load_state_dict(checkpoint["model"])
        again_opt.load_state_dict(checkpoint["optimizer"])
        for step in range(3, 6):
            step_once(world, again, again_opt, step, False)
        out["resume", name] = {"params": diff(again, reference)}
        # the same lines saved under this strategy: the state or one line
        if name == "ddp":
            continue
        model = dp.parallelize(build(MODEL, 0), policy, **options)
        opt = dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)
        step_once(world, model, opt, 0, False)
        data, error = saved_by_rank0(world, model, opt)
        lines = {
            "error": error or "",
            "finite": data is None or finite(torch.load(io.BytesIO(data))),
        }
        try:
            weights = model.state_dict()
            lines["model"] = "finite" if finite(weights) else "nan"
        except RuntimeError as refused:
            lines["model"] = str(refused)
        try:
            lines["optimizer"] = str(opt.state_dict())
        except RuntimeError as refused:
            lines["optimizer"] = str(refused)
        try:  # a rank's shard (what an older version saved) is not a plain state
            opt.load_state_dict(dp.local_optimizer_state_dict(opt))
            lines["shard"] = "loaded"
        except ValueError as refused:
            lines["shard"] = str(refused)
        out["save", name] = lines
    return out


# -- 5. two build calls -----------------------------------------------------------------------
def hidden(model) -> tuple[list, list]:
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


MUON = {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"}


def two_calls(world, names) -> dict:
    reference = build(MODEL, 0)
    matrices, rest = hidden(reference)
    ref_opts = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)]
    out = {}
    for step in range(4):
        step_once(world, reference, _Both(ref_opts), step, True)
    for name in names:
        policy, options = strategy(name)
        one = dp.parallelize(build(MODEL, 0), policy, **options)
        matrices, rest = hidden(one)
        grouped = dp.build_optimizer(
            one,
            torch.optim.Muon,
            [{"params": matrices}, {"params": rest, "optimizer": torch.optim.AdamW, **ADAMW}],
            **MUON,
        )
        two = dp.parallelize(build(MODEL, 0), policy, **options)
        matrices, rest = hidden(two)
        pair = _Both(
            [
                dp.build_optimizer(two, torch.optim.Muon, matrices, **MUON),
                dp.build_optimizer(two, torch.optim.AdamW, rest, **ADAMW),
            ]
        )
        for step in range(4):
            step_once(world, one, grouped, step, False)
            step_once(world, two, pair, step, False)
        out["two-calls", name] = {
            "params": diff(two, reference),
            "grouped": max(
                (dp.full_state_dict(two)[k] - v).abs().max().item()
                for k, v in dp.full_state_dict(one).items()
            ),
        }
    return out


class _Both:
    """Two optimizers stepped and zeroed together, as a training loop with two of them does."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for opt in self.opts:
            opt.step()

    def zero_grad(self):
        for opt in self.opts:
            opt.zero_grad()


# -- 6. a loss scaler where ranks own nothing -------------------------------------------------
def scaled(world, names, opt_name: str) -> dict:
    cls, kwargs = {"prodigy": (pytorch_optimizer.Prodigy, {"lr": 1.0})}[opt_name]
    reference = build(MODEL, 0)
    ref_opt = cls(reference.parameters(), **kwargs)
    for step in range(4):
        if step != 1:
            step_once(world, reference, ref_opt, step, True)
    out = {}
    for name in names:
        policy, options = strategy(name)
        model = dp.parallelize(build(MODEL, 0), policy, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = dp.build_optimizer(model, cls, **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        owned = sum(1 for g in opt.param_groups for p in g["params"] if p.numel() > 1)
        for step in range(4):
            step_once(world, model, opt, step, False, scaler, poison=step == 1 and world.rank == 1)
        out["scaler-" + opt_name, name] = {
            "params": diff(model, reference),
            "scale": scaler.get_scale(),
            "owned": owned,
        }
    return out


def world2(world) -> dict:
    out = {}
    out.update(statistics(world, FLAT))
    out.update(schedule_free(world, FLAT))
    out.update(nanogpt(world, FLAT))
    out.update(two_calls(world, FLAT))
    out.update(scaled(world, FLAT[1:], "prodigy"))
    return out


def world4(world) -> dict:
    out = {}
    out.update(statistics(world, MESH))
    out.update(schedule_free(world, MESH))
    out.update(scaled(world, ("zero1", "zero2", "zero3"), "prodigy"))
    return out


@cache
def results(n: int) -> list[dict]:
    return run_world(n, world2 if n == 2 else world4, timeout=600)


def rows(kind: str, n: int = 2) -> dict:
    """Every rank's rows of one kind, keyed (rank, case, strategy)."""
    return {
        (rank, *key): row
        for rank, out in enumerate(results(n))
        for key, row in out.items()
        if key[0].startswith(kind)
    }


def test_a_statistic_over_every_parameter_is_the_one_process_value_on_every_rank():
    cases = {
        **rows("prodigy"),
        **rows("global_scale"),
        **rows("prodigy", 4),
        **rows("global_scale", 4),
    }
    assert len(cases) == 2 * 3 * 4 + 4 * 3 * 3  # ranks x optimizers x strategies, both worlds
    for key, row in cases.items():
        assert row["params"] < TOL and row["statistic"] < TOL and row["moved"], (key, row)


def test_an_unknown_class_is_told_in_one_line_once_on_rank_0_where_the_layout_matters():
    declared = rows("global_scale-group")
    assert len(declared) == 2 * 4 and all(row["said"] == [] for row in declared.values())
    assert len(rows("prodigy")) == 2 * 4
    for (rank, _opt_name, name), row in rows("prodigy").items():
        said = row["said"]
        if rank != 0 or name == "ddp":
            assert said == [], (rank, name, said)
            continue
        assert len(said) == 1 and "\n" not in said[0], said
        assert said[0].startswith("build_optimizer: Prodigy is a class dataparallel does not know")
        assert "elementwise=True" in said[0] and "reads='parameter'" in said[0], said


def test_schedule_free_eval_and_train_reach_the_model_on_every_strategy():
    cases = {**rows("schedulefree"), **rows("schedulefree", 4)}
    assert len(cases) == 2 * 2 * 4 + 4 * 2 * 3  # ranks x (undeclared, elementwise) x strategies
    for key, row in cases.items():
        assert row["apart"] > 1e-3, (key, row)  # eval and train weights differ
        assert row["eval"] < TOL and row["train"] < TOL, (key, row)


def test_nanogpt_checkpoint_lines_resume_exactly_or_refuse_in_one_line():
    resumed = rows("resume")
    assert len(resumed) == 2 * (1 + 4)  # ranks x (one process, every strategy)
    for key, row in resumed.items():
        assert row["params"] < TOL, (key, row)
        assert row.get("finite", True), (key, row)
    saved = rows("save")
    assert len(saved) == 2 * 3
    for (_, _, name), row in saved.items():
        assert row["finite"], (name, row)
        first = "model" if name == "zero3" else "optimizer"  # the first line that refuses
        assert row["error"] == row[first], row  # what rank 0 met, told to every rank
        assert row["optimizer"].startswith(f"optimizer.state_dict() under {name} would hold"), row
        assert "dp.optimizer_state_dict(model, optimizer)" in row["optimizer"], row
        assert "\n" not in row["optimizer"], row
        shard = row["shard"]
        assert shard.startswith(f"optimizer.load_state_dict under {name} takes a plain"), row
        assert "dp.optimizer_state_dict" in shard and "\n" not in shard, row
        if name == "zero3":
            assert row["model"].startswith("model.state_dict() under zero3"), row
            assert "dp.full_state_dict(model)" in row["model"] and "\n" not in row["model"], row
        else:
            assert row["model"] == "finite", row


def test_two_build_calls_equal_the_one_call_grouped_optimizer():
    cases = rows("two-calls")
    assert len(cases) == 2 * 4
    for key, row in cases.items():
        assert row["params"] < TOL and row["grouped"] < 1e-6, (key, row)


def test_a_loss_scaler_with_ranks_that_own_nothing_skips_together():
    assert len(rows("scaler")) == 2 * 3 and len(rows("scaler", 4)) == 4 * 3
    for n in (2, 4):
        owned = {}
        for (_, _, name), row in rows("scaler", n).items():
            assert row["params"] < TOL and row["scale"] == 8.0, (n, name, row)  # 16, halved once
            owned.setdefault(name, []).append(row["owned"])
        for name, counts in owned.items():
            assert sorted(counts)[: n - 1] == [0] * (n - 1), (n, name, counts)  # one owner
