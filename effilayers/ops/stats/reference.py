"""The pure-PyTorch ``batch_stats``: the fallback kernel and the test oracle
(run it on float64 input for ground truth)."""

from __future__ import annotations

import torch

from ..._core.dtypes import accumulation_dtype
from .contract import values_per_channel

__all__ = ["batch_stats_reference"]


def batch_stats_reference(input: torch.Tensor, correction: int = 0):
    channels = input.shape[1]
    count = values_per_channel(input)
    acc = accumulation_dtype(input.dtype)
    count_tensor = torch.tensor(count, dtype=torch.int64, device=input.device)
    if count == 0 or channels == 0:
        zeros = torch.zeros(channels, dtype=acc, device=input.device)
        return zeros, zeros.clone(), count_tensor
    # Upcast copy: the reference trades memory for simplicity. torch's
    # var_mean is Welford-based, so large means keep their variance; each
    # channel is shifted by its first value as well, since torch's float32
    # var_mean on CUDA merges rounded means (a few values of spread 0.1
    # around 300 came out 1e-4 relative off on an H200).
    values = input.to(acc).transpose(0, 1).reshape(channels, count)
    pivot = values[:, :1]
    var, mean = torch.var_mean(values - pivot, dim=1, correction=0)
    mean = mean + pivot.squeeze(1)
    if count - correction > 0:
        var = var * (count / (count - correction))
    else:
        var = torch.full_like(var, float("nan"))
    return mean, var, count_tensor
