"""``nn.Module`` drop-ins."""

from .fused import ABN, FusedActivation, InPlaceABN, InPlaceABNSync, fused_norm
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .pooling import MaxPool2d
from .softmax import LogSoftmax, Softmax

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "Softmax", "LogSoftmax", "CrossEntropyLoss", "LinearCrossEntropyLoss"]
