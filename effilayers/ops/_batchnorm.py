"""BatchNorm's core, shared by activated BatchNorm and the DenseNet bottleneck.

Both normalise with per-channel batch statistics (or the running ones in
eval), update the running statistics once per forward exactly as
``torch.nn.BatchNorm2d`` does, and run BatchNorm's backward as two passes:
per-channel sums ``(sum dy, sum dy * x_hat)``, then an element-wise pass that
needs their means over the whole (possibly distributed) batch. What differs
between them is only which kernels compute the passes.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .._core import registry
from .._core.dtypes import accumulation_dtype, as_dtype
from .stats import combine_batch_stats, values_per_channel

__all__ = ["distributed", "channel_stats", "batch_statistics", "normalizing_statistics", "update_running_stats",
           "backward_passes"]


def distributed(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def channel_stats(x: torch.Tensor):
    """``batch_stats(x)`` without its checks (the callers checked ``x``)."""
    op = registry.op("batch_stats")
    if registry.runs_eagerly(x):
        # Autograd is not recording (an autograd Function's forward): the
        # op's Python autograd kernel would only pass the call on.
        with torch._C._AutoDispatchBelowAutograd():
            return op(x, 0)
    return op(x, 0)


def batch_statistics(parts: Sequence[torch.Tensor], group=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean, biased var, values per channel) of the channel concatenation of
    ``parts``, over this rank's batch or, with a process group, every rank's.

    The statistics of a concatenation are those of its parts, so nothing is
    concatenated to reduce it. The count comes from the shape, not from the
    kernel's count tensor: reading that is a host sync per norm and step on
    CUDA, and a data-dependent value torch.compile cannot trace.
    """
    if len(parts) == 1:
        mean, var, count = channel_stats(parts[0])
    else:
        stats = [channel_stats(part) for part in parts]
        mean, var, count = torch.cat([s[0] for s in stats]), torch.cat([s[1] for s in stats]), stats[0][2]
    if not distributed(group):
        return mean, var, values_per_channel(parts[0])
    # float64 keeps counts exact far beyond 2**24 values per channel.
    packed = torch.cat([mean.double(), var.double(), count.double().view(1)])
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    stacked = torch.stack(gathered)
    channels = mean.numel()
    counts = stacked[:, 2 * channels].round().to(torch.int64)
    mean, var, total = combine_batch_stats(stacked[:, :channels], stacked[:, channels:2 * channels], counts)
    acc = accumulation_dtype(parts[0].dtype)
    return mean.to(acc), var.to(acc), int(total)


@torch.no_grad()
def update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, count: int, momentum) -> None:
    """BatchNorm's update, with its arithmetic: ``running = (1 - f) running +
    f batch`` with the unbiased variance, ``f = momentum`` or
    ``1 / num_batches_tracked``."""
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if running_mean is None and running_var is None:
        return
    factor = (1.0 / float(num_batches_tracked)) if momentum is None else momentum
    if running_mean is not None:
        running_mean.mul_(1 - factor).add_(as_dtype(mean, running_mean.dtype), alpha=factor)
    if running_var is not None:
        running_var.mul_(1 - factor).add_(as_dtype(var * (count / (count - 1)), running_var.dtype), alpha=factor)


def too_few_values(parts: Sequence[torch.Tensor], where: str, group) -> ValueError:
    first = parts[0]
    size = (first.shape[0], sum(p.shape[1] for p in parts), *first.shape[2:])
    # torch's wording, which effilayers-bench recognises.
    return ValueError(f"{where}: expected more than 1 value per channel when training, got input size {size}"
                      + (" across all ranks" if distributed(group) else ""))


def _finish(mean, var, count: int, running_mean, running_var, num_batches_tracked, momentum, eps: float):
    """The running update (none for an empty batch, as BatchNorm: only the
    counter moves) and ``(mean, invstd)``."""
    if count == 0:
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
    else:
        update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, count, momentum)
    return mean, torch.rsqrt(var + eps)


def _normalizing_statistics_reference(x, running_mean, running_var, num_batches_tracked, momentum: float,
                                      cumulative: bool, eps: float):
    mean, var, _ = channel_stats(x)
    return _finish(mean, var, values_per_channel(x), running_mean, running_var, num_batches_tracked,
                   None if cumulative else momentum, eps)


# One compiled call for the common case, one tensor on one rank
# (csrc/common/batch_norm.h); eager only: no fake kernel, traced graphs hold
# the ops it is made of.
registry.declare("normalizing_statistics",
                 "(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
                 "float momentum, bool cumulative, float eps) -> (Tensor mean, Tensor invstd)")
registry.register(registry.OpKernels(name="normalizing_statistics", reference=_normalizing_statistics_reference,
                                     cpp="normalizing_statistics", cuda="normalizing_statistics"))


def _finish_statistics_reference(mean, var, count: int, running_mean, running_var, num_batches_tracked,
                                 momentum: float, cumulative: bool, eps: float):
    return _finish(mean, var, count, running_mean, running_var, num_batches_tracked, None if cumulative else momentum,
                   eps)[1]


