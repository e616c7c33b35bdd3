"""Activated BatchNorm, in place or not (see :mod:`.op`)."""

from .._activation import ACTIVATIONS, INVERTIBLE_ACTIVATIONS
from .contract import DEFAULT_WEIGHT_EPS, check_activation
from .op import abn, activated_batch_norm, inplace_abn
from .reference import effective_weight

__all__ = ["ACTIVATIONS", "INVERTIBLE_ACTIVATIONS", "DEFAULT_WEIGHT_EPS", "abn", "inplace_abn", "activated_batch_norm",
           "check_activation", "effective_weight"]
