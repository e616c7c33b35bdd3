"""What the DenseNet bottleneck accepts, and the layout of what it returns:
the one place its inputs are checked, and the one layout rule that every
backend and the fake kernels follow."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch._prims_common import suggest_memory_format

from ..._core.dtypes import accumulation_dtype

__all__ = ["layout_of", "in_layout", "is_pointwise", "check_arguments"]


def layout_of(first: torch.Tensor) -> torch.memory_format:
    """The layout of every 4-D output of the ops (the output, the gradient of
    the concatenation) on every backend and in the fake kernels: the first
    map's ``Tensor.suggest_memory_format()``, so that a channels_last map
    that is not dense (a channel slice of a block buffer) still gives
    channels_last outputs. (Dense tensors take two C++ checks first: the
    Python ``suggest_memory_format`` costs ~20 us, several times per call.)"""
    if first.is_contiguous():
        return torch.contiguous_format
    if first.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if first.dim() == 4:
        # A channel slice of an NCHW block buffer, the maps every dense layer
        # is given: each plane dense and planes further apart than one value,
        # which suggest_memory_format calls NCHW too, found without its
        # Python walk over the strides.
        _, _, height, width = first.shape
        if height * width > 1 and first.stride(3) == 1 and first.stride(2) == width \
                and first.stride(1) == height * width:
            return torch.contiguous_format
    return suggest_memory_format(first)


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`layout_of` ``(like)``: itself when it already is, else
    a copy. The op bodies apply it to every backend's results, so real and
    fake kernels agree whatever layouts PyTorch's convolution picks (it
    follows its input's and weight's layouts, and the gradient of a 3x3
    weight comes back channels_last for a channels_last input)."""
    return t.contiguous(memory_format=layout_of(like)) if t.dim() == 4 else t


def is_pointwise(conv_weight: torch.Tensor, padding: int) -> bool:
    return padding == 0 and conv_weight.shape[2:] == (1, 1)


def _check_tensor(name: str, t, device: torch.device, channels: Optional[int] = None) -> None:
    """A floating-point tensor on ``device``, of shape ``(channels,)`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bottleneck: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"bottleneck: {name} must be a floating-point tensor, got {t.dtype}")
    if channels is not None and tuple(t.shape) != (channels,):
        raise ValueError(f"bottleneck: {name} must have shape ({channels},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"bottleneck: {name} is on {t.device}, the features on {device}")




def check_arguments(features, weight, bias, running_mean, running_var, conv_weight, training, momentum, eps,
                    num_batches_tracked, padding, batch_statistics) -> list:
    """Raise a clear error for anything ``bottleneck`` cannot take; returns
    ``features`` as a list."""
    if isinstance(features, torch.Tensor):
        features = [features]
    features = list(features)
    if not features:
        raise ValueError("bottleneck: features must hold at least one tensor")
    for i, f in enumerate(features):
        if not isinstance(f, torch.Tensor):
            raise TypeError(f"bottleneck: features[{i}] must be a torch.Tensor, got {type(f).__name__}")
    first = features[0]
    if first.dim() != 4:
        raise ValueError(f"bottleneck: features must be 4-D (N, C, H, W), got shape {tuple(first.shape)}")
    if not first.is_floating_point():
        raise TypeError(f"bottleneck: features must be floating-point tensors, got {first.dtype}")
    for i, f in enumerate(features[1:], 1):
        if f.dim() != 4 or f.shape[0] != first.shape[0] or f.shape[2:] != first.shape[2:]:
            raise ValueError(f"bottleneck: features[{i}] has shape {tuple(f.shape)}, incompatible with "
                             f"features[0] {tuple(first.shape)} (same N, H, W needed)")
        if f.dtype != first.dtype or f.device != first.device:
            raise TypeError(f"bottleneck: every feature must have features[0]'s dtype and device ({first.dtype}, "
                            f"{first.device}); features[{i}] is {f.dtype} on {f.device}")
    channels = sum(f.shape[1] for f in features)
    _check_tensor("conv_weight", conv_weight, first.device)
    if conv_weight.dim() != 4 or conv_weight.shape[1] != channels:
        raise ValueError(f"bottleneck: conv_weight must be (C_out, {channels}, kH, kW), got {tuple(conv_weight.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int):
        raise TypeError(f"bottleneck: padding must be an int, got {type(padding).__name__}")
    if padding < 0:
        raise ValueError(f"bottleneck: padding must be non-negative, got {padding}")
    if batch_statistics is not None:
        if not isinstance(batch_statistics, (tuple, list)) or len(batch_statistics) != 2:
            raise TypeError("bottleneck: batch_statistics must be a (mean, var) pair of tensors")
        shared_mean, shared_var = batch_statistics
        expected = accumulation_dtype(first.dtype)
        for name, t in (("mean", shared_mean), ("var", shared_var)):
            _check_tensor(f"batch_statistics {name}", t, first.device, channels)
            if t.dtype != expected:
                raise TypeError(f"bottleneck: batch_statistics {name} must be {expected} for {first.dtype} "
                                f"features, got {t.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if t is not None:
            _check_tensor(name, t, first.device, channels)
    if (running_mean is None) != (running_var is None):
        raise ValueError("bottleneck: running_mean and running_var must both be tensors or both be None")
    if num_batches_tracked is not None:
        if not isinstance(num_batches_tracked, torch.Tensor) or num_batches_tracked.is_floating_point() \
                or num_batches_tracked.is_complex() or num_batches_tracked.dtype == torch.bool:
            got = num_batches_tracked.dtype if isinstance(num_batches_tracked, torch.Tensor) \
                else type(num_batches_tracked).__name__
            raise TypeError(f"bottleneck: num_batches_tracked must be an integer tensor (BatchNorm's int64 "
                            f"counter) or None, got {got}")
        if num_batches_tracked.numel() != 1 or num_batches_tracked.device != first.device:
            raise ValueError(f"bottleneck: num_batches_tracked must be one value on {first.device}, got shape "
                             f"{tuple(num_batches_tracked.shape)} on {num_batches_tracked.device}")
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))):
        raise TypeError(f"bottleneck: momentum must be a float or None, got {type(momentum).__name__}")
    if momentum is None and training and running_mean is not None and num_batches_tracked is None:
        raise ValueError("bottleneck: momentum=None (cumulative average) needs num_batches_tracked")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"bottleneck: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"bottleneck: eps must be a finite non-negative float, got {eps!r}")
    return features
