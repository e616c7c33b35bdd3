"""What the softmax ops accept (checked once, by the public functions) and
the one output-layout rule every backend and the fake kernels follow."""

from __future__ import annotations

import math

import torch

from ..._core.dtypes import accumulation_dtype
from ..._core.layout import three_groups

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def check_tensor(x, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x dtype must be {_DTYPE_NAMES}, got {x.dtype}")


def check_dtype(dtype, op: str) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype must be {_DTYPE_NAMES} (or None for the input's dtype), got {dtype}")


def floating_input(x, dtype, op: str) -> torch.Tensor:
    """``x`` checked, or for an integer or bool ``x`` with a floating
    ``dtype`` (checked before) its conversion: ``torch.softmax(x, dim,
    dtype=torch.float32)`` accepts those inputs (it converts x to dtype first;
    without a floating dtype torch raises too). The copy is float32 (float64
    for ``dtype=torch.float64``), so integers up to 2**24 are exact before
    the one rounding to ``dtype``."""
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
        if dtype is not None:
            return x.to(accumulation_dtype(dtype))
        raise TypeError(f"{op}: x dtype must be {_DTYPE_NAMES}, got {x.dtype} (integer and bool input needs a "
                        f"floating dtype=, as in torch.{op}(x, dim, dtype=torch.float32))")
    check_tensor(x, op)
    return x


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index (a 0-dim tensor takes 0 or -1, as in torch)."""
    return dim % max(ndim, 1)


def check_dim(dim, ndim: int, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"{op}: dim {dim} is out of range for a tensor with {ndim} dimensions "
                         f"(expected -{rank} <= dim < {rank})")
    return wrap_dim(dim, ndim)


def broadcasts_to(shape, target) -> bool:
    """True when a tensor of ``shape`` expands to ``target`` without changing it."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))))


def check_masked_arguments(x, mask, scale, causal) -> float:
    """Checks :func:`scaled_masked_softmax`'s arguments; returns ``scale`` as a float."""
    op = "scaled_masked_softmax"
    check_tensor(x, op)
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


def output_like(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The output every backend allocates: ``x``'s strides when ``x`` is
    dense and read in place, else contiguous (the fake kernels use it too, so
    compiled graphs see the real strides). ``dim`` is non-negative."""
    if x.dim() > 0 and three_groups(x, (dim,)) is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.empty_like(x, dtype=dtype)
