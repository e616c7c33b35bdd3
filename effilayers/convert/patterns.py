"""Recognising the norm + activation pairs :func:`effilayers.convert` fuses
(in nn.Sequential chains, torchvision-style ResNet blocks and stems, timm's
BatchNormAct2d), whether a module may be replaced, and moving a norm's
tensors into a fused module and back out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from ..ops.abn import DEFAULT_WEIGHT_EPS, INVERTIBLE_ACTIVATIONS
from ..ops.abn.module import ABN, PLAIN_TYPE_ATTR, fused_norm

_STATE_PARAMETERS = ("weight", "bias")
_STATE_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_PLAIN_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

_BASIC_BLOCK_CHILDREN = ("conv1", "bn1", "relu", "conv2", "bn2")
_BOTTLENECK_CHILDREN = ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu")
_RESNET_CHILDREN = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")


# ---- modules left behind by convert / revert ------------------------------------------------


class BatchNormAct(_BatchNorm):
    """Plain BatchNorm (inputs of rank 2 to 5) followed by the module ``act``,
    built only from standard ops. What :func:`revert` leaves where a fused
    module had no separate activation slot to give back; its state dict is a
    BatchNorm's."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, act: Optional[nn.Module] = None, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.act = act if act is not None else nn.Identity()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"BatchNormAct: expected 2D to 5D input (N, C, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(input))


# ---- activations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Activation:
    name: str  # as ABN spells it
    param: float

    def describe(self) -> str:
        return f"{self.name}({self.param:g})" if self.name in ("leaky_relu", "elu") else self.name

    @property
    def invertible(self) -> bool:
        return self.name in INVERTIBLE_ACTIVATIONS


# Activation modules without a parameter, by exact type, and the ABN name of
# each; the inverse map rebuilds them for revert (inplace where they take it).
_PLAIN_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Hardswish: "hardswish", nn.Mish: "mish",
                      nn.ReLU6: "relu6", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh"}
_MODULE_OF = {name: kind for kind, name in _PLAIN_ACTIVATIONS.items()}
# timm's own activation classes (timm.layers.activations) that compute one of
# ABN's activations, recognised by class path, timm not imported.
_TIMM_ACTIVATIONS = {"GELU": "gelu", "GELUTanh": "gelu_tanh", "Sigmoid": "sigmoid", "Tanh": "tanh"}
# What convert fuses, for the reasons it gives when it does not.
SUPPORTED_ACTIVATIONS = ("ReLU, LeakyReLU with slope >= 0, ELU with alpha > 0, SiLU, GELU, Hardswish, Mish, "
                         "ReLU6, Sigmoid, Tanh")


def activation_of(module: nn.Module) -> Optional[Activation]:
    """The ABN activation equal to ``module``, or None. Exact types only: a
    subclass may compute something else."""
    kind = type(module)
    if kind in _PLAIN_ACTIVATIONS:
        return Activation(_PLAIN_ACTIVATIONS[kind], 0.0)
    if kind is nn.GELU and module.approximate in ("none", "tanh"):
        return Activation("gelu" if module.approximate == "none" else "gelu_tanh", 0.0)
    if kind is nn.LeakyReLU and module.negative_slope >= 0:
        return Activation("leaky_relu", float(module.negative_slope))
    if kind is nn.ELU and module.alpha > 0:
        return Activation("elu", float(module.alpha))
    if kind.__module__ == "timm.layers.activations" and kind.__name__ in _TIMM_ACTIVATIONS:
        return Activation(_TIMM_ACTIVATIONS[kind.__name__], 0.0)
    return None


def activation_module(activation: Activation, inplace: bool) -> nn.Module:
    name = activation.name
    if name == "leaky_relu":
        return nn.LeakyReLU(activation.param, inplace=inplace)
    if name == "elu":
        return nn.ELU(activation.param, inplace=inplace)
    if name in ("gelu", "gelu_tanh"):
        return nn.GELU(approximate="none" if name == "gelu" else "tanh")
    if name in ("sigmoid", "tanh"):
        return _MODULE_OF[name]()
    if name in _MODULE_OF:
        return _MODULE_OF[name](inplace=inplace)
    return nn.Identity()


