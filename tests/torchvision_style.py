"""Stand-ins for torchvision's ResNet classes (torchvision is not installable
here), written from the architecture: the same class names, child names,
registration order and forward data flow (a shared ``relu`` module called
after each norm, the last time after the shortcut sum), so
``effilayers.convert`` sees what it would see in a torchvision model, and the
same function, so they serve as the reference for ``effilayers.models``.

``widths`` shrinks the stages for fast float64 tests; the default is
ImageNet's (64, 128, 256, 512).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from effilayers.nn import ABN


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels, planes, stride=1, downsample=None, groups=1, base_width=64, dilation=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        shortcut = x
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.downsample is not None:
            shortcut = self.downsample(x)
        y += shortcut
        return self.relu(y)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels, planes, stride=1, downsample=None, groups=1, base_width=64, dilation=1):
        super().__init__()
        inner = int(planes * base_width / 64) * groups
        self.conv1 = nn.Conv2d(in_channels, inner, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, inner, 3, stride, padding=dilation, dilation=dilation, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = nn.Conv2d(inner, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        shortcut = x
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        if self.downsample is not None:
            shortcut = self.downsample(x)
        y += shortcut
        return self.relu(y)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=10, groups=1, width_per_group=64, widths=(64, 128, 256, 512)):
        super().__init__()
        self.groups, self.base_width = groups, width_per_group
        self.channels = widths[0]
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.layer1 = self._stage(block, widths[0], layers[0], 1)
        self.layer2 = self._stage(block, widths[1], layers[1], 2)
        self.layer3 = self._stage(block, widths[2], layers[2], 2)
        self.layer4 = self._stage(block, widths[3], layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)

    def _stage(self, block, planes, count, stride):
        downsample = None
        if stride != 1 or self.channels != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.channels, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        blocks = [block(self.channels, planes, stride, downsample, self.groups, self.base_width)]
        self.channels = planes * block.expansion
        blocks += [block(self.channels, planes, 1, None, self.groups, self.base_width) for _ in range(1, count)]
        return nn.Sequential(*blocks)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm-like module (anything with running stats) distinct,
    non-trivial weights, biases and running statistics, so a mixed-up
    parameter or a dropped affine shows. Weights stay away from 0 (|w| >=
    0.5, either sign) so InPlaceABN uses them unchanged."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (_BatchNorm, ABN)):
                continue
            channels = module.num_features
            if module.weight is not None:
                magnitude = 0.5 + torch.rand(channels, generator=generator, dtype=torch.float64)
                sign = torch.where(torch.rand(channels, generator=generator) < 0.2, -1.0, 1.0).double()
                module.weight.copy_(magnitude * sign)
                module.bias.copy_(torch.randn(channels, generator=generator, dtype=torch.float64) * 0.3)
            if module.running_mean is not None:
                module.running_mean.copy_(torch.randn(channels, generator=generator, dtype=torch.float64) * 0.2)
                module.running_var.copy_(0.5 + torch.rand(channels, generator=generator, dtype=torch.float64))
                module.num_batches_tracked.fill_(7)
    return model


def relu_to_leaky(model: nn.Module, slope: float = 0.01) -> nn.Module:
    """Every nn.ReLU module becomes LeakyReLU(slope), in place: the function
    a ReLU model has once convert(mode="inplace") changed its activations."""
    for module in list(model.modules()):
        for name, child in list(module._modules.items()):
            if type(child) is nn.ReLU:
                module._modules[name] = nn.LeakyReLU(slope, inplace=child.inplace)
    return model
