"""``nn.Module`` drop-ins."""

from .abn import ABN, InPlaceABN, InPlaceABNSync

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync"]