# The finishing step alone, for statistics the caller has (a dense block
# shares each map's with every later layer): one compiled call where the
# composition is eight small ops per layer. Eager only, like the above.
registry.declare("finish_statistics",
                 "(Tensor mean, Tensor var, int count, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
                 "Tensor(c!)? num_batches_tracked, float momentum, bool cumulative, float eps) -> Tensor")
registry.register(registry.OpKernels(name="finish_statistics", reference=_finish_statistics_reference,
                                     cpp="finish_statistics", cuda="finish_statistics"))


def fused_statistics(x, running_mean, running_var, num_batches_tracked, momentum, eps: float):
    """``(mean, invstd)`` of ``x`` with the running update, in one compiled
    call; None where only the composed path runs (tracing)."""
    fused = registry.eager("normalizing_statistics", x)
    if fused is None:
        return None
    return fused(x, running_mean, running_var, num_batches_tracked, 0.0 if momentum is None else momentum,
                 momentum is None, eps)


def normalizing_statistics(parts: Sequence[torch.Tensor], running_mean, running_var, num_batches_tracked,
                           use_batch_stats: bool, momentum, eps: float, where: str, group=None,
                           shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
    """``(mean, invstd, count)`` to normalise the concatenation of ``parts``
    with; with batch statistics the running ones (when given) are updated,
    once. ``shared``: the batch ``(mean, var)`` when the caller has them.
    ``count`` is 0 with running statistics (they are constants in backward)."""
    if not use_batch_stats:
        acc = accumulation_dtype(parts[0].dtype)
        # Copies: a later training step updates the buffers in place before this backward runs.
        mean = running_mean.detach().to(acc, copy=True)
        return mean, torch.rsqrt(running_var.detach().to(acc) + eps), 0
    if len(parts) == 1 and shared is None and not distributed(group):
        count = values_per_channel(parts[0])
        if count == 1:
            raise too_few_values(parts, where, group)
        fused = fused_statistics(parts[0], running_mean, running_var, num_batches_tracked, momentum, eps)
        if fused is not None:
            return (*fused, count)
    if shared is not None:
        mean, var, count = shared[0].detach(), shared[1].detach(), values_per_channel(parts[0])
    else:
        mean, var, count = batch_statistics(parts, group)
    if count == 1:
        raise too_few_values(parts, where, group)
    fused = registry.eager("finish_statistics", mean)
    if fused is not None:
        return mean, fused(mean, var, count, running_mean, running_var, num_batches_tracked,
                           0.0 if momentum is None else momentum, momentum is None, eps), count
    mean, invstd = _finish(mean, var, count, running_mean, running_var, num_batches_tracked, momentum, eps)
    return mean, invstd, count


def backward_passes(reduce: Union[str, Callable], elemt: Union[str, Callable], grad: torch.Tensor,
                    saved: torch.Tensor, args: tuple,
                    count: int, *, need_sums: bool, need_elemt: bool, want_residual_grad: bool = False, group=None,
                    fused: Optional[Callable] = None):
    """BatchNorm's backward as its two kernel passes.

    ``reduce(grad, saved, *args) -> (sum dy, sum dy x_hat)`` and
    ``elemt(grad, saved, *args, mean_dy, mean_dy_xhat, want_residual_grad)
    -> (grad_input, grad_residual)``. ``count`` is the values per channel of
    the normalised batch (0: running statistics, constants with no mean
    terms). Returns ``(grad_input, grad_residual, sum_dy, sum_dy_xhat)``,
    the sums being this rank's (its weight and bias gradients: DDP averages
    those as it does every other parameter's) and the input gradient using
    the sums over the whole synchronised batch. ``fused(grad, saved, *args,
    count, need_sums, need_elemt, want_residual_grad)``, when given, does
    all of it in one call on a single rank. ``reduce`` and ``elemt`` may be
    op names, looked up only when the fused call does not serve (a lookup
    is host time a small layer's backward would otherwise pay twice over).
    """
    if fused is not None and not distributed(group):
        return fused(grad, saved, *args, count, need_sums, need_elemt, want_residual_grad)
    if isinstance(reduce, str):
        reduce, elemt = registry.op(reduce), registry.op(elemt)
    local_dy = local_dy_xhat = None
    mean = args[0]
    if need_sums:
        local_dy, local_dy_xhat = reduce(grad, saved, *args)
    grad_input = grad_residual = None
    if need_elemt:
        if count:
            sum_dy, sum_dy_xhat = local_dy, local_dy_xhat
            if distributed(group):
                packed = torch.cat([local_dy, local_dy_xhat])
                dist.all_reduce(packed, group=group)
                sum_dy, sum_dy_xhat = packed.split(mean.numel())
            mean_dy, mean_dy_xhat = sum_dy / count, sum_dy_xhat / count
        else:
            mean_dy = mean_dy_xhat = torch.zeros_like(mean)
        grad_input, grad_residual = elemt(grad, saved, *args, mean_dy, mean_dy_xhat, want_residual_grad)
    return grad_input, grad_residual, local_dy, local_dy_xhat
