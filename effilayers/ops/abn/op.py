"""Activated BatchNorm: z = act(s * (x - mean) * invstd + beta [+ residual]).

Two autograd Functions share the kernels:

* ``abn`` (not in place) saves its input ``x``, like BatchNorm does, and
  the per-channel mean and invstd, and recomputes the pre-activation in
  backward, so any activation works, ReLU and the smooth ones (silu, gelu,
  gelu_tanh, hardswish, mish, relu6, sigmoid, tanh) included, and ``s`` is
  the weight itself: exactly ``act(batch_norm(x) [+ residual])``.
* ``inplace_abn`` writes ``z`` over ``x`` and saves only ``z`` (plus
  per-channel statistics, and the residual when there is one, which a ResNet
  block keeps anyway). Backward inverts the activation and the affine map to
  rebuild ``x_hat`` from ``z``, so the activation must be invertible:
  leaky_relu (slope > 0), elu (alpha > 0) or identity.

Scale in place: dividing by the weight needs it away from zero, so
``s = sign(weight) * max(|weight|, weight_eps)`` (sign(0) = +1). Unlike the
``|weight| + eps`` of the original InPlace-ABN, weights with
``|weight| >= weight_eps`` are used unchanged, so a ``BatchNorm2d``
checkpoint loads and computes the same function; the weight gradient is zero
where the clamp is active.

Kernels (custom ops ``effilayers::abn_forward``, ``abn_forward_``,
``abn_backward_reduce``, ``abn_backward_elemt``): a C++ CPU kernel, a CUDA
kernel and the pure-PyTorch reference (``reference.py``). Statistics come from
``batch_stats``; with a process group they are combined across ranks through
``torch.distributed`` (any backend, ranks may hold different batch sizes,
including none).
"""

from __future__ import annotations

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype, as_dtype
from .. import _batchnorm
from . import reference
from .contract import (
    DEFAULT_WEIGHT_EPS,
    check_activation,
    check_arguments,
    check_in_place,
    check_input,
    check_weight_eps,
)

__all__ = ["abn", "inplace_abn", "activated_batch_norm"]

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("abn", "inplace_abn")

_KERNEL_ARGS = ("Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? residual, str activation, "
                "float activation_param, float weight_eps")


def _sums_like(grad, saved, *args):
    channels, acc = saved.shape[1], accumulation_dtype(saved.dtype)
    return saved.new_empty((channels,), dtype=acc), saved.new_empty((channels,), dtype=acc)


def _grads_like(grad, saved, *args):
    want_residual_grad = args[-1]
    return torch.empty_like(saved), (torch.empty_like(saved) if want_residual_grad else saved.new_empty(0))


# Declared once here; csrc/cpu/abn.cpp and csrc/cuda/abn_binding.cpp add the kernels.
_abn_forward = registry.declare(
    "abn_forward", f"(Tensor x, {_KERNEL_ARGS}) -> Tensor", lambda x, *args: torch.empty_like(x))
# flexible_layout: every kernel takes x with any strides (copying those it
# cannot walk), so inductor need not restride it. Under the default (exact
# strides) inductor restrides a mutated (N, C, 1, 1) conv output and then
# fails scheduling the copy back (KeyError in Scheduler.compute_ancestors,
# pytorch/pytorch#189271): ResNets at 32x32 reach 1x1 maps in layer4.
_abn_forward_ = registry.declare(
    "abn_forward_", f"(Tensor(a!) x, {_KERNEL_ARGS}) -> ()", lambda x, *args: None,
    tags=(torch.Tag.flexible_layout,))
_abn_backward_reduce = registry.declare(
    "abn_backward_reduce", f"(Tensor grad, Tensor saved, {_KERNEL_ARGS}, bool saved_is_output) -> (Tensor, Tensor)",
    _sums_like)
_abn_backward_elemt = registry.declare(
    "abn_backward_elemt", f"(Tensor grad, Tensor saved, {_KERNEL_ARGS}, bool saved_is_output, Tensor mean_dy, "
    "Tensor mean_dy_xhat, bool want_residual_grad) -> (Tensor, Tensor)", _grads_like)
# reduce, means and elemt in one call, for one rank: eager only (no fake
# kernel), traced graphs hold the two kernels it is made of.
_abn_backward = registry.declare(
    "abn_backward", f"(Tensor grad, Tensor saved, {_KERNEL_ARGS}, bool saved_is_output, int count, bool need_sums, "
    "bool need_elemt, bool want_residual_grad) -> (Tensor, Tensor, Tensor, Tensor)")


