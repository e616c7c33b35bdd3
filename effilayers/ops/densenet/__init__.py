"""The DenseNet bottleneck with recomputation (see :mod:`.op`)."""

from .contract import layout_of
from .op import _backward_op, _forward_op, bottleneck, norm_relu_conv

__all__ = ["bottleneck", "norm_relu_conv", "layout_of"]
