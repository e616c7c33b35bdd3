"""The activations a BatchNorm can be fused with, written once for Python.

Each row gives the activation ``z = act(y)``, its derivative at the
pre-activation ``y``, the same derivative written in terms of the output
``z`` (what an in-place layer has in backward), and the inverse ``y =
act^-1(z)`` where there is one. Activated BatchNorm's reference kernels are
built from this table and its checks read the names from it; the C++ and
CUDA kernels take theirs from ``csrc/common/activation.h``, which follows the
same rows. ``param`` is leaky_relu's negative slope or elu's alpha.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["ACTIVATIONS", "INVERTIBLE_ACTIVATIONS", "TABLE"]


class Activation(NamedTuple):
    forward: Callable
    derivative: Callable
    derivative_from_output: Callable
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
}

ACTIVATIONS = tuple(TABLE)
INVERTIBLE_ACTIVATIONS = tuple(name for name, row in TABLE.items() if row.inverse is not None)
