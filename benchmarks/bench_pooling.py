"""Max pooling that recomputes its argmax (``effilayers.nn.MaxPool2d``)
against ``torch.nn.MaxPool2d``, which keeps int64 indices for backward.

    python -m pytest benchmarks/bench_pooling.py --benchmark-group-by=group

Each group is one device/dtype/layout/shape/window and times forward +
backward. ``extra_info`` holds the bytes the layer keeps for backward
(``effilayers.memory``; its input, plus torch's indices), their ratio to
torch's, and ``bytes_beyond_input``: what it keeps besides its input, which
the layer before it (a ReLU, in a ResNet stem) usually keeps anyway. The
recomputation costs one more pooling pass in backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effilayers import memory
from effilayers.nn import MaxPool2d

from .conftest import devices, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "pooling", "kernels": ("effilayers/nn/pooling.py",), "prefix": "pooling", "target": "no target"}

# (shape, window): the ResNet stem pool (3x3, stride 2, padding 1) and a
# VGG-style 2x2 pool.
STEM = dict(kernel_size=3, stride=2, padding=1)
PAIR = dict(kernel_size=2, stride=2)
CPU_CASES = [((16, 64, 112, 112), STEM), ((32, 128, 56, 56), PAIR)]
GPU_CASES = [((128, 64, 112, 112), STEM), ((128, 128, 112, 112), PAIR)]
IMPLEMENTATIONS = ["torch", "effilayers"]


def _window_id(window: dict) -> str:
    return f"k{window['kernel_size']}s{window['stride']}p{window.get('padding', 0)}"


def cases():
    for device in devices():
        dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
        for shape, window in (CPU_CASES if device == "cpu" else GPU_CASES):
            for dtype in dtypes:
                for layout in ("contiguous", "channels_last"):
                    yield pytest.param(device, shape, window, dtype, layout,
                                       id=f"{device}-{'x'.join(map(str, shape))}-{_window_id(window)}-"
                                          f"{str(dtype)[6:]}-{layout}")


def build(implementation: str, window: dict) -> nn.Module:
    return nn.MaxPool2d(**window) if implementation == "torch" else MaxPool2d(**window)


def _saved_bytes(module: nn.Module, source: torch.Tensor) -> int:
    # `t * 1`: the pool's input is a fresh non-leaf, as in a network.
    return memory.activation_bytes(lambda t: module(t * 1), source.detach().requires_grad_())


@pytest.mark.parametrize("device, shape, window, dtype, layout", list(cases()))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_backward(benchmark, implementation, device, shape, window, dtype, layout):
    module = build(implementation, window)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    source = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=memory_format)
    grad = torch.randn_like(module(source))
    benchmark.group = f"maxpool2d {device} {'x'.join(map(str, shape))} {_window_id(window)} {str(dtype)[6:]} {layout}"

    # A fresh leaf over the same storage each round: no copy is timed, and
    # every implementation allocates its input gradient alike.
    def step():
        x = source.detach().requires_grad_()
        module(x).backward(grad)
        synchronize(device)

    saved = _saved_bytes(module, source)
    saved_torch = _saved_bytes(build("torch", window), source)
    input_bytes = source.numel() * source.element_size()
    benchmark.extra_info.update(activation_bytes=saved, activation_bytes_ratio=saved / saved_torch,
                                bytes_beyond_input=saved - input_bytes)
    benchmark.pedantic(step, warmup_rounds=2, rounds=20 if device == "cpu" else 50)
