"""effilayers.functional sum/var/norm against torch.sum / torch.var /
torch.linalg.vector_norm, eager and under torch.compile.

    python -m pytest benchmarks/bench_reductions.py --benchmark-group-by=group

Each group is one device/dtype/shape/dim/kind; the table's parenthesised
numbers are ratios to the fastest entry. ``extra_info`` carries the bytes
read and the achieved read bandwidth (GB/s); on CUDA also that bandwidth as a
fraction of a measured device-to-device copy (read + write bytes per second
of ``dst.copy_(src)`` on a 1 GiB tensor). mean and std cost what sum and var
cost (the same kernels, a different last step), so they are not repeated.
torch.compile is timed on the row reductions only (each case compiles, and a
2-core CPU run should stay short); compilation happens in the warm-up.
Liger-Kernel has no standalone reductions to compare with.
"""

from __future__ import annotations

import pytest
import torch

import effilayers.functional as EF

from .conftest import copy_gb_per_s, device_median_seconds, devices, launch_configs, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "reductions", "kernels": ("effilayers/ops/reductions", "csrc/cpu/reductions.cpp"),
          "prefix": "reductions", "target": ">= 90% of copy bandwidth", "met": (("pct_of_copy", 90, True),),
          "cases": 27, "gpu_seconds": 40}

CPU_SHAPE = (2048, 4096)
GPU_SHAPE = (16384, 16384)  # 512 MiB of bf16: fills an H100's memory system
DIMS = {"rows": -1, "columns": 0, "all": None}
KINDS = ["sum", "var", "norm"]


def torch_reduction(kind):
    if kind == "sum":
        return lambda x, dim: torch.sum(x) if dim is None else torch.sum(x, dim)
    if kind == "var":
        return lambda x, dim: torch.var(x, dim)
    return lambda x, dim: torch.linalg.vector_norm(x, 2, dim)


def ours(kind):
    function = getattr(EF, kind)
    return lambda x, dim: function(x, dim)


def cases():
    for device in devices():
        dtypes = [torch.float32, torch.bfloat16, torch.float16]
        for dtype in dtypes:
            for dim_name in DIMS:
                for kind in KINDS:
                    yield pytest.param(device, dtype, dim_name, kind,
                                       id=f"{device}-{str(dtype)[6:]}-{dim_name}-{kind}")


@pytest.mark.parametrize("device, dtype, dim_name, kind", list(cases()))
@pytest.mark.parametrize("implementation", ["effilayers", "torch", "torch-compile"])
def test_reduction(benchmark, run_with_backend, implementation, device, dtype, dim_name, kind):
    if implementation == "torch-compile" and dim_name != "rows":
        pytest.skip("torch.compile is timed on the row reductions only (compile time)")
    shape = CPU_SHAPE if device == "cpu" else GPU_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 3 + 1).to(device=device, dtype=dtype)
    dim = DIMS[dim_name]
    benchmark.group = f"{kind} {device} {str(dtype)[6:]} {'x'.join(map(str, shape))} {dim_name}"
    bytes_read = x.numel() * x.element_size()
    benchmark.extra_info.update(bytes_read=bytes_read)

    context = None
    if implementation == "effilayers":
        context = run_with_backend("reduce", "cpp" if device == "cpu" else "triton", device)
        fn = ours(kind)
    elif implementation == "torch":
        fn = torch_reduction(kind)
    else:
        torch._dynamo.reset()
        fn = torch.compile(torch_reduction(kind), fullgraph=True)

    def run():
        result = fn(x, dim)
        synchronize(device)
        return result

    rounds = 10 if device == "cpu" else 50
    if context is None:
        benchmark.pedantic(run, warmup_rounds=2, rounds=rounds)
    else:
        with context:
            launches = launch_configs(run)
            benchmark.pedantic(run, warmup_rounds=2, rounds=rounds)
        if launches:  # the Triton path: which configuration ran
            benchmark.extra_info["launch_configs"] = launches
    if benchmark.stats is None:  # --benchmark-disable
        return
    # CUDA: the device's own time (events), as the softmax and cross-entropy
    # benches take it, against a copy of the input: a reduction reads each
    # byte once and writes next to nothing, a copy reads and writes each.
    if device != "cuda":
        seconds = benchmark.stats.stats.median
    elif context is None:
        seconds = device_median_seconds(lambda: fn(x, dim), device)
    else:
        with context:
            seconds = device_median_seconds(lambda: fn(x, dim), device)
    benchmark.extra_info.update(seconds=seconds, gb_per_s=bytes_read / seconds / 1e9)
    if device == "cuda":
        benchmark.extra_info["pct_of_copy"] = 100 * bytes_read / seconds / 1e9 / copy_gb_per_s(x)
