"""DenseNet (Huang et al., 2017) with memory-efficient dense layers.

Every layer of a dense block sees the concatenation of all earlier feature
maps of the block, passes it through BatchNorm, ReLU and a 1x1 "bottleneck"
convolution (``bn_size * growth_rate`` channels), then BatchNorm, ReLU and a
3x3 convolution producing ``growth_rate`` new channels. Transitions between
blocks halve the channels (1x1 convolution) and the resolution (2x2 average
pooling).

``memory_efficient=True`` (the default) runs every "norm, ReLU, convolution"
of the model through :func:`effilayers.ops.densenet.bottleneck`, which keeps
only the convolution's input before the norm, plus per-channel statistics,
and recomputes norm and ReLU (and, for ``norm1``, the concatenation) in
backward:

* ``cat -> norm1 -> relu1 -> conv1``: autograd would keep two copies of the
  growing concatenation per layer, so a block's saved activations would grow
  quadratically with its depth; only the input maps (which the block keeps
  anyway) are kept, so they grow linearly;
* ``norm2 -> relu2 -> conv2``: the ``bn_size * growth_rate``-channel map is
  kept once instead of twice;
* transitions: the block output is kept once instead of twice;
* the block's maps are written into one preallocated buffer as they appear,
  and the block's output is that buffer: no concatenation at the end of the
  block, so the maps are not kept a second time as the transition's input.

A block computes each map's batch statistics once, when the map appears, and
hands them to every later layer (their ``norm1`` layers differ only in
``weight`` and ``bias``). Measured with ``effilayers.memory`` on DenseNet-121
at 1x3x224x224: 0.268x the naive model's activation bytes, 0.231x with
``norm_act="inplace"`` (tests/test_densenet_memory.py holds it at <= 0.33x; without
the block buffer it was 0.309x). The output of a memory-efficient block
shares memory with the maps kept for backward: modifying it in place raises
in backward.

``memory_efficient=False`` is the plain PyTorch path. Both use the same
modules, so they have the same parameters, buffers and state-dict keys,
compute the same function and update the running statistics once per
forward in the same way.

A memory-efficient step calls its modules instead, saving nothing there and
warning once per reason (``_recomputes``), where the recomputing Function
would not compute what calling them does: modules with hooks, a
convolution or norm it does not implement (``SyncBatchNorm``), and under
``torch.jit.trace``, ``torch.fx`` symbolic tracing or ``torch.func``
transforms.

Dropout (``drop_rate > 0``) is applied to the output of ``conv2``, after the
recomputed part, so it is never recomputed: its mask is drawn once, in the
forward pass, and backward uses that same mask in both modes.

State-dict keys: for the ImageNet stem (``small_inputs=False``) module names
and registration order are exactly torchvision's, so its ``densenet121``,
``densenet161``, ``densenet169`` and ``densenet201`` checkpoints load with a
strict ``load_state_dict``. Checkpoints written by very old torchvision
versions name the layer modules ``norm.1``, ``conv.2``, ...; a load hook
renames them (``denselayer1.norm.1.weight`` -> ``denselayer1.norm1.weight``).

``small_inputs=True`` is the CIFAR form of DenseNet-BC: a single 3x3
convolution as the stem, without ``norm0``, ``relu0`` and ``pool0``, so its
keys differ from torchvision's (there is no torchvision counterpart), e.g.
depth 100, k = 12::

    DenseNet(growth_rate=12, block_config=(16, 16, 16), num_init_features=24,
             small_inputs=True, num_classes=10)
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.abn.module import ABN
from ..ops.densenet import layout_of, norm_relu_conv
from ..ops.stats import batch_stats
from ._common import (
    activated_norm,
    activation_slot,
    check_bool,
    check_norm_act,
    drop_weight_arguments,
    fix_arguments,
    imagenet_stem,
    positive_int,
)

__all__ = [
    "DenseNet",
    "DenseLayer",
    "DenseBlock",
    "Transition",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "densenet264",
]

# Old torchvision checkpoints: "denselayer3.norm.1.weight" for today's
# "denselayer3.norm1.weight" (Sequential-style dotted indices).
_LEGACY_KEY = re.compile(
    r"^(.*denselayer\d+\.)(norm|relu|conv)\.([12])\.(weight|bias|running_mean|running_var|num_batches_tracked)$"
)


# ResNet's "abn" (BatchNorm + ReLU fused, not in place) would keep what the
# recomputing path already avoids keeping.
NORM_ACTS = ("plain", "inplace")


def _check_drop_rate(value: Any, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: drop_rate must be a float, got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: drop_rate must be in [0, 1), got {value}")
    return float(value)


def _check_layer_arguments(owner: str, num_input_features: Any, growth_rate: Any, bn_size: Any, drop_rate: Any,
                           memory_efficient: Any, norm_act: Any) -> float:
    """The checks a dense layer and a dense block share; returns drop_rate as a float."""
    positive_int(num_input_features, "num_input_features", owner)
    positive_int(growth_rate, "growth_rate", owner)
    positive_int(bn_size, "bn_size", owner)
    check_bool(memory_efficient, "memory_efficient", owner)
    check_norm_act(norm_act, NORM_ACTS, owner)
    return _check_drop_rate(drop_rate, owner)


def _uses_batch_statistics(norm: nn.BatchNorm2d) -> bool:
    # BatchNorm2d's own rule: batch statistics in training, and always when
    # it keeps no running statistics.
    return norm.training or norm.running_mean is None


def _norm_relu_conv(features: list[torch.Tensor], norm: nn.BatchNorm2d, conv: nn.Conv2d,
                    batch_statistics: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``conv(relu(norm(cat(features))))`` through the recomputing Function,
    with ``norm``'s running-statistics behaviour (``conv`` passed
    :func:`_plain_conv`)."""
    update = norm.training and norm.track_running_stats
    keeps_running = not norm.training or norm.track_running_stats
    return norm_relu_conv(
        features, norm.weight, norm.bias,
        norm.running_mean if keeps_running else None,
        norm.running_var if keeps_running else None,
        conv.weight, _uses_batch_statistics(norm), norm.momentum, norm.eps,
        norm.num_batches_tracked if update else None,
        padding=conv.padding[0],
        batch_statistics=batch_statistics,
    )


