"""Activated BatchNorm: z = act(s * (x - mean) * invstd + beta [+ residual]).

Two autograd Functions share the kernels:

* ``abn`` (not in place) saves its input ``x``, like BatchNorm does, so any
  activation works, ReLU included, and ``s`` is the weight itself: exactly
  ``act(batch_norm(x) [+ residual])``.
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
kernel and the pure-PyTorch reference in this file. Statistics come from
``batch_stats``; with a process group they are combined across ranks through
``torch.distributed`` (any backend, ranks may hold different batch sizes,
including none).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .._core import registry
from .stats import batch_stats, combine_batch_stats, stats_dtype

__all__ = [
    "ACTIVATIONS",
    "INVERTIBLE_ACTIVATIONS",
    "abn",
    "inplace_abn",
    "check_activation",
    "effective_weight",
]

ACTIVATIONS = ("leaky_relu", "elu", "identity", "relu")
INVERTIBLE_ACTIVATIONS = ("leaky_relu", "elu", "identity")
DEFAULT_WEIGHT_EPS = 1e-3


def check_activation(activation: str, activation_param: float, inplace: bool, where: str) -> None:
    """Raise a clear ValueError/TypeError for an unusable activation."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if inplace and activation not in INVERTIBLE_ACTIVATIONS:
        raise ValueError(
            f"{where}: activation={activation!r} is not invertible, so it cannot run in place "
            "(backward rebuilds the input from the output). Use activation='leaky_relu' "
            "(e.g. activation_param=0.01) or effilayers.nn.ABN, which supports relu."
        )
    if isinstance(activation_param, bool) or not isinstance(activation_param, (int, float)):
        raise TypeError(f"{where}: activation_param must be a float, got {type(activation_param).__name__}")
    if not math.isfinite(activation_param):
        raise ValueError(f"{where}: activation_param must be finite, got {activation_param}")
    if activation == "leaky_relu" and inplace and activation_param <= 0:
        raise ValueError(
            f"{where}: leaky_relu in place needs a negative slope > 0 to be invertible, got {activation_param}"
        )
    if activation == "leaky_relu" and activation_param < 0:
        raise ValueError(f"{where}: leaky_relu negative slope must be >= 0, got {activation_param}")
    if activation == "elu" and activation_param <= 0:
        raise ValueError(f"{where}: elu alpha must be > 0, got {activation_param}")


def effective_weight(weight: Optional[torch.Tensor], weight_eps: float) -> Optional[torch.Tensor]:
    """The scale ``s`` actually applied: the weight, clamped away from zero
    with its sign kept when ``weight_eps > 0``."""
    if weight is None or weight_eps <= 0:
        return weight
    sign = torch.where(weight < 0, weight.new_tensor(-1.0), weight.new_tensor(1.0))
    return sign * weight.abs().clamp_min(weight_eps)


# ---- pure-PyTorch reference kernels ---------------------------------------------------


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _activate(y, activation, param):
    if activation == "leaky_relu":
        return torch.where(y > 0, y, y * param)
    if activation == "elu":
        return torch.where(y > 0, y, param * torch.expm1(y))
    if activation == "relu":
        return y.clamp_min(0)
    return y


def _derivative(y, activation, param):
    """d act / d y at the pre-activation y."""
    if activation == "leaky_relu":
        return torch.where(y > 0, y.new_tensor(1.0), y.new_tensor(param))
    if activation == "elu":
        return torch.where(y > 0, torch.ones_like(y), param * torch.exp(y.clamp_max(0)))
    if activation == "relu":
        return (y > 0).to(y.dtype)
    return torch.ones_like(y)


def _derivative_from_output(z, activation, param):
    """d act / d y written in terms of the output z = act(y)."""
    if activation == "elu":
        return torch.where(z > 0, torch.ones_like(z), z + param)
    return _derivative(z, activation, param)  # the others depend only on the sign, shared by y and z


def _invert(z, activation, param):
    if activation == "leaky_relu":
        return torch.where(z > 0, z, z / param)
    if activation == "elu":
        # Saturated outputs (z == -alpha) carry no information about y; the
        # clamp keeps x_hat finite there (their dy is zero anyway).
        ratio = (z / param).clamp_min(-1 + torch.finfo(z.dtype).eps)
        return torch.where(z > 0, z, torch.log1p(ratio))
    return z


