"""The DenseNet bottleneck ``conv1x1(relu(batch_norm(cat(features))))`` with
recomputation.

A dense layer feeds the concatenation of every earlier feature map of its
block through BatchNorm, ReLU and a 1x1 convolution. Autograd would keep the
concatenation (BatchNorm's input) and the ReLU output (the convolution's
input) for every layer: two copies of a tensor that grows with the layer
index, so a block's activation memory grows quadratically with its depth.

:func:`bottleneck` keeps only what the block holds anyway, the input feature
maps themselves, plus the per-channel batch statistics ``(mean, invstd)``.
Backward rebuilds the concatenation, the normalised values and the ReLU
output for this one layer, uses them and drops them, so only one layer's
concatenated buffer exists at a time. BatchNorm's backward is written out
analytically (the statistics are constants of the recomputation, so nothing
has to be differentiated through them a second time)::

    x_hat = (x - mean) * invstd
    dbias   = sum(dy)             dweight = sum(dy * x_hat)
    dx      = weight * invstd * (dy - dbias / n - x_hat * dweight / n)

with ``dy`` the gradient at BatchNorm's output (after the ReLU mask) and ``n``
the values per channel; in eval mode the statistics are the running ones and
``dx = weight * invstd * dy``.

Running statistics follow ``torch.nn.BatchNorm2d``: they and
``num_batches_tracked`` are updated once, in the forward call (backward never
touches them); ``running_var`` receives the unbiased variance; with
``momentum=None`` the update is a cumulative average
(factor ``1 / num_batches_tracked``). Without running statistics (``None``)
batch statistics are used in eval mode too, as BatchNorm does.

The same Function serves every "norm, ReLU, convolution" step of a DenseNet
(``padding=1`` for the 3x3 ``conv2`` of a dense layer, one input map for
``norm2`` and for a transition): each keeps only its input and statistics.

Statistics come from :func:`effilayers.ops.stats.batch_stats` (accumulated in
float32, float64 for float64 input). In a dense block a channel's batch
statistics are the same in every later layer that normalises it, so the block
computes them once per new feature map and passes them in
(``batch_statistics=``); only each layer's ``weight`` and ``bias`` differ.

Kernels (custom ops ``effilayers::dense_bottleneck_forward`` / ``_backward``,
any stride-1 convolution given its padding): on CPU, ABN's C++ kernels
normalise and activate the recomputed concatenation in one pass (in place in
the forward) and compute the BatchNorm+ReLU backward, around PyTorch's
convolution; on CUDA, Triton virtual-concatenation GEMMs for the 1x1 case
(``effilayers/kernels/densenet.py``) and PyTorch ops for the rest. The
pure-PyTorch ``_forward_reference`` / ``_backward_reference`` are the oracle.
Measured on this project's 2-core CPU (benchmarks/results/densenet-cpu-2026-11-23.json,
median of 5 steps, machine shared with other jobs): a DenseNet-121 training
step at 4x3x64x64 takes 181 ms, the naive model's 118.5 ms (1.53x),
checkpointing's 173 ms (1.46x).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch._prims_common import suggest_memory_format

from .._core import registry
from .stats import batch_stats, stats_dtype, values_per_channel

__all__ = ["bottleneck"]


def _channel_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (dim - 2))


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
    return suggest_memory_format(first)


def _in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`layout_of` ``(like)``: itself when it already is, else
    a copy. The op bodies apply it to every backend's results, so real and
    fake kernels agree whatever layouts PyTorch's convolution picks (it
    follows its input's and weight's layouts, and the gradient of a 3x3
    weight comes back channels_last for a channels_last input)."""
    return t.contiguous(memory_format=layout_of(like)) if t.dim() == 4 else t


