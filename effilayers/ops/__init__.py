"""Autograd-aware functional ops, each backed by one ``effilayers::`` custom op."""

# The packages (not their functions) under these names, so `effilayers.ops.cross_entropy`,
# `effilayers.ops.softmax` and `effilayers.ops.reductions` stay packages; importing them
# registers their ops. Their functions are in effilayers.functional (reductions' sum/mean/...
# would shadow builtins here).
from . import cross_entropy, reductions, softmax  # noqa: F401
from .adam import adam_step_, adam_step_reference
from .cross_entropy import cross_entropy_rows_reference
from .stats import batch_stats, batch_stats_reference, combine_batch_stats

__all__ = ["adam_step_", "adam_step_reference", "cross_entropy_rows_reference", "batch_stats", "batch_stats_reference",
           "combine_batch_stats"]
