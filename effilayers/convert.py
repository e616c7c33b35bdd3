"""Swap BatchNorm + activation pairs in an existing model for fused ABNs, and back.

``convert(model, mode)`` rewrites a model in place and returns a
:class:`ConversionReport`; ``revert(model)`` undoes it for export and
returns a :class:`RevertReport`. Parameters and buffers are moved, not
copied: the converted model holds the very same ``Parameter`` objects (an
optimizer built before converting keeps working) and produces the same state
dict, key for key.

What is recognised (anything else is left alone and reported, with why):

* **nn.Sequential chains**: a ``BatchNorm{1,2,3}d`` directly followed by a
  ``ReLU``, ``LeakyReLU`` or ``ELU`` in a plain ``nn.Sequential`` (the data
  flow of a Sequential is its order, so the pair is certain). The norm
  becomes the fused module and the activation slot a pass-through
  :class:`FusedActivation`, so indices, and with them the state-dict keys of
  later children, do not move.
* **torchvision-style ResNet blocks**: a module named ``BasicBlock``
  (children exactly conv1, bn1, relu, conv2, bn2 [, downsample]) or
  ``Bottleneck`` (conv1, bn1, conv2, bn2, conv3, bn3, relu [, downsample]),
  whose shared ``relu`` runs after each norm, the last one after the
  shortcut sum. The block is replaced by an
  :class:`effilayers.models.resnet.BasicBlock` / ``Bottleneck`` holding the
  same convolutions and shortcut, whose last norm computes
  ``act(bn(x) + identity)`` in one call (``abn(x, residual=identity)``).
  Recognition is by class name and children, so a block with those names but
  a different forward would be misread; keep such blocks under other names.
  In place, the norm ending a projection shortcut (``downsample``) becomes
  an identity ``InPlaceABN`` over its 1x1 convolution's output: the fused
  sum keeps the shortcut anyway, so the convolution output is not kept twice.
* **the torchvision ResNet stem**: in a module named ``ResNet`` with
  children conv1, bn1, relu, maxpool, layer1-4, avgpool, fc, ``relu`` runs
  exactly once, right after ``bn1``, so ``bn1`` is fused and ``relu`` made a
  pass-through. In place, ``maxpool`` becomes :class:`effilayers.nn.MaxPool2d`
  (same function, no int64 indices kept for backward).
* **timm's BatchNormAct2d** (a ``BatchNorm2d`` subclass that applies its own
  ``drop`` (Identity) and ``act``): replaced by an ``ABN`` with its
  activation, never in place (the layer cannot know who else holds its input).

An activation module object may be shared by several slots (one ``ReLU``
reused along a Sequential, say): only the slot is replaced, so its other
uses still run it.

Modes:

``"abn"``      :class:`effilayers.nn.ABN` with the original activation:
               exactly the original function (relu stays relu, a leaky_relu
               keeps its slope, elu its alpha).
``"inplace"``  :class:`effilayers.nn.InPlaceABN` (``InPlaceABNSync`` for a
               ``SyncBatchNorm``): only the output is kept for backward. It
               needs an invertible activation, so **ReLU becomes
               leaky_relu(activation_param)** (default 0.01) -- a different
               function, reported as ``function_changed``; leaky_relu with a
               positive slope and elu are kept as they are. Writing over the
               norm's input is only safe when nothing else uses it, so a pair
               is converted in place only where that input is known to be a
               fresh convolution or linear output (the previous module of a
               Sequential, or inside a recognised block or stem). Elsewhere
               (first in a Sequential, after a pooling, inside BatchNormAct2d
               whose input is unknown) it gets an ``ABN`` with its original
               activation: fused, exact, not in place, and the report says so.

Also ``InPlaceABN`` uses ``sign(w) * max(|w|, 1e-3)`` as its scale; channels
with a smaller weight (``zero_init_residual``) are counted in the report.

Modules with hooks or parametrizations, modules registered at more than one
place, and uninitialised lazy modules are never replaced; nor is a norm or
block that is the root module itself, which cannot be swapped in place (wrap
it, for example ``nn.Sequential(block)``; a ResNet at the root is fine, only
its children change).

``revert`` gives back the original BatchNorm classes and activation modules
(the activation the fused module computes, so LeakyReLU after
``mode="inplace"``). A converted torchvision block stays an effilayers block,
in plain form: same children, state dict and function, not the torchvision
class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from .nn import ABN, InPlaceABN, InPlaceABNSync, MaxPool2d
from .nn.fused import PLAIN_TYPE_ATTR, FusedActivation, fused_norm
from .ops.abn import DEFAULT_WEIGHT_EPS

__all__ = [
    "MODES",
    "convert",
    "revert",
    "ConversionReport",
    "RevertReport",
    "FusedPair",
    "RestoredPair",
    "LeftAlone",
    "FusedActivation",
    "BatchNormAct",
]

MODES = ("abn", "inplace")

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


# ---- reports -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedPair:
    """One norm + activation pair that :func:`convert` fused."""

    norm: str  # path of the norm, now the fused module
    activation: Optional[str]  # path of the activation made a pass-through (None: it was inside the norm module)
    pattern: str  # "sequential", "resnet_block", "resnet_stem", "resnet_shortcut" or "norm_act"
    module: str  # "ABN", "InPlaceABN" or "InPlaceABNSync"
    before: str  # the original function, e.g. "BatchNorm2d -> relu"
    after: str  # the fused function, e.g. "InPlaceABN(leaky_relu(0.01), + residual)"
    residual: bool  # the shortcut sum of a ResNet block is inside the fused call
    function_changed: bool  # the activation differs from the original (relu -> leaky_relu)
    note: str = ""


@dataclass(frozen=True)
class RestoredPair:
    """One fused module that :func:`revert` turned back into plain modules."""

    norm: str
    activation: Optional[str]  # path of the activation module put back (None: inside a BatchNormAct)
    module: str  # e.g. "BatchNorm2d + ReLU", "BatchNormAct(LeakyReLU)"
    note: str = ""


@dataclass(frozen=True)
class LeftAlone:
    """A module left as it was, and why. ``path`` is "" for the root module."""

    path: str
    reason: str


def _format_entries(title: str, lines: list[str]) -> list[str]:
    return [f"{title} ({len(lines)}):"] + [f"  {line}" for line in lines] if lines else [f"{title}: none"]


@dataclass
class ConversionReport:
    """What :func:`convert` did: ``fused`` pairs, ``left_alone`` norms (with
    the reason), ``replaced_blocks`` (paths of ResNet blocks swapped for
    effilayers blocks, and of a stem max pool swapped for
    :class:`effilayers.nn.MaxPool2d`)."""

    mode: str
    activation_param: float
    fused: list[FusedPair] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)
    replaced_blocks: list[str] = field(default_factory=list)

    @property
    def fused_paths(self) -> list[str]:
        return [pair.norm for pair in self.fused]

    @property
    def left_alone_paths(self) -> list[str]:
        return [entry.path for entry in self.left_alone]

    @property
    def function_changed(self) -> bool:
        """True when some activation was changed (relu -> leaky_relu in place)."""
        return any(pair.function_changed for pair in self.fused)

    def reason(self, path: str) -> Optional[str]:
        """Why the norm at ``path`` was left alone, or None if it was not."""
        return next((entry.reason for entry in self.left_alone if entry.path == path), None)

    def __str__(self) -> str:
        lines = [f"effilayers.convert(mode={self.mode!r}, activation_param={self.activation_param}): "
                 f"{len(self.fused)} fused, {len(self.left_alone)} left alone"
                 + (" -- activations changed, see function_changed" if self.function_changed else "")]
        lines += _format_entries("fused", [
            f"{pair.norm}: {pair.before} => {pair.after} [{pair.pattern}]"
            + (" (function changed)" if pair.function_changed else "") + (f" -- {pair.note}" if pair.note else "")
            for pair in self.fused])
        lines += _format_entries("left alone", [f"{entry.path or '(root)'}: {entry.reason}"
                                                for entry in self.left_alone])
        if self.replaced_blocks:
            lines += _format_entries("ResNet blocks replaced", self.replaced_blocks)
        return "\n".join(lines)


@dataclass
class RevertReport:
    """What :func:`revert` did: ``restored`` fused modules, ``left_alone`` ones (with the reason)."""

    restored: list[RestoredPair] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)

    @property
    def restored_paths(self) -> list[str]:
        return [pair.norm for pair in self.restored]

    @property
    def left_alone_paths(self) -> list[str]:
        return [entry.path for entry in self.left_alone]

    def __str__(self) -> str:
        lines = [f"effilayers.revert: {len(self.restored)} restored, {len(self.left_alone)} left alone"]
        lines += _format_entries("restored", [
            f"{pair.norm}: {pair.module}" + (f" (activation at {pair.activation})" if pair.activation else "")
            + (f" -- {pair.note}" if pair.note else "") for pair in self.restored])
        lines += _format_entries("left alone", [f"{entry.path or '(root)'}: {entry.reason}"
                                                for entry in self.left_alone])
        return "\n".join(lines)


# ---- activations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Activation:
    name: str  # as ABN spells it
    param: float

    def describe(self) -> str:
        return self.name if self.name in ("relu", "identity") else f"{self.name}({self.param:g})"


def _activation_of(module: nn.Module) -> Optional[_Activation]:
    """The ABN activation equal to ``module``, or None. Exact types only: a
    subclass may compute something else."""
    kind = type(module)
    if kind is nn.ReLU:
        return _Activation("relu", 0.0)
    if kind is nn.LeakyReLU and module.negative_slope >= 0:
        return _Activation("leaky_relu", float(module.negative_slope))
    if kind is nn.ELU and module.alpha > 0:
        return _Activation("elu", float(module.alpha))
    return None


def _activation_module(activation: _Activation, inplace: bool) -> nn.Module:
    if activation.name == "relu":
        return nn.ReLU(inplace=inplace)
    if activation.name == "leaky_relu":
        return nn.LeakyReLU(activation.param, inplace=inplace)
    if activation.name == "elu":
        return nn.ELU(activation.param, inplace=inplace)
    return nn.Identity()


def _in_place_activation(activation: _Activation, slope: float) -> _Activation:
    """The invertible activation an in-place fused module uses instead."""
    if activation.name == "relu" or (activation.name == "leaky_relu" and activation.param == 0):
        return _Activation("leaky_relu", slope)
    return activation


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


def _fuse(norm: _BatchNorm, activation: _Activation, in_place: bool) -> ABN:
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


def _unfuse(fused: ABN, plain_type: Optional[type] = None, act: Optional[nn.Module] = None) -> nn.Module:
    """A plain norm (of ``plain_type``, or the one recorded at conversion)
    holding ``fused``'s tensors; a BatchNormAct around ``act`` when ``act`` is given."""
    arguments = (fused.num_features, fused.eps, fused.momentum, fused.affine, fused.track_running_stats)
    if act is not None:
        plain = BatchNormAct(*arguments, act=act, device="meta")
    else:
        kind = plain_type or getattr(fused, PLAIN_TYPE_ATTR, None) or BatchNormAct
        if kind is nn.SyncBatchNorm:
            plain = nn.SyncBatchNorm(*arguments, process_group=getattr(fused, "process_group", None), device="meta")
        else:
            plain = kind(*arguments, device="meta")
    _move_state(fused, plain)
    return plain