def _plain_norm_relu(norm: nn.Module, relu: nn.Module) -> bool:
    """Whether ``norm`` then ``relu`` is exactly BatchNorm2d + ReLU, the pair
    the recomputing Function implements (modules swapped by a user, or by
    :func:`effilayers.convert` / :func:`effilayers.revert`, take the plain
    module path instead)."""
    return type(norm) is nn.BatchNorm2d and type(relu) is nn.ReLU


def _plain_conv(conv: nn.Module) -> bool:
    """Whether ``conv`` is a convolution the recomputing Function implements:
    exactly ``nn.Conv2d``, stride and dilation 1, no groups or bias, the same
    zero padding on every side."""
    return type(conv) is nn.Conv2d and conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1 \
        and conv.bias is None and not isinstance(conv.padding, str) and conv.padding[0] == conv.padding[1] \
        and conv.padding_mode == "zeros"


_module_globals = torch.nn.modules.module


def _hooked(norm: nn.Module, relu: Optional[nn.Module], conv: nn.Module) -> bool:
    """Whether calling these modules would run hooks, their own or global
    ones (``register_module_forward_hook``, ...), or those of the modules a
    norm runs itself (a norm-act layer's ``act``; ``relu`` is None then).
    Dict-emptiness tests only: this runs for every layer of every forward."""
    if (_module_globals._global_forward_pre_hooks or _module_globals._global_forward_hooks
            or _module_globals._global_backward_pre_hooks or _module_globals._global_backward_hooks):
        return True
    modules = (norm, conv, *norm._modules.values()) if relu is None else (norm, relu, conv)
    return any(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
               or module._backward_hooks for module in modules if module is not None)


