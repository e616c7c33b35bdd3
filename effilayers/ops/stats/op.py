"""Per-channel batch statistics, as BatchNorm needs them.

``batch_stats(input, correction=0) -> (mean, var, count)`` reduces an
``(N, C, *)`` tensor over every dimension but the channel dimension 1:

* ``mean``, ``var``: shape ``(C,)``, float32 (float64 for float64 input),
  accumulated in that precision whatever the input dtype, so fp16/bf16 input
  neither overflows nor loses the variance of large-mean data;
* ``var`` divides by ``count - correction`` (0: biased, what BatchNorm
  normalises with; 1: unbiased, what it puts into ``running_var``);
* ``count``: 0-dim int64, the number of values per channel.

Numerics: values are reduced in chunks that fit in L1 (CPU) or a thread
block (CUDA), each with a two-pass mean/M2 inside the chunk, and chunks are
combined with Chan's parallel formula. A one-pass sum of squares loses every
digit of the variance of values around 1e4 ± 1 in fp32; this does not.

Edge cases: an empty batch (count 0) gives mean 0 and var 0, the neutral
element of :func:`combine_batch_stats`, so a distributed rank with no samples
contributes nothing; ``count <= correction`` (count > 0) gives var NaN, as
``torch.var`` does.

Layouts: contiguous (NCHW-style) and channels_last / channels_last_3d (any
layout where the channel stride is 1 and the rest is dense) are read in place;
any other strides are copied to contiguous first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from .contract import check_correction, check_input, check_parts, values_per_channel
from .reference import batch_stats_reference

__all__ = ["batch_stats", "combine_batch_stats"]

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("batch_stats", "combine_batch_stats")


def _batch_stats_fake(input, correction):
    acc = accumulation_dtype(input.dtype)
    channels = input.shape[1]
    return (
        input.new_empty((channels,), dtype=acc),
        input.new_empty((channels,), dtype=acc),
        input.new_empty((), dtype=torch.int64),
    )


# Declared once here; csrc/cpu/stats.cpp and csrc/cuda/stats_binding.cpp add the kernels.
_batch_stats_op = registry.declare(
    "batch_stats", "(Tensor input, int correction) -> (Tensor mean, Tensor var, Tensor count)", _batch_stats_fake)


def _setup_context(ctx, inputs, output):
    input, correction = inputs
    mean = output[0]
    ctx.correction = correction
    ctx.save_for_backward(input, mean)
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_mean, grad_var, _grad_count):
    # d mean_c / d x = 1 / n;  d var_c / d x = 2 (x - mean_c) / (n - correction)
    input, mean = ctx.saved_tensors
    channels = input.shape[1]
    count = values_per_channel(input)
    if count == 0:
        return torch.zeros_like(input), None
    shape = [1, channels] + [1] * (input.dim() - 2)
    acc = mean.dtype
    grad = torch.zeros((), dtype=acc, device=input.device)
    if grad_mean is not None:
        grad = grad + (grad_mean / count).view(shape)
    if grad_var is not None:
        dof = count - ctx.correction
        scale = 2.0 / dof if dof > 0 else float("nan")
        grad = grad + (grad_var * scale).view(shape) * (input.to(acc) - mean.view(shape))
    return grad.expand(input.shape).to(input.dtype), None


torch.library.register_autograd(_batch_stats_op, _backward, setup_context=_setup_context)

registry.register(
    registry.OpKernels(name="batch_stats", reference=batch_stats_reference, cpp="batch_stats", cuda="batch_stats")
)


def batch_stats(input: torch.Tensor, correction: int = 0):
    """Per-channel ``(mean, var, count)`` of ``input`` over all dims but dim 1.

    See the module docstring for dtypes, layouts and edge cases. Differentiable
    in ``input`` through ``mean`` and ``var``; works under
    ``torch.compile(fullgraph=True)``.
    """
    check_input(input, correction)
    return _batch_stats_op(input, correction)


def combine_batch_stats(
    means: torch.Tensor | Sequence[torch.Tensor],
    variances: torch.Tensor | Sequence[torch.Tensor],
    counts: torch.Tensor | Sequence[torch.Tensor],
    correction: int = 0,
):
    """Combine per-part statistics (for example one part per rank) into the
    statistics of the whole batch, with Chan's parallel formula.

    ``means`` and ``variances`` are ``(P, C)`` (or sequences of ``(C,)``);
    the variances are biased ones, as ``batch_stats(x, correction=0)`` returns
    them. ``counts`` is ``(P,)``; parts with count 0 are ignored. The result is
    ``(mean, var, count)`` like :func:`batch_stats` with ``correction``.
    Everything stays on the tensors' device: no host synchronisation.
    """
    check_correction(correction, "combine_batch_stats")
    means = means if isinstance(means, torch.Tensor) else torch.stack(list(means))
    variances = variances if isinstance(variances, torch.Tensor) else torch.stack(list(variances))
    counts = counts if isinstance(counts, torch.Tensor) else torch.stack([torch.as_tensor(c) for c in counts])
    check_parts(means, variances, counts)
    part_counts = counts.to(device=means.device, dtype=means.dtype).unsqueeze(1)
    # A part with no samples carries no information, whatever its numbers say.
    means = torch.where(part_counts > 0, means, torch.zeros_like(means))
    variances = torch.where(part_counts > 0, variances, torch.zeros_like(variances))
    total = part_counts.sum(0)
    weights = part_counts / total.clamp_min(1)
    mean = (weights * means).sum(0)
    # within-part M2 plus the spread of the part means around the total mean
    m2 = (part_counts * variances).sum(0) + (part_counts * (means - mean) ** 2).sum(0)
    dof = total - correction
    var = torch.where(dof > 0, m2 / dof.clamp_min(1), torch.full_like(m2, float("nan")))
    var = torch.where(total > 0, var, torch.zeros_like(var))
    return mean, var, counts.sum().to(device=means.device, dtype=torch.int64)
