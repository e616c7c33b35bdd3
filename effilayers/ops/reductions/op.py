"""The ``effilayers::reduce`` op, its autograd and the public
functions (see the package docstring for the contract and the methods)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._core import registry
from ..._core.dtypes import accumulation_dtype
from ..._core.layout import autocast_to_float32, refuse_forward_ad
from .contract import (
    check,
    check_kind,
    integer_input,
    norm_dims,
    norm_order,
    output_shape,
    reduced_dims,
    variance_arguments,
)
from .reference import reduce_op_reference

# The functions effilayers.functional exports from this family (effilayers/functional.py finds them here).
FUNCTIONAL = ("sum", "mean", "var", "std", "norm")

# Every backend's kernel takes the op's arguments; the Python ones run
# contract.run_three over their (outer, reduced, inner) kernel, the C++ one
# the same view (csrc/cpu/layout.h).
registry.register(registry.OpKernels(name="reduce", reference=reduce_op_reference, cpp="reduce",
                                     triton="effilayers.ops.reductions.triton:reduce_op_triton"))


def _kind_checked(x, dims, kind, correction, keepdim, dtype) -> None:
    check_kind(kind)


# Declared once here; csrc/cpu/reductions.cpp adds the CPU kernel, the
# registry the Triton and reference ones where those are the choice.
_reduce_op = registry.declare(
    "reduce", "(Tensor x, int[] dims, str kind, float correction, bool keepdim, ScalarType? dtype) -> Tensor",
    lambda x, dims, kind, correction, keepdim, dtype: x.new_empty(
        output_shape(x.shape, dims, keepdim), dtype=x.dtype if dtype is None else dtype),
    check=_kind_checked)


def _setup_context(ctx, inputs, output):
    x, dims, kind, correction, keepdim, dtype = inputs
    ctx.kind, ctx.correction = kind, correction
    ctx.dims = tuple(dims)
    ctx.input_shape, ctx.input_dtype = tuple(x.shape), x.dtype
    ctx.count = math.prod(x.shape[d] for d in dims)
    if kind == "var":
        ctx.save_for_backward(x)
    elif kind in ("std", "norm"):
        ctx.save_for_backward(x, output)


def _mean(x: torch.Tensor, dims, acc: torch.dtype) -> torch.Tensor:
    """The overflow-free mean over ``dims`` (kept) in ``acc``, for var/std's
    backward: the op, which traces and has a derivative (create_graph=True)."""
    return _reduce_op(x, list(dims), "mean", 0.0, True, acc)


def _backward(ctx, grad):
    acc = accumulation_dtype(ctx.input_dtype)
    keep_shape = output_shape(ctx.input_shape, ctx.dims, True)
    g = grad.to(acc).reshape(keep_shape)
    n = ctx.count
    if ctx.kind in ("sum", "mean"):
        # Rounded once at output size, then broadcast without a copy (an
        # empty input has no elements to receive 0 / 0).
        scaled = g if ctx.kind == "sum" else g / max(n, 1)
        return scaled.to(ctx.input_dtype).expand(ctx.input_shape), None, None, None, None, None
    if ctx.kind == "norm":
        x, result = ctx.saved_tensors
        norm = result.to(acc).reshape(keep_shape)
        # (x / norm) is at most 1 in magnitude: no overflow before * g. One
        # input-sized float32 temporary, updated in place.
        grad_x = x.to(acc) / norm
        grad_x.mul_(g).masked_fill_(norm == 0, 0.0)
    else:
        saved = ctx.saved_tensors
        x = saved[0]
        mean = _mean(x, ctx.dims, acc)
        dof = n - ctx.correction
        scale = 2.0 / dof if dof > 0 else float("nan")
        if ctx.kind == "std":
            std = saved[1].to(acc).reshape(keep_shape)
            # d std = d var / (2 std); 0 where std is 0, as torch does.
            g = torch.where(std == 0, torch.zeros((), dtype=acc, device=x.device), g / (2 * std))
        grad_x = x.to(acc) - mean  # a new tensor even for float32 x
        grad_x.mul_(g * scale)
    return grad_x.to(ctx.input_dtype), None, None, None, None, None


torch.library.register_autograd(_reduce_op, _backward, setup_context=_setup_context)


# CUDA autocast runs torch.sum, torch.linalg.vector_norm and torch.norm in
# float32 when they get no dtype (its "fp32_set_opt_dtype" policy); it leaves
# mean/var/std alone, and CPU autocast leaves all five alone.
_AUTOCAST_FLOAT32_DEVICES = {"sum": ("cuda",), "norm": ("cuda",)}


def _checked(op: str, x, dim, keepdim: bool, dtype, correction=0.0, order=None):
    """``(x, dims, dtype)`` after the checks, with integer input converted
    and ``dtype`` set where autocast asks for float32."""
    x = integer_input(op, x, dtype)
    check(op, x, dtype, keepdim, correction)
    if dtype is None and autocast_to_float32(x, _AUTOCAST_FLOAT32_DEVICES.get(op, ())):
        dtype = torch.float32
    dims = norm_dims(x, dim, order) if op == "norm" else reduced_dims(op, x, dim)
    return x, dims, dtype


def _reduce(op: str, x, dim, correction: float, keepdim: bool, dtype) -> torch.Tensor:
    x, dims, dtype = _checked(op, x, dim, keepdim, dtype, correction)
    refuse_forward_ad(op, x)
    return _reduce_op(x, list(dims), op, float(correction), keepdim, dtype)


def sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum over ``dim`` with float32 accumulation; see the package docstring."""
    return _reduce("sum", x, dim, 0.0, keepdim, dtype)


def mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Mean over ``dim``, divided before the one rounding to the output dtype."""
    return _reduce("mean", x, dim, 0, keepdim, dtype)


def var(x: torch.Tensor, dim=None, unbiased: Optional[bool] = None, keepdim: bool = False, *,
        correction: Optional[float] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Variance over ``dim``: M2 / max(0, n - correction), two-pass in float32.

    Both of ``torch.var``'s signatures: ``var(x, dim, correction=c,
    keepdim=k)`` with any int or float ``c`` (None: 1), and ``var(x, dim,
    unbiased, keepdim)`` or ``var(x, unbiased)`` (True: correction 1,
    False: 0)."""
    dim, correction = variance_arguments("var", dim, unbiased, correction)
    return _reduce("var", x, dim, correction, keepdim, dtype)


def std(x: torch.Tensor, dim=None, unbiased: Optional[bool] = None, keepdim: bool = False, *,
        correction: Optional[float] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Standard deviation over ``dim`` (the square root of :func:`var`, with
    its arguments)."""
    dim, correction = variance_arguments("std", dim, unbiased, correction)
    return _reduce("std", x, dim, correction, keepdim, dtype)


def norm(x: torch.Tensor, dim=None, keepdim: bool = False, *, ord=None, p=None, dtype: Optional[torch.dtype] = None
         ) -> torch.Tensor:
    """Vector norm over ``dim`` (``torch.linalg.vector_norm(x, ord, dim)``).

    The second positional argument is ``dim``, not an order as in
    ``torch.norm(x, p, dim)``: ``norm(x, 1)`` is the 2-norm over dimension 1;
    the order is keyword-only, as ``ord=`` or (torch.norm's name) ``p=``.
    Every order torch takes, computed as follows:

    * ``2`` (default) and ``"fro"`` (torch.norm's Frobenius norm: the 2-norm
      over one or two dims, or all): this op's kernel, scaled by powers of
      two so the squares of bf16 values do not overflow.
    * ``1``: the op's sum of ``x.abs()`` (overflow-free like :func:`sum`;
      costs an input-sized ``abs`` temporary, which autograd keeps).
    * ``inf``, ``-inf`` (largest, smallest magnitude) and ``0`` (count of
      non-zeros): ``torch.linalg.vector_norm`` in x's dtype, where they are
      exact, then rounded once to ``dtype``.
    * any other real order (3, fractional, negative): ``torch.linalg.vector_norm``
      in float32 for fp16/bf16/fp32 input (float64 for float64), then rounded
      once to the output dtype; no kernel of ours, as these orders are rare.
    * ``"nuc"`` (nuclear norm, over exactly two dims, as in torch.norm):
      ``torch.linalg.matrix_norm`` in float32 (float64 for float64): torch
      itself refuses fp16/bf16 there.
    """
    order = norm_order(ord, p)
    if order in (2, "fro"):
        x, dims, dtype = _checked("norm", x, dim, keepdim, dtype, order=order)
        refuse_forward_ad("norm", x)
        return _reduce_op(x, list(dims), "norm", 0.0, keepdim, dtype)
    x, dims, dtype = _checked("norm", x, dim, keepdim, dtype, order=order)
    if order == 1:
        refuse_forward_ad("norm", x)
        return _reduce_op(x.abs(), list(dims), "sum", 0.0, keepdim, dtype)
    out_dtype = x.dtype if dtype is None else dtype
    if order in (math.inf, -math.inf, 0):
        # One of x's magnitudes, or a count: exact in x's dtype (torch's own
        # dtype= refuses a narrower output dtype).
        return torch.linalg.vector_norm(x, order, dims, keepdim).to(out_dtype)
    acc = accumulation_dtype(x.dtype)
    if order == "nuc":
        return torch.linalg.matrix_norm(x.to(acc), "nuc", dims, keepdim).to(out_dtype)
    return torch.linalg.vector_norm(x, order, dims, keepdim, dtype=acc).to(out_dtype)