# Why memory_efficient=True fell back to the module path somewhere: each
# reason is warned about once per process.
_WARNED: set[str] = set()

_FALLBACK_REASONS = {
    "hooks": "for a norm -> relu -> conv whose modules have forward or backward hooks (their own or global "
             "ones; torch.nn.utils.prune and the old weight_norm are forward pre-hooks): the recomputing path "
             "reads their weights without calling them, so it would skip the hooks",
    "norm": "for a norm and activation other than exactly nn.BatchNorm2d and nn.ReLU (e.g. nn.SyncBatchNorm, "
            "whose statistics span processes, or a BatchNorm2d subclass)",
    "jit.trace": "under torch.jit.trace: the traced graph is the plain model's (the block buffer's Tensor.set_ "
                 "and the recomputing autograd Functions do not trace)",
    "fx": "under torch.fx symbolic tracing: the GraphModule calls the modules as the plain model does (the "
          "recomputing path cannot be traced symbolically)",
    "func": "under torch.func transforms (grad, vmap, ...), which its autograd Functions do not support",
    "conv": "for a convolution it does not implement (only nn.Conv2d with stride and dilation 1, no groups or "
            "bias, the same padding on every side and padding_mode='zeros')",
}


def _fall_back(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"effilayers DenseNet: memory_efficient=True calls the modules, saving no memory, "
                      f"{_FALLBACK_REASONS[reason]}", stacklevel=2)


_is_fx_symbolic_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None) \
    or torch.fx._symbolic_trace.is_fx_tracing


def _tracer() -> Optional[str]:
    """The tracer or transform now running that the recomputing path (its
    autograd Functions, the block buffer) cannot go through, as a key of
    ``_FALLBACK_REASONS``; None when there is none. torch.compile is not
    one: it traces the custom ops and plans its own memory."""
    if torch.compiler.is_compiling():
        return None
    if torch.jit.is_tracing():
        return "jit.trace"
    if _is_fx_symbolic_tracing():
        return "fx"
    if torch._C._are_functorch_transforms_active():
        return "func"
    return None


def _recomputes(norm: nn.Module, relu: Optional[nn.Module], conv: nn.Module,
                plain_pair: Callable[[nn.Module, Optional[nn.Module]], bool] = _plain_norm_relu) -> bool:
    """Whether a memory-efficient ``conv(relu(norm(x)))`` runs through the
    recomputing Function; if not, the caller calls the modules (the naive
    path, for this one step), which computes the same function.
    ``plain_pair`` is the owner's test that ``norm`` then ``relu`` (None: the
    norm's own activation) is exactly BatchNorm + ReLU."""
    if not plain_pair(norm, relu):
        # effilayers' own norms (norm_act="inplace", convert) save memory
        # their own way; a BatchNorm that is not BatchNorm2d + ReLU does not.
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and not isinstance(norm, ABN):
            _fall_back("norm")
        return False
    tracer = _tracer()
    if tracer is not None:
        _fall_back(tracer)
        return False
    if not _plain_conv(conv):
        _fall_back("conv")
        return False
    if _hooked(norm, relu, conv):
        _fall_back("hooks")
        return False
    return True


