"""Autograd-aware functional ops, each backed by one ``effilayers::`` custom op."""

from .stats import batch_stats, batch_stats_reference, combine_batch_stats

__all__ = ["batch_stats", "batch_stats_reference", "combine_batch_stats"]
