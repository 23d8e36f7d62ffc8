"""Batch normalisation with statistics over the global batch, on CPU (gloo) and CUDA alike.

`torch.nn.SyncBatchNorm` refuses CPU tensors, so we carry our own: in training, each rank
sums x per channel and counts its samples; one all-reduce gives the global mean, a second the
global sum of squared deviations from it, and every rank normalises with the global mean and
variance. The all-reduces are differentiable: their backward is an all-reduce of the incoming
gradient, which, combined with the strategy's gradient mean,
gives exactly the gradient of plain BatchNorm on the concatenated batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .torch_internals import BatchNormBase


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(BatchNormBase):
    """BatchNorm over any input of shape (N, C, ...) with statistics over all ranks' batches.

    group: the ranks whose batches are normalised together (None: the default group).
    Other arguments are those of `torch.nn.BatchNorm1d`.
    """

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        group=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group = group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected (N, C, ...) input, got {input.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        group = self.group if self.group is not None else dist.group.WORLD
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        if not (self.training and distributed):
            return super().forward(x)
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        # Two passes, mean first: E[x^2] - mean^2 cancels catastrophically when the mean is
        # large against the spread (fp32, mean 3000, std 0.5 gave variances of 0 to 2).
        count = x.new_full((1,), x.numel() // channels)
        totals = _AllReduceSum.apply(torch.cat([x.sum(dims), count]), group)
        n = totals[-1]
        mean = totals[:channels] / n
        centred = x - mean.view(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims), group) / n
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n) -> None:
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp(min=1)
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(unbiased, factor)


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm (and torch.nn.SyncBatchNorm) in `module` with ours, keeping state.

    Returns the module (a new one if `module` itself is a BatchNorm).
    """
    if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            group,
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
        if module.affine:
            converted.weight.requires_grad_(module.weight.requires_grad)
            converted.bias.requires_grad_(module.bias.requires_grad)
        return converted
    for name, child in module.named_children():
        replacement = convert_sync_batchnorm(child, group)
        if replacement is not child:
            setattr(module, name, replacement)
    return module
