"""The reductions in PyTorch ops, computed in float64 (a float64 copy of the
input, 4x its bytes for fp16/bf16): the fallback and the test oracle."""

from __future__ import annotations

from typing import Optional

import torch

from .contract import reduced_dims, run_three


def reduce_three_reference(x: torch.Tensor, out: torch.Tensor, kind: str, correction: float) -> None:
    """The reference kernel: reduces the (outer, reduced, inner) view ``x``
    over dim 1 into ``out`` (outer, inner)."""
    wide = x.to(torch.float64)
    if kind == "sum":
        result = wide.sum(1)
    elif kind == "mean":
        result = wide.mean(1)
    elif kind == "norm":
        result = torch.linalg.vector_norm(wide, 2, dim=1)
    elif x.shape[1] == 0:  # var, std of nothing
        result = torch.full((x.shape[0], x.shape[2]), float("nan"), dtype=torch.float64, device=x.device)
    else:
        m2 = (wide - wide.mean(1, keepdim=True)).square().sum(1)
        result = m2 / max(0, x.shape[1] - correction)
        if kind == "std":
            result = result.sqrt()
    out.copy_(result)


def reduce_op_reference(x: torch.Tensor, dims: list[int], kind: str, correction: float, keepdim: bool,
                        dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``effilayers::reduce`` in PyTorch ops (the registry's reference kernel)."""
    return run_three(reduce_three_reference, x, dims, kind, correction, keepdim, dtype)


def reduce_reference(x: torch.Tensor, dim=None, kind: str = "sum", correction: float = 1.0, keepdim: bool = False,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Whole-op reference (float64 inside): the test oracle."""
    return reduce_op_reference(x, list(reduced_dims(kind, x, dim)), kind, correction, keepdim, dtype)
