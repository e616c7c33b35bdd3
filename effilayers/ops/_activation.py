"""The activations a BatchNorm can be fused with, written once for Python.

Each row gives the activation ``z = act(y)``, its derivative at the
pre-activation ``y``, and, for the invertible ones (what an in-place layer
can use), the same derivative written in terms of the output ``z`` and the
inverse ``y = act^-1(z)``. The others (relu and the smooth activations:
silu, gelu, gelu_tanh, hardswish, mish, relu6, sigmoid, tanh) run only
where the norm's input is kept, and backward recomputes ``y`` from it.
Forwards are torch's own functions and derivatives match torch's autograd,
kinks included. Activated BatchNorm's reference kernels are built from this
table and its checks read the names from it; the C++ and CUDA kernels take
theirs from ``csrc/common/activation.h``, which follows the same rows.
``param`` is leaky_relu's negative slope or elu's alpha; the others ignore it.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "INVERTIBLE_ACTIVATIONS", "TABLE"]


class Activation(NamedTuple):
    forward: Callable
    derivative: Callable
    derivative_from_output: Optional[Callable]
    inverse: Optional[Callable]


def _elu_inverse(z, alpha):
    # Saturated outputs (z == -alpha) carry no information about y; the
    # clamp keeps the inverse finite there (their gradient is zero anyway).
    ratio = (z / alpha).clamp_min(-1 + torch.finfo(z.dtype).eps)
    return torch.where(z > 0, z, torch.log1p(ratio))


def _leaky_derivative(t, slope):
    # Depends only on the sign, which the input and the output share.
    return torch.where(t > 0, t.new_tensor(1.0), t.new_tensor(slope))


def _relu_derivative(t, _):
    return (t > 0).to(t.dtype)


def _silu_derivative(y, _):
    s = torch.sigmoid(y)
    return s * (1 + y * (1 - s))


def _gelu_derivative(y, _):
    return 0.5 * (1 + torch.erf(y * math.sqrt(0.5))) + y * torch.exp(-0.5 * y * y) / math.sqrt(2 * math.pi)


def _gelu_tanh_derivative(y, _):
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (y + 0.044715 * y ** 3))
    return 0.5 * (1 + t) + 0.5 * y * (1 - t * t) * k * (1 + 3 * 0.044715 * y * y)


def _hardswish_derivative(y, _):
    # torch's values at the kinks: 0 at y = -3, 1 at y = 3
    return torch.where(y <= -3, torch.zeros_like(y), torch.where(y >= 3, torch.ones_like(y), y / 3 + 0.5))


def _mish_derivative(y, _):
    t = torch.tanh(F.softplus(y))
    return t + y * torch.sigmoid(y) * (1 - t * t)


def _relu6_derivative(y, _):
    # hardtanh's: zero at both kinks
    return ((y > 0) & (y < 6)).to(y.dtype)


def _sigmoid_derivative(y, _):
    s = torch.sigmoid(y)
    return s * (1 - s)


def _tanh_derivative(y, _):
    return 1 - torch.tanh(y) ** 2


def _smooth(forward, derivative) -> Activation:
    return Activation(forward=lambda y, _: forward(y), derivative=derivative, derivative_from_output=None,
                      inverse=None)


TABLE = {
    "leaky_relu": Activation(
        forward=lambda y, slope: torch.where(y > 0, y, y * slope),
        derivative=_leaky_derivative,
        derivative_from_output=_leaky_derivative,
        inverse=lambda z, slope: torch.where(z > 0, z, z / slope),
    ),
    "elu": Activation(
        forward=lambda y, alpha: torch.where(y > 0, y, alpha * torch.expm1(y)),
        derivative=lambda y, alpha: torch.where(y > 0, torch.ones_like(y), alpha * torch.exp(y.clamp_max(0))),
        derivative_from_output=lambda z, alpha: torch.where(z > 0, torch.ones_like(z), z + alpha),
        inverse=_elu_inverse,
    ),
    "identity": Activation(
        forward=lambda y, _: y,
        derivative=lambda y, _: torch.ones_like(y),
        derivative_from_output=lambda z, _: torch.ones_like(z),
        inverse=lambda z, _: z,
    ),
    "relu": Activation(
        forward=lambda y, _: y.clamp_min(0),
        derivative=_relu_derivative,
        derivative_from_output=_relu_derivative,
        inverse=None,
    ),
    "silu": _smooth(F.silu, _silu_derivative),
    "gelu": _smooth(F.gelu, _gelu_derivative),
    "gelu_tanh": _smooth(lambda y: F.gelu(y, approximate="tanh"), _gelu_tanh_derivative),
    "hardswish": _smooth(F.hardswish, _hardswish_derivative),
    "mish": _smooth(F.mish, _mish_derivative),
    "relu6": _smooth(F.relu6, _relu6_derivative),
    "sigmoid": _smooth(torch.sigmoid, _sigmoid_derivative),
    "tanh": _smooth(torch.tanh, _tanh_derivative),
}

ACTIVATIONS = tuple(TABLE)
INVERTIBLE_ACTIVATIONS = tuple(name for name, row in TABLE.items() if row.inverse is not None)
