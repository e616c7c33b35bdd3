"""What the reductions accept (checked once, by the public functions and
the custom op's ``kind``) and the (outer, reduced, inner) view every kernel
is handed."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..._core.dtypes import accumulation_dtype
from ..._core.layout import is_dense, normalize_dims, three_view

KINDS = ("sum", "mean", "var", "std", "norm")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"reduce: kind must be one of {', '.join(KINDS)}, got {kind!r}")


MATRIX_ORDERS = ("fro", "nuc")


def norm_order(ord, p):
    """The order of :func:`norm`: ``ord`` (torch.linalg's name) or ``p``
    (torch.norm's), 2 when neither is given. Any real number
    ``torch.linalg.vector_norm`` takes (inf, -inf, 0, fractional,
    negative), or torch.norm's ``"fro"`` and ``"nuc"``."""
    if ord is not None and p is not None:
        raise TypeError(f"norm: pass ord or p, not both (ord={ord!r}, p={p!r})")
    order = p if ord is None else ord
    if order is None:
        return 2
    if isinstance(order, str) and order in MATRIX_ORDERS:
        return order
    if isinstance(order, bool) or not isinstance(order, (int, float)) or math.isnan(order):
        raise ValueError(f"norm: ord must be a real number (inf, -inf, 0, 1, 2, fractional or negative), "
                         f"'fro' or 'nuc', got {order!r}")
    return order


def norm_dims(x: torch.Tensor, dim, order) -> tuple[int, ...]:
    """The reduced dims of ``norm``, with torch.norm's limits on the matrix
    orders: "fro" over one or two dims (or all, for dim=None), "nuc" over
    exactly two (dim=None: a 2-D input)."""
    dims = reduced_dims("norm", x, dim)
    if order == "nuc" and len(dims) != 2:
        raise ValueError(f"norm: ord='nuc' is a matrix norm: dim must name two dims (or be None for a 2-D input), "
                         f"got dim={dim!r} for a {x.dim()}-D input")
    if order == "fro" and dim is not None and len(dims) > 2:
        raise ValueError(f"norm: ord='fro' takes one or two dims (or dim=None for all), got dim={dim!r}")
    return dims


def variance_arguments(op: str, dim, unbiased, correction):
    """``(dim, correction)`` from torch.var's two signatures:
    ``var(x, dim=None, *, correction=None)`` (None: 1) and
    ``var(x, dim, unbiased, keepdim)`` or ``var(x, unbiased)`` (True: 1,
    False: 0). Naming both ``unbiased`` and ``correction`` is refused, as torch does."""
    if isinstance(dim, bool):
        # torch.var(x, False): the bool is unbiased, not a dim.
        if unbiased is not None:
            raise TypeError(f"{op}: got a bool dim ({dim}) and unbiased={unbiased!r}; dim must be an int, a "
                            "sequence of ints or None")
        dim, unbiased = None, dim
    if unbiased is None:
        return dim, 1 if correction is None else correction
    if not isinstance(unbiased, bool):
        raise TypeError(f"{op}: unbiased must be a bool, got {type(unbiased).__name__}")
    if correction is not None:
        raise TypeError(f"{op}: pass unbiased or correction, not both (unbiased={unbiased}, "
                        f"correction={correction!r}); unbiased=True is correction=1, False is correction=0")
    return dim, 1 if unbiased else 0


def integer_input(op: str, x, dtype):
    """torch.sum / torch.mean accept integer and bool ``x`` with a floating
    ``dtype`` (converting x first): so do these, through a float32 copy
    (float64 for ``dtype=torch.float64``), exact for integers up to 2**24."""
    if op in ("sum", "mean") and isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
            and dtype in FLOAT_DTYPES:
        return x.to(accumulation_dtype(dtype))
    return x


def check(op: str, x, dtype, keepdim, correction=0.0) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        hint = ("pass a floating dtype=, e.g. dtype=torch.float32, for integer or bool input" if op in ("sum", "mean")
                else "convert integer tensors first, e.g. x.float(), as torch requires")
        raise TypeError(f"{op}: x must be float16, bfloat16, float32 or float64, got {x.dtype} ({hint})")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be None, float16, bfloat16, float32 or float64, got {dtype}")
    if not isinstance(keepdim, bool):
        raise TypeError(f"{op}: keepdim must be a bool, got {type(keepdim).__name__}")
    if isinstance(correction, bool) or not isinstance(correction, (int, float)):
        raise TypeError(f"{op}: correction must be an int or a float (as in torch.var), got {correction!r}")


def reduced_dims(op: str, x: torch.Tensor, dim) -> tuple[int, ...]:
    """Sorted reduced dims, checked; () and None mean all, as in torch."""
    if dim is None:
        return tuple(range(x.dim()))
    dims = normalize_dims(dim, x.dim(), "dim", op)
    if not dims or x.dim() == 0:
        return tuple(range(x.dim()))
    return dims


def output_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(shape)]
    return [s for d, s in enumerate(shape) if d not in dims]


def as_three(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``x`` as an (outer, reduced, inner) strided tensor whose reduction over
    dim 1, laid out (outer, inner), is the reduction over ``dims`` in the
    order of the kept dims. A view where possible, else one copy."""
    if len(dims) == x.dim():
        if x.is_contiguous() or (x.numel() > 0 and is_dense(x)):
            # Order does not matter for a full reduction: memory order.
            return x.as_strided((1, x.numel(), 1), (0, 1, 0), x.storage_offset())
        return x.contiguous().view(1, x.numel(), 1)
    view = three_view(x, dims)
    if view is None:
        kept = [d for d in range(x.dim()) if d not in dims]
        x = x.permute(*kept, *dims).contiguous()  # the one input-sized copy
        view = three_view(x, tuple(range(len(kept), x.dim())))
    return view


def run_three(kernel, x: torch.Tensor, dims: Sequence[int], kind: str, correction: float, keepdim: bool,
              dtype) -> torch.Tensor:
    """The whole reduction through ``kernel`` (any backend's, with the
    signature of ``reduce_three_reference``): view, allocate, reduce, reshape."""
    three = as_three(x, dims)
    out = torch.empty((three.shape[0], three.shape[2]), dtype=x.dtype if dtype is None else dtype, device=x.device)
    kernel(three, out, kind, correction)
    return out.view(output_shape(x.shape, dims, keepdim))
