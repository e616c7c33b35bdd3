"""``nn.Module`` drop-ins."""

from .abn import ABN, InPlaceABN, InPlaceABNSync
from .pooling import MaxPool2d
from .loss import CrossEntropyLoss
from .softmax import LogSoftmax, Softmax

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "Softmax", "LogSoftmax", "CrossEntropyLoss"]
