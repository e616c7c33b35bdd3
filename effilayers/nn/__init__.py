"""``nn.Module`` drop-ins."""

from .abn import ABN, InPlaceABN, InPlaceABNSync
from .pooling import MaxPool2d
from .softmax import LogSoftmax, Softmax

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "Softmax", "LogSoftmax"]
