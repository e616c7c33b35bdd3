"""Softmax, log-softmax and scaled/masked softmax that accumulate in fp32.

Public functions (also in :mod:`effilayers.functional`)::

    softmax(x, dim, dtype=None)
    log_softmax(x, dim, dtype=None)
    scaled_masked_softmax(x, mask=None, scale=1.0, causal=False)

Numerics
    Every backend converts each value to the accumulation type as it reads
    it: float32 for float16/bfloat16/float32 input, float64 when the input or
    the requested ``dtype`` is float64. The row maximum is subtracted before
    ``exp`` (so fp16 rows with values above ~11 do not overflow), the sum of
    exponentials and the log-sum-exp are formed in that type, and only the
    final value is rounded to the output dtype. ``dtype`` names the output
    dtype; unlike ``torch.softmax(x, dim, dtype=...)`` no converted copy of
    ``x`` is made first. Integer and bool ``x`` are accepted with a floating
    ``dtype``, as torch accepts them: they are converted to float32 (float64
    for ``dtype=torch.float64``) first, the one copy this makes.

    A row whose values are all ``-inf`` (a fully masked row) gives zeros from
    softmax and ``-inf`` from log-softmax, not the NaNs ``torch.softmax``
    returns; its softmax gradient is zero. A NaN or ``+inf`` anywhere in a
    row makes the whole row NaN, as in torch.

What autograd saves
    Only the output (softmax: ``y``, log-softmax: ``log y``), as torch does;
    ``effilayers.memory`` counts exactly the output's bytes. The backward is
    one fused kernel per row: ``gx = y * (g - sum(g * y))`` for softmax,
    ``gx = g - exp(y) * sum(g)`` for log-softmax (times ``scale`` for
    :func:`scaled_masked_softmax`), computed in float32 and returned in the
    *input's* dtype even when ``dtype`` asked for another output dtype.

Layouts
    ``x`` is read in place as ``(outer, reduced, inner)`` problems
    (:func:`effilayers.ops._layout.three_groups`): contiguous tensors with any
    ``dim``, channels_last with ``dim=1``, transposed matrices and most
    slices. When the dimensions before or after ``dim`` cannot be merged into
    one strided index (for example ``x.permute(1, 0, 2)`` with ``dim=2``), the
    kernels first make a contiguous copy of ``x`` (one input-sized buffer,
    freed when the op returns). One layout rule for the outputs of all three
    ops (and the gradient), on every backend and in the fake kernels that
    ``torch.compile`` traces (:func:`output_like`): the input's strides when
    the input is dense and its dimensions around ``dim`` (the last one for
    :func:`scaled_masked_softmax`) merge, else contiguous, also where a
    kernel could have read the input in place. (``torch.softmax`` always
    returns a contiguous tensor; the values are the same.)

    :func:`scaled_masked_softmax` reads ``mask`` through its broadcast
    strides (0 along broadcast dimensions); the C++ and Triton kernels never
    expand it into an ``x``-sized tensor, except the Triton kernel for inputs
    of more than four dimensions whose leading dimensions do not merge. The
    pure-PyTorch reference (the fallback) does materialise it.

Double backward (``create_graph=True``) works: the backward op's own
gradient is written in PyTorch ops (it saves ``g`` and ``y``), not fused.

Autocast
    The ops keep the input dtype under ``torch.autocast``: a bfloat16/float16
    input gives a bfloat16/float16 output. On CPU that is what torch does; on
    CUDA, torch's autocast runs softmax in float32 and returns float32, which
    doubles the bytes of the activation that backward keeps. Since the
    accumulation is float32 here anyway, the narrow output costs only its
    final rounding; pass ``dtype=torch.float32`` for a float32 output.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._core import registry
from .._core.layout import refuse_forward_ad, three_groups

__all__ = [
    "softmax",
    "log_softmax",
    "scaled_masked_softmax",
    "softmax_forward_reference",
    "softmax_backward_reference",
    "scaled_masked_softmax_forward_reference",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


# --------------------------------------------------------------------------- checks


def _check_tensor(x, op: str, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} dtype must be {_DTYPE_NAMES}, got {x.dtype}")


def _floating_input(x, dtype, op: str):
    """``x``, or for an integer or bool ``x`` with a floating ``dtype`` its
    conversion: ``torch.softmax(x, dim, dtype=torch.float32)`` accepts those
    inputs (it converts x to dtype first; without a floating dtype torch
    raises too). The copy is float32 (float64 for ``dtype=torch.float64``), so
    integers up to 2**24 are exact before the one rounding to ``dtype``."""
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
        if dtype is not None:  # checked before: a floating dtype
            return x.to(accumulation_dtype(dtype))
        raise TypeError(f"{op}: x dtype must be {_DTYPE_NAMES}, got {x.dtype} (integer and bool input needs a "
                        f"floating dtype=, as in torch.{op}(x, dim, dtype=torch.float32))")
    _check_tensor(x, op)
    return x


def _check_dim(dim, ndim: int, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    rank = max(ndim, 1)  # a 0-dim tensor takes dim 0 or -1, as in torch
    if not -rank <= dim < rank:
        raise IndexError(f"{op}: dim {dim} is out of range for a tensor with {ndim} dimensions "
                         f"(expected -{rank} <= dim < {rank})")
    return dim % rank


def _check_dtype(dtype, op: str) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype must be {_DTYPE_NAMES} (or None for the input's dtype), got {dtype}")


def _check_masked_arguments(x, mask, scale, causal) -> float:
    op = "scaled_masked_softmax"
    _check_tensor(x, op)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dimension (softmax runs over the last one), got a 0-dim tensor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if causal and x.dim() < 2:
        raise ValueError(f"{op}: causal=True masks over the last two dimensions; x must have at least 2, "
                         f"got shape {tuple(x.shape)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{op}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and mask.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: mask dtype must be bool (True = keep) or floating ({_DTYPE_NAMES}; added "
                            f"to x * scale), got {mask.dtype}")
        if mask.device != x.device:
            raise ValueError(f"{op}: mask is on {mask.device} but x is on {x.device}")
        if not broadcasts_to(mask.shape, x.shape):
            raise ValueError(f"{op}: mask of shape {tuple(mask.shape)} does not broadcast to x's shape "
                             f"{tuple(x.shape)} (each trailing size must be 1 or equal x's)")
    return scale


def broadcasts_to(shape, target) -> bool:
    """True when a tensor of ``shape`` expands to ``target`` without changing it."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))))