def _clamped_channels(norm: nn.Module) -> int:
    weight = getattr(norm, "weight", None)
    if weight is None or weight.is_meta:
        return 0
    return int((weight.detach().abs() < DEFAULT_WEIGHT_EPS).sum())


# ---- what may be replaced -------------------------------------------------------------------


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _swap_pool(pool: nn.MaxPool2d, kind: type) -> nn.MaxPool2d:
    swapped = kind(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices, pool.ceil_mode)
    swapped.train(pool.training)
    return swapped


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_DICTS)


def _is_batchnorm(module: Optional[nn.Module]) -> bool:
    """A BatchNorm computing exactly BatchNorm: a subclass that overrides
    forward (timm's BatchNormAct2d, ...) is something else."""
    if not isinstance(module, _BatchNorm) or isinstance(module, BatchNormAct):
        return False
    return type(module).forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def _is_timm_norm_act(module: Optional[nn.Module]) -> bool:
    return (isinstance(module, nn.BatchNorm2d) and type(module).__name__ == "BatchNormAct2d"
            and set(module._modules) == {"drop", "act"} and type(module._modules["drop"]) is nn.Identity)


def _is_plain_sequential(module: nn.Module) -> bool:
    # A subclass with its own forward may route data any way it likes.
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _is_resnet_block(module: nn.Module) -> Optional[str]:
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


