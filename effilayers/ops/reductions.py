"""Overflow-free sum, mean, var, std and vector 2-norm for fp16/bf16 (issue 5).

``sum(x, dim=None, keepdim=False, *, dtype=None)``, ``mean`` (same),
``var(x, dim=None, *, correction=1, keepdim=False, dtype=None)``, ``std``
(same) and ``norm(x, dim=None, keepdim=False, *, ord=2, dtype=None)`` (the
vector norm ``torch.linalg.vector_norm(x, ord, dim)``; ord 2, 1 or inf, the
2-norm being the op's own kernel) follow torch's semantics for
``dim`` (an int, a tuple, ``None`` or ``()`` for all dimensions, negative
values) and ``keepdim``. The result has the input's dtype unless ``dtype`` is
given (``dtype=torch.float32`` returns the float32 result of fp16/bf16 input
without rounding it to the input dtype first). Inputs must be float16,
bfloat16, float32 or float64, except that ``sum`` and ``mean`` take integer
and bool inputs with a floating ``dtype``, as torch's do (through a float32
copy, float64 for ``dtype=torch.float64``); other integer inputs raise
TypeError (``torch.sum`` without ``dtype`` would return an int64 sum;
``var``, ``std`` and ``norm`` refuse them in torch too). The output is a new
contiguous tensor.

Contract
    Accumulation is in float32 for fp16/bf16/fp32 input (float64 for float64)
    and the result is formed in float64 before its one rounding to the output
    dtype, so a finite fp16/bf16 input whose true result is representable in
    the output dtype never gives inf. Examples where torch 2.13 on CPU does
    (kept in ``tests/test_reductions.py::test_overflow_table`` with both
    results): the bf16 mean of 100,000 values of 3e38 (torch: inf), the bf16
    2-norm of values of 1e20 (torch: inf; the squares overflow float32), a
    bf16 sum whose partial sums overflow but whose total is 1 (torch: nan),
    the naive fp16 ``x.pow(2).sum().sqrt()`` and ``x.sum() / n``.

Method (CPU kernel, csrc/cpu/reductions.cpp)
    The reduced range is cut into blocks of at most 4096 values, a block is
    reduced in float32 with vector accumulators (var/std: a two-pass mean and
    M2 inside the block), and block results are combined in float64 in a fixed
    order (Chan's formula for mean/M2), so results do not depend on the thread
    count. fp16 values cannot overflow a float32 block (65504^2 * 4096 ~
    1.8e13). A bf16/fp32 block whose float32 result is not finite while its
    values are is recomputed with its values multiplied by 2^-e (e the exponent
    of the block's largest magnitude), exactly as BLAS nrm2 scales, and its
    result is scaled back by 2^e (2^2e for squares and M2) in float64. Only
    values more than 2^126 below the block maximum lose bits there. The rescue
    runs only for blocks that overflowed, so the common case costs nothing.

Method (Triton kernel, effilayers/kernels/reductions.py)
    One program per output (or per tile of adjacent outputs) loops over the
    reduced range in blocks; each block is scaled by a power of two from its
    largest magnitude and the running result carries its own exponent, so
    nothing overflows float32 in one pass. Large full reductions split the
    range across programs and combine the per-program partials (count,
    mean/sum, M2, exponent) in float64.

Layouts
    The input is viewed as (outer, reduced, inner) without copying where the
    reduced dims are consecutive and each group's strides nest
    (``effilayers.ops._layout.three_groups``): the last dims of a contiguous
    tensor, leading dims, the channel dim of channels_last, transposed
    matrices. A full reduction of any dense tensor (no overlap, no gaps) reads
    it in memory order without a copy. Other cases (dims (0, 2) of a
    contiguous 3-D tensor, strided slices) move the reduced dims last and copy
    the input once (an input-sized buffer in the input dtype).

Autograd (what is saved)
    sum/mean save nothing but shapes: the backward broadcasts the gradient
    (divided by n for the mean, in float32, rounded at output size) as an
    expanded view, without an input-sized buffer. var saves the input; its backward
    recomputes the float32 mean with this op (one more read of the input,
    instead of keeping an output-sized float32 tensor), std and norm also
    save their output. Backward products are formed in float32 per element
    (``2 (x - mean) / (n - correction) * g``; ``(x / norm) * g``, in that
    order so nothing overflows fp16; bf16 values beyond ~1.7e38 of both signs
    can still overflow float32's ``x - mean`` there) with PyTorch ops on one input-sized
    float32 temporary (updated in place; 2x the input's bytes for fp16/bf16,
    alive during backward only), and rounded once to the input dtype. As in torch, the gradient of std and norm is 0 where the
    result is 0.

Edge cases (as torch): an empty reduction gives sum 0, norm 0, mean/var/std
nan; var divides M2 by max(0, n - correction) (inf, or nan when M2 is 0), for
any int or float ``correction`` (0.5 and -1 included, as torch takes them);
``dim=()`` reduces everything; a 0-dim input accepts dim 0 and -1.

Autocast: each function returns what the torch op it replaces returns under
``torch.autocast``. CUDA autocast runs ``torch.sum`` and
``torch.linalg.vector_norm`` (and ``torch.norm``) in float32 when no
``dtype`` is given, so with CUDA autocast enabled :func:`sum` and
:func:`norm` (every ``ord``) of float16/bfloat16 input return float32: the
float32 result the kernel formed anyway, not rounded to the input dtype, and
without the float32 copy of the input torch makes. ``mean``, ``var`` and
``std`` are not on autocast's lists and keep the input dtype; CPU autocast
changes none of the five. An explicit ``dtype=`` always wins, as in torch.

Reference (pure PyTorch, the fallback and the float64 oracle): converts the
input to float64 and uses torch's reductions; that copy is 4x the input's
bytes for fp16/bf16.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .._core import registry
from .._core.layout import autocast_to_float32, normalize_dims, refuse_forward_ad, three_groups

__all__ = ["sum", "mean", "var", "std", "norm", "reduce_reference", "reduce_three_reference", "KINDS"]

KINDS = ("sum", "mean", "var", "std", "norm")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(op: str, x, dtype, keepdim, correction=0.0) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        hint = ("pass a floating dtype=, e.g. dtype=torch.float32, for integer or bool input" if op in ("sum", "mean")
                else "convert integer tensors first, e.g. x.float(), as torch requires")
        raise TypeError(f"{op}: x must be float16, bfloat16, float32 or float64, got {x.dtype} ({hint})")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be None, float16, bfloat16, float32 or float64, got {dtype}")
    if not isinstance(keepdim, bool):
        raise TypeError(f"{op}: keepdim must be a bool, got {type(keepdim).__name__}")
    if isinstance(correction, bool) or not isinstance(correction, (int, float)):
        raise TypeError(f"{op}: correction must be an int or a float (as in torch.var), got {correction!r}")


def _dims(op: str, x: torch.Tensor, dim) -> tuple[int, ...]:
    """Sorted reduced dims; () and None mean all, as in torch."""
    if dim is None:
        return tuple(range(x.dim()))
    dims = normalize_dims(dim, x.dim(), "dim", op)
    if not dims or x.dim() == 0:
        return tuple(range(x.dim()))
    return dims


def _output_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(shape)]
    return [s for d, s in enumerate(shape) if d not in dims]


def _is_dense(x: torch.Tensor) -> bool:
    """No overlap and no gaps: the elements fill [offset, offset + numel)."""
    pairs = sorted(((st, sz) for sz, st in zip(x.shape, x.stride()) if sz != 1), reverse=True)
    expected = 1
    for stride, size in reversed(pairs):
        if stride != expected:
            return False
        expected *= size
    return True


def as_three(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``x`` as an (outer, reduced, inner) strided tensor whose reduction over
    dim 1, laid out (outer, inner), is the reduction over ``dims`` in the
    order of the kept dims. A view where possible, else one copy."""
    if len(dims) == x.dim():
        if x.is_contiguous() or (x.numel() > 0 and _is_dense(x)):
            # Order does not matter for a full reduction: memory order.
            return x.as_strided((1, x.numel(), 1), (0, 1, 0), x.storage_offset())
        return x.contiguous().view(1, x.numel(), 1)
    groups = three_groups(x, dims)
    if groups is None:
        kept = [d for d in range(x.dim()) if d not in dims]
        x = x.permute(*kept, *dims).contiguous()  # the one input-sized copy
        dims = tuple(range(len(kept), x.dim()))
        groups = three_groups(x, dims)
    return x.as_strided(
        (groups.outer, groups.reduced, groups.inner),
        (groups.outer_stride, groups.reduced_stride, groups.inner_stride),
        x.storage_offset(),
    )


