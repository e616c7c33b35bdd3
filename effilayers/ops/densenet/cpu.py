"""The bottleneck on CPU: ABN's C++ kernels normalise and activate the
recomputed concatenation (in place, one pass) and run BatchNorm+ReLU's
backward around PyTorch's convolution."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _batchnorm
from .contract import in_layout, layout_of
from .reference import concatenated, nothing

__all__ = ["forward", "backward"]

# ReLU as the ABN kernels spell it: leaky_relu's slope and the weight clamp unused.
_RELU = ("relu", 0.0, 0.0)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`layout_of` ``(x)`` and dense: the layouts ABN's kernels
    walk (they would copy a channel slice of a block buffer to NCHW)."""
    return x.contiguous(memory_format=layout_of(x))


def forward(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor, conv_weight: torch.Tensor, padding: int = 0) -> torch.Tensor:
    kernels = torch.ops.effilayers_cpu
    x, private = concatenated(features)
    readable = _dense(x)
    if private or readable is not x:  # a buffer of our own: normalised in place
        kernels.abn_forward_(readable, mean, invstd, weight, bias, None, *_RELU)
        y = readable
    else:  # one map, used as it is: never written
        y = kernels.abn_forward(x, mean, invstd, weight, bias, None, *_RELU)
    return in_layout(torch.nn.functional.conv2d(y, conv_weight, padding=padding), features[0])


def backward(grad_out: torch.Tensor, features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
             weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor, batch_stats: bool,
             need_input: bool, need_conv: bool, padding: int = 0):
    """The gradients ``reference.backward`` computes, with BatchNorm+ReLU's
    backward as ABN's two C++ passes read from the recomputed concatenation."""
    kernels = torch.ops.effilayers_cpu
    x = _dense(concatenated(features)[0])
    y = kernels.abn_forward(x, mean, invstd, weight, bias, None, *_RELU)
    grad_y, grad_conv = torch.ops.aten.convolution_backward(
        grad_out, y, conv_weight, None, [1, 1], [padding] * 2, [1, 1], False, [0, 0], 1,
        [need_input, need_conv, False])[:2]
    del y
    grad_conv = in_layout(grad_conv, conv_weight) if need_conv else nothing(mean)
    if not need_input:
        return nothing(mean), nothing(mean), nothing(mean), grad_conv
    if grad_y.stride() != x.stride():  # the kernels walk both with one set of strides
        grad_y = torch.empty_like(x).copy_(grad_y)
    count = x.numel() // max(x.shape[1], 1) if batch_stats else 0
    grad_x, _, grad_bias, grad_weight = _batchnorm.backward_passes(
        kernels.abn_backward_reduce, kernels.abn_backward_elemt, grad_y, x, (mean, invstd, weight, bias, None, *_RELU,
                                                                             False),
        count, need_sums=True, need_elemt=True)
    return in_layout(grad_x, features[0]), grad_bias, grad_weight, grad_conv
