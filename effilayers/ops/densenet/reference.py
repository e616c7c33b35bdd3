"""The bottleneck in PyTorch ops: the oracle of the Triton kernels, and the
path for what they do not cover (float64, the 3x3 convolution). Holds the
recomputed concatenation and activation for the duration of a call only."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._core.dtypes import as_dtype
from .contract import in_layout, layout_of

__all__ = ["forward", "backward", "concatenated", "affine_vectors", "nothing"]


def _channel_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (dim - 2))


def concatenated(features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The input of the norm, and whether it is a private buffer that may be
    overwritten (one map is used as it is, never copied). The concatenation
    takes the first map's layout (``torch.cat`` alone gives NCHW when the
    maps' layouts differ)."""
    if len(features) == 1:
        return features[0], False
    first = features[0]
    out = torch.empty((first.shape[0], sum(f.shape[1] for f in features), *first.shape[2:]), dtype=first.dtype,
                      device=first.device, memory_format=layout_of(first))
    return torch.cat(features, 1, out=out), True


def _normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, private: bool) -> torch.Tensor:
    """x_hat in the statistics' dtype, reusing x's storage when x is a
    private buffer of that dtype (the recomputed concatenation)."""
    dim = x.dim()
    if private and x.dtype == mean.dtype:
        return x.sub_(_channel_view(mean, dim)).mul_(_channel_view(invstd, dim))
    return (x.to(mean.dtype) - _channel_view(mean, dim)) * _channel_view(invstd, dim)


def affine_vectors(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm's weight and bias in the statistics' dtype (ones and zeros
    without affine parameters)."""
    w = torch.ones_like(mean) if weight is None else as_dtype(weight.detach(), mean.dtype)
    b = torch.zeros_like(mean) if bias is None else as_dtype(bias.detach(), mean.dtype)
    return w, b


def nothing(like: torch.Tensor) -> torch.Tensor:
    """An output that was not asked for: empty, and its own tensor (a custom
    op's outputs may not alias one another)."""
    return like.new_empty(0)


def _activated(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat, relu(x_hat * weight + bias) in the maps' dtype), recomputed."""
    x, private = concatenated(features)
    x_hat = _normalized(x, mean, invstd, private)
    del x
    dim = x_hat.dim()
    y = torch.addcmul(_channel_view(bias, dim), x_hat, _channel_view(weight, dim))
    return x_hat, y.clamp_min_(0).to(features[0].dtype)


def forward(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                       padding: int = 0) -> torch.Tensor:
    """cat, BatchNorm with the given statistics, ReLU and the convolution in
    PyTorch ops: the CPU path and the oracle of the Triton kernels. Holds the
    concatenation and the activation for the duration of the call only."""
    _, y = _activated(features, mean, invstd, weight, bias)
    return in_layout(torch.nn.functional.conv2d(y, conv_weight, padding=padding), features[0])


def backward(grad_out: torch.Tensor, features: Sequence[torch.Tensor], mean: torch.Tensor,
                        invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                        batch_stats: bool, need_input: bool, need_conv: bool, padding: int = 0):
    """Gradients of :func:`forward` with respect to the maps,
    BatchNorm's bias and weight and the convolution weight (module
    docstring for the formulas). Returns ``(grad_input, grad_bias,
    grad_weight, grad_conv)``, ``grad_input`` the gradient of the
    concatenation; entries not asked for are empty."""
    x_hat, y = _activated(features, mean, invstd, weight, bias)
    dim = x_hat.dim()
    grad_y, grad_conv = torch.ops.aten.convolution_backward(
        grad_out, y, conv_weight, None, [1, 1], [padding] * 2, [1, 1], False, [0, 0], 1,
        [need_input, need_conv, False])[:2]
    grad_conv = in_layout(grad_conv, conv_weight) if need_conv else nothing(mean)
    if not need_input:
        return nothing(mean), nothing(mean), nothing(mean), grad_conv
    # Through the ReLU: its output is zero exactly where it cut.
    grad_z = grad_y.to(mean.dtype).masked_fill_(y <= 0, 0)
    del y, grad_y
    reduce_dims = [0] + list(range(2, dim))
    grad_bias = grad_z.sum(reduce_dims)
    grad_weight = (grad_z * x_hat).sum(reduce_dims)
    if batch_stats:
        n = x_hat.numel() // max(x_hat.shape[1], 1)
        grad_x = x_hat.mul_(_channel_view(grad_weight / n, dim))
        grad_x = grad_z.sub_(_channel_view(grad_bias / n, dim)).sub_(grad_x)
    else:
        grad_x = grad_z
    grad_x = grad_x.mul_(_channel_view(invstd * weight, dim)).to(features[0].dtype)
    return in_layout(grad_x, features[0]), grad_bias, grad_weight, grad_conv


