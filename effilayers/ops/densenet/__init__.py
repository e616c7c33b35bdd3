"""The DenseNet bottleneck with recomputation (see :mod:`.op`)."""

from .contract import layout_of
from .op import _backward_op, _forward_op, bottleneck

__all__ = ["bottleneck", "layout_of"]
