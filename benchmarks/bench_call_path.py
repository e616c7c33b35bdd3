"""How a call travels: host time of a layer against the PyTorch modules it
replaces, where the kernels are too small for their own time to matter.

    python -m pytest benchmarks/bench_call_path.py --benchmark-group-by=group

Each test times its variants interleaved (blocks of calls taken in turn, so
load from other processes falls on all of them alike), records the median
time per call of each and the ratio to the PyTorch peer in ``extra_info``,
and hands the effilayers variant to pytest-benchmark for its table. Targets
(issue "Architecture, second step"): InPlaceABN forward+backward on a small
tensor <= 1.1x BatchNorm2d + LeakyReLU; ABN <= 1.0x BatchNorm2d + LeakyReLU in
both layouts at the layer benchmark's shape.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import pytest
import torch
from torch import nn

from effilayers.nn import ABN, InPlaceABN

SMALL = (2, 64, 8, 8)
LAYER = (32, 64, 56, 56)


def interleaved_medians(steps: dict, blocks: int, calls: int, warmup: int = 10,
                        clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median seconds per call of each step, over ``blocks`` rounds in which
    every step runs ``calls`` times in turn, read on ``clock`` (the wall
    clock, or e.g. ``time.process_time`` for the process's CPU time)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for _ in range(blocks):
        for name, step in steps.items():
            start = clock()
            for _ in range(calls):
                step()
            times[name].append((clock() - start) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


def training_step(module: nn.Module, shape, layout: str):
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    source = torch.randn(shape).contiguous(memory_format=memory_format)
    grad = torch.randn_like(source)

    # A layer's input is a previous layer's output: a fresh non-leaf copy each call, for every variant alike.
    def step():
        module(source.clone()).backward(grad)

    return step


def _compare(benchmark, ours: str, shape, layout: str, blocks: int, calls: int) -> None:
    channels = shape[1]
    modules = {
        "torch BatchNorm2d+LeakyReLU": nn.Sequential(nn.BatchNorm2d(channels), nn.LeakyReLU(0.01)),
        "effilayers InPlaceABN": InPlaceABN(channels, activation_param=0.01),
        "effilayers ABN": ABN(channels, activation_param=0.01),
    }
    steps = {name: training_step(module, shape, layout) for name, module in modules.items()}
    medians = interleaved_medians(steps, blocks, calls)
    peer = medians["torch BatchNorm2d+LeakyReLU"]
    benchmark.group = f"call path cpu {'x'.join(map(str, shape))} {layout} threads={torch.get_num_threads()}"
    benchmark.extra_info.update(
        median_us={name: value * 1e6 for name, value in medians.items()},
        ratio_to_torch={name: value / peer for name, value in medians.items()},
    )
    benchmark.pedantic(steps[ours], warmup_rounds=2, rounds=blocks)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_small_tensor_host_time(benchmark, layout):
    """InPlaceABN / ABN forward+backward on 2x64x8x8: host overhead only.
    Measured on one thread, so a second thread's scheduling does not blur
    microsecond timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare(benchmark, "effilayers InPlaceABN", SMALL, layout, blocks=30, calls=50)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_layer_time(benchmark, layout):
    """ABN / InPlaceABN forward+backward at the layer benchmark's CPU shape."""
    _compare(benchmark, "effilayers ABN", LAYER, layout, blocks=7, calls=2)


def _compare_steps(benchmark, group: str, steps: dict, peer: str, ours: str, blocks: int, calls: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        medians = interleaved_medians(steps, blocks, calls)
    finally:
        torch.set_num_threads(threads)
    benchmark.group = f"call path cpu {group} threads=1"
    benchmark.extra_info.update(
        median_us={name: value * 1e6 for name, value in medians.items()},
        ratio_to_torch={name: value / medians[peer] for name, value in medians.items()},
    )
    benchmark.pedantic(steps[ours], warmup_rounds=2, rounds=blocks)


def test_dense_layer_host_time(benchmark):
    """One DenseNet layer (64 maps in, growth 32, bottleneck 4) forward+backward
    on 2x64x8x8: the recomputing bottleneck against the plain layer."""
    from effilayers.models.densenet import DenseLayer

    plain = DenseLayer(64, 32, 4, 0.0, memory_efficient=False)
    ours = DenseLayer(64, 32, 4, 0.0, memory_efficient=True)
    ours.load_state_dict(plain.state_dict())
    features = [torch.randn(SMALL, requires_grad=True)]
    grad = torch.randn(SMALL[0], 32, *SMALL[2:])
    steps = {"plain DenseLayer": lambda: plain(features).backward(grad),
             "effilayers DenseLayer (memory_efficient)": lambda: ours(features).backward(grad)}
    _compare_steps(benchmark, "dense layer 2x64x8x8", steps, "plain DenseLayer",
                   "effilayers DenseLayer (memory_efficient)", blocks=30, calls=20)


def test_softmax_module_host_time(benchmark):
    """``effilayers.nn.Softmax`` against ``torch.nn.Softmax``, forward+backward
    on 16x128 rows."""
    from effilayers.nn import Softmax

    x = torch.randn(16, 128, requires_grad=True)
    grad = torch.randn(16, 128)
    theirs, ours = nn.Softmax(-1), Softmax(-1)
    steps = {"torch Softmax": lambda: theirs(x).backward(grad), "effilayers Softmax": lambda: ours(x).backward(grad)}
    _compare_steps(benchmark, "softmax 16x128", steps, "torch Softmax", "effilayers Softmax", blocks=30, calls=50)
