"""The softmax custom ops, their autograd and the public functions (see the
package docstring for numerics, layouts and autocast)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from ..._core.layout import refuse_forward_ad
from .contract import check_dim, check_dtype, check_masked_arguments, floating_input, output_like, wrap_dim
from .reference import scaled_masked_softmax_forward_reference, softmax_backward_reference, softmax_forward_reference

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("softmax", "log_softmax", "scaled_masked_softmax")

registry.register(registry.OpKernels(name="softmax_forward", reference=softmax_forward_reference,
                                     cpp="softmax_forward", triton="effilayers.ops.softmax.triton:softmax_forward"))
registry.register(registry.OpKernels(name="softmax_backward", reference=softmax_backward_reference,
                                     cpp="softmax_backward", triton="effilayers.ops.softmax.triton:softmax_backward"))
registry.register(registry.OpKernels(
    name="scaled_masked_softmax_forward", reference=scaled_masked_softmax_forward_reference,
    cpp="scaled_masked_softmax_forward", triton="effilayers.ops.softmax.triton:scaled_masked_softmax_forward"))


# --------------------------------------------------------------------------- ops
# Declared once here; csrc/cpu/softmax.cpp adds the CPU kernels, the registry
# the Triton and reference ones where those are the choice.


_softmax_forward_op = registry.declare(
    "softmax_forward", "(Tensor x, int dim, bool log, ScalarType? dtype) -> Tensor",
    lambda x, dim, log, dtype: output_like(x, wrap_dim(dim, x.dim()), x.dtype if dtype is None else dtype))
_softmax_backward_op = registry.declare(
    "softmax_backward",
    "(Tensor grad, Tensor output, int dim, bool log, float scale, ScalarType input_dtype) -> Tensor",
    lambda grad, output, dim, log, scale, input_dtype: output_like(output, wrap_dim(dim, output.dim()), input_dtype))
_scaled_masked_softmax_op = registry.declare(
    "scaled_masked_softmax_forward", "(Tensor x, Tensor? mask, float scale, bool causal) -> Tensor",
    lambda x, mask, scale, causal: output_like(x, x.dim() - 1, x.dtype))


# --------------------------------------------------------------------------- autograd


def _run_backward(grad, output, dim, log, scale, input_dtype):
    # The op's own derivative (below) serves backward(create_graph=True).
    return _softmax_backward_op(grad, output, dim, log, scale, input_dtype)


def _softmax_setup_context(ctx, inputs, output):
    x, dim, log, _dtype = inputs
    ctx.dim, ctx.log, ctx.input_dtype = dim, log, x.dtype
    ctx.save_for_backward(output)  # the only tensor kept for backward


def _softmax_backward(ctx, grad):
    (output,) = ctx.saved_tensors
    return _run_backward(grad, output, ctx.dim, ctx.log, 1.0, ctx.input_dtype), None, None, None


torch.library.register_autograd(_softmax_forward_op, _softmax_backward, setup_context=_softmax_setup_context)


def _masked_setup_context(ctx, inputs, output):
    x, _mask, scale, _causal = inputs
    ctx.scale, ctx.input_dtype = scale, x.dtype
    ctx.save_for_backward(output)


def _masked_backward(ctx, grad):
    (output,) = ctx.saved_tensors
    return _run_backward(grad, output, output.dim() - 1, False, ctx.scale, ctx.input_dtype), None, None, None


torch.library.register_autograd(_scaled_masked_softmax_op, _masked_backward, setup_context=_masked_setup_context)


def _backward_setup_context(ctx, inputs, output):
    grad, y, dim, log, scale, _input_dtype = inputs
    ctx.dim, ctx.log, ctx.scale = dim, log, scale
    ctx.save_for_backward(grad, y)


def _backward_backward(ctx, grad_of_grad_x):
    """Double backward in PyTorch ops (only reached with ``create_graph=True``)."""
    grad, y = ctx.saved_tensors
    acc = accumulation_dtype(grad.dtype, y.dtype, grad_of_grad_x.dtype)
    g, yy, h = grad.to(acc), y.to(acc), grad_of_grad_x.to(acc)
    dim = ctx.dim if y.dim() > 0 else None
    total = (lambda t: t.sum(dim, keepdim=True)) if dim is not None else (lambda t: t)
    if ctx.log:
        e = yy.exp()
        d_grad = h - total(h * e)
        d_y = -h * e * total(g)
    else:
        hy = total(h * yy)
        d_grad = yy * (h - hy)
        d_y = h * (g - total(g * yy)) - hy * g
    return (d_grad * ctx.scale).to(grad.dtype), (d_y * ctx.scale).to(y.dtype), None, None, None, None


torch.library.register_autograd(_softmax_backward_op, _backward_backward, setup_context=_backward_setup_context)


# --------------------------------------------------------------------------- the eager path

# The whole op, autograd included, for an eager call on a CPU tensor: the CPU
# library registers it (csrc/common/softmax_autograd.h); elsewhere
# _EagerSoftmax below does the same in Python.
_eager_softmax = registry.declare_autograd("softmax", "(Tensor x, int dim, bool log, ScalarType? dtype) -> Tensor")


class _EagerSoftmax(torch.autograd.Function):
    """softmax / log_softmax on the eager path: the same two ops, called
    below the Autograd key, saving only the output as the registered
    autograd does. With ``create_graph=True`` backward calls the backward op
    with its own registered derivative."""

    @staticmethod
    def forward(ctx, x, dim, log, dtype):
        with torch._C._AutoDispatchBelowAutograd():
            output = _softmax_forward_op(x, dim, log, dtype)
        ctx.dim, ctx.log, ctx.input_dtype = dim, log, x.dtype
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _run_backward(grad, output, ctx.dim, ctx.log, 1.0, ctx.input_dtype), None, None, None
        with torch._C._AutoDispatchBelowAutograd():
            return _softmax_backward_op(grad, output, ctx.dim, ctx.log, 1.0, ctx.input_dtype), None, None, None


# --------------------------------------------------------------------------- public functions


def _softmax(op: str, x, dim, log: bool, dtype) -> torch.Tensor:
    check_dtype(dtype, op)
    x = floating_input(x, dtype, op)
    refuse_forward_ad(op, x)
    dim = check_dim(dim, x.dim(), op)
    # An eager call skips the op's Python autograd kernel (torch.library's, a wrapper and two
    # re-dispatches per call, more host time than the kernel on small rows): on CPU for the C++
    # autograd, elsewhere for the Function above. Only the CPU library registers the former (a CUDA
    # tensor's kernels are Triton's, and asking would build the CUDA library for them).
    if x.device.type == "cpu" and registry.compiled_autograd("softmax", x):
        return _eager_softmax(x, dim, log, dtype)
    if registry.eager_call(x):
        if x.requires_grad and torch.is_grad_enabled():
            return _EagerSoftmax.apply(x, dim, log, dtype)
        with torch._C._AutoDispatchBelowAutograd():
            return _softmax_forward_op(x, dim, log, dtype)
    return _softmax_forward_op(x, dim, log, dtype)


def softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype)`` accumulated in float32 (float64 for
    float64), saving only the output for backward. See the package docstring."""
    return _softmax("softmax", x, dim, False, dtype)


def log_softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim, dtype)`` accumulated in float32 (float64
    for float64), saving only the output for backward."""
    return _softmax("log_softmax", x, dim, True, dtype)


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor] = None, scale: float = 1.0,
                          causal: bool = False) -> torch.Tensor:
    """Softmax over the last dimension of ``x * scale`` with an attention mask.

    ``mask`` follows ``torch.nn.functional.scaled_dot_product_attention``'s
    ``attn_mask``: a bool mask keeps the positions that are True; a floating
    mask is added to ``x * scale``. It must broadcast to ``x`` and is read
    through its broadcast strides. ``causal=True`` additionally masks column
    ``j > i`` of row ``i`` of the last two dimensions (the top-left aligned
    lower triangle, SDPA's ``is_causal``). A row with nothing left to attend
    gives zeros and a zero gradient. The gradient flows to ``x`` only (times
    ``scale``), never to ``mask``. Output and gradient have ``x``'s dtype.
    """
    scale = check_masked_arguments(x, mask, scale, causal)
    refuse_forward_ad("scaled_masked_softmax", x, mask)
    return _scaled_masked_softmax_op(x, mask, scale, causal)
