"""softmax / log-softmax (and the scaled/masked variant) against plain PyTorch.

    python -m pytest benchmarks/bench_softmax.py --benchmark-group-by=group

Each group is one op/direction/device/dtype/shape; implementations are torch
eager, ``torch.compile`` of the same torch code, effilayers (C++ kernel on
CPU, Triton on CUDA) and Liger-Kernel's softmax when it is installed (CUDA).
``extra_info`` holds:

* ``bytes_moved``: the minimum traffic of the op: forward reads x and writes
  y (2 N elements); forward+backward adds reading g and y and writing dx
  (5 N in all);
* ``gb_per_s``: bytes_moved / time, the time being the do_bench median on
  CUDA and the fastest of the rounds on CPU (on a shared CPU machine the
  median mostly measures the neighbours);
* ``speedup_vs_torch``: torch eager's time / this one's (same run, same
  statistic; > 1 is faster than torch);
* CUDA only: ``copy_gb_per_s`` (a device-to-device copy of x, read + write,
  timed the same way) and ``pct_of_copy`` = gb_per_s / copy_gb_per_s, the
  issue's target being >= 90 % of copy bandwidth and >= 1.0x torch;
* the Triton rows: ``launch_configs``, each configuration the launchers
  chose (table key, BLOCK, warps, ROWS, split, persistent; tuned or
  heuristic), so results of different sessions say which path they timed.

CUDA times are medians of ``triton.testing.do_bench`` (it flushes L2 between
runs); the pytest-benchmark table around them times the same call with a
synchronize. CPU groups are small so they run on a 2-core CI machine.
"""

from __future__ import annotations

import pytest
import torch

from effilayers import memory
from effilayers.functional import log_softmax, scaled_masked_softmax, softmax

from .conftest import copy_gb_per_s, device_median_seconds, devices, launch_configs, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "softmax", "kernels": ("effilayers/ops/softmax", "csrc/cpu/softmax.cpp"), "prefix": "softmax",
          "target": ">= 1.0x torch eager 1K-256K columns; >= 90% of copy bandwidth",
          "met": (("time_ratio", 1.0), ("pct_of_copy", 90, True)), "cases": 33, "gpu_seconds": 60}