def _affine(weight, bias, invstd, mean, weight_eps, acc, shape):
    """Per-channel (s, beta) in the accumulation dtype, views of ``shape``."""
    channels = mean.numel()
    scale = effective_weight(weight, weight_eps)
    scale = torch.ones(channels, dtype=acc, device=mean.device) if scale is None else scale.to(acc)
    shift = torch.zeros(channels, dtype=acc, device=mean.device) if bias is None else bias.to(acc)
    return scale.view(shape), shift.view(shape)


def _reference_forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps):
    acc = stats_dtype(x.dtype)
    shape = _channel_shape(x)
    scale, shift = _affine(weight, bias, invstd, mean, weight_eps, acc, shape)
    y = (x.to(acc) - mean.to(acc).view(shape)) * (invstd.to(acc).view(shape) * scale) + shift
    if residual is not None:
        y = y + residual.to(acc)
    return _activate(y, activation, param).to(x.dtype)


def _reference_forward_out(x, mean, invstd, weight, bias, residual, activation, param, weight_eps):
    return _reference_forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps)


def _reference_forward_inplace(x, mean, invstd, weight, bias, residual, activation, param, weight_eps):
    x.copy_(_reference_forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps))


def _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps, saved_is_output):
    acc = stats_dtype(saved.dtype)
    shape = _channel_shape(saved)
    scale, shift = _affine(weight, bias, invstd, mean, weight_eps, acc, shape)
    if saved_is_output:
        z = saved.to(acc)
        y = _invert(z, activation, param)
        pre_residual = y if residual is None else y - residual.to(acc)
        x_hat = (pre_residual - shift) / scale
        dy = grad.to(acc) * _derivative_from_output(z, activation, param)
    else:
        x_hat = (saved.to(acc) - mean.to(acc).view(shape)) * invstd.to(acc).view(shape)
        y = x_hat * scale + shift
        if residual is not None:
            y = y + residual.to(acc)
        dy = grad.to(acc) * _derivative(y, activation, param)
    return dy, x_hat, scale


def _reference_backward_reduce(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                               saved_is_output):
    dy, x_hat, _ = _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                                saved_is_output)
    dims = [0] + list(range(2, saved.dim()))
    return dy.sum(dims), (dy * x_hat).sum(dims)


def _reference_backward_elemt(grad, saved, mean, invstd, weight, bias, residual, activation, param, weight_eps,
                              saved_is_output, mean_dy, mean_dy_xhat, want_residual_grad):
    dy, x_hat, scale = _dy_and_xhat(grad, saved, mean, invstd, weight, bias, residual, activation, param,
                                    weight_eps, saved_is_output)
    shape = _channel_shape(saved)
    acc = dy.dtype
    grad_input = (scale * invstd.to(acc).view(shape)) * (
        dy - mean_dy.to(acc).view(shape) - x_hat * mean_dy_xhat.to(acc).view(shape)
    )
    grad_residual = dy.to(saved.dtype) if want_residual_grad else saved.new_empty(0)
    return grad_input.to(saved.dtype), grad_residual


# ---- custom ops ---------------------------------------------------------------------------


def _kernel(name, tensor):
    return registry.kernel(name, tensor.device)


@torch.library.custom_op("effilayers::abn_forward", mutates_args=())
def _abn_forward_op(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    activation_param: float,
    weight_eps: float,
) -> torch.Tensor:
    return _kernel("abn_forward", x)(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps)


@_abn_forward_op.register_fake
def _(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps):
    return torch.empty_like(x)


# flexible_layout: every kernel takes x with any strides (copying those it
# cannot walk), so inductor need not restride it. Under the default (exact
# strides) inductor restrides a mutated (N, C, 1, 1) conv output and then
# fails scheduling the copy back (KeyError in Scheduler.compute_ancestors,
# pytorch/pytorch#189271): ResNets at 32x32 reach 1x1 maps in layer4.
@torch.library.custom_op("effilayers::abn_forward_", mutates_args=("x",), tags=(torch.Tag.flexible_layout,))
def _abn_forward_inplace_op(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    activation_param: float,
    weight_eps: float,
) -> None:
    _kernel("abn_forward_", x)(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps)


