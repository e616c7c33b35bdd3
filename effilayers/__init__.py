"""effilayers: memory-efficient PyTorch layers on custom kernels.

Start with ``python -m effilayers.info`` to see which kernels run here.
"""

from ._core import registry as backends
from . import functional, memory, nn, ops, optim
from ._core.registry import use_backend
from ._info import info
from .ops import batch_stats, combine_batch_stats
# After nn: the converter and the models are built from its modules. The
# function `convert` shadows the submodule of the same name as an attribute;
# `from effilayers.convert import ConversionReport` still reaches the module.
from .convert import convert, revert
from . import models
# A module (effilayers.checkpoint.checkpoint mirrors torch.utils.checkpoint.checkpoint).
from . import checkpoint
from .max_batch import MaxBatch, find_max_batch
# The function shadows the submodule, as convert does.
from .fit import FitReport, fit

__version__ = "0.1.0.dev0"

__all__ = ["backends", "functional", "memory", "nn", "ops", "optim", "models", "info", "use_backend", "convert", "revert",
           "batch_stats", "combine_batch_stats", "__version__", "checkpoint",
           "find_max_batch", "MaxBatch", "fit", "FitReport"]
