"""The softmax family in PyTorch ops: the fallback and, on float64 input,
the test oracle. Same arguments as the compiled kernels; inputs were checked
by the public functions."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._core.dtypes import accumulation_dtype
from .contract import output_like, wrap_dim


def _softmax_values(z: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """Softmax of ``z`` (already in the accumulation dtype) with the
    all-``-inf``-row rule (zeros; ``-inf`` for log-softmax)."""
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
    dim = wrap_dim(dim, x.dim())
    out_dtype = x.dtype if dtype is None else dtype
    out = output_like(x, dim, out_dtype)
    z = x.to(accumulation_dtype(x.dtype, out_dtype))
    out.copy_(_softmax_values(z, dim, log) if x.dim() > 0 else _softmax_values(z.reshape(1), 0, log).reshape(()))
    return out


def softmax_backward_reference(grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool, scale: float,
                               input_dtype: torch.dtype) -> torch.Tensor:
    """``gx = scale * y * (g - sum(g * y))`` (softmax) or
    ``scale * (g - exp(y) * sum(g))`` (log-softmax), in the accumulation dtype."""
    dim = wrap_dim(dim, output.dim())
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


def masked_scores(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool,
                  acc: torch.dtype) -> torch.Tensor:
    """``x * scale`` with the mask applied, in ``acc`` (it materialises the broadcast)."""
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
    out = output_like(x, x.dim() - 1, x.dtype)
    out.copy_(_softmax_values(masked_scores(x, mask, scale, causal, accumulation_dtype(x.dtype)), -1, False))
    return out