@_abn_forward_inplace_op.register_fake
def _(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps):
    return None


@torch.library.custom_op("effilayers::abn_backward_reduce", mutates_args=())
def _abn_backward_reduce_op(
    grad: torch.Tensor,
    saved: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    activation_param: float,
    weight_eps: float,
    saved_is_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel("abn_backward_reduce", saved)(
        grad, saved, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, saved_is_output
    )


@_abn_backward_reduce_op.register_fake
def _(grad, saved, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, saved_is_output):
    acc = stats_dtype(saved.dtype)
    channels = saved.shape[1]
    return saved.new_empty((channels,), dtype=acc), saved.new_empty((channels,), dtype=acc)


@torch.library.custom_op("effilayers::abn_backward_elemt", mutates_args=())
def _abn_backward_elemt_op(
    grad: torch.Tensor,
    saved: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    activation_param: float,
    weight_eps: float,
    saved_is_output: bool,
    mean_dy: torch.Tensor,
    mean_dy_xhat: torch.Tensor,
    want_residual_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel("abn_backward_elemt", saved)(
        grad, saved, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, saved_is_output,
        mean_dy, mean_dy_xhat, want_residual_grad,
    )


@_abn_backward_elemt_op.register_fake
def _(grad, saved, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, saved_is_output,
      mean_dy, mean_dy_xhat, want_residual_grad):
    return torch.empty_like(saved), (torch.empty_like(saved) if want_residual_grad else saved.new_empty(0))


for _name, _reference in (
    ("abn_forward", _reference_forward_out),
    ("abn_forward_", _reference_forward_inplace),
    ("abn_backward_reduce", _reference_backward_reduce),
    ("abn_backward_elemt", _reference_backward_elemt),
):
    registry.register(registry.OpKernels(name=_name, reference=_reference, cpp=_name, cuda=_name))


# ---- statistics, running averages, distributed -----------------------------------------


def _distributed(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _global_batch_stats(x: torch.Tensor, group):
    """(mean, biased var, count as a Python int) over this rank's batch or,
    with a process group, over every rank's."""
    mean, var, count = batch_stats(x, 0)
    if not _distributed(group):
        # The count from the shape, not int(count): reading the tensor is a
        # host sync per norm and step on CUDA, and a data-dependent value
        # that torch.compile cannot trace (it is a symbolic int here).
        return mean, var, x.shape[0] * math.prod(x.shape[2:])
    # float64 keeps counts exact far beyond 2**24 values per channel.
    packed = torch.cat([mean.double(), var.double(), count.double().view(1)])
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    stacked = torch.stack(gathered)
    channels = mean.numel()
    counts = stacked[:, 2 * channels].round().to(torch.int64)
    mean, var, total = combine_batch_stats(stacked[:, :channels], stacked[:, channels:2 * channels], counts)
    return mean.to(stats_dtype(x.dtype)), var.to(stats_dtype(x.dtype)), int(total)


@torch.no_grad()
def _update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, count, momentum):
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if running_mean is None and running_var is None:
        return
    factor = (1.0 / float(num_batches_tracked)) if momentum is None else momentum
    unbiased = var * (count / (count - 1))
    if running_mean is not None:
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    if running_var is not None:
        running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)


def _statistics(x, running_mean, running_var, num_batches_tracked, training, momentum, eps, group, where):
    """(mean, invstd, count) to normalise with; updates running stats in training."""
    if training:
        mean, var, count = _global_batch_stats(x, group)
        if count == 0:  # an empty batch, as BatchNorm: nothing to normalise, statistics untouched
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            return mean, torch.rsqrt(var + eps), count
        if count == 1:
            raise ValueError(
                f"{where}: expected more than 1 value per channel when training, got input size {tuple(x.shape)}"
                + (" across all ranks" if _distributed(group) else "")
            )
        _update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, count, momentum)
    else:
        acc = stats_dtype(x.dtype)
        # Copies: a later training step updates the buffers in place.
        mean, var, count = running_mean.to(acc, copy=True), running_var.to(acc, copy=True), 0
    invstd = torch.rsqrt(var + eps)
    return mean, invstd, count