class DenseLayer(nn.Module):
    """Bottleneck (norm1, relu1, conv1 1x1) then norm2, relu2, conv2 (3x3),
    producing ``growth_rate`` channels from the list of earlier maps.

    ``norm_act="inplace"`` makes ``norm2`` an :class:`effilayers.nn.InPlaceABN`
    with leaky_relu(0.01) written over conv1's output (``relu2`` becomes a
    pass-through); ``norm1`` cannot work in place, its input is the block's
    maps."""

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int, drop_rate: float,
                 memory_efficient: bool = True, norm_act: str = "plain") -> None:
        super().__init__()
        drop_rate = _check_layer_arguments("DenseLayer", num_input_features, growth_rate, bn_size, drop_rate,
                                           memory_efficient, norm_act)
        inner = bn_size * growth_rate
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, inner, kernel_size=1, stride=1, bias=False)
        self.norm2 = activated_norm(inner, norm_act)
        self.relu2 = activation_slot(norm_act, "norm2")
        self.conv2 = nn.Conv2d(inner, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)
        self.drop_rate = float(drop_rate)
        self.memory_efficient = memory_efficient

    # The test that a norm and its activation are exactly what the
    # recomputing Function implements; owners whose norms apply their own
    # activation (timm's DenseLayer, effilayers.convert) pass another.
    _plain_pair = staticmethod(_plain_norm_relu)

    def forward(self, features: torch.Tensor | Sequence[torch.Tensor],
                batch_statistics: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """``features``: the maps of the block so far. ``batch_statistics``:
        their per-channel (mean, biased variance), when the block has them
        (memory-efficient mode uses them instead of recomputing)."""
        return dense_layer_forward(self, features, batch_statistics)


def _then(relu: Optional[nn.Module], x: torch.Tensor) -> torch.Tensor:
    # None: the norm applied its own activation
    return x if relu is None else relu(x)


def dense_layer_forward(layer: nn.Module, features: torch.Tensor | Sequence[torch.Tensor],
                        batch_statistics: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """A dense layer's forward, for :class:`DenseLayer` and for any module
    with its attributes: ``norm1``, ``relu1``, ``conv1``, ``norm2``,
    ``relu2``, ``conv2`` (a ``relu`` None where the norm applies its own
    activation), ``drop_rate``, ``memory_efficient`` and ``_plain_pair``
    (effilayers.convert gives timm's DenseLayer this forward)."""
    features = [features] if isinstance(features, torch.Tensor) else list(features)
    memory_efficient = layer.memory_efficient
    if memory_efficient and _recomputes(layer.norm1, layer.relu1, layer.conv1, layer._plain_pair):
        out = _norm_relu_conv(features, layer.norm1, layer.conv1, batch_statistics)
    else:
        out = layer.conv1(_then(layer.relu1, layer.norm1(torch.cat(features, 1))))
    if memory_efficient and _recomputes(layer.norm2, layer.relu2, layer.conv2, layer._plain_pair):
        out = _norm_relu_conv([out], layer.norm2, layer.conv2)
    else:
        # InPlaceABN writes over conv1's output, the one copy kept.
        out = layer.conv2(_then(layer.relu2, layer.norm2(out)))
    if layer.drop_rate > 0:
        out = F.dropout(out, p=layer.drop_rate, training=layer.training)
    return out


class _OutputWatch:
    """The block output's version when the block returned it: all that the
    backward of a map needs (``check``). Kept apart from the buffer so that
    autograd nodes reach the buffer's memory only through saved tensors,
    which ``torch.utils.checkpoint`` and other saved-tensor hooks
    (``save_on_cpu``) drop or move."""

    __slots__ = ("output", "version")

    def __init__(self) -> None:
        self.output: Optional[weakref.ref] = None
        self.version = 0

    def check(self) -> None:
        output = self.output() if self.output is not None else None
        if output is not None and output._version != self.version:
            raise RuntimeError(
                "the output of an effilayers DenseBlock was modified by an in-place operation before backward; "
                "it shares memory with the feature maps the block keeps for backward. Use an out-of-place "
                "operation (or .clone() the output first).")


class _BlockBuffer:
    """One (N, C_total, H, W) buffer holding every map of a dense block, so
    that the block's output needs no concatenation: the maps are written into
    it as they appear and the output is the whole buffer.

    Each map is a separate tensor over its channels of the buffer's storage
    (``Tensor.set_``), not an autograd view: the maps are written once and
    then only read (the layers' recomputing Functions save them), and a
    write through one map must not bump a version counter shared with the
    maps saved before it. What autograd's version check cannot see then is
    an in-place change of the block's *output*, which shares their memory;
    the backward of every map checks for it and raises (``_OutputWatch``).
    Nothing outlives the block's forward but the maps and the output: the
    storage lives as long as a saved map or the output does."""

    def __init__(self, like: torch.Tensor, channels: int) -> None:
        n, _, h, w = like.shape
        self.buffer = torch.empty((n, channels, h, w), dtype=like.dtype, device=like.device,
                                  memory_format=layout_of(like))
        self.output_watch = _OutputWatch()

    def slot(self, start: int, channels: int) -> torch.Tensor:
        view = self.buffer.narrow(1, start, channels)
        return torch.empty(0, dtype=view.dtype, device=view.device).set_(
            self.buffer.untyped_storage(), view.storage_offset(), view.shape, view.stride())

    def watch(self, output: torch.Tensor) -> None:
        if output.is_inference() or not output.requires_grad:
            # No backward can follow (and inference tensors have no version
            # counter to watch).
            return
        self.output_watch.output = weakref.ref(output)
        self.output_watch.version = output._version


class _IntoBuffer(torch.autograd.Function):
    """Copies a new map into its channels of the block buffer and returns
    that slot; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, new_map: torch.Tensor, buffer: _BlockBuffer, start: int) -> torch.Tensor:
        slot = buffer.slot(start, new_map.shape[1])
        slot.copy_(new_map)
        # Not the buffer: the node would keep the whole block's memory alive
        # outside saved tensors, where checkpointing cannot free it.
        ctx.output_watch = buffer.output_watch
        return slot

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.output_watch.check()
        return grad, None, None


class _BufferOutput(torch.autograd.Function):
    """The whole buffer as the block's output, once every map is in it."""

    @staticmethod
    def forward(ctx, buffer: _BlockBuffer, *maps: torch.Tensor) -> torch.Tensor:
        ctx.splits = [m.shape[1] for m in maps]
        return buffer.slot(0, sum(ctx.splits))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *grad.split_with_sizes(ctx.splits, 1))


class DenseBlock(nn.ModuleDict):
    """``num_layers`` dense layers named ``denselayer1``, ``denselayer2``, ...;
    returns the input and every new map concatenated along channels."""

    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int,
                 drop_rate: float, memory_efficient: bool = True, norm_act: str = "plain") -> None:
        super().__init__()
        positive_int(num_layers, "num_layers", "DenseBlock")
        drop_rate = _check_layer_arguments("DenseBlock", num_input_features, growth_rate, bn_size, drop_rate,
                                           memory_efficient, norm_act)
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size,
                                                    drop_rate, memory_efficient, norm_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_block_forward(self, x)