# --------------------------------------------------------------------------- layout and dtype rules


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def readable(x: torch.Tensor, dim: int):
    """``(x or a contiguous copy, its ThreeGroups)``: the copy is made only
    when the dimensions around ``dim`` do not merge (see the module docstring)."""
    groups = three_groups(x, (dim,)) if x.dim() > 0 else three_groups(x.reshape(1), (0,))
    if groups is None:
        x = x.contiguous()
        groups = three_groups(x, (dim,))
    return x, groups


def output_like(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The output every backend allocates: ``x``'s strides when ``x`` is
    dense and read in place, else contiguous (the fake kernels use it too, so
    compiled graphs see the real strides)."""
    if x.dim() > 0 and three_groups(x, (dim,)) is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.empty_like(x, dtype=dtype)


# --------------------------------------------------------------------------- references


def _softmax_values(z: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """Softmax of ``z`` (already in the accumulation dtype) with the
    all-``-inf``-row rule of the module docstring."""
    if z.numel() == 0:
        return z.clone()
    maximum = z.amax(dim, keepdim=True)
    shift = torch.where(maximum == -math.inf, torch.zeros_like(maximum), maximum)
    shifted = z - shift
    exps = shifted.exp()
    total = exps.sum(dim, keepdim=True)
    empty_row = total == 0
    if log:
        result = shifted - torch.where(empty_row, torch.ones_like(total), total).log()
        return torch.where(empty_row, torch.full_like(result, -math.inf), result)
    return torch.where(empty_row, torch.zeros_like(exps), exps / total)


def softmax_forward_reference(x: torch.Tensor, dim: int, log: bool, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Pure PyTorch: the fallback and (on float64 input) the test oracle."""
    _check_tensor(x, "softmax_forward")
    _check_dtype(dtype, "softmax_forward")
    dim = _check_dim(dim, x.dim(), "softmax_forward")
    out_dtype = x.dtype if dtype is None else dtype
    out = output_like(x, dim, out_dtype)
    z = x.to(accumulation_dtype(x.dtype, out_dtype))
    out.copy_(_softmax_values(z, dim if x.dim() > 0 else 0, log) if x.dim() > 0
              else _softmax_values(z.reshape(1), 0, log).reshape(()))
    return out


def softmax_backward_reference(grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool, scale: float,
                               input_dtype: torch.dtype) -> torch.Tensor:
    """``gx = scale * y * (g - sum(g * y))`` (softmax) or
    ``scale * (g - exp(y) * sum(g))`` (log-softmax), in the accumulation dtype."""
    _check_backward_arguments(grad, output, input_dtype)
    dim = _check_dim(dim, output.dim(), "softmax_backward")
    acc = accumulation_dtype(grad.dtype, output.dtype, input_dtype)
    g, y = grad.to(acc), output.to(acc)
    reduce_dim = dim if output.dim() > 0 else None
    if log:
        result = g - y.exp() * (g.sum(reduce_dim, keepdim=True) if reduce_dim is not None else g)
    else:
        result = y * (g - ((g * y).sum(reduce_dim, keepdim=True) if reduce_dim is not None else g * y))
    out = output_like(output, dim, input_dtype)
    out.copy_(result * scale)
    return out


def _check_backward_arguments(grad, output, input_dtype) -> None:
    _check_tensor(grad, "softmax_backward", "grad")
    _check_tensor(output, "softmax_backward", "output")
    _check_dtype(input_dtype, "softmax_backward")
    if grad.shape != output.shape:
        raise ValueError(f"softmax_backward: grad has shape {tuple(grad.shape)}, output {tuple(output.shape)}")
    if grad.device != output.device:
        raise ValueError(f"softmax_backward: grad is on {grad.device}, output on {output.device}")


def masked_scores(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool,
                  acc: torch.dtype) -> torch.Tensor:
    """``x * scale`` with the mask applied, in ``acc`` (reference only: it
    materialises the broadcast)."""
    z = x.to(acc) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            z = z.masked_fill(~mask, -math.inf)
        else:
            z = z + mask.to(acc)
    if causal:
        rows, cols = x.shape[-2:]
        keep = torch.ones(rows, cols, dtype=torch.bool, device=x.device).tril()
        z = z.masked_fill(~keep, -math.inf)
    return z


def scaled_masked_softmax_forward_reference(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                                            causal: bool) -> torch.Tensor:
    scale = _check_masked_arguments(x, mask, scale, causal)
    out = output_like(x, x.dim() - 1, x.dtype)
    z = masked_scores(x, mask, scale, causal, accumulation_dtype(x.dtype))
    out.copy_(_softmax_values(z, -1, False))
    return out


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("effilayers::softmax_forward", mutates_args=())
def _softmax_forward_op(x: torch.Tensor, dim: int, log: bool, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return registry.kernel("softmax_forward", x.device)(x, dim, log, dtype)


@_softmax_forward_op.register_fake
def _(x, dim, log, dtype):
    return output_like(x, _check_dim(dim, x.dim(), "softmax_forward"), x.dtype if dtype is None else dtype)


@torch.library.custom_op("effilayers::softmax_backward", mutates_args=())
def _softmax_backward_op(grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool, scale: float,
                         input_dtype: torch.dtype) -> torch.Tensor:
    return registry.kernel("softmax_backward", output.device)(grad, output, dim, log, scale, input_dtype)


@_softmax_backward_op.register_fake
def _(grad, output, dim, log, scale, input_dtype):
    return output_like(output, _check_dim(dim, output.dim(), "softmax_backward"), input_dtype)


@torch.library.custom_op("effilayers::scaled_masked_softmax_forward", mutates_args=())
def _scaled_masked_softmax_op(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                              causal: bool) -> torch.Tensor:
    return registry.kernel("scaled_masked_softmax_forward", x.device)(x, mask, scale, causal)


@_scaled_masked_softmax_op.register_fake
def _(x, mask, scale, causal):
    return output_like(x, x.dim() - 1, x.dtype)


def _softmax_setup_context(ctx, inputs, output):
    x, dim, log, _dtype = inputs
    ctx.dim, ctx.log, ctx.input_dtype = dim, log, x.dtype
    ctx.save_for_backward(output)  # the only tensor kept for backward


def _softmax_backward(ctx, grad):
    (output,) = ctx.saved_tensors
    return _softmax_backward_op(grad, output, ctx.dim, ctx.log, 1.0, ctx.input_dtype), None, None, None


_softmax_forward_op.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


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


_softmax_backward_op.register_autograd(_backward_backward, setup_context=_backward_setup_context)


def _masked_setup_context(ctx, inputs, output):
    x, _mask, scale, _causal = inputs
    ctx.scale, ctx.input_dtype = scale, x.dtype
    ctx.save_for_backward(output)


def _masked_backward(ctx, grad):
    (output,) = ctx.saved_tensors
    grad_x = _softmax_backward_op(grad, output, output.dim() - 1, False, ctx.scale, ctx.input_dtype)
    return grad_x, None, None, None


_scaled_masked_softmax_op.register_autograd(_masked_backward, setup_context=_masked_setup_context)


def _triton(name):
    def run(*args):
        from ..kernels import softmax as kernels  # imports triton: only when this backend runs

        return getattr(kernels, name)(*args)

    run.__name__ = f"{name}_triton"
    return run


registry.register(registry.OpKernels(name="softmax_forward", reference=softmax_forward_reference,
                                     cpp="softmax_forward", triton=_triton("softmax_forward")))
registry.register(registry.OpKernels(name="softmax_backward", reference=softmax_backward_reference,
                                     cpp="softmax_backward", triton=_triton("softmax_backward")))
registry.register(registry.OpKernels(name="scaled_masked_softmax_forward",
                                     reference=scaled_masked_softmax_forward_reference,
                                     cpp="scaled_masked_softmax_forward",
                                     triton=_triton("scaled_masked_softmax_forward")))


# --------------------------------------------------------------------------- public functions


def softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype)`` accumulated in float32 (float64 for
    float64), saving only the output for backward. See the module docstring."""
    _check_dtype(dtype, "softmax")
    x = _floating_input(x, dtype, "softmax")
    refuse_forward_ad("softmax", x)
    _check_dim(dim, x.dim(), "softmax")
    return _softmax_forward_op(x, dim, False, dtype)


def log_softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim, dtype)`` accumulated in float32 (float64
    for float64), saving only the output for backward."""
    _check_dtype(dtype, "log_softmax")
    x = _floating_input(x, dtype, "log_softmax")
    refuse_forward_ad("log_softmax", x)
    _check_dim(dim, x.dim(), "log_softmax")
    return _softmax_forward_op(x, dim, True, dtype)


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
    scale = _check_masked_arguments(x, mask, scale, causal)
    refuse_forward_ad("scaled_masked_softmax", x, mask)
    return _scaled_masked_softmax_op(x, mask, scale, causal)