def _backward_reference(grad, saved, *args_count_and_needs):
    *args, count, need_sums, need_elemt, want_residual_grad = args_count_and_needs
    return _batchnorm.backward_passes(reference.backward_reduce, reference.backward_elemt, grad, saved, tuple(args),
                                      count, need_sums=need_sums, need_elemt=need_elemt,
                                      want_residual_grad=want_residual_grad)


# The whole layer, autograd included, for an eager call on one rank: the
# compiled libraries register it (csrc/common/abn_autograd.h); elsewhere
# _ActivatedBatchNorm below does the same in Python.
_EAGER_ARGS = ("Tensor? weight, Tensor? bias, Tensor? residual, Tensor(b!)? running_mean, Tensor(c!)? running_var, "
               "Tensor(d!)? num_batches_tracked, bool use_batch_stats, float momentum, bool cumulative, float eps, "
               "str activation, float activation_param, float weight_eps")
_eager_abn = registry.declare_autograd("activated_batch_norm", f"(Tensor x, {_EAGER_ARGS}) -> Tensor")
_eager_inplace_abn = registry.declare_autograd("activated_batch_norm_", f"(Tensor(a!) x, {_EAGER_ARGS}) -> Tensor(a!)")


for _name, _reference in (("abn_forward", reference.forward), ("abn_forward_", reference.forward_),
                          ("abn_backward_reduce", reference.backward_reduce),
                          ("abn_backward_elemt", reference.backward_elemt), ("abn_backward", _backward_reference)):
    registry.register(registry.OpKernels(name=_name, reference=_reference, cpp=_name, cuda=_name))


