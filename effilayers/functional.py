"""Functional forms of effilayers ops (``import effilayers.functional as EF``)."""

from .ops.abn import abn, inplace_abn
from .ops.cross_entropy import cross_entropy
from .ops.linear_cross_entropy import linear_cross_entropy

# These shadow the builtins sum/... inside this module (which uses none of them).
from .ops.reductions import mean, norm, std, sum, var
from .ops.softmax import log_softmax, scaled_masked_softmax, softmax
from .ops.stats import batch_stats, combine_batch_stats

__all__ = ["abn", "inplace_abn", "batch_stats", "combine_batch_stats", "softmax", "log_softmax",
           "scaled_masked_softmax", "cross_entropy", "linear_cross_entropy", "sum", "mean", "var", "std", "norm"]