def in_place_activation(activation: Activation, slope: float) -> Activation:
    """The invertible activation an in-place fused module uses instead of
    relu; the others are returned unchanged (the smooth ones are not
    invertible: they stay exact, in an ABN)."""
    if activation.name == "relu" or (activation.name == "leaky_relu" and activation.param == 0):
        return Activation("leaky_relu", slope)
    return activation


def activation_of_fused(module: ABN) -> Activation:
    return Activation(module.activation, module.activation_param)


# ---- moving state between norms -------------------------------------------------------------


def _move_state(source: nn.Module, target: nn.Module) -> None:
    # The same tensor objects: nothing is copied, parameters keep their
    # identity (optimizers, tied weights) and the state dict is unchanged.
    # Assigning into the existing dict slots keeps the registration order.
    for name in _STATE_PARAMETERS:
        target._parameters[name] = source._parameters.get(name)
    for name in _STATE_BUFFERS:
        target._buffers[name] = source._buffers.get(name)
    target.train(source.training)


def fuse_norm(norm: _BatchNorm, activation: Activation, in_place: bool) -> ABN:
    sync = isinstance(norm, nn.SyncBatchNorm)
    plain_type = next((kind for kind in _PLAIN_NORMS if isinstance(norm, kind)), BatchNormAct)
    # Built on the meta device, then handed the norm's own tensors: no
    # allocation, and device and dtype are the originals'.
    fused = fused_norm(norm.num_features, activation=activation.name, activation_param=activation.param,
                       in_place=in_place, eps=norm.eps, momentum=norm.momentum, affine=norm.affine,
                       track_running_stats=norm.track_running_stats, plain_type=plain_type,
                       process_group=getattr(norm, "process_group", None), sync=sync, device="meta")
    _move_state(norm, fused)
    return fused


def unfuse_norm(fused: ABN, plain_type: Optional[type] = None, act: Optional[nn.Module] = None) -> nn.Module:
    """A plain norm (of ``plain_type``, or the one recorded at conversion)
    holding ``fused``'s tensors; a BatchNormAct around ``act`` when ``act`` is given."""
    arguments = (fused.num_features, fused.eps, fused.momentum, fused.affine, fused.track_running_stats)
    recorded = getattr(fused, PLAIN_TYPE_ATTR, None)
    if act is not None and recorded is not None and recorded.__module__.startswith("timm."):
        # timm's BatchNormAct2d again, holding the activation the fused module computes
        plain = recorded(*arguments, device="meta")
        plain._modules["drop"], plain._modules["act"] = nn.Identity(), act
    elif act is not None:
        plain = BatchNormAct(*arguments, act=act, device="meta")
    else:
        kind = plain_type or getattr(fused, PLAIN_TYPE_ATTR, None) or BatchNormAct
        if kind is nn.SyncBatchNorm:
            plain = nn.SyncBatchNorm(*arguments, process_group=getattr(fused, "process_group", None), device="meta")
        else:
            plain = kind(*arguments, device="meta")
    _move_state(fused, plain)
    return plain


def clamped_channels(norm: nn.Module) -> int:
    weight = getattr(norm, "weight", None)
    if weight is None or weight.is_meta:
        return 0
    return int((weight.detach().abs() < DEFAULT_WEIGHT_EPS).sum())


def clamp_note(fused: nn.Module) -> str:
    """The report's note on the channels whose scale an InPlaceABN clamps, or ""."""
    clamped = clamped_channels(fused)
    if not clamped:
        return ""
    return f"{clamped} channel(s) with |weight| < {DEFAULT_WEIGHT_EPS:g} use ±{DEFAULT_WEIGHT_EPS:g}"


# ---- what may be replaced -------------------------------------------------------------------


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def swap_pool(pool: nn.MaxPool2d, kind: type) -> nn.MaxPool2d:
    swapped = kind(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices, pool.ceil_mode)
    swapped.train(pool.training)
    return swapped


