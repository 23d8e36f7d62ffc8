"""[Note: sharded gradients]: a model parameter's `.grad` under ZeRO refuses every use in one
line naming the call and the fix; its metadata reads true; zero_grad clears it. No process
group: the placeholder alone, and the strategy's attach/drop."""

from __future__ import annotations

import pytest
import torch

from dataparallel.strategies.parts.sharded_grads import (
    ShardedGrads,
    is_sharded_grad,
    sharded_grad,
)

FIX = "use dataparallel.clip_grad_norm_(model, max_norm), dataparallel.clip_grad_value_"
USES = {
    "torch.nn.utils.clip_grad_norm_": lambda p: torch.nn.utils.clip_grad_norm_([p], 1.0),
    "torch.nn.utils.clip_grad_value_": lambda p: torch.nn.utils.clip_grad_value_([p], 1.0),
    "torch.nn.utils.get_total_norm": lambda p: torch.nn.utils.get_total_norm([p.grad]),
    ".grad.norm": lambda p: p.grad.norm(),
    ".grad.mul": lambda p: p.grad * 2,
    ".grad.__repr__": lambda p: repr(p.grad),
}


@pytest.mark.parametrize("call", list(USES))
def test_every_use_raises_one_line_naming_the_call_and_the_fix(call):
    param = torch.nn.Parameter(torch.randn(3, 4))
    param.grad = sharded_grad(param, "zero2")
    with pytest.raises(RuntimeError) as error:
        USES[call](param)
    message = str(error.value)
    assert message.startswith(f"{call} read a model parameter's .grad, which under zero2")
    assert FIX in message and "\n" not in message


def test_metadata_reads_true_and_zero_grad_clears():
    layer = torch.nn.Linear(3, 4)
    layer.weight.grad = sharded_grad(layer.weight, "zero1")
    grad = layer.weight.grad
    assert grad is not None and grad.shape == (4, 3) and grad.dtype == torch.float32
    assert grad.size(0) == 4 and grad.dim() == 2 and grad.numel() == 12
    layer.zero_grad(set_to_none=False)  # zeros: a no-op on the placeholder
    assert is_sharded_grad(layer.weight.grad)
    layer.zero_grad()
    assert layer.weight.grad is None


def test_attach_follows_the_used_flags_and_the_parameters_dtype_and_drop_clears():
    used, unused, frozen = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    frozen.requires_grad_(False)
    grads = ShardedGrads([used, unused, frozen], "zero3")
    grads.attach([True, False, True])
    assert is_sharded_grad(used.grad) and unused.grad is None and frozen.grad is None
    first = used.grad
    grads.drop()
    assert used.grad is None
    used.data = used.data.to(torch.bfloat16)  # ZeRO-3 gathers in the compute dtype
    grads.attach([True, False, False])
    assert used.grad.dtype == torch.bfloat16 and used.grad is not first
    used.grad = None
    real = torch.ones(2)
    unused.grad = real
    grads.drop()  # a real gradient is never touched
    assert unused.grad is real
