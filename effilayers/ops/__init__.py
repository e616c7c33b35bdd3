"""Autograd-aware functional ops, each backed by one ``effilayers::`` custom op."""

from .abn import abn, inplace_abn
from .stats import batch_stats, batch_stats_reference, combine_batch_stats

__all__ = ["abn", "inplace_abn", "batch_stats", "batch_stats_reference", "combine_batch_stats"]
