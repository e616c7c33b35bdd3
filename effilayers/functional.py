"""Functional forms of effilayers ops (``import effilayers.functional as EF``)."""

from .ops.abn import abn, inplace_abn
from .ops.stats import batch_stats, combine_batch_stats
from .ops.cross_entropy import cross_entropy

__all__ = ["abn", "inplace_abn", "batch_stats", "combine_batch_stats", "cross_entropy"]
