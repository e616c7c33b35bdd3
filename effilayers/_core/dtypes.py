"""The accumulation dtype, decided in one place.

Every effilayers kernel reads fp16/bf16/fp32 and accumulates in fp32 (its
statistics, sums, logsumexps and optimizer math too); float64 input stays
float64, so the float64 reference tests compare like with like.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "as_dtype"]


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` already has it: a no-op
    ``.to`` still costs a call into torch per tensor, several per layer on
    the hot paths."""
    return t if t.dtype == dtype else t.to(dtype)
