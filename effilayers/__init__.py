"""effilayers: memory-efficient PyTorch layers on custom kernels.

Start with ``python -m effilayers.info`` to see which kernels run here.
"""

from . import backends, memory, nn, ops
from .backends import use_backend
from ._info import info
from .ops import batch_stats, combine_batch_stats

__version__ = "0.1.0.dev0"

__all__ = ["backends", "memory", "nn", "ops", "info", "use_backend", "batch_stats", "combine_batch_stats", "__version__"]
