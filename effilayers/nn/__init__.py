"""``nn.Module`` drop-ins."""

from .abn import ABN, InPlaceABN, InPlaceABNSync
from .pooling import MaxPool2d
from .loss import CrossEntropyLoss

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "MaxPool2d", "CrossEntropyLoss"]
