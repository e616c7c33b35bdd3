"""ResNet, ResNeXt and Wide ResNet with a choice of norm + activation.

The architectures are the ImageNet ResNets of He et al. (2016) in the
"v1.5" form torchvision uses (the stride of a bottleneck sits on its 3x3
convolution), with ResNeXt's grouped 3x3 (Xie et al., 2017) and Wide
ResNet's wider bottlenecks (Zagoruyko & Komodakis, 2016). Module names,
registration order and therefore state-dict keys are exactly torchvision's
for every ``norm_act``, so checkpoints move freely between them.

``norm_act`` picks what follows each convolution:

``"plain"``    ``BatchNorm2d`` then ``ReLU``: torchvision's function.
``"abn"``      :class:`effilayers.nn.ABN` with ``relu``: the same function,
               BatchNorm and ReLU in one kernel. Not a memory saving: ABN
               keeps its input as BatchNorm does, and a block with a
               projection shortcut also keeps the shortcut for the fused sum
               (about +6% activation bytes on resnet50).
``"inplace"``  :class:`effilayers.nn.InPlaceABN` with ``leaky_relu(0.01)``,
               written over the convolution output, which is then the only
               copy kept for backward; the end of each block,
               ``act(bn(out) + identity)``, is one in-place call too. ReLU is
               not invertible, so the activation changes to leaky_relu(0.01):
               a different (if close) function, to fine-tune or train with.
               A scale ``|weight| < 1e-3`` is used as ``±1e-3`` (see
               ``InPlaceABN``); ``zero_init_residual=True`` therefore starts
               the last norm of each block at 1e-3, not 0.

The BatchNorm of a projection shortcut has no activation after it: plain
``nn.BatchNorm2d`` in ``"plain"`` and ``"abn"`` modes; in ``"inplace"`` mode an
identity :class:`~effilayers.nn.InPlaceABN` written over its 1x1 convolution's
output (the fused sum keeps the shortcut anyway, so nothing else is kept),
and the stem pool is :class:`effilayers.nn.MaxPool2d`, which recomputes its
argmax in backward instead of keeping int64 indices. In fused modes the
stem's ``relu`` is a pass-through :class:`effilayers.ops.abn.module.FusedActivation`
(``bn1`` applies the activation) and the blocks have no ``relu``; none of
these hold state, so the keys do not change.

Activation memory (``effilayers.memory.activation_bytes``, resnet50, batch 2,
float32): ``"inplace"`` keeps 0.53x of ``"plain"`` at 224x224 (0.54x at
64x64; ``python -m pytest benchmarks/bench_abn.py -k resnet50``). A block
with an identity shortcut keeps exactly half (three maps instead of six); a
block with a projection shortcut keeps the shortcut once, for its fused sum.

Loading a torchvision checkpoint (weights ship with torchvision, not here)::

    import torchvision
    reference = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    model = effilayers.models.resnet50(norm_act="inplace")
    model.load_state_dict(reference.state_dict())   # strict: every key matches

With ``norm_act="plain"`` or ``"abn"`` the model then computes exactly what
the torchvision one does; with ``"inplace"`` it computes the leaky_relu
variant of it. Going back, ``effilayers.revert(model)`` turns the fused
modules into ``BatchNorm2d`` + activation modules (state dict unchanged) for
export.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Type, Union

import torch
from torch import nn

from ..ops.abn.module import ABN, fused_norm
from ._common import (
    INPLACE_SLOPE as INPLACE_SLOPE,  # re-exported: effilayers.bench reads it here
    activated_norm,
    check_norm_act,
    drop_weight_arguments,
    fix_arguments,
    imagenet_stem,
)

__all__ = [
    "NORM_ACTS",
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
]

NORM_ACTS = ("plain", "abn", "inplace")


def _shortcut_norm(channels: int, norm_act: str) -> nn.Module:
    """The norm of a projection shortcut: no activation follows it, only the
    block's fused sum, which keeps the shortcut for its backward anyway. In
    place mode an identity InPlaceABN writes over the 1x1 convolution's
    output, so that output is not kept a second time (as BatchNorm's input)."""
    if norm_act == "inplace":
        return fused_norm(channels, activation="identity", activation_param=0.0, in_place=True)
    return nn.BatchNorm2d(channels)


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    # padding = dilation keeps the spatial size at stride 1.
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=dilation, groups=groups,
                     bias=False, dilation=dilation)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False)


