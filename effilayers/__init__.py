"""effilayers: memory-efficient PyTorch layers on custom kernels.

Start with ``python -m effilayers.info`` to see which kernels run here.
"""

# `checkpoint` is the module (effilayers.checkpoint.checkpoint mirrors torch.utils.checkpoint.checkpoint).
from . import checkpoint, functional, memory, models, nn, ops, optim
from ._core import registry as backends
from ._core.registry import use_backend
from ._info import info

# The functions `convert` and `fit` shadow the submodules of the same names as
# attributes; `from effilayers.convert import ConversionReport` still reaches the module.
from .convert import convert, revert
from .fit import FitReport, fit
from .max_batch import MaxBatch, find_max_batch
from .ops import batch_stats, combine_batch_stats

__version__ = "0.1.0.dev0"

__all__ = ["backends", "functional", "memory", "nn", "ops", "optim", "models", "info", "use_backend", "convert",
           "revert", "batch_stats", "combine_batch_stats", "__version__", "checkpoint",
           "find_max_batch", "MaxBatch", "fit", "FitReport"]
