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

In a model built from timm's classes, every norm ``convert`` fuses where a
``BatchNorm2d`` (or ``SyncBatchNorm``) was also gets a run-time class
(:func:`norm_act_class`): a subclass of its effilayers class and of timm's
``BatchNormAct2d``, so timm's ``freeze_batch_norm_2d`` (and
``timm.utils.freeze``) find it. Its ``act`` and ``drop`` are read-only
properties describing what it computes in its place in the model (the fused
activation; Identity for the last norm of a fused block, whose activation
comes after the shortcut sum), which is what timm's helper copies into the
``FrozenBatchNormAct2d`` it builds. The fused block forwards fall back to
timm's own tail (norm, sum, activation) when that norm is no longer a fused
module. Forward, state dict and children are the effilayers class's.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from ..ops.abn.module import ABN, BASE_TYPE_ATTR, WITH_BASE_ATTR, FusedActivation
from .patterns import Activation, activation_module, activation_of_fused, has_hooks

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
# timm's squeeze-excitation modules: ``x * gate(pooled x)``, a new tensor,
# nothing written into x (their children see only the pooled values)
_SE_MODULES = {("timm.layers.squeeze_excite", "SEModule"), ("timm.layers.squeeze_excite", "EffectiveSEModule")}
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


def is_plain_se(module: nn.Module) -> bool:
    """One of timm's squeeze-excitation modules, without hooks: it reads its
    input and returns a new tensor."""
    kind = type(module)
    return (kind.__module__, kind.__name__) in _SE_MODULES and not has_hooks(module)


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


def slot_activation(slot: nn.Module) -> Optional[Activation]:
    """The activation a :class:`FusedActivation` stands for, when convert
    recorded it."""
    name = getattr(slot, "activation", None)
    return None if name is None else Activation(name, slot.activation_param)


def _activated_sum(norm: nn.Module, act: nn.Module, x: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
    if isinstance(norm, ABN):
        return act(norm(x, shortcut))
    # The norm was swapped after convert (timm's freeze_batch_norm_2d gives a
    # FrozenBatchNormAct2d whose act is Identity, see _act): timm's own tail,
    # with the activation the fused norm applied after the sum.
    out = norm(x) + shortcut
    if not isinstance(act, FusedActivation):
        return act(out)
    activation = slot_activation(act)
    if activation is None:
        raise RuntimeError(f"a fused timm block whose last norm is now {type(norm).__name__} cannot run: its "
                           "activation was not recorded at conversion; run effilayers.convert again on the "
                           "original model")
    return activation_module(activation, inplace=False)(out)


def _basic_forward(self, x: torch.Tensor) -> torch.Tensor:
    # timm's BasicBlock.forward with se and drop_path absent (checked when
    # fused), the sum and act2 inside bn2.
    shortcut = x if self.downsample is None else self.downsample(x)
    x = self.aa(self.act1(self.drop_block(self.bn1(self.conv1(x)))))
    return _activated_sum(self.bn2, self.act2, self.conv2(x), shortcut)


def _bottleneck_forward(self, x: torch.Tensor) -> torch.Tensor:
    shortcut = x if self.downsample is None else self.downsample(x)
    x = self.act1(self.bn1(self.conv1(x)))
    x = self.aa(self.act2(self.drop_block(self.bn2(self.conv2(x)))))
    return _activated_sum(self.bn3, self.act3, self.conv3(x), shortcut)


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


# ---- fused norms in timm's form -------------------------------------------------------------

_NORM_ACT = ("timm.layers.norm_act", "BatchNormAct2d")
# Set on a fused norm whose activation its block applies after the shortcut sum.
ACT_IN_BLOCK_ATTR = "_effilayers_act_in_block"
_TIMM_TYPE_ATTR = "_effilayers_timm_type"
_NORM_ACT_CLASSES: dict[tuple[type, type], type] = {}


def timm_norm_act(model: nn.Module) -> Optional[type]:
    """timm's ``BatchNormAct2d`` when ``model`` holds a module of one of
    timm's classes (timm is imported then; it is never imported here), else None."""
    module = sys.modules.get(_NORM_ACT[0])
    norm_act = getattr(module, _NORM_ACT[1], None)
    if not (isinstance(norm_act, type) and issubclass(norm_act, nn.BatchNorm2d)):
        return None
    if any(type(child).__module__.startswith("timm.") for child in model.modules()):
        return norm_act
    return None


def _act(self) -> nn.Module:
    if self.__dict__.get(ACT_IN_BLOCK_ATTR):
        return nn.Identity()
    # in place: timm's frozen norm hands it a tensor of its own
    return activation_module(activation_of_fused(self), inplace=True)


def _drop(self) -> nn.Module:
    return nn.Identity()


def _new_norm_act(base: type, norm_act: type) -> nn.Module:
    return object.__new__(norm_act_class(base, norm_act))


def _reduce_norm_act(self, protocol):
    # Made at run time: pickle and deepcopy rebuild it from the two classes,
    # which pickle by name (unpickling imports timm, as the model needs).
    kind = type(self)
    return _new_norm_act, (getattr(kind, BASE_TYPE_ATTR), getattr(kind, _TIMM_TYPE_ATTR)), self.__dict__


def norm_act_class(base: type, norm_act: type) -> type:
    """The subclass of the fused class ``base`` and timm's ``norm_act``
    (BatchNormAct2d); one per pair. Its methods are ``base``'s; only ``act``
    and ``drop`` are added."""
    key = (base, norm_act)
    if key not in _NORM_ACT_CLASSES:
        _NORM_ACT_CLASSES[key] = type(f"Timm{base.__name__}", (base, norm_act), {
            "__doc__": f"{base.__name__} that timm's freeze helpers see as a {norm_act.__name__} "
                       "(effilayers.convert.timm_blocks).",
            "__module__": __name__,
            "act": property(_act, doc="What a frozen copy applies after the norm: the fused activation, or "
                                      "Identity where the block applies it after the shortcut sum."),
            "drop": property(_drop, doc="Nothing runs between the norm and the activation: Identity."),
            "__jit_unused_properties__": ["qconfig", "act", "drop"],
            "__reduce_ex__": _reduce_norm_act,
            BASE_TYPE_ATTR: base,
            _TIMM_TYPE_ATTR: norm_act,
            WITH_BASE_ATTR: staticmethod(lambda other: norm_act_class(other, norm_act)),
        })
    return _NORM_ACT_CLASSES[key]


def to_norm_act(fused: ABN, norm_act: type, act_in_block: bool = False) -> None:
    """Gives ``fused`` (of an effilayers class) its timm form, in place."""
    fused.__class__ = norm_act_class(type(fused), norm_act)
    if act_in_block:
        fused.__dict__[ACT_IN_BLOCK_ATTR] = True
