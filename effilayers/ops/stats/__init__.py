"""Per-channel batch statistics (see :mod:`.op` for dtypes, layouts and edge cases)."""

from .contract import values_per_channel

# The private custom op stays reachable here for tests/test_compile.py.
from .op import _batch_stats_op as _batch_stats_op, batch_stats, combine_batch_stats
from .reference import batch_stats_reference

__all__ = ["batch_stats", "batch_stats_reference", "combine_batch_stats", "values_per_channel"]
