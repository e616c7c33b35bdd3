"""The self-test's inputs for the abn ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

from ..._core.selftest import Case, f32, positive, randn
from .._activation import INVERTIBLE_ACTIVATIONS, TABLE


def _channels(device, g, c):
    return (randn((c,), g, f32, device, 0.2), positive((c,), g, device), positive((c,), g, device),
            randn((c,), g, f32, device, 0.1))


# The activations only ABN takes (no inverse): each once, from the saved input.
SMOOTH_ACTIVATIONS = tuple(name for name in TABLE if name not in INVERTIBLE_ACTIVATIONS and name != "relu")


def _abn_forward(device, dtype, g):
    mean, invstd, weight, bias = _channels(device, g, 3)
    x = randn((2, 3, 4, 5), g, dtype, device)
    return [(x, mean, invstd, weight, bias, None, "leaky_relu", 0.01, 1e-5),
            (x, mean, invstd, weight, bias, randn((2, 3, 4, 5), g, dtype, device), "elu", 1.0, 1e-5),
            *((x, mean, invstd, weight, bias, None, name, 0.0, 0.0) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward_args(device, dtype, g, activation="leaky_relu"):
    mean, invstd, weight, bias = _channels(device, g, 3)
    grad, saved = randn((2, 3, 4, 5), g, dtype, device), randn((2, 3, 4, 5), g, dtype, device)
    return grad, saved, mean, invstd, weight, bias, None, activation, 0.01, 1e-5


def _abn_backward_reduce(device, dtype, g):
    # The smooth activations only from the saved input (not invertible).
    return [*((*_abn_backward_args(device, dtype, g), saved_is_output) for saved_is_output in (False, True)),
            *((*_abn_backward_args(device, dtype, g, name), False) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward_elemt(device, dtype, g):
    means = randn((3,), g, f32, device, 0.1), randn((3,), g, f32, device, 0.1)
    return [(*_abn_backward_args(device, dtype, g), True, *means, False),
            *((*_abn_backward_args(device, dtype, g, name), False, *means, True) for name in SMOOTH_ACTIVATIONS)]


def _abn_backward(device, dtype, g):
    return [(*_abn_backward_args(device, dtype, g), True, 40, True, True, False)]


CASES = {
    "abn_forward": Case(_abn_forward),
    "abn_forward_": Case(_abn_forward),
    "abn_backward_reduce": Case(_abn_backward_reduce),
    "abn_backward_elemt": Case(_abn_backward_elemt),
    "abn_backward": Case(_abn_backward),
}
