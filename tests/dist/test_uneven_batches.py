"""[Note: uneven batches]: a global batch that the ranks do not divide keeps the global batch's
gradient exactly, and a run resized onto such a split trains on every sample once.

One step of the trainer on a global batch of 8 windows (accum 2) is taken by 1 rank (micro-batches
4 + 4) and by 3 ranks (3,3,2 windows: micro-batches 2+1, 2+1, 1+1): the gradients the optimizer
gets, the loss and the norm must agree to float32 summation order.
"""

from __future__ import annotations

import torch

from .harness import run_world
from .tiny_trainer import ACCUM, GLOBAL_BATCH, trained_samples, trainer_state


def one_step_gradients(world, strategy: str) -> dict:
    """The gradients handed to the optimizer in the first step (DDP: whole on every rank), the
    step's loss and norm, and this rank's micro-batch sizes."""
    from dataparallel.train.trainer import train_step

    state = trainer_state(world, strategy)
    captured = {}
    step = state.optimizer.step

    def capturing(*args, **kwargs):
        for name, p in state.model.named_parameters():
            captured[name] = p.grad.tolist()  # tensors do not outlive the rank's process
        return step(*args, **kwargs)

    state.optimizer.step = capturing
    sizes = []
    batch = state.train_windows.batch

    def counting(indices):
        sizes.append(len(indices))
        return batch(indices)

    state.train_windows.batch = counting
    record = train_step(state)
    return {"grads": captured, "loss": record.loss, "norm": record.grad_norm, "sizes": sizes}


def test_an_uneven_split_keeps_the_global_batchs_gradient():
    (whole,) = run_world(1, one_step_gradients, "ddp")
    split = run_world(3, one_step_gradients, "ddp")
    assert whole["sizes"] == [4, 4]
    assert [r["sizes"] for r in split] == [[2, 1], [2, 1], [1, 1]]
    worst = 0.0  # the largest difference relative to the gradient's largest element
    for rank in split:
        assert abs(rank["loss"] - whole["loss"]) < 1e-6 * whole["loss"]
        assert abs(rank["norm"] - whole["norm"]) < 1e-5 * whole["norm"]
        for name, grad in whole["grads"].items():
            if name.endswith("attn.k.bias"):  # an exactly zero true gradient (gpt.py): noise
                continue
            ours, reference = torch.tensor(rank["grads"][name]), torch.tensor(grad)
            scale = reference.abs().max().item()
            worst = max(worst, (ours - reference).abs().max().item() / scale)
    print(f"uneven split: largest gradient difference {worst:.1e} of the largest element")
    assert worst < 1e-5  # float32 summation order (measured: see docs/train.md)


def train_and_count(world, run_dir, strategy, steps, resume, global_batch, accum):
    """`steps` steps (after resuming run_dir when `resume`), a checkpoint at the end; every
    sample index any rank trained on, in stream order."""
    state = trainer_state(world, strategy, run_dir, global_batch, accum)
    return trained_samples(world, state, run_dir, steps, resume)


def test_a_resume_onto_an_uneven_split_trains_on_every_sample_once(tmp_path):
    """A global batch of 8: 4 steps on 2 ranks (ZeRO-2, 4 + 4), then 6 on 3 ranks (ZeRO-3,
    3,3,2, accum 2), then 5 on 1 rank (DDP, accum 2): the 120 samples are the first epoch's 74,
    each once, then 46 distinct ones of the second."""
    run_dir = str(tmp_path / "run")
    first = run_world(2, train_and_count, run_dir, "zero2", 4, False, 8, 1)[0]
    second = run_world(3, train_and_count, run_dir, "zero3", 6, True, 8, 2)[0]
    third = run_world(1, train_and_count, run_dir, "ddp", 5, True, 8, 2)[0]
    assert (len(first), len(second), len(third)) == (32, 48, 40)
    taken = first + second + third
    epoch = len(set(taken))
    assert epoch == 74
    assert sorted(taken[:epoch]) == list(range(epoch))
    assert len(set(taken[epoch:])) == len(taken) - epoch
