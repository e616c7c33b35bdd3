"""batch_stats against plain PyTorch: torch.var_mean over the same dims, and
F.batch_norm in training mode, which computes the same statistics with
PyTorch's own BatchNorm kernels and also writes the normalised output (so it
bounds, from above, what PyTorch's BatchNorm spends on statistics).

    python -m pytest benchmarks/bench_stats.py --benchmark-group-by=group

Each group is one device/dtype/layout/shape; the table's parenthesised
numbers are ratios to the fastest entry of the group.
"""

from __future__ import annotations

import pytest
import torch

from effilayers.ops import batch_stats

from .conftest import devices, synchronize

# ResNet-50-like activations at a batch that fits a 2-core CPU run.
CPU_SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14), (256, 2048)]
GPU_SHAPES = [(128, 64, 112, 112), (128, 256, 56, 56), (128, 2048, 7, 7), (8192, 4096)]


def cases():
    for device in devices():
        shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
        dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.float32, torch.bfloat16, torch.float16]
        for shape in shapes:
            for dtype in dtypes:
                layouts = ["contiguous", "channels_last"] if len(shape) == 4 else ["contiguous"]
                for layout in layouts:
                    yield pytest.param(device, shape, dtype, layout,
                                       id=f"{device}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}-{layout}")


def make_input(device, shape, dtype, layout):
    x = torch.randn(shape, device=device, dtype=torch.float32).mul_(3).add_(1).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def torch_var_mean(x):
    # Upcast (var_mean has no accumulation-dtype argument), then reduce over
    # every dim but channels.
    dims = [0] + list(range(2, x.dim()))
    return torch.var_mean(x.float() if x.dtype != torch.float64 else x, dim=dims, correction=0)


def torch_batch_norm(x):
    return torch.nn.functional.batch_norm(x, None, None, training=True)


@pytest.mark.parametrize("device, shape, dtype, layout", list(cases()))
@pytest.mark.parametrize("implementation", ["torch-var_mean", "torch-batch_norm", "effilayers", "effilayers-reference"])
def test_batch_stats(benchmark, run_with_backend, implementation, device, shape, dtype, layout):
    x = make_input(device, shape, dtype, layout)
    benchmark.group = f"batch_stats {device} {'x'.join(map(str, shape))} {str(dtype)[6:]} {layout}"
    benchmark.extra_info.update(bytes_read=x.numel() * x.element_size())

    if implementation.startswith("torch"):
        fn = torch_var_mean if implementation == "torch-var_mean" else torch_batch_norm
        context = None
    else:
        backend = "reference" if implementation.endswith("reference") else ("cpp" if device == "cpu" else "cuda")
        context = run_with_backend("batch_stats", backend, device)
        fn = batch_stats

    def run():
        result = fn(x)
        synchronize(device)
        return result

    if context is None:
        benchmark.pedantic(run, warmup_rounds=2, rounds=10 if device == "cpu" else 50)
    else:
        with context:
            benchmark.pedantic(run, warmup_rounds=2, rounds=10 if device == "cpu" else 50)
