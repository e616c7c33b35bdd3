"""``nn.Module`` drop-ins."""

from .fused import ABN, FusedActivation, InPlaceABN, InPlaceABNSync, fused_norm
from .pooling import MaxPool2d
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .softmax import LogSoftmax, Softmax

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "Softmax", "LogSoftmax", "CrossEntropyLoss", "LinearCrossEntropyLoss"]
