"""timm's ResNet family as :func:`effilayers.convert` sees it.

timm is never imported: its modules are recognised by their class's module
path and children, exactly as timm 1.0 builds them. A recognised block keeps
its timm class for the pairs inside it (the norm becomes the fused module,
the ``act*`` slot a :class:`FusedActivation`, as in a Sequential); fusing the
residual tail (``act(bn(x) + shortcut)`` in one call) needs another forward,
so the block's class becomes a subclass of its own timm class
(:func:`fused_class`) whose forward passes the shortcut to the last norm.
Children, state dict and ``isinstance`` checks against timm's class are
unchanged, and :func:`plain_class` gives the class back to ``revert``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

_TIMM_RESNET = "timm.models.resnet"
# (norm, activation, the module that runs between them in timm's forward)
_INNER_PAIRS = {
    "basic": (("bn1", "act1", "drop_block"),),
    "bottleneck": (("bn1", "act1", None), ("bn2", "act2", "drop_block")),
}
_TAILS = {"basic": ("conv2", "bn2", "act2"), "bottleneck": ("conv3", "bn3", "act3")}
# Always present; the optional ones (None when absent) are plain attributes then.
_BLOCK_CHILDREN = {
    "basic": {"conv1", "bn1", "drop_block", "act1", "aa", "conv2", "bn2", "act2"},
    "bottleneck": {"conv1", "bn1", "act1", "conv2", "bn2", "drop_block", "act2", "aa", "conv3", "bn3", "act3"},
}
_OPTIONAL_CHILDREN = {"se", "downsample", "drop_path"}
_STEM_CHILDREN = {"conv1", "bn1", "act1", "maxpool", "layer1", "layer2", "layer3", "layer4"}
_DENSE_LAYER = ("timm.models.densenet", "DenseLayer")
_CONV_NORM_ACT = ("timm.layers.conv_bn_act", "ConvNormAct")


def _timm_class(module: nn.Module, module_path: str, name: str) -> bool:
    kind = type(module)
    return kind.__module__ == module_path and kind.__name__ == name


def block_kind(module: nn.Module) -> Optional[str]:
    """"basic" / "bottleneck" for a block of timm's ResNet family (resnet*,
    resnext*, seresnet*, the "d" variants), in its timm class or made fused
    by :func:`fused_class`; else None."""
    kind = plain_class(module) or type(module)
    for name, label in (("BasicBlock", "basic"), ("Bottleneck", "bottleneck")):
        if kind.__module__ == _TIMM_RESNET and kind.__name__ == name and (
                _BLOCK_CHILDREN[label] <= set(module._modules) <= _BLOCK_CHILDREN[label] | _OPTIONAL_CHILDREN):
            return label
    return None


def is_resnet(module: nn.Module) -> bool:
    """timm's ResNet, whose forward runs conv1, bn1, act1, maxpool, layer1-4."""
    return _timm_class(module, _TIMM_RESNET, "ResNet") and _STEM_CHILDREN <= set(module._modules)


def inner_pairs(kind: str):
    return _INNER_PAIRS[kind]


def tail(kind: str):
    return _TAILS[kind]


def previous_of_norm_act(parent: nn.Module, name: str) -> Optional[nn.Module]:
    """The module whose output a timm BatchNormAct2d at ``parent.<name>`` reads
    in timm's own forwards (DenseLayer's norm2 after conv1, ConvNormAct's bn
    after conv), or None when that is not known."""
    if _timm_class(parent, *_DENSE_LAYER) and name == "norm2":
        return parent._modules.get("conv1")
    if _timm_class(parent, *_CONV_NORM_ACT) and name == "bn":
        return parent._modules.get("conv")
    return None


def _basic_forward(self, x: torch.Tensor) -> torch.Tensor:
    # timm's BasicBlock.forward with se and drop_path absent (checked when
    # fused), the sum and act2 inside bn2.
    shortcut = x if self.downsample is None else self.downsample(x)
    x = self.aa(self.act1(self.drop_block(self.bn1(self.conv1(x)))))
    return self.act2(self.bn2(self.conv2(x), shortcut))


def _bottleneck_forward(self, x: torch.Tensor) -> torch.Tensor:
    shortcut = x if self.downsample is None else self.downsample(x)
    x = self.act1(self.bn1(self.conv1(x)))
    x = self.aa(self.act2(self.drop_block(self.bn2(self.conv2(x)))))
    return self.act3(self.bn3(self.conv3(x), shortcut))


_FUSED_CLASSES: dict[type, type] = {}
_PLAIN_ATTR = "_effilayers_timm_class"


def _new_fused(plain: type) -> nn.Module:
    return object.__new__(fused_class(plain))


def _reduce(self, protocol):
    # The fused class is made at run time: pickle (and deepcopy) rebuild it
    # from timm's class, which pickles by name.
    return _new_fused, (plain_class(self),), self.__dict__


def fused_class(plain: type) -> type:
    """The subclass of timm's block class ``plain`` whose forward fuses the
    residual tail; one per class."""
    if plain not in _FUSED_CLASSES:
        forward = _basic_forward if plain.__name__ == "BasicBlock" else _bottleneck_forward
        _FUSED_CLASSES[plain] = type(f"Fused{plain.__name__}", (plain,), {
            "forward": forward, _PLAIN_ATTR: plain, "__reduce_ex__": _reduce, "__module__": __name__})
    return _FUSED_CLASSES[plain]


def plain_class(module: nn.Module) -> Optional[type]:
    """timm's class of a block made fused by :func:`fused_class`, else None."""
    return type(module).__dict__.get(_PLAIN_ATTR)