class _ResidualBlock(nn.Module):
    """What both blocks share: per-norm dispatch between the plain form
    (``norm`` then the block's ``relu`` module) and the fused form (an ABN
    that applies its own activation), and assembly from existing modules.

    A block is fused when its norms are ABNs; it then has no ``relu`` child.
    The dispatch is per norm so that :func:`effilayers.convert` /
    :func:`effilayers.revert` can flip a block without rebuilding it.
    """

    expansion: int = 1
    # Registration order of the children; it fixes the state-dict key order.
    _CHILDREN: tuple[str, ...] = ()

    downsample: Optional[nn.Module]

    def _activated(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, ABN):
            return norm(x)
        return self.relu(norm(x))

    def _activated_sum(self, norm: nn.Module, x: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, ABN):
            # One call: act(bn(x) + identity), written over x when in place.
            return norm(x, residual=identity)
        out = norm(x)
        out += identity
        return self.relu(out)

    def norms(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self._CHILDREN if name.startswith("bn")]

    @property
    def is_fused(self) -> bool:
        return all(isinstance(norm, ABN) for norm in self.norms())

    @classmethod
    def _from_modules(cls, modules: dict[str, Optional[nn.Module]], stride: int, training: bool):
        """A block around existing modules (no new parameters), children in
        the canonical order; names missing from ``modules`` are left out."""
        block = cls.__new__(cls)
        nn.Module.__init__(block)
        for name in cls._CHILDREN:
            module = modules.get(name)
            if module is not None:
                setattr(block, name, module)
        # Without a shortcut module, `downsample` is a plain None attribute
        # (not a child), as torchvision's blocks have it.
        if modules.get("downsample") is None:
            block.downsample = None
        block.stride = stride
        block.training = training  # the children keep their own flags
        return block

    def _set_children(self, modules: dict[str, Optional[nn.Module]]) -> None:
        """Replace children in place, keeping the canonical order."""
        for name in self._CHILDREN:
            if name in self._modules:
                del self._modules[name]
        for name in self._CHILDREN:
            module = modules.get(name)
            if module is not None:
                setattr(self, name, module)  # also drops a same-named plain attribute
            elif name == "downsample":
                self.downsample = None


class BasicBlock(_ResidualBlock):
    """Two 3x3 convolutions and an identity (or projected) shortcut, as in ResNet-18/34."""

    expansion = 1
    _CHILDREN = ("conv1", "bn1", "relu", "conv2", "bn2", "downsample")

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 groups: int = 1, base_width: int = 64, dilation: int = 1, norm_act: str = "plain") -> None:
        super().__init__()
        check_norm_act(norm_act, NORM_ACTS)
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64 (use Bottleneck for ResNeXt / "
                             f"Wide ResNet), got groups={groups}, base_width={base_width}")
        if dilation > 1:
            raise NotImplementedError("BasicBlock does not support dilation > 1 (replace_stride_with_dilation "
                                      "needs Bottleneck blocks)")
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = activated_norm(planes, norm_act)
        if norm_act == "plain":
            self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = activated_norm(planes, norm_act)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self._activated(self.bn1, self.conv1(x))
        return self._activated_sum(self.bn2, self.conv2(out), identity)


class Bottleneck(_ResidualBlock):
    """1x1 reduce, 3x3 (strided, grouped, dilated), 1x1 expand by 4, plus a
    shortcut: the block of ResNet-50/101/152, ResNeXt and Wide ResNet."""

    expansion = 4
    _CHILDREN = ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu", "downsample")

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 groups: int = 1, base_width: int = 64, dilation: int = 1, norm_act: str = "plain") -> None:
        super().__init__()
        check_norm_act(norm_act, NORM_ACTS)
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = activated_norm(width, norm_act)
        self.conv2 = _conv3x3(width, width, stride, groups, dilation)
        self.bn2 = activated_norm(width, norm_act)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = activated_norm(planes * self.expansion, norm_act)
        if norm_act == "plain":
            self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self._activated(self.bn1, self.conv1(x))
        out = self._activated(self.bn2, self.conv2(out))
        return self._activated_sum(self.bn3, self.conv3(out), identity)


Block = Union[Type[BasicBlock], Type[Bottleneck]]