def has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_DICTS)


def is_batchnorm(module: Optional[nn.Module]) -> bool:
    """A BatchNorm computing exactly BatchNorm: a subclass that overrides
    forward (timm's BatchNormAct2d, ...) is something else."""
    if not isinstance(module, _BatchNorm) or isinstance(module, BatchNormAct):
        return False
    return type(module).forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def is_timm_norm_act(module: Optional[nn.Module]) -> bool:
    return (isinstance(module, nn.BatchNorm2d) and type(module).__name__ == "BatchNormAct2d"
            and set(module._modules) == {"drop", "act"} and type(module._modules["drop"]) is nn.Identity)


def is_plain_sequential(module: nn.Module) -> bool:
    # A subclass with its own forward may route data any way it likes.
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def is_resnet_block(module: nn.Module) -> Optional[str]:
    """"basic" / "bottleneck" for a torchvision-style block, else None."""
    name = type(module).__name__
    children = set(module._modules) - {"downsample"}
    if name == "BasicBlock" and children == set(_BASIC_BLOCK_CHILDREN):
        kind = "basic"
    elif name == "Bottleneck" and children == set(_BOTTLENECK_CHILDREN):
        kind = "bottleneck"
    else:
        return None
    if any(not isinstance(module._modules[child], nn.Conv2d) for child in children if child.startswith("conv")):
        return None
    if module._modules.get("downsample") is None and getattr(module, "downsample", None) is not None:
        return None  # a shortcut that is not a module: unknown forward
    return kind


def is_resnet(module: nn.Module) -> bool:
    return type(module).__name__ == "ResNet" and set(_RESNET_CHILDREN) <= set(module._modules)


def fresh_output(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` returns a new tensor that only its caller sees, so
    the next module may overwrite it."""
    if module is None or has_hooks(module):  # a forward hook may keep the output
        return False
    if is_plain_sequential(module):
        children = [child for child in module._modules.values() if child is not None]
        return bool(children) and fresh_output(children[-1])
    return isinstance(module, (_ConvNd, nn.Linear))


class Slots:
    """Every (parent, name) slot holding each module: a module in two slots
    is shared, and replacing it in one would untie it from the other."""

    def __init__(self, root: nn.Module) -> None:
        self.paths: dict[int, list[str]] = {}
        self._walk(root, "", set())

    def _walk(self, module: nn.Module, prefix: str, seen: set[int]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module._modules.items():
            if child is None:
                continue
            path = join_path(prefix, name)
            self.paths.setdefault(id(child), []).append(path)
            self._walk(child, path, seen)

    def shared(self, module: nn.Module) -> Optional[str]:
        paths = self.paths.get(id(module), [])
        if len(paths) > 1:
            return f"the same module is registered at {len(paths)} places ({', '.join(paths)})"
        return None


def replace_blocker(module: nn.Module, slots: Slots, what: str) -> Optional[str]:
    """Why ``module`` must not be replaced, or None."""
    shared = slots.shared(module)
    if shared:
        return f"{what}: {shared}; replacing it in one place would untie it from the others"
    if isinstance(module, LazyModuleMixin):  # before hooks: it has its own
        return f"{what} is an uninitialised lazy module (run one forward first)"
    if has_hooks(module):
        return f"{what} has hooks, which a replacement would lose"
    if parametrize.is_parametrized(module):
        return f"{what} is parametrized"
    return None


def activation_blocker(module: nn.Module) -> Optional[str]:
    # A stateless activation may be shared freely (its other uses keep it);
    # only hooks on it would be lost.
    if has_hooks(module):
        return "the activation has hooks, which fusing it would bypass"
    return None


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def in_module_order(model: nn.Module, entries: list, path_of) -> list:
    """``entries`` sorted as ``model.named_modules()`` lists their paths (the
    walk fuses a Sequential's pairs before it visits nested children)."""
    order = {name: index for index, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(entries, key=lambda entry: order.get(path_of(entry), len(order)))
