"""Autograd-aware functional ops, each backed by one ``effilayers::`` custom op."""

from .adam import adam_step_, adam_step_reference
from .stats import batch_stats, batch_stats_reference, combine_batch_stats
from . import reductions  # registers effilayers::reduce (its sum/mean/... shadow builtins: not imported here)

__all__ = ["adam_step_", "adam_step_reference", "batch_stats", "batch_stats_reference", "combine_batch_stats"]