def reduce_three_reference(x: torch.Tensor, out: torch.Tensor, kind: str, correction: float) -> None:
    """The reference kernel: reduces the (outer, reduced, inner) view ``x``
    over dim 1 into ``out`` (outer, inner), computed in float64 (a float64
    copy of the input)."""
    wide = x.to(torch.float64)
    if kind == "sum":
        result = wide.sum(1)
    elif kind == "mean":
        result = wide.mean(1)
    elif kind == "norm":
        result = torch.linalg.vector_norm(wide, 2, dim=1)
    elif kind in ("var", "std"):
        n = x.shape[1]
        if n == 0:
            result = torch.full((x.shape[0], x.shape[2]), float("nan"), dtype=torch.float64, device=x.device)
        else:
            centered = wide - wide.mean(1, keepdim=True)
            m2 = centered.square().sum(1)
            result = m2 / max(0, n - correction)
            if kind == "std":
                result = result.sqrt()
    else:
        raise ValueError(f"reduce: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    out.copy_(result)


def reduce_reference(x: torch.Tensor, dim=None, kind: str = "sum", correction: float = 1.0, keepdim: bool = False,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Whole-op reference (float64 inside): the test oracle."""
    dims = _dims(kind, x, dim)
    return _run(reduce_three_reference, x, dims, kind, correction, keepdim, dtype)


def _run(kernel, x, dims, kind, correction, keepdim, dtype) -> torch.Tensor:
    three = as_three(x, dims)
    out = torch.empty((three.shape[0], three.shape[2]), dtype=x.dtype if dtype is None else dtype, device=x.device)
    kernel(three, out, kind, correction)
    return out.view(_output_shape(x.shape, dims, keepdim))


@torch.library.custom_op("effilayers::reduce", mutates_args=())
def _reduce_op(x: torch.Tensor, dims: list[int], kind: str, correction: float, keepdim: bool,
               dtype: Optional[torch.dtype]) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"reduce: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return _run(registry.kernel("reduce", x.device), x, dims, kind, correction, keepdim, dtype)


@_reduce_op.register_fake
def _(x, dims, kind, correction, keepdim, dtype):
    return x.new_empty(_output_shape(x.shape, dims, keepdim), dtype=x.dtype if dtype is None else dtype)


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


def _backward(ctx, grad):
    acc = accumulation_dtype(ctx.input_dtype)
    keep_shape = _output_shape(ctx.input_shape, ctx.dims, True)
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
        mean = _reduce_op(x, list(ctx.dims), "mean", 0.0, True, acc)
        dof = n - ctx.correction
        scale = 2.0 / dof if dof > 0 else float("nan")
        if ctx.kind == "std":
            std = saved[1].to(acc).reshape(keep_shape)
            # d std = d var / (2 std); 0 where std is 0, as torch does.
            g = torch.where(std == 0, torch.zeros((), dtype=acc, device=x.device), g / (2 * std))
        grad_x = x.to(acc) - mean  # a new tensor even for float32 x
        grad_x.mul_(g * scale)
    return grad_x.to(ctx.input_dtype), None, None, None, None, None


_reduce_op.register_autograd(_backward, setup_context=_setup_context)


def _triton_kernel(x, out, kind, correction):
    from ..kernels.reductions import reduce_triton

    reduce_triton(x, out, kind, correction)


# Every backend's kernel has the signature of reduce_three_reference:
# (x viewed as (outer, reduced, inner), out (outer, inner), kind, correction).
registry.register(
    registry.OpKernels(name="reduce", reference=reduce_three_reference, cpp="reduce_", triton=_triton_kernel)
)


# CUDA autocast runs torch.sum, torch.linalg.vector_norm and torch.norm in
# float32 when they get no dtype (its "fp32_set_opt_dtype" policy); it leaves
# mean/var/std alone, and CPU autocast leaves all five alone.
_AUTOCAST_FLOAT32_DEVICES = {"sum": ("cuda",), "norm": ("cuda",)}


def _autocast_dtype(op: str, x: torch.Tensor, dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None and autocast_to_float32(x, _AUTOCAST_FLOAT32_DEVICES.get(op, ())):
        return torch.float32
    return dtype


def _integer_input(op: str, x, dtype):
    """torch.sum / torch.mean accept integer and bool ``x`` with a floating
    ``dtype`` (converting x first): so do these, through a float32 copy
    (float64 for ``dtype=torch.float64``), exact for integers up to 2**24."""
    if op in ("sum", "mean") and isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
            and dtype in _FLOAT_DTYPES:
        return x.to(accumulation_dtype(dtype))
    return x


def _reduce(op: str, x, dim, kind: str, correction: float, keepdim: bool, dtype) -> torch.Tensor:
    x = _integer_input(op, x, dtype)
    _check(op, x, dtype, keepdim, correction)
    refuse_forward_ad(op, x)
    dtype = _autocast_dtype(op, x, dtype)
    return _reduce_op(x, list(_dims(op, x, dim)), kind, float(correction), keepdim, dtype)


def sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum over ``dim`` with float32 accumulation; see the module docstring."""
    return _reduce("sum", x, dim, "sum", 0.0, keepdim, dtype)


def mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Mean over ``dim``, divided before the one rounding to the output dtype."""
    return _reduce("mean", x, dim, "mean", 0, keepdim, dtype)


def var(x: torch.Tensor, dim=None, *, correction: float = 1, keepdim: bool = False,
        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Variance over ``dim``: M2 / max(0, n - correction), two-pass in float32.
    ``correction`` is any int or float, as in ``torch.var``."""
    return _reduce("var", x, dim, "var", correction, keepdim, dtype)


def std(x: torch.Tensor, dim=None, *, correction: float = 1, keepdim: bool = False,
        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Standard deviation over ``dim`` (the square root of :func:`var`)."""
    return _reduce("std", x, dim, "std", correction, keepdim, dtype)


def norm(x: torch.Tensor, dim=None, keepdim: bool = False, *, ord=2, dtype: Optional[torch.dtype] = None
         ) -> torch.Tensor:
    """Vector norm over ``dim`` (``torch.linalg.vector_norm(x, ord, dim)``).

    The second positional argument is ``dim``, not an order as in
    ``torch.norm(x, p, dim)``: ``norm(x, 1)`` is the 2-norm over dimension 1;
    ``ord`` is keyword-only.

    ``ord=2`` (default): this op, scaled by powers of two so the squares of
    bf16 values do not overflow. ``ord=1``: :func:`sum` of ``x.abs()``
    (overflow-free like the sum; costs an input-sized ``abs`` temporary,
    which autograd keeps). ``ord=inf``: the largest magnitude, which cannot
    overflow: ``torch.linalg.vector_norm`` itself.
    """
    if isinstance(ord, bool) or ord not in (1, 2, math.inf):
        raise ValueError(f"norm: ord must be 1, 2 or math.inf, got {ord!r}")
    if ord == 2:
        return _reduce("norm", x, dim, "norm", 0, keepdim, dtype)
    _check("norm", x, dtype, keepdim)
    dtype = _autocast_dtype("norm", x, dtype)
    dims = _dims("norm", x, dim)
    if ord == 1:
        return _reduce("norm", x.abs(), dims, "sum", 0, keepdim, dtype)
    # The largest magnitude is one of x's values: exact in x's dtype, then
    # rounded once to ``dtype`` (torch's own dtype= refuses a narrower one).
    result = torch.linalg.vector_norm(x, math.inf, dims, keepdim)
    return result if dtype is None else result.to(dtype)