class ResNet(nn.Module):
    """A 7x7 stem, four stages of residual blocks, global average pooling and
    a linear classifier.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: blocks per stage (four ints).
        num_classes: classifier outputs.
        zero_init_residual: start the last norm of every block at weight 0,
            so each block begins as its shortcut (1e-3 instead of 0 with
            ``norm_act="inplace"``, see the module docstring).
        groups: ResNeXt cardinality of the bottleneck 3x3 convolutions.
        width_per_group: Wide ResNet width of the bottleneck 3x3
            convolutions (per group).
        replace_stride_with_dilation: three bools, for stages 2-4: keep the
            resolution and dilate instead of striding (dense prediction).
        norm_act: ``"plain"``, ``"abn"`` or ``"inplace"`` (module docstring).
    """

    def __init__(self, block: Block, layers: Sequence[int], num_classes: int = 1000,
                 zero_init_residual: bool = False, groups: int = 1, width_per_group: int = 64,
                 replace_stride_with_dilation: Optional[Sequence[bool]] = None, norm_act: str = "plain") -> None:
        super().__init__()
        check_norm_act(norm_act, NORM_ACTS)
        if block not in (BasicBlock, Bottleneck):
            raise TypeError(f"block must be effilayers.models.resnet.BasicBlock or Bottleneck, got {block!r}")
        if len(layers) != 4 or not all(isinstance(n, int) and n > 0 for n in layers):
            raise ValueError(f"layers must be four positive ints (blocks per stage), got {list(layers)!r}")
        if replace_stride_with_dilation is None:
            replace_stride_with_dilation = [False, False, False]
        if len(replace_stride_with_dilation) != 3:
            raise ValueError("replace_stride_with_dilation must be None or three bools (stages 2, 3, 4), "
                             f"got {replace_stride_with_dilation!r}")
        self.inplanes = 64
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

        self.conv1, self.bn1, self.relu, self.maxpool = imagenet_stem(self.inplanes, norm_act, "bn1")
        self.layer1 = self._make_layer(block, 64, layers[0], 1, False, norm_act)
        self.layer2 = self._make_layer(block, 128, layers[1], 2, replace_stride_with_dilation[0], norm_act)
        self.layer3 = self._make_layer(block, 256, layers[2], 2, replace_stride_with_dilation[1], norm_act)
        self.layer4 = self._make_layer(block, 512, layers[3], 2, replace_stride_with_dilation[2], norm_act)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self._init_weights(zero_init_residual)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int, dilate: bool,
                    norm_act: str) -> nn.Sequential:
        previous_dilation = self.dilation
        if dilate:
            self.dilation *= stride
            stride = 1
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       _shortcut_norm(planes * block.expansion, norm_act))
        stage = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width, previous_dilation,
                       norm_act=norm_act)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            stage.append(block(self.inplanes, planes, groups=self.groups, base_width=self.base_width,
                               dilation=self.dilation, norm_act=norm_act))
        return nn.Sequential(*stage)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, ABN)) and module.affine:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, _ResidualBlock):
                    nn.init.zeros_(module.norms()[-1].weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Everything up to the global pooling: (N, 512 * expansion, H/32, W/32)."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.layer4(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.forward_features(x))
        return self.fc(torch.flatten(x, 1))


def _resnet(block: Block, layers: Sequence[int], kwargs: dict) -> ResNet:
    return ResNet(block, layers, **drop_weight_arguments(kwargs, "ResNets"))


def resnet18(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNet-18 (BasicBlock, 2-2-2-2). Keyword arguments go to :class:`ResNet`;
    torchvision's ``resnet18`` checkpoints load with ``load_state_dict``."""
    return _resnet(BasicBlock, [2, 2, 2, 2], dict(kwargs, norm_act=norm_act))


def resnet34(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNet-34 (BasicBlock, 3-4-6-3); see :func:`resnet18`."""
    return _resnet(BasicBlock, [3, 4, 6, 3], dict(kwargs, norm_act=norm_act))


def resnet50(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNet-50 (Bottleneck, 3-4-6-3); see :func:`resnet18`."""
    return _resnet(Bottleneck, [3, 4, 6, 3], dict(kwargs, norm_act=norm_act))


def resnet101(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNet-101 (Bottleneck, 3-4-23-3); see :func:`resnet18`."""
    return _resnet(Bottleneck, [3, 4, 23, 3], dict(kwargs, norm_act=norm_act))


def resnet152(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNet-152 (Bottleneck, 3-8-36-3); see :func:`resnet18`."""
    return _resnet(Bottleneck, [3, 8, 36, 3], dict(kwargs, norm_act=norm_act))


def resnext50_32x4d(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """ResNeXt-50 32x4d: ResNet-50 with 32 groups of width 4 in each 3x3; see :func:`resnet18`."""
    kwargs = fix_arguments(dict(kwargs, norm_act=norm_act), "ResNet", groups=32, width_per_group=4)
    return _resnet(Bottleneck, [3, 4, 6, 3], kwargs)


def wide_resnet50_2(*, norm_act: str = "plain", **kwargs: Any) -> ResNet:
    """Wide ResNet-50-2: ResNet-50 with bottlenecks twice as wide (the 1x1
    expansion output is unchanged); see :func:`resnet18`."""
    kwargs = fix_arguments(dict(kwargs, norm_act=norm_act), "ResNet", width_per_group=64 * 2)
    return _resnet(Bottleneck, [3, 4, 6, 3], kwargs)
