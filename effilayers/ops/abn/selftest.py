"""The self-test's inputs for the abn ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

from ..._core.selftest import Case, f32, positive, randn


def _channels(device, g, c):
    return (randn((c,), g, f32, device, 0.2), positive((c,), g, device), positive((c,), g, device),
            randn((c,), g, f32, device, 0.1))


def _abn_forward(device, dtype, g):
    mean, invstd, weight, bias = _channels(device, g, 3)
    x = randn((2, 3, 4, 5), g, dtype, device)
    return [(x, mean, invstd, weight, bias, None, "leaky_relu", 0.01, 1e-5),
            (x, mean, invstd, weight, bias, randn((2, 3, 4, 5), g, dtype, device), "elu", 1.0, 1e-5)]


def _abn_backward_args(device, dtype, g):
    mean, invstd, weight, bias = _channels(device, g, 3)
    grad, saved = randn((2, 3, 4, 5), g, dtype, device), randn((2, 3, 4, 5), g, dtype, device)
    return grad, saved, mean, invstd, weight, bias, None, "leaky_relu", 0.01, 1e-5


def _abn_backward_reduce(device, dtype, g):
    return [(*_abn_backward_args(device, dtype, g), saved_is_output) for saved_is_output in (False, True)]


def _abn_backward_elemt(device, dtype, g):
    means = randn((3,), g, f32, device, 0.1), randn((3,), g, f32, device, 0.1)
    return [(*_abn_backward_args(device, dtype, g), True, *means, False)]


def _abn_backward(device, dtype, g):
    return [(*_abn_backward_args(device, dtype, g), True, 40, True, True, False)]


CASES = {
    "abn_forward": Case(_abn_forward),
    "abn_forward_": Case(_abn_forward),
    "abn_backward_reduce": Case(_abn_backward_reduce),
    "abn_backward_elemt": Case(_abn_backward_elemt),
    "abn_backward": Case(_abn_backward),
}