class _ActivatedBatchNorm(torch.autograd.Function):
    """act(batch_norm(x) [+ residual]); in place, ``x`` is overwritten and the
    output is what backward keeps, else ``x`` is."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, num_batches_tracked, settings):
        # settings: (use_batch_stats, momentum, eps, activation, activation_param, weight_eps, group, inplace),
        # one argument rather than eight (each argument costs apply() time).
        use_batch_stats, momentum, eps, activation, activation_param, weight_eps, group, inplace = settings
        mean, invstd, count = _batchnorm.normalizing_statistics(
            (x,), running_mean, running_var, num_batches_tracked, use_batch_stats, momentum, eps,
            "inplace_abn" if inplace else "abn", group)
        args = (mean, invstd, weight, bias, residual, activation, activation_param, weight_eps)
        if inplace:
            _abn_forward_(x, *args)
            ctx.mark_dirty(x)
            output = x
        else:
            output = _abn_forward(x, *args)
        # Per-channel statistics go through save_for_backward too, so the
        # memory meter sees everything this layer keeps.
        ctx.save_for_backward(x, residual, weight, bias, mean, invstd)
        ctx.count, ctx.settings = count, settings
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            # backward(create_graph=True): the kernels are not differentiable,
            # so the gradients are computed as constants and tied to what they
            # came from by a node that refuses to be differentiated.
            with torch.no_grad():
                grads = _ActivatedBatchNorm._gradients(ctx, grad_output)
            return _RefuseDoubleBackward.apply(len(grads), *grads, grad_output, *ctx.saved_tensors)
        return _ActivatedBatchNorm._gradients(ctx, grad_output)

    @staticmethod
    def _gradients(ctx, grad_output):
        saved, residual, weight, bias, mean, invstd = ctx.saved_tensors
        if grad_output.stride() != saved.stride():
            # An expanded or differently laid-out gradient (e.g. from .sum()):
            # the kernels walk grad and saved with one set of strides.
            grad_output = torch.empty_like(saved).copy_(grad_output)
        need_input, need_weight, need_bias, need_residual = ctx.needs_input_grad[:4]
        want_residual_grad = residual is not None and need_residual
        use_batch_stats, _, _, activation, activation_param, weight_eps, group, inplace = ctx.settings
        args = (mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, inplace)
        grad_input, grad_residual, sum_dy, sum_dy_xhat = _batchnorm.backward_passes(
            _abn_backward_reduce, _abn_backward_elemt, grad_output, saved, args, ctx.count,
            need_sums=use_batch_stats or need_weight or need_bias, need_elemt=need_input or want_residual_grad,
            want_residual_grad=want_residual_grad, group=group,
            fused=_abn_backward if registry.runs_eagerly(saved) else None)
        # Straight through the weight clamp: where |weight| < weight_eps the
        # clamp is flat, and its true derivative (zero) would freeze a weight
        # that starts or decays there (zero_init_residual) for good.
        return (grad_input if need_input else None,
                as_dtype(sum_dy_xhat, weight.dtype) if need_weight else None,
                as_dtype(sum_dy, bias.dtype) if need_bias else None,
                grad_residual if want_residual_grad else None,
                None, None, None, None)


class _RefuseDoubleBackward(torch.autograd.Function):
    """Returns copies of the first ``count`` tensors (a backward's results),
    differentiable in the rest (what they were computed from); its own
    backward raises."""

    @staticmethod
    def forward(ctx, count, *tensors):
        return tuple(None if t is None else t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("effilayers: activated BatchNorm has no double backward (its backward kernels are not "
                           "differentiable); use torch.nn.BatchNorm2d and the activation for higher-order gradients")


def activated_batch_norm(x, weight, bias, residual, running_mean, running_var, num_batches_tracked,
                         use_batch_stats: bool, momentum, eps: float, activation: str, activation_param: float,
                         weight_eps: float, group, inplace: bool) -> torch.Tensor:
    """The unchecked entry the modules call (they check their configuration
    once, when built, and the input on each call)."""
    # Normalising with running statistics, the C++ kernel reads both without checking them.
    if (group is None or not _batchnorm.distributed(group)) and registry.compiled_autograd("activated_batch_norm", x) \
            and (use_batch_stats or (running_mean is not None and running_var is not None)):
        # values_per_channel(x) == 1, read from numel: slicing and multiplying the shape is host time here.
        if use_batch_stats and x.numel() == x.shape[1]:
            raise _batchnorm.too_few_values((x,), "inplace_abn" if inplace else "abn", group)
        return (_eager_inplace_abn if inplace else _eager_abn)(
            x, weight, bias, residual, running_mean, running_var, num_batches_tracked, use_batch_stats,
            0.0 if momentum is None else momentum, momentum is None, eps, activation, activation_param, weight_eps)
    return _ActivatedBatchNorm.apply(x, weight, bias, residual, running_mean, running_var, num_batches_tracked,
                                     (use_batch_stats, momentum, eps, activation, activation_param, weight_eps,
                                      group, inplace))


def abn(x, weight=None, bias=None, running_mean=None, running_var=None, training=True, momentum=0.1, eps=1e-5,
        activation="leaky_relu", activation_param=0.01, residual=None, num_batches_tracked=None, group=None):
    """``act(batch_norm(x) [+ residual])``, fused, not in place; saves ``x``.

    Arguments follow ``torch.nn.functional.batch_norm``; ``momentum=None``
    means a cumulative average (needs ``num_batches_tracked``); ``group`` is a
    ``torch.distributed`` process group to synchronise statistics over.
    """
    check_activation(activation, activation_param, inplace=False, where="abn")
    check_input(x, residual, "abn")
    check_arguments(x, weight, bias, running_mean, running_var, num_batches_tracked, training, eps, momentum, "abn")
    return activated_batch_norm(x, weight, bias, residual, running_mean, running_var, num_batches_tracked,
                                training, momentum, float(eps), activation, float(activation_param), 0.0, group,
                                False)


def inplace_abn(x, weight=None, bias=None, running_mean=None, running_var=None, training=True, momentum=0.1,
                eps=1e-5, activation="leaky_relu", activation_param=0.01, residual=None, num_batches_tracked=None,
                group=None, weight_eps=DEFAULT_WEIGHT_EPS):
    """``act(batch_norm(x) [+ residual])`` written over ``x``; saves only the
    output (and ``residual``). Returns ``x``, now holding the output."""
    where = "inplace_abn"
    check_activation(activation, activation_param, inplace=True, where=where)
    check_input(x, residual, where)
    check_arguments(x, weight, bias, running_mean, running_var, num_batches_tracked, training, eps, momentum, where)
    check_weight_eps(weight_eps, where)
    check_in_place(x, residual, where)
    return activated_batch_norm(x, weight, bias, residual, running_mean, running_var, num_batches_tracked,
                                training, momentum, float(eps), activation, float(activation_param),
                                float(weight_eps), group, True)