def dense_block_forward(block: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    """A dense block's forward over the layers ``block`` holds, in order,
    each with :func:`dense_layer_forward`'s attributes and arguments (timm's
    DenseBlock gets it from effilayers.convert)."""
    layers = list(block.values())
    buffer = None
    # Under a tracer the layers call their modules: no buffer, no shared
    # statistics (checked before anything that would branch on x).
    traced = _tracer() is not None
    # Zero-copy concatenation: the maps live in one buffer from the start,
    # so the output is not a second copy of all of them. Not under
    # torch.compile, which cannot trace the storage aliasing (Tensor.set_)
    # and plans what its graph keeps itself.
    if not traced and layers and all(layer.memory_efficient for layer in layers) \
            and not torch.compiler.is_compiling() and x.dim() == 4:
        channels = x.shape[1] + sum(layer.conv2.out_channels for layer in layers)
        buffer = _BlockBuffer(x, channels)
        x = _IntoBuffer.apply(x, buffer, 0)
    features = [x]
    # A channel's batch statistics are the same in every layer that
    # normalises it: compute them once per map, when it appears.
    share = not traced and any(layer.memory_efficient and layer._plain_pair(layer.norm1, layer.relu1)
                               and _uses_batch_statistics(layer.norm1) for layer in layers)
    means: list[torch.Tensor] = []
    variances: list[torch.Tensor] = []
    for layer in layers:
        statistics = None
        if share:
            with torch.no_grad():
                for new in features[len(means):]:
                    mean, var, _ = batch_stats(new)
                    means.append(mean)
                    variances.append(var)
            statistics = (torch.cat(means), torch.cat(variances))
        new_map = layer(features, statistics)
        if buffer is not None:
            new_map = _IntoBuffer.apply(new_map, buffer, sum(f.shape[1] for f in features))
        features.append(new_map)
    if buffer is None:
        return torch.cat(features, 1)
    output = _BufferOutput.apply(buffer, *features)
    buffer.watch(output)
    return output


class Transition(nn.Sequential):
    """norm, relu, 1x1 conv to ``num_output_features``, 2x2 average pooling.
    Memory-efficient: norm and ReLU are recomputed in backward, so only the
    input (the block's output) and the convolution's output are kept."""

    def __init__(self, num_input_features: int, num_output_features: int, memory_efficient: bool = False) -> None:
        super().__init__()
        positive_int(num_input_features, "num_input_features", "Transition")
        positive_int(num_output_features, "num_output_features", "Transition")
        check_bool(memory_efficient, "memory_efficient", "Transition")
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)
        self.memory_efficient = memory_efficient

    _plain_pair = staticmethod(_plain_norm_relu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transition_forward(self, x)


def transition_forward(transition: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A transition's forward, for :class:`Transition` and for any
    Sequential of ``norm``, [``relu``,] ``conv``, ``pool`` with
    ``memory_efficient`` and ``_plain_pair`` (``relu`` None where the norm
    applies its own activation: timm's DenseTransition, given this forward
    by effilayers.convert)."""
    if not (transition.memory_efficient and _recomputes(transition.norm, transition.relu, transition.conv,
                                                        transition._plain_pair)):
        return nn.Sequential.forward(transition, x)
    return transition.pool(_norm_relu_conv([x], transition.norm, transition.conv))


class DenseNet(nn.Module):
    """DenseNet-BC: stem, dense blocks joined by halving transitions, a final
    BatchNorm + ReLU, global average pooling and a linear classifier.

    Args:
        growth_rate: channels each dense layer adds (k).
        block_config: dense layers per block.
        num_init_features: channels of the stem convolution.
        bn_size: bottleneck width as a multiple of ``growth_rate``.
        drop_rate: dropout probability after each layer's ``conv2``, in [0, 1).
        num_classes: classifier outputs.
        memory_efficient: recompute each bottleneck's concatenation, norm and
            ReLU in backward instead of keeping them (module docstring).
        small_inputs: CIFAR-style 3x3 stem without norm0/pool0 (state-dict keys
            then differ from torchvision's).
        norm_act: ``"plain"`` (BatchNorm2d + ReLU, torchvision's function) or
            ``"inplace"``: every ``norm2`` and the stem's ``norm0`` become
            :class:`effilayers.nn.InPlaceABN` with leaky_relu(0.01), written
            over the convolution output before them, and ``pool0`` an
            :class:`effilayers.nn.MaxPool2d` that recomputes its argmax. A
            different (if close) function: opt in to train or fine-tune with
            it. Keys are unchanged, so torchvision checkpoints still load.
    """

    def __init__(self, growth_rate: int = 32, block_config: Sequence[int] = (6, 12, 24, 16),
                 num_init_features: int = 64, bn_size: int = 4, drop_rate: float = 0.0, num_classes: int = 1000,
                 memory_efficient: bool = True, small_inputs: bool = False, norm_act: str = "plain") -> None:
        super().__init__()
        positive_int(growth_rate, "growth_rate", "DenseNet")
        positive_int(num_init_features, "num_init_features", "DenseNet")
        positive_int(bn_size, "bn_size", "DenseNet")
        positive_int(num_classes, "num_classes", "DenseNet")
        drop_rate = _check_drop_rate(drop_rate, "DenseNet")
        check_bool(memory_efficient, "memory_efficient", "DenseNet")
        check_bool(small_inputs, "small_inputs", "DenseNet")
        check_norm_act(norm_act, NORM_ACTS, "DenseNet")
        if isinstance(block_config, (str, bytes)) or not isinstance(block_config, Sequence):
            raise TypeError(f"DenseNet: block_config must be a sequence of ints, got {type(block_config).__name__}")
        block_config = tuple(block_config)
        if not block_config:
            raise ValueError("DenseNet: block_config must name at least one dense block")
        for i, n in enumerate(block_config):
            positive_int(n, f"block_config[{i}]", "DenseNet")
        self.memory_efficient = memory_efficient
        self.small_inputs = small_inputs
        self.norm_act = norm_act

        if small_inputs:
            stem = [("conv0", nn.Conv2d(3, num_init_features, kernel_size=3, stride=1, padding=1, bias=False))]
        else:
            stem = list(zip(("conv0", "norm0", "relu0", "pool0"), imagenet_stem(num_init_features, norm_act, "norm0")))
        self.features = nn.Sequential(OrderedDict(stem))
        channels = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(
                num_layers, channels, bn_size, growth_rate, drop_rate, memory_efficient, norm_act))
            channels += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(channels, channels // 2, memory_efficient))
                channels //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(channels))
        self.classifier = nn.Linear(channels, num_classes)
        self._init_weights()
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight)
            elif isinstance(module, (nn.BatchNorm2d, ABN)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Up to and including the final norm + ReLU: (N, C, H', W')."""
        return F.relu(self.features(x), inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.forward_features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def _rename_legacy_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    # Only keys under this model's prefix: the hook also runs when the model
    # is a submodule of something larger.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _LEGACY_KEY.match(key[len(prefix):])
        if match:
            head, kind, index, leaf = match.groups()
            state_dict[f"{prefix}{head}{kind}{index}.{leaf}"] = state_dict.pop(key)


def _densenet(growth_rate: int, block_config: Sequence[int], num_init_features: int, kwargs: dict) -> DenseNet:
    kwargs = fix_arguments(drop_weight_arguments(kwargs, "DenseNets"), "DenseNet", growth_rate=growth_rate,
                           block_config=tuple(block_config), num_init_features=num_init_features)
    return DenseNet(**kwargs)


def densenet121(**kwargs: Any) -> DenseNet:
    """DenseNet-121 (k = 32, blocks 6-12-24-16, 64 stem channels). Keyword
    arguments go to :class:`DenseNet`; torchvision's checkpoints load strictly."""
    return _densenet(32, (6, 12, 24, 16), 64, kwargs)


def densenet161(**kwargs: Any) -> DenseNet:
    """DenseNet-161 (k = 48, blocks 6-12-36-24, 96 stem channels); see :func:`densenet121`."""
    return _densenet(48, (6, 12, 36, 24), 96, kwargs)


def densenet169(**kwargs: Any) -> DenseNet:
    """DenseNet-169 (k = 32, blocks 6-12-32-32, 64 stem channels); see :func:`densenet121`."""
    return _densenet(32, (6, 12, 32, 32), 64, kwargs)


def densenet201(**kwargs: Any) -> DenseNet:
    """DenseNet-201 (k = 32, blocks 6-12-48-32, 64 stem channels); see :func:`densenet121`."""
    return _densenet(32, (6, 12, 48, 32), 64, kwargs)


def densenet264(**kwargs: Any) -> DenseNet:
    """DenseNet-264 (k = 32, blocks 6-12-64-48, 64 stem channels), from the
    DenseNet paper; torchvision has no such model, so there are no checkpoints
    to load, but its keys follow the same scheme."""
    return _densenet(32, (6, 12, 64, 48), 64, kwargs)
