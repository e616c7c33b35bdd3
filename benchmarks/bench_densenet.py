"""Memory-efficient DenseNet against the naive model and checkpointing.

    python -m pytest benchmarks/bench_densenet.py --benchmark-group-by=group

Variants, all DenseNet-121 with the same weights:

``torch-naive``            ``memory_efficient=False``: plain PyTorch modules.
``torch-checkpoint``       torchvision's ``memory_efficient=True`` when
                           torchvision imports, else the same construction
                           (``effilayers.bench.checkpointed_densenet``, also a
                           variant of ``python -m effilayers.bench``): each
                           ``cat -> norm1 -> relu1 -> conv1`` under
                           ``torch.utils.checkpoint`` (which also runs norm1's
                           running-statistics update a second time in backward).
``effilayers``             ``memory_efficient=True`` (exact function).
``effilayers-inplace``     ``memory_efficient=True, norm_act="inplace"``
                           (leaky_relu norm2/norm0, a different function).

Each test records the activation bytes of one forward at 1x3x224x224
(``effilayers.memory``, device-independent) and their ratio to the naive
model's in ``extra_info``, and times a training step (forward, backward) at
the device's size: CPU 4x3x64x64 in float32, CUDA 64x3x224x224 under bf16
autocast, as models are trained there (plus CUDA peak bytes).
Targets (issue 4): activation bytes <= 0.33x naive at 224; on GPU a step
<= 1.05x the naive model's time.

``test_bottleneck`` times one bottleneck alone (concatenation, BatchNorm in
training, ReLU, 1x1 convolution; forward and backward), ``torch-naive``
being that composition in plain PyTorch. The op is memory-bound, so on
CUDA its rows also hold ``pct_of_copy``: the bytes any bottleneck must move
over its CUDA-event median, against a device-to-device copy of the
concatenation (conftest.copy_gb_per_s).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory
from effilayers.bench import checkpointed_densenet, torchvision_densenet
from effilayers.models import densenet121
from effilayers.ops.densenet import bottleneck

from .conftest import copy_gb_per_s, device_median_seconds, devices, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "densenet", "kernels": ("effilayers/ops/densenet", "csrc/cpu/densenet.cpp",
                                        "effilayers/models/densenet.py"),
          "prefix": "densenet", "target": "step <= 1.05x naive at <= 0.33x activation bytes",
          "baseline": "torch-naive", "met": (("time_ratio", 1.05), ("activation_bytes_ratio", 0.33)), "cases": 2,
          "gpu_seconds": 35}

VARIANTS = ["torch-naive", "torch-checkpoint", "effilayers", "effilayers-inplace"]
STEP_SHAPE = {"cpu": (4, 3, 64, 64), "cuda": (64, 3, 224, 224)}


def build(variant: str):
    torch.manual_seed(0)
    if variant == "torch-naive":
        return densenet121(memory_efficient=False)
    if variant == "torch-checkpoint":
        torchvision_builder, _ = torchvision_densenet("densenet121")
        if torchvision_builder is not None:
            return torchvision_builder()
        return checkpointed_densenet(densenet121(memory_efficient=False))
    if variant == "effilayers":
        return densenet121(memory_efficient=True)
    return densenet121(memory_efficient=True, norm_act="inplace")


def _activation_bytes_224(variant: str) -> int:
    model = build(variant)
    return memory.activation_bytes(model, torch.randn(1, 3, 224, 224))


@pytest.fixture(scope="module")
def naive_bytes_224():
    return _activation_bytes_224("torch-naive")


def host_issue_ms(model, x, target, autocast, device, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = F.cross_entropy(model(x), target)
        loss.backward()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    synchronize(device)
    return statistics.median(times)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("variant", VARIANTS)
def test_densenet121_training_step(benchmark, variant, device, naive_bytes_224):
    saved = _activation_bytes_224(variant)
    shape = STEP_SHAPE[device]
    model = build(variant).to(device).train()
    x = torch.randn(shape, device=device)
    target = torch.randint(0, 1000, (shape[0],), device=device)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def step():
        with autocast:
            loss = F.cross_entropy(model(x), target)
        loss.backward()
        model.zero_grad(set_to_none=True)
        synchronize(device)

    precision = "bf16 autocast" if device == "cuda" else "float32"
    benchmark.group = f"densenet121 training step {device} {'x'.join(map(str, shape))} {precision}"
    # Activation bytes at 1x3x224x224, whatever the timed shape (named like
    # the other suites' keys so summarize.py shows the ratio).
    info = dict(activation_bytes=saved, activation_bytes_ratio=saved / naive_bytes_224,
                activation_bytes_shape="1x3x224x224")
    if device == "cuda":
        step()
        info["cuda_peak_bytes"] = memory.cuda_peak_bytes(step)
        # Host time to issue one step (forward and backward queued, no
        # synchronisation) against the step's time: close to it means the
        # step waits on Python and launches (or on a synchronisation inside
        # it), not on the GPU. The H200's first run had effilayers' step at
        # 3.2x the naive model's; this says which of the two it is.
        info["host_issue_ms"] = host_issue_ms(model, x, target, autocast, device)
    benchmark.extra_info.update(info)
    benchmark.pedantic(step, warmup_rounds=1, rounds=5 if device == "cpu" else 20)


# The last layer of DenseNet-121's first block, its widest input at the
# largest size: 64 + 5 x 32 channels in, 4 x 32 out, 56x56 at 224 (on CUDA
# 103 MB of bf16 input at batch 64).
BOTTLENECK_CHANNELS = (64, 32, 32, 32, 32, 32)
BOTTLENECK_OUT = 128
BOTTLENECK_SHAPE = {"cpu": (4, 16, 16), "cuda": (64, 56, 56)}  # batch, height, width


def bottleneck_bytes(features, out_channels: int) -> int:
    """What any bottleneck must move forward and backward: read the input
    maps and write the output; read the output's gradient and the input
    maps again (nothing larger than them is kept) and write their
    gradients. (The weights and per-channel statistics are under 0.1 %.)"""
    batch, _, height, width = features[0].shape
    input_bytes = sum(f.numel() for f in features) * features[0].element_size()
    output_bytes = batch * out_channels * height * width * features[0].element_size()
    return 3 * input_bytes + 2 * output_bytes


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("implementation", ["torch-naive", "effilayers"])
def test_bottleneck(benchmark, implementation, device):
    batch, height, width = BOTTLENECK_SHAPE[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    features = [torch.randn(batch, c, height, width, generator=generator).to(device, dtype).requires_grad_()
                for c in BOTTLENECK_CHANNELS]
    channels = sum(BOTTLENECK_CHANNELS)
    weight, bias = torch.rand(channels, device=device) + 0.5, torch.randn(channels, device=device)
    running_mean, running_var = torch.zeros(channels, device=device), torch.ones(channels, device=device)
    conv_weight = torch.randn(BOTTLENECK_OUT, channels, 1, 1, device=device, dtype=dtype) * channels ** -0.5
    grad = torch.randn(batch, BOTTLENECK_OUT, height, width, device=device, dtype=dtype)

    def forward():
        if implementation == "effilayers":
            return bottleneck(features, weight, bias, running_mean, running_var, conv_weight, True)
        # bf16 maps with float32 parameters and statistics, as under autocast
        x = F.batch_norm(torch.cat(features, 1), running_mean, running_var, weight, bias, training=True)
        return F.conv2d(F.relu(x), conv_weight)

    def step():
        torch.autograd.grad(forward(), features, grad)

    def run():
        step()
        synchronize(device)

    benchmark.group = (f"densenet bottleneck fwd+bwd {device} {batch}x{channels}x{height}x{width}"
                       f"->{BOTTLENECK_OUT} {str(dtype)[6:]}")
    run()
    benchmark.pedantic(run, warmup_rounds=1, rounds=5 if device == "cpu" else 30)
    if device == "cuda":
        seconds = device_median_seconds(step, device)
        moved = bottleneck_bytes(features, BOTTLENECK_OUT)
        ceiling = copy_gb_per_s(torch.cat(features, 1))
        benchmark.extra_info.update(bytes_moved=moved, seconds=seconds, gb_per_s=moved / seconds / 1e9,
                                    copy_gb_per_s=ceiling, pct_of_copy=100 * moved / seconds / 1e9 / ceiling)
