"""Functional forms of effilayers ops (``import effilayers.functional as EF``)."""

from .ops.abn import abn, inplace_abn
from .ops.stats import batch_stats, combine_batch_stats
# These shadow the builtins sum/... inside this module (which uses none of them).
from .ops.reductions import mean, norm, std, sum, var

__all__ = ["abn", "inplace_abn", "batch_stats", "combine_batch_stats", "sum", "mean", "var", "std", "norm"]
