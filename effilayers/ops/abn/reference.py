"""Pure-PyTorch kernels of activated BatchNorm: the fallback and the oracle
the C++ and CUDA kernels are tested against (float64 input for ground truth).
They take exactly the arguments of the compiled kernels (``csrc/common/schemas.h``)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._core.dtypes import accumulation_dtype
from .._activation import TABLE

__all__ = ["effective_weight", "forward", "forward_", "backward_reduce", "backward_elemt"]


def effective_weight(weight: Optional[torch.Tensor], weight_eps: float) -> Optional[torch.Tensor]:
    """The scale ``s`` actually applied: the weight, clamped away from zero
    with its sign kept when ``weight_eps > 0``."""
    if weight is None or weight_eps <= 0:
        return weight
    sign = torch.where(weight < 0, weight.new_tensor(-1.0), weight.new_tensor(1.0))
    return sign * weight.abs().clamp_min(weight_eps)


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _affine(weight, bias, mean, weight_eps, acc, shape):
    """Per-channel (s, beta) in the accumulation dtype, views of ``shape``."""
    channels = mean.numel()
    scale = effective_weight(weight, weight_eps)
    scale = torch.ones(channels, dtype=acc, device=mean.device) if scale is None else scale.to(acc)
    shift = torch.zeros(channels, dtype=acc, device=mean.device) if bias is None else bias.to(acc)
    return scale.view(shape), shift.view(shape)


def forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps):
    acc = accumulation_dtype(x.dtype)
    shape = _channel_shape(x)
    scale, shift = _affine(weight, bias, mean, weight_eps, acc, shape)
    y = (x.to(acc) - mean.to(acc).view(shape)) * (invstd.to(acc).view(shape) * scale) + shift
    if residual is not None:
        y = y + residual.to(acc)
    return TABLE[activation].forward(y, param).to(x.dtype)


def forward_(x, mean, invstd, weight, bias, residual, activation, param, weight_eps):
    x.copy_(forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps))


def _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps, saved_is_output):
    acc = accumulation_dtype(saved.dtype)
    shape = _channel_shape(saved)
    scale, shift = _affine(weight, bias, mean, weight_eps, acc, shape)
    row = TABLE[activation]
    if saved_is_output and row.inverse is None:
        # the compiled kernels refuse it alike (csrc/common/checks.h)
        raise ValueError(f"abn backward: activation {activation!r} is not invertible, so backward needs the saved "
                         "input (saved_is_output=False)")
    if saved_is_output:
        # Rebuild x_hat from the output: invert the activation, then the affine map.
        z = saved.to(acc)
        y = row.inverse(z, param)
        pre_residual = y if residual is None else y - residual.to(acc)
        x_hat = (pre_residual - shift) / scale
        dy = grad.to(acc) * row.derivative_from_output(z, param)
    else:
        x_hat = (saved.to(acc) - mean.to(acc).view(shape)) * invstd.to(acc).view(shape)
        y = x_hat * scale + shift
        if residual is not None:
            y = y + residual.to(acc)
        dy = grad.to(acc) * row.derivative(y, param)
    return dy, x_hat, scale


def backward_reduce(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                    saved_is_output):
    dy, x_hat, _ = _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                                saved_is_output)
    dims = [0] + list(range(2, saved.dim()))
    return dy.sum(dims), (dy * x_hat).sum(dims)


def backward_elemt(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                   saved_is_output, mean_dy, mean_dy_xhat, want_residual_grad):
    dy, x_hat, scale = _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param,
                                    weight_eps, saved_is_output)
    shape = _channel_shape(saved)
    acc = dy.dtype
    grad_input = (scale * invstd.to(acc).view(shape)) * (
        dy - mean_dy.to(acc).view(shape) - x_hat * mean_dy_xhat.to(acc).view(shape)
    )
    grad_residual = dy.to(saved.dtype) if want_residual_grad else saved.new_empty(0)
    return grad_input.to(saved.dtype), grad_residual
