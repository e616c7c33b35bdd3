"""Autograd-aware functional ops, each backed by one ``effilayers::`` custom op."""

from .adam import adam_step_, adam_step_reference
# The module (not its function) under this name, so `effilayers.ops.cross_entropy`
# stays importable as a module; the function is effilayers.functional.cross_entropy.
from . import cross_entropy  # noqa: F401  (registers the op)
from .cross_entropy import cross_entropy_rows_reference
from .stats import batch_stats, batch_stats_reference, combine_batch_stats
from . import softmax  # noqa: F401  registers the softmax family; its functions are in effilayers.functional
from . import reductions  # registers effilayers::reduce (its sum/mean/... shadow builtins: not imported here)

__all__ = ["adam_step_", "adam_step_reference", "cross_entropy_rows_reference", "batch_stats", "batch_stats_reference", "combine_batch_stats"]
