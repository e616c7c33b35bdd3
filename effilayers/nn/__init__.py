"""``nn.Module`` drop-ins."""

# FusedActivation and fused_norm are reachable here (effilayers.models builds from them) but left out of __all__.
from .fused import ABN, FusedActivation as FusedActivation, InPlaceABN, InPlaceABNSync, fused_norm as fused_norm
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .pooling import MaxPool2d
from .softmax import LogSoftmax, Softmax

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "Softmax", "LogSoftmax", "CrossEntropyLoss",
           "LinearCrossEntropyLoss"]
