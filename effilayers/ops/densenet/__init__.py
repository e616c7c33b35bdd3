"""The DenseNet bottleneck with recomputation (see :mod:`.op`)."""

from .contract import layout_of

# The private declared ops stay reachable here for tests/test_densenet_ops.py.
from .op import _backward_op as _backward_op, _forward_op as _forward_op, bottleneck, norm_relu_conv

__all__ = ["bottleneck", "norm_relu_conv", "layout_of"]
