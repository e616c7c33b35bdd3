"""Model definitions built on effilayers modules, state-dict compatible with torchvision.

``resnet18`` ... ``wide_resnet50_2`` take ``norm_act="plain" | "abn" | "inplace"``;
see :mod:`effilayers.models.resnet`.

``densenet121`` ... ``densenet264`` take ``memory_efficient=True | False``;
see :mod:`effilayers.models.densenet`.
"""

from . import densenet, resnet
from .densenet import DenseNet, densenet121, densenet161, densenet169, densenet201, densenet264
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

# Exactly the names imported above, sorted as strings.
__all__ = [
    "DenseNet",
    "ResNet",
    "densenet",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "densenet264",
    "resnet",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnext50_32x4d",
    "wide_resnet50_2",
]
