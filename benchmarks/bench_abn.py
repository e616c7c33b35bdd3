"""Activated BatchNorm: forward+backward time and activation bytes against
BatchNorm + LeakyReLU (and the inplace_abn package when it is installed).

    python -m pytest benchmarks/bench_abn.py --benchmark-group-by=group

Each group is one device/dtype/layout/shape; ``extra_info`` holds the
activation bytes of one forward (effilayers.memory) and the ratio to plain
PyTorch's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from effilayers import memory
from effilayers.nn import ABN, InPlaceABN

from .conftest import devices, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "abn", "kernels": ("effilayers/ops/abn", "effilayers/ops/stats", "effilayers/ops/_batchnorm.py",
                                   "effilayers/ops/_activation.py", "csrc/cuda/abn*", "csrc/cuda/stats*",
                                   "csrc/cpu/abn*", "csrc/cpu/stats.cpp", "csrc/common"),
          "prefix": "abn", "target": "InPlaceABN fwd+bwd <= 0.9x cuDNN BN + LeakyReLU", "ours": "effilayers-inplace",
          "met": (("time_ratio", 0.9),), "cases": 4, "gpu_seconds": 15}

CPU_SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14)]
GPU_SHAPES = [(32, 256, 56, 56)]  # issue 28's: a ResNet stage-2 map, 100 MB in fp32
HAS_INPLACE_ABN = importlib.util.find_spec("inplace_abn") is not None


def implementations():
    names = ["torch", "effilayers-inplace", "effilayers-abn"]
    if HAS_INPLACE_ABN:
        names.append("inplace_abn")
    return names


def cases(cpu_shapes=CPU_SHAPES):
    for device in devices():
        shapes = cpu_shapes if device == "cpu" else GPU_SHAPES
        dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
        for shape in shapes:
            for dtype in dtypes:
                for layout in ("contiguous", "channels_last"):
                    yield pytest.param(device, shape, dtype, layout,
                                       id=f"{device}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}-{layout}")


def build(implementation, channels, activation="leaky_relu"):
    param = 0.01 if activation == "leaky_relu" else 0.0
    if implementation == "torch":
        torch_activation = {"leaky_relu": nn.LeakyReLU(0.01), "silu": nn.SiLU()}[activation]
        return nn.Sequential(nn.BatchNorm2d(channels), torch_activation)
    if implementation == "effilayers-inplace":
        return InPlaceABN(channels, activation=activation, activation_param=param)
    if implementation == "effilayers-abn":
        return ABN(channels, activation=activation, activation_param=param)
    import inplace_abn

    return inplace_abn.InPlaceABN(channels, activation=activation, activation_param=param)


def time_forward_backward(benchmark, implementation, activation, device, shape, dtype, layout):
    module = build(implementation, shape[1], activation).to(device)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    source = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=memory_format)
    grad = torch.randn_like(source)
    name = "abn" if activation == "leaky_relu" else f"abn {activation}"
    benchmark.group = f"{name} {device} {'x'.join(map(str, shape))} {str(dtype)[6:]} {layout}"

    # The layer's input is the output of a previous layer (a convolution, in a
    # network): every variant gets a fresh non-leaf copy, timed alike.
    def step():
        out = module(source.clone())
        out.backward(grad)
        synchronize(device)

    saved = memory.activation_bytes(lambda t: module(t * 1), source, exclude=module)
    plain = build("torch", shape[1], activation).to(device)
    saved_plain = memory.activation_bytes(lambda t: plain(t * 1), source, exclude=plain)
    benchmark.extra_info.update(activation_bytes=saved, activation_bytes_ratio=saved / saved_plain)
    benchmark.pedantic(step, warmup_rounds=3, rounds=30 if device == "cpu" else 50)


@pytest.mark.parametrize("device, shape, dtype, layout", list(cases()))
@pytest.mark.parametrize("implementation", implementations())
def test_forward_backward(benchmark, implementation, device, shape, dtype, layout):
    time_forward_backward(benchmark, implementation, "leaky_relu", device, shape, dtype, layout)


# A smooth activation takes the kernels' transcendental path (SiLU, GELU,
# Mish, sigmoid, tanh share one instantiation and pick their formula at run
# time). ABN only: it is not invertible, so InPlaceABN refuses it.
@pytest.mark.parametrize("device, shape, dtype, layout", list(cases(CPU_SHAPES[:1])))
@pytest.mark.parametrize("implementation", ["torch", "effilayers-abn"])
def test_forward_backward_smooth(benchmark, implementation, device, shape, dtype, layout):
    time_forward_backward(benchmark, implementation, "silu", device, shape, dtype, layout)


# Named like the layer benchmarks' implementations, so tables line up.
RESNET_VARIANTS = [pytest.param("plain", id="torch-cpu-resnet50"),
                   pytest.param("abn", id="effilayers-abn-cpu-resnet50"),
                   pytest.param("inplace", id="effilayers-inplace-cpu-resnet50")]


@pytest.mark.parametrize("norm_act", RESNET_VARIANTS)
def test_resnet50_activation_bytes(benchmark, norm_act):
    """Activation bytes of ResNet-50 at 224x224 (target for norm_act="inplace":
    <= 0.55x of plain). Timed: one forward pass on CPU, batch 2."""
    from effilayers.models import resnet50

    torch.manual_seed(0)
    model = resnet50(norm_act=norm_act)
    plain = resnet50(norm_act="plain")
    x = torch.randn(2, 3, 224, 224)
    saved = memory.activation_bytes(model, x)
    saved_plain = memory.activation_bytes(plain, x)
    benchmark.group = "resnet50 224x224 activation bytes (batch 2, cpu forward time)"
    benchmark.extra_info.update(activation_bytes=saved, activation_bytes_ratio=saved / saved_plain)
    benchmark.pedantic(lambda: model(x), warmup_rounds=2, rounds=7)