CPU_CASES = [((256, 4096), -1, torch.float32), ((256, 4096), -1, torch.bfloat16), ((16, 64, 32, 32), 1, torch.float32)]
# 2**27 elements each: the 4096 x 32768 case of the issue and a sweep of row lengths.
GPU_CASES = [((4096, 32768), -1, torch.float16), ((4096, 32768), -1, torch.bfloat16)] + [
    ((2**27 // cols, cols), -1, torch.bfloat16) for cols in (1024, 4096, 16384, 65536, 262144)
] + [((64, 256, 64, 64), 1, torch.bfloat16)]
OPS = ["softmax", "softmax+backward", "log_softmax", "log_softmax+backward"]
CPU_OPS = ["softmax", "softmax+backward", "log_softmax+backward"]
IMPLEMENTATIONS = ["torch", "torch-compile", "effilayers", "liger"]

_torch_medians: dict[str, float] = {}


def cases():
    for device in devices():
        for shape, dim, dtype in (CPU_CASES if device == "cpu" else GPU_CASES):
            for op in (CPU_OPS if device == "cpu" else OPS):
                yield pytest.param(device, shape, dim, dtype, op,
                                   id=f"{op}-{device}-{'x'.join(map(str, shape))}-dim{dim}-{str(dtype)[6:]}")


def _liger_softmax():
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return LigerSoftmaxFunction.apply


def _function(implementation, op, dim):
    log = op.startswith("log")
    if implementation in ("torch", "torch-compile"):
        def fn(x):
            return torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
        return torch.compile(fn, dynamic=False) if implementation == "torch-compile" else fn
    if implementation == "effilayers":
        return (lambda x: log_softmax(x, dim)) if log else (lambda x: softmax(x, dim))
    liger = _liger_softmax()
    if liger is None:
        pytest.skip("Liger-Kernel is not installed")
    if log or dim not in (-1,):
        pytest.skip("Liger-Kernel has a last-dim softmax only")
    return liger


@pytest.mark.parametrize("device, shape, dim, dtype, op", list(cases()))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_softmax(benchmark, run_with_backend, implementation, device, shape, dim, dtype, op):
    group = f"{op} {device} {'x'.join(map(str, shape))} dim={dim} {str(dtype)[6:]}"
    benchmark.group = group
    backward = op.endswith("+backward")
    fn = _function(implementation, op, dim)
    x = torch.randn(shape, device=device, dtype=torch.float32).mul_(3).to(dtype)
    if dim == 1 and len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last) if device == "cuda" else x
    x.requires_grad_(backward)
    grad = torch.randn_like(x) if backward else None

    def step():
        y = fn(x)
        if backward:
            torch.autograd.grad(y, x, grad)
        return y

    def run():
        step()
        synchronize(device)

    context = (run_with_backend("softmax_forward", "cpp" if device == "cpu" else "triton", device)
               if implementation == "effilayers" else None)
    if context is not None:
        context.__enter__()
    try:
        launches = launch_configs(run)  # compile / build outside the timing
        benchmark.pedantic(run, warmup_rounds=2, rounds=20 if device == "cpu" else 30)
        # CPU: the fastest round, the least disturbed by other processes on
        # a shared machine (the table keeps the full distribution).
        seconds = device_median_seconds(step, device) if device == "cuda" else benchmark.stats.stats.min
    finally:
        if context is not None:
            context.__exit__(None, None, None)

    bytes_moved = (5 if backward else 2) * x.numel() * x.element_size()
    info = dict(bytes_moved=bytes_moved, gb_per_s=bytes_moved / seconds / 1e9, seconds=seconds,
                threads=torch.get_num_threads())
    if launches:  # the Triton path: which configuration ran
        info["launch_configs"] = launches
    if implementation == "torch":
        _torch_medians[group] = seconds
    elif group in _torch_medians:
        info["speedup_vs_torch"] = _torch_medians[group] / seconds
    if device == "cuda":
        info["copy_gb_per_s"] = copy_gb_per_s(x)
        info["pct_of_copy"] = 100 * info["gb_per_s"] / info["copy_gb_per_s"]
    benchmark.extra_info.update(info)


MASKED_CASES = {"cpu": [((4, 8, 256, 256), torch.float32)], "cuda": [((16, 32, 1024, 1024), torch.bfloat16)]}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("implementation", ["torch", "torch-compile", "effilayers"])
def test_scaled_masked_softmax(benchmark, run_with_backend, implementation, device):
    """Causal attention probabilities with a (L, S) padding mask broadcast over
    batch and heads, forward + backward."""
    for shape, dtype in MASKED_CASES[device]:
        benchmark.group = f"scaled_masked_softmax+backward causal {device} {'x'.join(map(str, shape))} {str(dtype)[6:]}"
        x = torch.randn(shape, device=device, dtype=torch.float32).to(dtype).requires_grad_()
        mask = torch.rand(shape[-2:], device=device) > 0.1
        causal = torch.ones(shape[-2:], dtype=torch.bool, device=device).tril()
        grad = torch.randn_like(x)
        scale = shape[-1] ** -0.5

        def eager(t):
            return (t * scale).masked_fill(~(mask & causal), float("-inf")).softmax(-1)

        if implementation == "effilayers":
            fn = lambda t: scaled_masked_softmax(t, mask, scale, causal=True)  # noqa: E731
            context = run_with_backend("scaled_masked_softmax_forward", "cpp" if device == "cpu" else "triton", device)
        else:
            fn = torch.compile(eager, dynamic=False) if implementation == "torch-compile" else eager
            context = None

        def run():
            torch.autograd.grad(fn(x), x, grad)
            synchronize(device)

        if context is not None:
            context.__enter__()
        try:
            launches = launch_configs(run)
            if launches:
                benchmark.extra_info["launch_configs"] = launches
            benchmark.pedantic(run, warmup_rounds=1, rounds=5 if device == "cpu" else 30)
        finally:
            if context is not None:
                context.__exit__(None, None, None)
        if implementation != "torch-compile":
            # What autograd keeps: eager torch saves the softmax output and the
            # masked_fill mask; effilayers the output only.
            with memory.track_activations() as meter:
                y = fn(x)
            benchmark.extra_info.update(activation_bytes=meter.bytes, output_bytes=y.numel() * y.element_size())
            del y
