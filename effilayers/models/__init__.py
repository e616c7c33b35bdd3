"""Model definitions built on effilayers modules, state-dict compatible with torchvision.

``resnet18`` ... ``wide_resnet50_2`` take ``norm_act="plain" | "abn" | "inplace"``;
see :mod:`effilayers.models.resnet`.
"""

from . import resnet
from .resnet import (
    ResNet,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
    resnext50_32x4d,
    wide_resnet50_2,
)

__all__ = [
    "resnet",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
]
