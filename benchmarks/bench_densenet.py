"""Memory-efficient DenseNet against the naive model and checkpointing.

    python -m pytest benchmarks/bench_densenet.py --benchmark-group-by=group

Variants, all DenseNet-121 with the same weights:

``torch-naive``            ``memory_efficient=False``: plain PyTorch modules.
``torch-checkpoint``       torchvision's ``memory_efficient=True`` when
                           torchvision imports, else the same construction
                           here: each ``cat -> norm1 -> relu1 -> conv1`` under
                           ``torch.utils.checkpoint`` (which also runs norm1's
                           running-statistics update a second time in backward).
``effilayers``             ``memory_efficient=True`` (exact function).
``effilayers-inplace``     ``memory_efficient=True, norm_act="inplace"``
                           (leaky_relu norm2/norm0, a different function).

Each test records the activation bytes of one forward at 1x3x224x224
(``effilayers.memory``, device-independent) and their ratio to the naive
model's in ``extra_info``, and times a training step (forward, backward) at
the device's size: CPU 4x3x64x64, CUDA 64x3x224x224 (plus CUDA peak bytes).
Targets (issue 4): activation bytes <= 0.33x naive at 224; on GPU a step
<= 1.05x the naive model's time.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from effilayers import memory
from effilayers.models import densenet121
from effilayers.models.densenet import DenseLayer

from .conftest import devices, synchronize

VARIANTS = ["torch-naive", "torch-checkpoint", "effilayers", "effilayers-inplace"]
STEP_SHAPE = {"cpu": (4, 3, 64, 64), "cuda": (64, 3, 224, 224)}


def _torchvision_densenet121():
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision

        return torchvision.models.densenet121(memory_efficient=True)
    except Exception:  # noqa: BLE001 - a CPU torch with a CUDA torchvision fails to load its ops
        return None


class _CheckpointedLayer(DenseLayer):
    """torchvision's recipe: the bottleneck under activation checkpointing."""

    def forward(self, features, batch_statistics=None):
        features = [features] if isinstance(features, torch.Tensor) else list(features)

        def bottleneck(*maps):
            return self.conv1(self.relu1(self.norm1(torch.cat(maps, 1))))

        out = checkpoint(bottleneck, *features, use_reentrant=False)
        out = self.conv2(self.relu2(self.norm2(out)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


def checkpointed(model):
    """``model`` (built with ``memory_efficient=False``) with every dense
    layer's bottleneck under checkpointing, in place; tests/test_densenet.py
    uses it to show the second running-statistics update."""
    for module in model.modules():
        if isinstance(module, DenseLayer):
            module.__class__ = _CheckpointedLayer
    return model


def build(variant: str):
    torch.manual_seed(0)
    if variant == "torch-naive":
        return densenet121(memory_efficient=False)
    if variant == "torch-checkpoint":
        model = _torchvision_densenet121()
        if model is not None:
            return model
        return checkpointed(densenet121(memory_efficient=False))
    if variant == "effilayers":
        return densenet121(memory_efficient=True)
    return densenet121(memory_efficient=True, norm_act="inplace")


def _activation_bytes_224(variant: str) -> int:
    model = build(variant)
    return memory.activation_bytes(model, torch.randn(1, 3, 224, 224))


@pytest.fixture(scope="module")
def naive_bytes_224():
    return _activation_bytes_224("torch-naive")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("variant", VARIANTS)
def test_densenet121_training_step(benchmark, variant, device, naive_bytes_224):
    saved = _activation_bytes_224(variant)
    shape = STEP_SHAPE[device]
    model = build(variant).to(device).train()
    x = torch.randn(shape, device=device)
    target = torch.randint(0, 1000, (shape[0],), device=device)

    def step():
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        model.zero_grad(set_to_none=True)
        synchronize(device)

    benchmark.group = f"densenet121 training step {device} {'x'.join(map(str, shape))}"
    # Activation bytes at 1x3x224x224, whatever the timed shape (named like
    # the other suites' keys so summarize.py shows the ratio).
    info = dict(activation_bytes=saved, activation_bytes_ratio=saved / naive_bytes_224,
                activation_bytes_shape="1x3x224x224")
    if device == "cuda":
        step()
        info["cuda_peak_bytes"] = memory.cuda_peak_bytes(step)
    benchmark.extra_info.update(info)
    benchmark.pedantic(step, warmup_rounds=1, rounds=5 if device == "cpu" else 20)