def _concatenated(features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The input of the norm, and whether it is a private buffer that may be
    overwritten (one map is used as it is, never copied). The concatenation
    takes the first map's layout (``torch.cat`` alone gives NCHW when the
    maps' layouts differ)."""
    if len(features) == 1:
        return features[0], False
    first = features[0]
    out = torch.empty((first.shape[0], sum(f.shape[1] for f in features), *first.shape[2:]), dtype=first.dtype,
                      device=first.device, memory_format=layout_of(first))
    return torch.cat(features, 1, out=out), True


def _normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, private: bool) -> torch.Tensor:
    """x_hat in the statistics' dtype, reusing x's storage when x is a
    private buffer of that dtype (the recomputed concatenation)."""
    dim = x.dim()
    if private and x.dtype == mean.dtype:
        return x.sub_(_channel_view(mean, dim)).mul_(_channel_view(invstd, dim))
    return (x.to(mean.dtype) - _channel_view(mean, dim)) * _channel_view(invstd, dim)


def _affine_vectors(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm's weight and bias in the statistics' dtype (ones and zeros
    without affine parameters)."""
    w = torch.ones_like(mean) if weight is None else weight.detach().to(mean.dtype)
    b = torch.zeros_like(mean) if bias is None else bias.detach().to(mean.dtype)
    return w, b


def _nothing(like: torch.Tensor) -> torch.Tensor:
    """An output that was not asked for: empty, and its own tensor (a custom
    op's outputs may not alias one another)."""
    return like.new_empty(0)


def _is_pointwise(conv_weight: torch.Tensor, padding: int) -> bool:
    return padding == 0 and conv_weight.shape[2:] == (1, 1)


def _activated(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat, relu(x_hat * weight + bias) in the maps' dtype), recomputed."""
    x, private = _concatenated(features)
    x_hat = _normalized(x, mean, invstd, private)
    del x
    dim = x_hat.dim()
    y = torch.addcmul(_channel_view(bias, dim), x_hat, _channel_view(weight, dim))
    return x_hat, y.clamp_min_(0).to(features[0].dtype)


def _forward_reference(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                       padding: int = 0) -> torch.Tensor:
    """cat, BatchNorm with the given statistics, ReLU and the convolution in
    PyTorch ops: the CPU path and the oracle of the Triton kernels. Holds the
    concatenation and the activation for the duration of the call only."""
    _, y = _activated(features, mean, invstd, weight, bias)
    return torch.nn.functional.conv2d(y, conv_weight, padding=padding)


def _backward_reference(grad_out: torch.Tensor, features: Sequence[torch.Tensor], mean: torch.Tensor,
                        invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                        batch_stats: bool, need_input: bool, need_conv: bool, padding: int = 0):
    """Gradients of :func:`_forward_reference` with respect to the maps,
    BatchNorm's bias and weight and the convolution weight (module
    docstring for the formulas). Returns ``(grad_input, grad_bias,
    grad_weight, grad_conv)``, ``grad_input`` the gradient of the
    concatenation; entries not asked for are empty."""
    x_hat, y = _activated(features, mean, invstd, weight, bias)
    dim = x_hat.dim()
    grad_y, grad_conv = torch.ops.aten.convolution_backward(
        grad_out, y, conv_weight, None, [1, 1], [padding] * 2, [1, 1], False, [0, 0], 1,
        [need_input, need_conv, False])[:2]
    grad_conv = grad_conv if need_conv else mean.new_empty(0)
    if not need_input:
        return _nothing(mean), _nothing(mean), _nothing(mean), grad_conv
    # Through the ReLU: its output is zero exactly where it cut.
    grad_z = grad_y.to(mean.dtype).masked_fill_(y <= 0, 0)
    del y, grad_y
    reduce_dims = [0] + list(range(2, dim))
    grad_bias = grad_z.sum(reduce_dims)
    grad_weight = (grad_z * x_hat).sum(reduce_dims)
    if batch_stats:
        n = x_hat.numel() // max(x_hat.shape[1], 1)
        grad_x = x_hat.mul_(_channel_view(grad_weight / n, dim))
        grad_x = grad_z.sub_(_channel_view(grad_bias / n, dim)).sub_(grad_x)
    else:
        grad_x = grad_z
    grad_x = grad_x.mul_(_channel_view(invstd * weight, dim)).to(features[0].dtype)
    return grad_x, grad_bias, grad_weight, grad_conv


# ReLU as the ABN kernels spell it: leaky_relu's slope and the weight clamp unused.
_RELU = ("relu", 0.0, 0.0)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`layout_of` ``(x)`` and dense: the layouts ABN's kernels
    walk (they would copy a channel slice of a block buffer to NCHW)."""
    return x.contiguous(memory_format=layout_of(x))


def _forward_cpp(features: Sequence[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor, conv_weight: torch.Tensor, padding: int = 0) -> torch.Tensor:
    """CPU path: the ABN C++ kernel normalises and activates the recomputed
    concatenation in place (one pass, one buffer), then the convolution."""
    kernels = torch.ops.effilayers_cpu
    x, private = _concatenated(features)
    readable = _dense(x)
    if private or readable is not x:  # a buffer of our own: normalised in place
        kernels.abn_forward_(readable, mean, invstd, weight, bias, None, *_RELU)
        y = readable
    else:  # one map, used as it is: never written
        y = kernels.abn_forward(x, mean, invstd, weight, bias, None, *_RELU)
    return torch.nn.functional.conv2d(y, conv_weight, padding=padding)


def _backward_cpp(grad_out: torch.Tensor, features: Sequence[torch.Tensor], mean: torch.Tensor,
                  invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor,
                  batch_stats: bool, need_input: bool, need_conv: bool, padding: int = 0):
    """CPU path of :func:`_backward_reference`: the BatchNorm+ReLU backward is
    ABN's two C++ kernels (per-channel sums, then the element-wise pass) read
    from the recomputed concatenation, instead of a chain of PyTorch ops."""
    kernels = torch.ops.effilayers_cpu
    x, _ = _concatenated(features)
    x = _dense(x)
    y = kernels.abn_forward(x, mean, invstd, weight, bias, None, *_RELU)
    grad_y, grad_conv = torch.ops.aten.convolution_backward(
        grad_out, y, conv_weight, None, [1, 1], [padding] * 2, [1, 1], False, [0, 0], 1,
        [need_input, need_conv, False])[:2]
    del y
    grad_conv = grad_conv if need_conv else _nothing(mean)
    if not need_input:
        return _nothing(mean), _nothing(mean), _nothing(mean), grad_conv
    if grad_y.stride() != x.stride():  # the kernels walk both with one set of strides
        grad_y = torch.empty_like(x).copy_(grad_y)
    args = (mean, invstd, weight, bias, None, *_RELU, False)
    grad_bias, grad_weight = kernels.abn_backward_reduce(grad_y, x, *args)
    if batch_stats:
        n = x.numel() // max(x.shape[1], 1)
        mean_dy, mean_dy_xhat = grad_bias / n, grad_weight / n
    else:  # running statistics are constants
        mean_dy = mean_dy_xhat = torch.zeros_like(mean)
    grad_x = kernels.abn_backward_elemt(grad_y, x, *args, mean_dy, mean_dy_xhat, False)[0]
    return grad_x, grad_bias, grad_weight, grad_conv


def _forward_triton(features, mean, invstd, weight, bias, conv_weight, padding):
    if features[0].dtype == torch.float64 or not _is_pointwise(conv_weight, padding):
        # tl.dot has no float64 here, and the virtual-concatenation GEMM is a
        # 1x1 convolution: PyTorch ops serve double precision and the 3x3.
        return _forward_reference(features, mean, invstd, weight, bias, conv_weight, padding)
    from ..kernels import densenet as kernels

    return kernels.bottleneck_forward(features, mean, invstd, weight, bias, conv_weight)


def _backward_triton(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input,
                     need_conv, padding):
    if features[0].dtype == torch.float64 or not _is_pointwise(conv_weight, padding):
        return _backward_reference(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats,
                                   need_input, need_conv, padding)
    from ..kernels import densenet as kernels

    grad_input, grad_bias, grad_weight, grad_conv = kernels.bottleneck_backward(
        grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv)
    if not need_conv:
        grad_conv = _nothing(mean)
    if not need_input:
        return _nothing(mean), _nothing(mean), _nothing(mean), grad_conv
    return grad_input, grad_bias, grad_weight, grad_conv


registry.register(registry.OpKernels(name="dense_bottleneck_forward", reference=_forward_reference,
                                     cpp=_forward_cpp, triton=_forward_triton))
registry.register(registry.OpKernels(name="dense_bottleneck_backward", reference=_backward_reference,
                                     cpp=_backward_cpp, triton=_backward_triton))


@torch.library.custom_op("effilayers::dense_bottleneck_forward", mutates_args=())
def _forward_op(features: list[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, conv_weight: torch.Tensor, padding: int) -> torch.Tensor:
    """conv(relu(batch_norm(cat(features))), padding) with given statistics
    (stride 1); no autograd of its own (the Function below differentiates it)."""
    out = registry.kernel("dense_bottleneck_forward", features[0].device)(
        features, mean, invstd, weight, bias, conv_weight, padding)
    return _in_layout(out, features[0])


def _output_size(first: torch.Tensor, conv_weight: torch.Tensor, padding: int) -> list[int]:
    return [size + 2 * padding - k + 1 for size, k in zip(first.shape[2:], conv_weight.shape[2:])]


@_forward_op.register_fake
def _(features, mean, invstd, weight, bias, conv_weight, padding):
    first = features[0]
    return torch.empty((first.shape[0], conv_weight.shape[0], *_output_size(first, conv_weight, padding)),
                       dtype=first.dtype, device=first.device, memory_format=layout_of(first))


@torch.library.custom_op("effilayers::dense_bottleneck_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, features: list[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor, conv_weight: torch.Tensor, batch_stats: bool,
                 need_input: bool, need_conv: bool, padding: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of the concatenation, grad_bias, grad_weight, grad_conv) of the
    forward op; entries not asked for are empty."""
    grad_input, grad_bias, grad_weight, grad_conv = registry.kernel("dense_bottleneck_backward", grad_out.device)(
        grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv, padding)
    return _in_layout(grad_input, features[0]), grad_bias, grad_weight, _in_layout(grad_conv, conv_weight)


@_backward_op.register_fake
def _(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv, padding):
    first = features[0]
    channels = sum(f.shape[1] for f in features)
    grad_input = torch.empty((first.shape[0], channels, *first.shape[2:]), dtype=first.dtype, device=first.device,
                             memory_format=layout_of(first)) if need_input else _nothing(mean)
    grad_bias = torch.empty_like(mean) if need_input else _nothing(mean)
    grad_weight = torch.empty_like(mean) if need_input else _nothing(mean)
    grad_conv = torch.empty(conv_weight.shape, dtype=conv_weight.dtype, device=conv_weight.device,
                            memory_format=layout_of(conv_weight)) if need_conv else _nothing(mean)
    return grad_input, grad_bias, grad_weight, grad_conv


class _Bottleneck(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, bias, running_mean, running_var, num_batches_tracked, conv_weight,
                training, momentum, eps, padding, shared_mean, shared_var, *features):
        first = features[0]
        acc = stats_dtype(first.dtype)
        use_batch_stats = training or running_mean is None or running_var is None
        if use_batch_stats:
            n = values_per_channel(first)
            if shared_mean is not None:
                mean, var = shared_mean.detach(), shared_var.detach()
            else:
                # Per-channel statistics of a concatenation are those of its
                # parts: no concatenated copy just to reduce it.
                parts = [batch_stats(f)[:2] for f in features]
                mean = torch.cat([m for m, _ in parts])
                var = torch.cat([v for _, v in parts])
            if n <= 1:
                channels = sum(f.shape[1] for f in features)
                # torch's wording (as ABN's), which effilayers-bench recognises.
                raise ValueError("bottleneck: expected more than 1 value per channel when training, got input size "
                                 f"{(first.shape[0], channels, *first.shape[2:])}")
            invstd = torch.rsqrt(var + eps)
            if training and running_mean is not None and running_var is not None:
                # Once per forward, exactly like BatchNorm2d; backward recomputes
                # from the saved statistics and never comes back here.
                factor = momentum
                if num_batches_tracked is not None:
                    num_batches_tracked.add_(1)
                    if momentum is None:
                        factor = 1.0 / float(num_batches_tracked)
                unbiased = var * (n / (n - 1))
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        else:
            n = 0
            # Copies: a later training forward may update the buffers before this backward runs.
            mean = running_mean.detach().to(acc, copy=True)
            invstd = torch.rsqrt(running_var.detach().to(acc) + eps)
        vectors = _affine_vectors(weight, bias, mean)
        out = _forward_op(list(features), mean, invstd, *vectors, conv_weight.to(features[0].dtype), padding)
        ctx.padding = padding
        ctx.use_batch_stats = use_batch_stats
        ctx.num_features = len(features)
        ctx.save_for_backward(weight, bias, conv_weight, mean, invstd, *features)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            # create_graph=True: the analytic backward treats the batch
            # statistics as constants, so its own derivative would be wrong.
            # (once_differentiable would only detach it, and autograd.grad
            # with explicit inputs would then drop those terms silently.)
            raise RuntimeError("effilayers DenseNet bottleneck does not support double backward (create_graph=True)")
        weight, bias, conv_weight, mean, invstd, *features = ctx.saved_tensors
        first_feature = _FIRST_FEATURE
        need_features = any(ctx.needs_input_grad[first_feature:])
        need_input = need_features or ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_conv = ctx.needs_input_grad[5]
        in_dtype = features[0].dtype
        vectors = _affine_vectors(weight, bias, mean)
        args = (grad_out, features, mean, invstd, *vectors, conv_weight.to(in_dtype), ctx.use_batch_stats,
                need_input, need_conv)
        grad_input, grad_bias, grad_weight, grad_conv = _backward_op(*args, ctx.padding)
        grad_conv = grad_conv.to(conv_weight.dtype) if need_conv else None
        if need_features:
            grad_features = list(torch.split(grad_input, [f.shape[1] for f in features], 1))
        else:
            grad_features = [None] * ctx.num_features
        grad_features = [g if need else None for g, need in zip(grad_features, ctx.needs_input_grad[first_feature:])]
        return (
            None if weight is None or not ctx.needs_input_grad[0] else grad_weight.to(weight.dtype),
            None if bias is None or not ctx.needs_input_grad[1] else grad_bias.to(bias.dtype),
            None, None, None,
            grad_conv,
            *(None,) * (first_feature - 6),
            *grad_features,
        )


# Position of the first feature map among _Bottleneck.forward's inputs.
_FIRST_FEATURE = 12


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


def bottleneck(
    features: Sequence[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    conv_weight: torch.Tensor,
    training: bool,
    momentum: Optional[float] = 0.1,
    eps: float = 1e-5,
    num_batches_tracked: Optional[torch.Tensor] = None,
    padding: int = 0,
    batch_statistics: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """``conv2d(relu(batch_norm(cat(features, 1))), conv_weight, padding=padding)``
    keeping only ``features`` and per-channel statistics for backward (module
    docstring).

    Args:
        features: the (N, C_i, H, W) maps to concatenate along channels; same
            N, H, W, dtype and device.
        weight, bias: BatchNorm's affine parameters, (sum C_i,) or None.
        running_mean, running_var: BatchNorm's buffers, updated in place in
            training mode; None for batch statistics in every mode.
        conv_weight: (C_out, sum C_i, kH, kW), no bias, stride 1, no groups.
        training: batch statistics (and a running-statistics update) when true.
        momentum: running-statistics factor; None for a cumulative average.
        eps: added to the variance.
        num_batches_tracked: BatchNorm's counter, incremented in training mode.
        padding: zero padding of the convolution on every side.
        batch_statistics: ``(mean, biased variance)`` of the concatenation,
            each ``(sum C_i,)`` in float32 (float64 for float64 features),
            when the caller already has them; used only where batch
            statistics are (training, or no running statistics). They must
            be the statistics of exactly these features: nothing checks the
            values, and the backward formula assumes it.
    """
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
    shared_mean = shared_var = None
    if batch_statistics is not None:
        if not isinstance(batch_statistics, (tuple, list)) or len(batch_statistics) != 2:
            raise TypeError("bottleneck: batch_statistics must be a (mean, var) pair of tensors")
        shared_mean, shared_var = batch_statistics
        expected = stats_dtype(first.dtype)
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
    return _Bottleneck.apply(weight, bias, running_mean, running_var, num_batches_tracked, conv_weight,
                             bool(training), None if momentum is None else float(momentum), float(eps), padding,
                             shared_mean, shared_var, *features)
