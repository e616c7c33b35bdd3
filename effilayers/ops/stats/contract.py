"""What ``batch_stats`` and ``combine_batch_stats`` accept: the one place
their inputs are checked."""

from __future__ import annotations

import math

import torch

__all__ = ["SUPPORTED_DTYPES", "check_input", "check_correction", "check_parts", "values_per_channel"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_correction(correction, where: str) -> None:
    if isinstance(correction, bool) or not isinstance(correction, int) or correction < 0:
        raise ValueError(f"{where}: correction must be a non-negative int, got {correction!r}")


def check_input(input, correction) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"batch_stats: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 2:
        raise ValueError(
            f"batch_stats: input must have at least 2 dimensions (N, C, ...), got shape {tuple(input.shape)}"
        )
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"batch_stats: input dtype must be float16, bfloat16, float32 or float64, got {input.dtype}"
        )
    check_correction(correction, "batch_stats")


def check_parts(means: torch.Tensor, variances: torch.Tensor, counts: torch.Tensor) -> None:
    if means.dim() != 2 or variances.shape != means.shape:
        raise ValueError(
            "combine_batch_stats: means and variances must both be (parts, channels), "
            f"got {tuple(means.shape)} and {tuple(variances.shape)}"
        )
    if counts.shape != means.shape[:1]:
        raise ValueError(
            f"combine_batch_stats: counts must be (parts,) = ({means.shape[0]},), got {tuple(counts.shape)}"
        )


def values_per_channel(input: torch.Tensor) -> int:
    """N times the product of the spatial sizes (defined even when C is 0)."""
    return math.prod(input.shape[:1] + input.shape[2:])