def _save(ctx, saved, residual, weight, bias, mean, invstd, count, training, activation, activation_param,
          weight_eps, group):
    # Per-channel statistics go through save_for_backward too, so the memory
    # meter sees everything this layer keeps.
    ctx.save_for_backward(saved, residual, weight, bias, mean, invstd)
    ctx.count, ctx.training, ctx.group = count, training, group
    ctx.activation, ctx.activation_param, ctx.weight_eps = activation, activation_param, weight_eps
    ctx.needs_residual_grad = residual is not None and ctx.needs_input_grad[3]


def _backward(ctx, grad_output, saved_is_output):
    saved, residual, weight, bias, mean, invstd = ctx.saved_tensors
    args = (mean, invstd, weight, bias, residual, ctx.activation, ctx.activation_param, ctx.weight_eps,
            saved_is_output)
    if grad_output.stride() != saved.stride():
        # An expanded or differently laid-out gradient (e.g. from .sum()):
        # the kernels walk grad and saved with one set of strides.
        grad_output = torch.empty_like(saved).copy_(grad_output)
    need_weight, need_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    need_sums = ctx.training or need_weight or need_bias
    acc = mean.dtype
    if need_sums:
        # This rank's sums are its weight and bias gradients (DDP averages
        # those across ranks, as for every other parameter); the input
        # gradient needs the sums over the whole synchronised batch.
        local_dy, local_dy_xhat = _abn_backward_reduce_op(grad_output, saved, *args)
        sum_dy, sum_dy_xhat = local_dy, local_dy_xhat
        if ctx.training and _distributed(ctx.group):
            packed = torch.cat([local_dy, local_dy_xhat])
            dist.all_reduce(packed, group=ctx.group)
            sum_dy, sum_dy_xhat = packed.split(mean.numel())
    else:
        local_dy = local_dy_xhat = None
    if ctx.training:
        mean_dy, mean_dy_xhat = sum_dy / ctx.count, sum_dy_xhat / ctx.count
    else:  # running statistics are constants: no mean terms
        mean_dy = mean_dy_xhat = torch.zeros_like(mean, dtype=acc)
    want_residual_grad = residual is not None and ctx.needs_residual_grad
    grad_input = grad_residual = None
    if ctx.needs_input_grad[0] or want_residual_grad:
        grad_input, grad_residual = _abn_backward_elemt_op(
            grad_output, saved, *args, mean_dy, mean_dy_xhat, want_residual_grad
        )
        if not ctx.needs_input_grad[0]:
            grad_input = None
        if not want_residual_grad:
            grad_residual = None
    grad_weight = grad_bias = None
    if need_weight:
        # Straight through the clamp: where |weight| < weight_eps the clamp
        # is flat, and its true derivative (zero) would freeze a weight that
        # starts or decays there (zero_init_residual) for good.
        grad_weight = local_dy_xhat.to(weight.dtype)
    if need_bias:
        grad_bias = local_dy.to(bias.dtype)
    return grad_input, grad_weight, grad_bias, grad_residual


class _ABNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, momentum,
                eps, activation, activation_param, group):
        mean, invstd, count = _statistics(x, running_mean, running_var, num_batches_tracked, training, momentum,
                                          eps, group, "abn")
        output = _abn_forward_op(x, mean, invstd, weight, bias, residual, activation, activation_param, 0.0)
        _save(ctx, x, residual, weight, bias, mean, invstd, count, training, activation, activation_param, 0.0, group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias, grad_residual = _backward(ctx, grad_output, False)
        return grad_input, grad_weight, grad_bias, grad_residual, *([None] * 9)


class _InPlaceABNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, momentum,
                eps, activation, activation_param, weight_eps, group):
        mean, invstd, count = _statistics(x, running_mean, running_var, num_batches_tracked, training, momentum,
                                          eps, group, "inplace_abn")
        _abn_forward_inplace_op(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps)
        ctx.mark_dirty(x)
        _save(ctx, x, residual, weight, bias, mean, invstd, count, training, activation, activation_param,
              weight_eps, group)
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias, grad_residual = _backward(ctx, grad_output, True)
        return grad_input, grad_weight, grad_bias, grad_residual, *([None] * 10)


# ---- functional API -------------------------------------------------------------------------


