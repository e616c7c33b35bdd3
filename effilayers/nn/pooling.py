"""Max pooling that keeps no indices for backward.

``torch.nn.MaxPool2d`` saves its input and an int64 index per output value;
in a ResNet stem those indices weigh twice the fp32 output. This drop-in
saves only its input (which the layer before it usually keeps anyway) and
recomputes the indices in backward with one more pooling pass, the cheapest
layer in the network. Gradients are identical: the recomputation picks the
same maxima, ties included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MaxPool2d"]


class _MaxPool2dRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode):
        ctx.pool_args = (kernel_size, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(x)
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        kernel_size, stride, padding, dilation, ceil_mode = ctx.pool_args
        with torch.no_grad():
            _, indices = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
        grad_input = torch.ops.aten.max_pool2d_with_indices_backward(
            grad_output, x, kernel_size, stride, padding, dilation, ceil_mode, indices
        )
        return grad_input, None, None, None, None, None


def _pair(value):
    return list(value) if isinstance(value, (tuple, list)) else [value, value]


class MaxPool2d(nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` (same arguments) that recomputes its argmax in
    backward instead of storing it. ``return_indices=True`` has to store the
    indices, so it behaves exactly like the torch module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.return_indices or not (torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        stride = self.stride if self.stride is not None else self.kernel_size
        return _MaxPool2dRecompute.apply(x, _pair(self.kernel_size), _pair(stride), _pair(self.padding),
                                         _pair(self.dilation), self.ceil_mode)
