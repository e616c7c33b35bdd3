"""timm's DenseNet as :func:`effilayers.convert` and :func:`effilayers.fit` see it.

timm's DenseNet (``timm.models.densenet``) is torchvision's with timm's
``BatchNormAct2d`` (BatchNorm, then its own ``act``: a ReLU) for each
BatchNorm2d + ReLU pair. Autograd keeps, for every dense layer, the
concatenation of its input maps and the norm's output: two copies of a
tensor that grows with the layer's depth. The memory-efficient path of
:mod:`effilayers.models.densenet` keeps only the maps (once, in one buffer
per block) and per-channel statistics, and recomputes the concatenation,
norm and ReLU in backward. This module gives timm's model that same path,
through class swaps, as :mod:`.timm_blocks` gives timm's ResNet blocks
their fused tail:

* a ``DenseLayer`` whose ``norm1`` is timm's ``BatchNormAct2d`` with a ReLU
  and whose ``conv1`` the recomputing Function implements (and no hooks on
  them) becomes a run-time subclass of timm's class whose forward is
  :func:`effilayers.models.densenet.dense_layer_forward`; ``norm2`` is
  recomputed too where it is such a norm (else its step calls the modules);
* a ``DenseTransition`` (norm, conv, pool) likewise, with
  :func:`~effilayers.models.densenet.transition_forward`;
* a ``DenseBlock`` all of whose layers were swapped, with
  :func:`~effilayers.models.densenet.dense_block_forward`: one buffer for
  the block's maps, and each map's batch statistics computed once.

The norms stay timm's modules, where they were: children, parameters,
buffers and state dict are unchanged, ``isinstance`` against timm's classes
holds, and every norm is still a ``BatchNorm2d`` to ``named_modules`` walks
and timm's freeze helpers. A norm that is no longer exactly that (frozen,
hooked, swapped) makes its step call the modules again, as an effilayers
DenseNet does. The swapped layers ignore timm's ``grad_checkpointing``:
what a checkpointed bottleneck would keep, they keep already.
:func:`plain_class` gives timm's class back to ``revert``. timm is never
imported: classes are recognised by module path and children.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..models import densenet
from .patterns import has_hooks

_DENSENET = "timm.models.densenet"
_NORM_ACT = ("timm.layers.norm_act", "BatchNormAct2d")
_LAYER_CHILDREN = {"norm1", "conv1", "norm2", "conv2"}
_TRANSITION_CHILDREN = ("norm", "conv", "pool")
_PLAIN_ATTR = "_effilayers_timm_densenet_class"
# the (norm, conv) steps each kind recomputes, by child name
STEPS = {"layer": (("norm1", "conv1"), ("norm2", "conv2")), "transition": (("norm", "conv"),)}


def plain_pair(norm: nn.Module, relu: Optional[nn.Module]) -> bool:
    """Whether ``norm`` is timm's ``BatchNormAct2d`` applying exactly a ReLU
    (``relu`` None: the activation is the norm's own): the BatchNorm + ReLU
    that the recomputing Function implements."""
    kind = type(norm)
    return (relu is None and (kind.__module__, kind.__name__) == _NORM_ACT
            and type(norm._modules.get("act")) is nn.ReLU and type(norm._modules.get("drop")) is nn.Identity)


def kind_of(module: nn.Module) -> Optional[str]:
    """"layer", "block" or "transition" for a module of timm's DenseNet, in
    timm's class or swapped by :func:`swap`; else None."""
    kind = plain_class(module) or type(module)
    if kind.__module__ != _DENSENET:
        return None
    if kind.__name__ == "DenseLayer" and set(module._modules) == _LAYER_CHILDREN:
        return "layer"
    if kind.__name__ == "DenseTransition" and tuple(module._modules) == _TRANSITION_CHILDREN:
        return "transition"
    if kind.__name__ == "DenseBlock":
        return "block"
    return None


def recomputable(module: nn.Module, norm_name: str, conv_name: str) -> Optional[str]:
    """Why the step ``conv(norm(x))`` of ``module`` cannot run through the
    recomputing Function, or None when it can."""
    norm, conv = module._modules[norm_name], module._modules[conv_name]
    if not plain_pair(norm, None):
        return f"{norm_name} ({type(norm).__name__}) is not timm's BatchNormAct2d with a ReLU"
    if not densenet._plain_conv(conv):
        return (f"{conv_name} is not a convolution the recomputing Function implements (nn.Conv2d, stride and "
                "dilation 1, no groups or bias, zero padding)")
    hooked = next((name for name, child in ((norm_name, norm), (conv_name, conv), *(
        (f"{norm_name}.{name}", child) for name, child in norm._modules.items())) if has_hooks(child)), None)
    if hooked:
        return f"{hooked} has hooks, which the recomputing Function would skip"
    return None


def recomputed_norms(module: nn.Module) -> list[tuple[str, str]]:
    """(norm, conv) names of the steps of a swapped layer or transition that
    run through the recomputing Function."""
    return [(norm, conv) for norm, conv in STEPS[kind_of(module)] if recomputable(module, norm, conv) is None]


def why_not(module: nn.Module) -> Optional[str]:
    """Why ``module`` (a timm DenseNet module) keeps timm's forward, or None
    when :func:`swap` may give it the memory-efficient one."""
    kind = kind_of(module)
    if kind == "block":
        plain = next((name for name, layer in module._modules.items() if plain_class(layer) is None), None)
        return None if plain is None else f"its {plain} keeps timm's forward"
    norm, conv = STEPS[kind][0]
    return recomputable(module, norm, conv)


def _layer_forward(self, x, batch_statistics=None):
    return densenet.dense_layer_forward(self, x, batch_statistics)


_FORWARDS = {"layer": _layer_forward, "block": densenet.dense_block_forward,
             "transition": densenet.transition_forward}
# What the effilayers forwards read that timm's modules lack: no activation
# module (the norm applies its own), always memory-efficient, timm's pair test.
_ATTRIBUTES = {"layer": {"relu1": None, "relu2": None}, "transition": {"relu": None}, "block": {}}
_CLASSES: dict[type, type] = {}


def _new(plain: type) -> nn.Module:
    return object.__new__(memory_efficient_class(plain))


def _reduce(self, protocol):
    # Made at run time: pickle and deepcopy rebuild it from timm's class,
    # which pickles by name.
    return _new, (plain_class(self),), self.__dict__


def memory_efficient_class(plain: type) -> type:
    """The subclass of timm's DenseNet class ``plain`` (DenseLayer,
    DenseBlock, DenseTransition) with the effilayers forward; one per class."""
    if plain not in _CLASSES:
        kind = {"DenseLayer": "layer", "DenseBlock": "block", "DenseTransition": "transition"}[plain.__name__]
        _CLASSES[plain] = type(f"MemoryEfficient{plain.__name__}", (plain,), {
            "__doc__": f"timm's {plain.__name__} with the forward of effilayers' memory-efficient DenseNet "
                       "(effilayers.convert.timm_densenet).",
            "__module__": __name__,
            "forward": _FORWARDS[kind],
            "memory_efficient": True,
            "_plain_pair": staticmethod(plain_pair),
            "__reduce_ex__": _reduce,
            _PLAIN_ATTR: plain,
            **_ATTRIBUTES[kind],
        })
    return _CLASSES[plain]


def plain_class(module: nn.Module) -> Optional[type]:
    """timm's class of a module swapped by :func:`swap`, else None."""
    return type(module).__dict__.get(_PLAIN_ATTR)


def swap(module: nn.Module) -> None:
    module.__class__ = memory_efficient_class(plain_class(module) or type(module))


def restore(module: nn.Module) -> bool:
    """timm's class again; False when ``module`` was not swapped."""
    plain = plain_class(module)
    if plain is not None:
        module.__class__ = plain
    return plain is not None


def memory_efficient_densenet(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Swaps every timm DenseNet layer and transition of ``model`` that can
    recompute, then every block whose layers all do; returns them
    (path, module), in that order."""
    swapped = []
    candidates = [(path, module) for path, module in model.named_modules() if plain_class(module) is None]
    for wanted in ("layer", "transition", "block"):
        for path, module in candidates:
            if kind_of(module) == wanted and why_not(module) is None:
                swap(module)
                swapped.append((path, module))
    return swapped