def _check_inputs(x, weight, bias, residual, running_mean, running_var, training, eps, momentum, where):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: input must be a torch.Tensor, got {type(x).__name__}")
    if not 2 <= x.dim() <= 5:
        raise ValueError(f"{where}: input must have 2 to 5 dimensions (N, C, ...), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{where}: input dtype must be float16, bfloat16, float32 or float64, got {x.dtype}")
    channels = x.shape[1]
    for name, tensor in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                         ("running_var", running_var)):
        if tensor is not None and tuple(tensor.shape) != (channels,):
            raise ValueError(f"{where}: {name} must have shape ({channels},) for input with {channels} channels, "
                             f"got {tuple(tensor.shape)}")
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{where}: {name} is on {tensor.device} but input is on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{where}: residual must match input in shape and dtype, got {tuple(residual.shape)} "
                         f"{residual.dtype} for input {tuple(x.shape)} {x.dtype}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError(f"{where}: training=False needs running_mean and running_var")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{where}: eps must be a positive float, got {eps!r}")
    if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum <= 1):
        raise ValueError(f"{where}: momentum must be None or in [0, 1], got {momentum!r}")


def abn(x, weight=None, bias=None, running_mean=None, running_var=None, training=True, momentum=0.1, eps=1e-5,
        activation="leaky_relu", activation_param=0.01, residual=None, num_batches_tracked=None, group=None):
    """``act(batch_norm(x) [+ residual])``, fused, not in place; saves ``x``.

    Arguments follow ``torch.nn.functional.batch_norm``; ``momentum=None``
    means a cumulative average (needs ``num_batches_tracked``); ``group`` is a
    ``torch.distributed`` process group to synchronise statistics over.
    """
    check_activation(activation, activation_param, inplace=False, where="abn")
    _check_inputs(x, weight, bias, residual, running_mean, running_var, training, eps, momentum, "abn")
    if momentum is None and training and (running_mean is not None or running_var is not None) \
            and num_batches_tracked is None:
        raise ValueError("abn: momentum=None (cumulative average) needs num_batches_tracked")
    return _ABNFunction.apply(x, weight, bias, residual, running_mean, running_var, num_batches_tracked, training,
                              momentum, float(eps), activation, float(activation_param), group)


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        # Dynamo cannot read storage addresses: it breaks the graph there and
        # guards the resumed frame on the address, which recompiles whenever
        # the allocator moves the tensor. Views made by view ops carry their
        # base, which it can trace (sharing by other means goes unseen here).
        return (a if a._base is None else a._base) is (b if b._base is None else b._base)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def inplace_abn(x, weight=None, bias=None, running_mean=None, running_var=None, training=True, momentum=0.1,
                eps=1e-5, activation="leaky_relu", activation_param=0.01, residual=None, num_batches_tracked=None,
                group=None, weight_eps=DEFAULT_WEIGHT_EPS):
    """``act(batch_norm(x) [+ residual])`` written over ``x``; saves only the
    output (and ``residual``). Returns ``x``, now holding the output."""
    check_activation(activation, activation_param, inplace=True, where="inplace_abn")
    _check_inputs(x, weight, bias, residual, running_mean, running_var, training, eps, momentum, "inplace_abn")
    if x.is_leaf and x.requires_grad:
        raise ValueError(
            "inplace_abn: input is a leaf tensor that requires grad (for example the model's input); "
            "it cannot be overwritten. Pass x.clone() or use effilayers.nn.ABN."
        )
    if momentum is None and training and (running_mean is not None or running_var is not None) \
            and num_batches_tracked is None:
        raise ValueError("inplace_abn: momentum=None (cumulative average) needs num_batches_tracked")
    if not (isinstance(weight_eps, (int, float)) and weight_eps > 0):
        raise ValueError(f"inplace_abn: weight_eps must be a positive float, got {weight_eps!r}")
    if residual is not None and _share_memory(residual, x):
        raise ValueError(
            "inplace_abn: residual shares memory with the input, which is overwritten; backward needs the "
            "residual as it was. Pass a residual that is not a view of the input (or use abn)."
        )
    return _InPlaceABNFunction.apply(x, weight, bias, residual, running_mean, running_var, num_batches_tracked,
                                     training, momentum, float(eps), activation, float(activation_param),
                                     float(weight_eps), group)
