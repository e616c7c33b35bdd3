"""The self-test's inputs for the densenet ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

from ..._core.selftest import Case, bf16, f16, f32, positive, randn

# More error than the default table allows, for these reasons:
TIERS = {
    # A 1x1-convolution GEMM over the channels: float32 sums in another
    # order; in fp16/bf16 the error comes from rounding the GEMM's inputs, so
    # atol is relative to the tensor's largest value (SCALED).
    # tests/accuracy.py ("densenet_gemm") gives the measurement.
    "gemm": {f32: (1e-4, 1e-4), f16: (2e-3, 8e-4), bf16: (1.6e-2, 5e-3)},
    # The same GEMMs in TF32 (float32 on a GPU whose convolutions may use it):
    # each input rounded to 10 mantissa bits; atol relative to the largest value.
    "gemm_tf32": {f32: (0.0, 4e-3)},
}
SCALED = {"gemm": (f16, bf16), "gemm_tf32": (f32,)}

def _bottleneck_inputs(device, dtype, g):
    features = [randn((2, channels, 3, 5), g, dtype, device) for channels in (4, 3)]
    k = 7
    mean = randn((k,), g, f32, device, 0.2)
    invstd = positive((k,), g, device)
    weight, bias = positive((k,), g, device), randn((k,), g, f32, device, 0.1)
    conv_weight = randn((6, k, 1, 1), g, dtype, device, 0.3)
    return features, mean, invstd, weight, bias, conv_weight


def _dense_forward(device, dtype, g):
    return [(*_bottleneck_inputs(device, dtype, g), 0)]


def _dense_backward(device, dtype, g):
    features, *rest = _bottleneck_inputs(device, dtype, g)
    grad_out = randn((2, 6, 3, 5), g, dtype, device)
    return [(grad_out, features, *rest, batch_stats, True, True, 0) for batch_stats in (True, False)]


def _tf32(dtype):
    from .triton import _allow_tf32  # the GEMMs follow PyTorch's flag for convolutions

    return _allow_tf32(dtype)


CASES = {
    "dense_bottleneck_forward": Case(_dense_forward, tier="gemm", tf32=_tf32),
    "dense_bottleneck_backward": Case(_dense_backward, tier="gemm", tf32=_tf32),
}
