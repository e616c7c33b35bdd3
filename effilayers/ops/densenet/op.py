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

Kernels (the declared ops ``effilayers::dense_bottleneck_forward`` /
``_backward``, any stride-1 convolution given its padding): on CPU one C++ call each
(``csrc/cpu/densenet.cpp``), where ABN's kernels normalise and activate the
recomputed concatenation in one pass (in place in the forward) and compute
the BatchNorm+ReLU backward, around ATen's convolution; on CUDA, Triton virtual-concatenation GEMMs for the 1x1 case
(``triton.py``) and PyTorch ops for the rest. The
pure-PyTorch ``reference.forward`` / ``reference.backward`` are the oracle.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._core import registry
from ..._core.dtypes import as_dtype
from .. import _batchnorm
from . import reference
from .contract import check_arguments, layout_of

__all__ = ["bottleneck", "norm_relu_conv", "layout_of"]


def _output_size(first: torch.Tensor, conv_weight: torch.Tensor, padding: int) -> list[int]:
    return [size + 2 * padding - k + 1 for size, k in zip(first.shape[2:], conv_weight.shape[2:])]


def _forward_like(features, mean, invstd, weight, bias, conv_weight, padding):
    first = features[0]
    return torch.empty((first.shape[0], conv_weight.shape[0], *_output_size(first, conv_weight, padding)),
                       dtype=first.dtype, device=first.device, memory_format=layout_of(first))


def _backward_like(grad_out, features, mean, invstd, weight, bias, conv_weight, batch_stats, need_input, need_conv,
                   padding):
    first = features[0]
    channels = sum(f.shape[1] for f in features)
    grad_input = torch.empty((first.shape[0], channels, *first.shape[2:]), dtype=first.dtype, device=first.device,
                             memory_format=layout_of(first)) if need_input else reference.nothing(mean)
    grad_bias = torch.empty_like(mean) if need_input else reference.nothing(mean)
    grad_weight = torch.empty_like(mean) if need_input else reference.nothing(mean)
    grad_conv = torch.empty(conv_weight.shape, dtype=conv_weight.dtype, device=conv_weight.device,
                            memory_format=layout_of(conv_weight)) if need_conv else reference.nothing(mean)
    return grad_input, grad_bias, grad_weight, grad_conv


# conv(relu(batch_norm(cat(features))), padding) with given statistics (stride
# 1), and its gradients (of the concatenation, BatchNorm's bias and weight,
# the convolution weight; entries not asked for are empty). Declared once
# here; csrc/cpu/densenet.cpp adds the CPU kernels, the registry the Triton
# and reference ones. No autograd of their own: the Function below
# differentiates the forward with the backward.
_forward_op = registry.declare(
    "dense_bottleneck_forward", "(Tensor[] features, Tensor mean, Tensor invstd, Tensor weight, Tensor bias, "
    "Tensor conv_weight, int padding) -> Tensor", _forward_like)
_backward_op = registry.declare(
    "dense_bottleneck_backward", "(Tensor grad_out, Tensor[] features, Tensor mean, Tensor invstd, Tensor weight, "
    "Tensor bias, Tensor conv_weight, bool batch_stats, bool need_input, bool need_conv, int padding) "
    "-> (Tensor, Tensor, Tensor, Tensor)", _backward_like)
registry.register(registry.OpKernels(name="dense_bottleneck_forward", reference=reference.forward,
                                     cpp="dense_bottleneck_forward",
                                     triton="effilayers.ops.densenet.triton:forward"))
registry.register(registry.OpKernels(name="dense_bottleneck_backward", reference=reference.backward,
                                     cpp="dense_bottleneck_backward", triton="effilayers.ops.densenet.triton:backward"))


class _Bottleneck(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, bias, running_mean, running_var, num_batches_tracked, conv_weight,
                training, momentum, eps, padding, shared_mean, shared_var, *features):
        use_batch_stats = training or running_mean is None or running_var is None
        # Running statistics (and the counter) move once per training forward,
        # exactly like BatchNorm2d; backward recomputes from the saved
        # statistics and never comes back here.
        tracked = num_batches_tracked if training and running_mean is not None else None
        mean, invstd, _ = _batchnorm.normalizing_statistics(
            features, running_mean, running_var, tracked, use_batch_stats, momentum, eps, "bottleneck",
            shared=None if shared_mean is None else (shared_mean, shared_var))
        vectors = reference.affine_vectors(weight, bias, mean)
        first = features[0]
        out = _forward_op(list(features), mean, invstd, *vectors, as_dtype(conv_weight, first.dtype), padding)
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
        vectors = reference.affine_vectors(weight, bias, mean)
        grad_input, grad_bias, grad_weight, grad_conv = _backward_op(
            grad_out, features, mean, invstd, *vectors, as_dtype(conv_weight, in_dtype), ctx.use_batch_stats,
            need_input, need_conv, ctx.padding)
        grad_conv = as_dtype(grad_conv, conv_weight.dtype) if need_conv else None
        if need_features:
            # The method itself: torch.split's Python wrapper costs more than the split on a small layer.
            grad_features = grad_input.split_with_sizes([f.shape[1] for f in features], 1)
        else:
            grad_features = [None] * ctx.num_features
        grad_features = [g if need else None for g, need in zip(grad_features, ctx.needs_input_grad[first_feature:])]
        return (
            None if weight is None or not ctx.needs_input_grad[0] else as_dtype(grad_weight, weight.dtype),
            None if bias is None or not ctx.needs_input_grad[1] else as_dtype(grad_bias, bias.dtype),
            None, None, None,
            grad_conv,
            *(None,) * (first_feature - 6),
            *grad_features,
        )


# Position of the first feature map among _Bottleneck.forward's inputs.
_FIRST_FEATURE = 12



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
    features = check_arguments(features, weight, bias, running_mean, running_var, conv_weight, training, momentum,
                               eps, num_batches_tracked, padding, batch_statistics)
    return norm_relu_conv(features, weight, bias, running_mean, running_var, conv_weight, training, momentum, eps,
                          num_batches_tracked, padding, batch_statistics)


def norm_relu_conv(features: list[torch.Tensor], weight, bias, running_mean, running_var, conv_weight,
                   training: bool, momentum, eps: float, num_batches_tracked, padding: int,
                   batch_statistics) -> torch.Tensor:
    """:func:`bottleneck` without its checks, for callers whose arguments are
    consistent by construction (DenseNet's layers and transitions, whose
    modules were checked when built): the checks would run on every layer of
    every step."""
    shared_mean, shared_var = batch_statistics if batch_statistics is not None else (None, None)
    return _Bottleneck.apply(weight, bias, running_mean, running_var, num_batches_tracked, conv_weight,
                             bool(training), None if momentum is None else float(momentum), float(eps), padding,
                             shared_mean, shared_var, *features)