def _is_resnet(module: nn.Module) -> bool:
    return type(module).__name__ == "ResNet" and set(_RESNET_CHILDREN) <= set(module._modules)


def _fresh_output(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` returns a new tensor that only its caller sees, so
    the next module may overwrite it."""
    if module is None or _has_hooks(module):  # a forward hook may keep the output
        return False
    if _is_plain_sequential(module):
        children = [child for child in module._modules.values() if child is not None]
        return bool(children) and _fresh_output(children[-1])
    return isinstance(module, (_ConvNd, nn.Linear))


class _Slots:
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
            path = f"{prefix}.{name}" if prefix else name
            self.paths.setdefault(id(child), []).append(path)
            self._walk(child, path, seen)

    def shared(self, module: nn.Module) -> Optional[str]:
        paths = self.paths.get(id(module), [])
        if len(paths) > 1:
            return f"the same module is registered at {len(paths)} places ({', '.join(paths)})"
        return None


def _blocker(module: nn.Module, slots: _Slots, what: str) -> Optional[str]:
    """Why ``module`` must not be replaced, or None."""
    shared = slots.shared(module)
    if shared:
        return f"{what}: {shared}; replacing it in one place would untie it from the others"
    if isinstance(module, LazyModuleMixin):  # before hooks: it has its own
        return f"{what} is an uninitialised lazy module (run one forward first)"
    if _has_hooks(module):
        return f"{what} has hooks, which a replacement would lose"
    if parametrize.is_parametrized(module):
        return f"{what} is parametrized"
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _in_module_order(model: nn.Module, entries: list, path_of) -> list:
    """``entries`` sorted as ``model.named_modules()`` lists their paths (the
    walk fuses a Sequential's pairs before it visits nested children)."""
    order = {name: index for index, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(entries, key=lambda entry: order.get(path_of(entry), len(order)))


# ---- convert --------------------------------------------------------------------------------


class _Converter:
    def __init__(self, root: nn.Module, mode: str, activation_param: float) -> None:
        self.root = root
        self.mode = mode
        self.slope = activation_param
        self.slots = _Slots(root)
        self.report = ConversionReport(mode, activation_param)
        self.visited: set[int] = set()
        self.reported: set[int] = set()
        from .models import resnet  # here: effilayers.models imports this module

        self.resnet = resnet

    # -- decisions shared by every pattern

    def plan(self, norm: nn.Module, activation: _Activation, input_fresh: bool, why_not_fresh: str):
        """(fused activation, in place?, note) or a str: why not to fuse."""
        if self.mode == "abn":
            if isinstance(norm, nn.SyncBatchNorm):
                return ("SyncBatchNorm: there is no synchronised non-in-place ABN; use mode='inplace' "
                        "(InPlaceABNSync)")
            return activation, False, ""
        if input_fresh:
            return _in_place_activation(activation, self.slope), True, ""
        if isinstance(norm, nn.SyncBatchNorm):
            return (f"SyncBatchNorm whose input cannot be overwritten ({why_not_fresh}), and there is no "
                    "synchronised non-in-place ABN")
        return activation, False, f"ABN, not in place: {why_not_fresh}; activation kept"

    def fuse(self, norm, activation, input_fresh, why_not_fresh, residual=False):
        """The fused module and the report fields, or a str: why not."""
        decision = self.plan(norm, activation, input_fresh, why_not_fresh)
        if isinstance(decision, str):
            return decision
        fused_activation, in_place, note = decision
        try:
            fused = _fuse(norm, fused_activation, in_place)
        except (ValueError, TypeError) as error:  # e.g. a momentum ABN does not accept
            return f"cannot be represented as an ABN: {error}"
        clamped = _clamped_channels(fused) if in_place else 0
        if clamped:
            note = (note + "; " if note else "") + (
                f"{clamped} channel(s) with |weight| < {DEFAULT_WEIGHT_EPS:g} use ±{DEFAULT_WEIGHT_EPS:g}")
        after = f"{type(fused).__name__}({fused_activation.describe()}" + (", + residual)" if residual else ")")
        details = {
            "module": type(fused).__name__,
            "before": f"{type(norm).__name__} {'+ residual ' if residual else ''}-> {activation.describe()}",
            "after": after,
            "residual": residual,
            "function_changed": fused_activation != activation,
            "note": note,
        }
        return fused, details

    def leave(self, module: nn.Module, path: str, reason: str) -> None:
        if id(module) not in self.reported:
            self.reported.add(id(module))
            self.report.left_alone.append(LeftAlone(path, reason))

    # -- the walk

    def run(self) -> ConversionReport:
        root = self.root
        cannot = ("cannot be replaced in place, being the root module; wrap it, e.g. "
                  "convert(nn.Sequential(model))")
        if _is_batchnorm(root) or _is_timm_norm_act(root):
            self.leave(root, "", f"the norm {cannot}")
        elif _is_resnet_block(root):
            for name, child in root._modules.items():
                if _is_batchnorm(child):
                    self.leave(child, name, f"in a ResNet block that {cannot}")
        self.visit(root, "")
        report = self.report
        report.fused = _in_module_order(root, report.fused, lambda pair: pair.norm)
        report.left_alone = _in_module_order(root, report.left_alone, lambda entry: entry.path)
        return report

    def visit(self, parent: nn.Module, prefix: str) -> None:
        if id(parent) in self.visited:
            return
        self.visited.add(id(parent))
        reasons: dict[str, str] = {}
        if _is_plain_sequential(parent):
            reasons = self.sequential(parent, prefix)
        elif _is_resnet(parent):
            reasons = self.resnet_stem(parent, prefix)
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = _join(prefix, name)
            if _is_resnet_block(child):
                child = self.resnet_block(parent, name, child, path)
            elif _is_timm_norm_act(child):
                self.norm_act(parent, name, child, path)
                continue
            elif _is_batchnorm(child):
                self.leave(child, path, reasons.get(name) or (
                    f"inside {type(parent).__name__}, whose forward decides what follows it: only nn.Sequential "
                    "chains and recognised ResNet blocks / stems are converted"))
                continue
            self.visit(child, path)

    def record(self, norm_path, activation_path, pattern, details) -> None:
        self.report.fused.append(FusedPair(norm_path, activation_path, pattern, **details))

    def sequential(self, sequential: nn.Sequential, prefix: str) -> dict[str, str]:
        items = [(name, module) for name, module in sequential._modules.items() if module is not None]
        reasons = {}
        for index, (name, norm) in enumerate(items):
            if not _is_batchnorm(norm):
                continue
            if index + 1 == len(items):
                reasons[name] = ("last module of its nn.Sequential: what follows it is decided outside, "
                                 "so it is not known to be an activation")
                continue
            act_name, act_module = items[index + 1]
            activation = _activation_of(act_module)
            if activation is None:
                reasons[name] = (f"followed by {type(act_module).__name__}, not a supported activation "
                                 "(ReLU, LeakyReLU with slope >= 0, ELU)")
                continue
            blocker = _blocker(norm, self.slots, "the norm") or _blocker_activation(act_module)
            if blocker:
                reasons[name] = blocker
                continue
            previous = items[index - 1][1] if index > 0 else None
            why_not = ("first module of its nn.Sequential, so its input comes from outside and may be used "
                       "again" if previous is None else
                       f"its input comes from {type(previous).__name__}, not known to be a fresh tensor")
            outcome = self.fuse(norm, activation, _fresh_output(previous), why_not)
            if isinstance(outcome, str):
                reasons[name] = outcome
                continue
            fused, details = outcome
            sequential._modules[name] = fused
            sequential._modules[act_name] = FusedActivation(name, getattr(act_module, "inplace", True))
            self.record(_join(prefix, name), _join(prefix, act_name), "sequential", details)
        return reasons

    def resnet_stem(self, model: nn.Module, prefix: str) -> dict[str, str]:
        norm, act_module = model._modules["bn1"], model._modules["relu"]
        if not _is_batchnorm(norm):
            return {}
        activation = _activation_of(act_module)
        if activation is None:
            return {"bn1": f"the stem activation is {type(act_module).__name__}, not ReLU, LeakyReLU or ELU"}
        blocker = _blocker(norm, self.slots, "the norm") or _blocker_activation(act_module)
        if blocker:
            return {"bn1": blocker}
        outcome = self.fuse(norm, activation, _fresh_output(model._modules["conv1"]),
                            "conv1 has hooks that may keep its output")
        if isinstance(outcome, str):
            return {"bn1": outcome}
        fused, details = outcome
        model._modules["bn1"] = fused
        model._modules["relu"] = FusedActivation("bn1", getattr(act_module, "inplace", True))
        self.record(_join(prefix, "bn1"), _join(prefix, "relu"), "resnet_stem", details)
        pool = model._modules["maxpool"]
        if type(fused) is not ABN and type(pool) is nn.MaxPool2d and not pool.return_indices and not _has_hooks(pool):
            # The stem output is kept by the fused norm already; a pool that
            # recomputes its argmax keeps nothing more (no int64 indices).
            model._modules["maxpool"] = _swap_pool(pool, MaxPool2d)
            self.report.replaced_blocks.append(_join(prefix, "maxpool"))
        return {}

    def resnet_block(self, parent: nn.Module, name: str, block: nn.Module, path: str) -> nn.Module:
        """Replaces ``block`` in ``parent`` with a fused effilayers block;
        returns what is in the slot afterwards."""
        kind = _is_resnet_block(block)
        norm_names = ("bn1", "bn2") if kind == "basic" else ("bn1", "bn2", "bn3")
        act_module = block._modules["relu"]
        activation = _activation_of(act_module)
        problem = _blocker(block, self.slots, "the block")
        if activation is None:
            problem = f"the block's activation is {type(act_module).__name__}, not ReLU, LeakyReLU or ELU"
        problem = problem or _blocker_activation(act_module)
        for norm_name in norm_names:
            norm = block._modules[norm_name]
            if problem:
                break
            if not _is_batchnorm(norm):
                problem = f"{norm_name} is {type(norm).__name__}, not a BatchNorm"
            else:
                problem = _blocker(norm, self.slots, norm_name)
        planned = {}
        for norm_name in norm_names:
            if problem:
                break
            conv = block._modules["conv" + norm_name[-1]]
            residual = norm_name == norm_names[-1]
            outcome = self.fuse(block._modules[norm_name], activation, _fresh_output(conv),
                                f"conv{norm_name[-1]} has hooks that may keep its output", residual=residual)
            if isinstance(outcome, str):
                problem = f"{norm_name}: {outcome}"
            else:
                planned[norm_name] = outcome
        if problem:
            for norm_name in norm_names:
                if _is_batchnorm(block._modules[norm_name]):
                    self.leave(block._modules[norm_name], _join(path, norm_name),
                               f"in a {type(block).__name__} left alone: {problem}")
            return block
        modules = dict(block._modules)
        modules.pop("relu")
        modules.update({norm_name: fused for norm_name, (fused, _) in planned.items()})
        block_type = self.resnet.BasicBlock if kind == "basic" else self.resnet.Bottleneck
        replacement = block_type._from_modules(modules, stride=getattr(block, "stride", 1), training=block.training)
        parent._modules[name] = replacement
        self.report.replaced_blocks.append(path)
        for norm_name, (_, details) in planned.items():
            self.record(_join(path, norm_name), _join(path, "relu"), "resnet_block", details)
        shortcut = modules.get("downsample")
        if shortcut is not None and _is_plain_sequential(shortcut) and len(shortcut):
            self.shortcut_norm(shortcut, _join(path, "downsample"),
                               in_place=all(type(fused) is not ABN for fused, _ in planned.values()))
        return replacement

    def shortcut_norm(self, shortcut: nn.Sequential, path: str, in_place: bool) -> None:
        """The norm ending a projection shortcut. Only the block's fused sum
        follows it, and that sum keeps the shortcut for backward anyway, so
        in place an identity InPlaceABN over the convolution output saves
        keeping that output a second time (as BatchNorm's input)."""
        names = list(shortcut._modules)
        last_name, last = names[-1], shortcut._modules[names[-1]]
        if not _is_batchnorm(last):
            return
        norm_path = _join(path, last_name)
        previous = shortcut._modules[names[-2]] if len(names) > 1 else None
        problem = None
        if not in_place:
            problem = ("norm of the block's shortcut, with no activation after it: plain BatchNorm computes it "
                       "exactly (mode='abn' or a block fused out of place)")
        elif not _fresh_output(previous):
            problem = "norm of the block's shortcut whose input may be kept elsewhere: left a plain BatchNorm"
        else:
            problem = _blocker(last, self.slots, "the norm")
        if problem:
            self.leave(last, norm_path, problem)
            return
        identity = _Activation("identity", 0.0)
        try:
            fused = _fuse(last, identity, in_place=True)
        except (ValueError, TypeError) as error:
            self.leave(last, norm_path, f"cannot be represented as an ABN: {error}")
            return
        shortcut._modules[last_name] = fused
        clamped = _clamped_channels(fused)
        note = (f"{clamped} channel(s) with |weight| < {DEFAULT_WEIGHT_EPS:g} use ±{DEFAULT_WEIGHT_EPS:g}"
                if clamped else "")
        self.record(norm_path, None, "resnet_shortcut", {
            "module": type(fused).__name__, "before": f"{type(last).__name__}", "after": "InPlaceABN(identity)",
            "residual": False, "function_changed": False, "note": note})

    def norm_act(self, parent: nn.Module, name: str, module: nn.Module, path: str) -> None:
        act_module = module._modules["act"]
        activation = _activation_of(act_module)
        problem = _blocker(module, self.slots, "the module")
        if activation is None:  # Identity included: nothing to fuse
            problem = f"its act is {type(act_module).__name__}, not ReLU, LeakyReLU or ELU"
        if not problem:
            outcome = self.fuse(module, activation, False,
                                "a BatchNormAct2d does not know where its input comes from")
            if isinstance(outcome, str):
                problem = outcome
        if problem:
            self.leave(module, path, f"{type(module).__name__}: {problem}")
            return
        fused, details = outcome
        setattr(fused, PLAIN_TYPE_ATTR, BatchNormAct)  # its activation lives inside, as it did
        parent._modules[name] = fused
        self.record(path, None, "norm_act", details)


def _blocker_activation(module: nn.Module) -> Optional[str]:
    # A stateless activation may be shared freely (its other uses keep it);
    # only hooks on it would be lost.
    if _has_hooks(module):
        return "the activation has hooks, which fusing it would bypass"
    return None


def _check_arguments(model, mode, activation_param) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"convert: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if isinstance(activation_param, bool) or not isinstance(activation_param, (int, float)):
        raise TypeError(f"convert: activation_param must be a float, got {type(activation_param).__name__}")
    if not (math.isfinite(activation_param) and activation_param > 0):
        raise ValueError("convert: activation_param (the leaky_relu slope that replaces relu in place) must be a "
                         f"finite float > 0, got {activation_param}")


def convert(model: nn.Module, mode: str = "inplace", *, activation_param: float = 0.01) -> ConversionReport:
    """Fuse BatchNorm + activation pairs of ``model`` into effilayers ABNs, in place.

    Args:
        model: any ``nn.Module``; modified in place (``copy.deepcopy`` it
            first to keep the original).
        mode: ``"inplace"`` (InPlaceABN: least memory; ReLU becomes
            leaky_relu(``activation_param``)) or ``"abn"`` (ABN: exactly the
            original function). See the module docstring.
        activation_param: the leaky_relu slope that replaces ReLU in place
            (> 0). Unused by ``mode="abn"``.

    Returns:
        A :class:`ConversionReport`: every fused pair with its path and
        whether its function changed, and every BatchNorm left alone with the
        reason. ``print(report)`` gives a summary.
    """
    _check_arguments(model, mode, activation_param)
    return _Converter(model, mode, float(activation_param)).run()


# ---- revert ---------------------------------------------------------------------------------


def _activation_of_fused(module: ABN) -> _Activation:
    return _Activation(module.activation, module.activation_param)


def _plain_description(norm: nn.Module, act: nn.Module) -> str:
    return f"{type(norm).__name__} + {type(act).__name__}" if not isinstance(norm, BatchNormAct) else (
        f"BatchNormAct({type(norm.act).__name__})")


def _revert_note(fused: ABN) -> str:
    clamped = _clamped_channels(fused) if isinstance(fused, InPlaceABN) else 0
    if clamped:
        return (f"{clamped} channel(s) with |weight| < {fused.weight_eps:g}: InPlaceABN used ±{fused.weight_eps:g}, "
                "the plain norm uses the weight itself")
    return ""


class _Reverter:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.slots = _Slots(root)
        self.report = RevertReport()
        self.visited: set[int] = set()
        from .models import resnet

        self.resnet = resnet

    def run(self) -> RevertReport:
        if isinstance(self.root, ABN):
            self.report.left_alone.append(LeftAlone("", "the root module itself cannot be replaced in place; "
                                                        "wrap it, e.g. revert(nn.Sequential(model))"))
            return self.report
        self.visit(self.root, "")
        report = self.report
        report.restored = _in_module_order(self.root, report.restored, lambda pair: pair.norm)
        report.left_alone = _in_module_order(self.root, report.left_alone, lambda entry: entry.path)
        return report

    def blocked(self, module: nn.Module, path: str) -> bool:
        problem = _blocker(module, self.slots, "the module")
        if problem:
            self.report.left_alone.append(LeftAlone(path, problem))
        return bool(problem)

    def visit(self, parent: nn.Module, prefix: str) -> None:
        if id(parent) in self.visited:
            return
        self.visited.add(id(parent))
        kept: set[str] = set()
        if isinstance(parent, self.resnet._ResidualBlock):
            kept = self.resnet_block(parent, prefix)
        placeholders = {module.fused_into: name for name, module in parent._modules.items()
                        if isinstance(module, FusedActivation)}
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = _join(prefix, name)
            if type(child) is MaxPool2d:  # same function; torch's pool exports everywhere
                parent._modules[name] = _swap_pool(child, nn.MaxPool2d)
                continue
            if isinstance(child, ABN):
                if name not in kept and not self.blocked(child, path):
                    self.restore(parent, name, child, path, placeholders.get(name), prefix)
                continue
            self.visit(child, path)

    def restore(self, parent, name, fused, path, placeholder_name, prefix) -> None:
        activation = _activation_of_fused(fused)
        note = _revert_note(fused)
        if placeholder_name is not None:
            placeholder = parent._modules[placeholder_name]
            # An unknown original class gives a BatchNormAct with an Identity
            # act: a rank-agnostic plain norm.
            plain = _unfuse(fused)
            act = _activation_module(activation, placeholder.inplace)
            parent._modules[name] = plain
            parent._modules[placeholder_name] = act
            self.report.restored.append(RestoredPair(path, _join(prefix, placeholder_name),
                                                     _plain_description(plain, act), note))
            return
        if activation.name == "identity" and getattr(fused, PLAIN_TYPE_ATTR, None) is not None:
            # A norm with nothing after it (a shortcut's): its own class again.
            plain = _unfuse(fused)
            parent._modules[name] = plain
            self.report.restored.append(RestoredPair(path, None, type(plain).__name__, note))
            return
        plain = _unfuse(fused, act=_activation_module(activation, inplace=True))
        parent._modules[name] = plain
        self.report.restored.append(RestoredPair(path, None, _plain_description(plain, plain.act), note))

    def resnet_block(self, block, path) -> set[str]:
        """Turns a fused effilayers block plain, in place; returns the names
        of norms it left fused (the caller must not restore them singly)."""
        norms = {name: block._modules.get(name) for name in block._CHILDREN if name.startswith("bn")}
        if not any(isinstance(norm, ABN) for norm in norms.values()):
            return set()
        activations = {_activation_of_fused(norm) for norm in norms.values() if isinstance(norm, ABN)}
        problem = None
        if not all(isinstance(norm, ABN) for norm in norms.values()):
            problem = "only some of its norms are fused"
        elif len(activations) != 1:
            problem = "its norms use different activations, and the plain block has one relu module"
        else:
            problem = next((_blocker(norm, self.slots, name) for name, norm in norms.items()
                            if _blocker(norm, self.slots, name)), None)
        if problem:
            for name, norm in norms.items():
                if isinstance(norm, ABN):
                    self.report.left_alone.append(LeftAlone(_join(path, name), f"in a block left alone: {problem}"))
            return set(norms)
        (activation,) = activations
        relu = _activation_module(activation, inplace=True)  # torchvision's blocks use an in-place ReLU
        modules = dict(block._modules)
        for name, norm in norms.items():
            modules[name] = _unfuse(norm, plain_type=nn.BatchNorm2d)
            self.report.restored.append(RestoredPair(_join(path, name), _join(path, "relu"),
                                                     f"BatchNorm2d + {type(relu).__name__}", _revert_note(norm)))
        modules["relu"] = relu
        block._set_children(modules)
        return set()


def revert(model: nn.Module) -> RevertReport:
    """Turn the fused modules of ``model`` back into plain ones, in place, for export.

    * a norm whose activation slot :func:`convert` (or a fused effilayers
      ResNet) left as a :class:`FusedActivation` becomes its original
      BatchNorm class again, and the slot an activation module;
    * an effilayers ResNet block with fused norms becomes the same block in
      plain form (``BatchNorm2d`` norms, one ``relu`` module);
    * any other ABN becomes a :class:`BatchNormAct` (BatchNorm then its
      activation module).

    The activation put back is the one the fused module computes --
    ``LeakyReLU(0.01)`` after ``convert(mode="inplace")``, not the ReLU it
    replaced -- so outputs do not change. Tensors are moved, not copied: the
    state dict stays the same, key for key.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert: model must be a torch.nn.Module, got {type(model).__name__}")
    return _Reverter(model).run()

