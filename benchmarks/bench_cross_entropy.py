"""cross_entropy forward + backward against torch: F.cross_entropy eager and
under torch.compile, and Liger-Kernel's LigerCrossEntropyLoss when installed
(GPU only).

    python -m pytest benchmarks/bench_cross_entropy.py --benchmark-group-by=group

One timed call is ``loss = fn(logits, target)`` then
``torch.autograd.grad(loss, logits)``: the loss and the gradient of the
logits, nothing upstream. The logits are a fresh non-leaf copy made in each
round's (untimed) setup, because ``inplace_backward=True`` overwrites them.

Recorded in ``extra_info``:

* ``bytes_moved``: the least traffic any implementation of forward + backward
  has, reading the logits and writing their gradient (2x the logits' bytes),
  and ``gb_per_s`` = bytes_moved / time, the time being the median of the
  CUDA-event timings on CUDA and the fastest round on CPU (on a shared CPU
  machine the median mostly measures the neighbours), as in
  bench_softmax.py; on CUDA also ``copy_gb_per_s`` (a device-to-device copy
  of the logits, read + write, timed the same way) and ``pct_of_copy``;

* the Triton rows: ``launch_configs``, each configuration the launcher
  chose (table key, BLOCK, warps, ROWS, split; tuned or heuristic);
* every device: ``activation_bytes`` (effilayers.memory's meter: what autograd
  keeps between forward and backward, beyond the logits' own storage) and its
  ratio to F.cross_entropy's;
* CUDA: ``peak_bytes``, the most memory allocated during forward + backward
  beyond what was allocated before it (the logits, the target), and
  ``peak_ratio_vs_torch`` / ``time_ratio_vs_torch`` against F.cross_entropy
  eager measured in the same test with CUDA events (median of 20).

The issue's target is the GPU group 16384 x 131072 bf16 (4 GiB of logits;
F.cross_entropy peaks around 12 GiB above the logits, so it fits an 80 GB
card with room to spare): peak <= 0.3x F.cross_entropy's at <= 1.0x its time.
Only ``effilayers-inplace`` can meet the memory part: ``effilayers`` (the
default mode) saves a logits-sized gradient, 4 GiB here, about a third of
torch's ~3x-logits peak, so its peak_ratio_vs_torch is expected near 0.33.
Nothing here has run on a GPU yet.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory
from effilayers.functional import cross_entropy

from .conftest import copy_gb_per_s, devices, launch_configs, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "cross_entropy", "kernels": ("effilayers/ops/cross_entropy", "csrc/cpu/cross_entropy.cpp"),
          "prefix": "cross_entropy", "target": "fwd+bwd <= 1.0x torch eager", "met": (("time_ratio", 1.0),),
          "cases": 3, "gpu_seconds": 40}

CPU_SHAPES = [(512, 8192), (128, 32000)]
GPU_SHAPES = [(16384, 131072), (8192, 32000)]
IMPLEMENTATIONS = ["torch", "torch-compile", "effilayers", "effilayers-inplace", "liger"]


def cases():
    for device in devices():
        shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
        dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float32]
        for shape in shapes:
            for dtype in dtypes:
                if device == "cuda" and shape == (16384, 131072) and dtype == torch.float32:
                    continue  # the target is bf16; fp32 at this size is 8 GiB of logits
                yield pytest.param(device, shape, dtype, id=f"{device}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}")


_compiled = {}


def implementation_fn(name, device):
    if name == "torch":
        return F.cross_entropy
    if name == "torch-compile":
        if "fn" not in _compiled:
            _compiled["fn"] = torch.compile(F.cross_entropy)
        return _compiled["fn"]
    if name == "effilayers":
        return cross_entropy
    if name == "effilayers-inplace":
        return lambda logits, target: cross_entropy(logits, target, inplace_backward=True)
    if name == "liger":
        liger = pytest.importorskip("liger_kernel.transformers", reason="Liger-Kernel is not installed")
        if device != "cuda":
            pytest.skip("Liger-Kernel's kernels run on CUDA only")
        return liger.LigerCrossEntropyLoss()
    raise ValueError(name)


def make_inputs(device, shape, dtype):
    rows, classes = shape
    generator = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(shape, device=device, dtype=dtype, generator=generator).mul_(4)
    target = torch.randint(0, classes, (rows,), device=device, generator=generator)
    target[::17] = -100
    leaf = base.requires_grad_()
    return leaf, target


def fresh_logits(leaf):
    # A non-leaf copy per call: inplace_backward refuses leaves and destroys
    # its input. Its backward (into `leaf`) is never run: grad stops at it.
    with torch.enable_grad():
        return leaf * 1


def step(fn, logits, target):
    loss = fn(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


def activation_bytes(fn, leaf, target):
    """Bytes autograd keeps beyond the logits' own storage (which the caller
    holds anyway; inplace_backward saves its gradient there)."""
    logits = fresh_logits(leaf)
    with memory.track_activations(exclude=[leaf, logits]) as meter:
        loss = fn(logits, target)
    saved = meter.bytes
    del loss
    return saved


def cuda_peak_and_time(fn, leaf, target, repeats=20):
    """(peak bytes beyond the inputs, median ms) over `repeats` calls."""
    times, peaks = [], []
    for index in range(repeats + 3):
        logits = fresh_logits(leaf)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss, grad = step(fn, logits, target)
        end.record()
        torch.cuda.synchronize()
        if index >= 3:  # warm-up (and compilation) first
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - before)
        del loss, grad, logits
    return max(peaks), statistics.median(times)


@pytest.mark.parametrize("device, shape, dtype", list(cases()))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_backward(benchmark, implementation, device, shape, dtype):
    fn = implementation_fn(implementation, device)
    leaf, target = make_inputs(device, shape, dtype)
    benchmark.group = f"cross_entropy fwd+bwd {device} {'x'.join(map(str, shape))} {str(dtype)[6:]}"
    logits_bytes = leaf.numel() * leaf.element_size()
    benchmark.extra_info.update(logits_bytes=logits_bytes)

    if implementation != "torch-compile":  # the meter does not see inside compiled graphs
        ours_saved = activation_bytes(fn, leaf, target)
        torch_saved = activation_bytes(F.cross_entropy, leaf, target)
        benchmark.extra_info.update(activation_bytes=ours_saved,
                                    activation_ratio_vs_torch=ours_saved / torch_saved)
    bytes_moved = 2 * logits_bytes
    launches = launch_configs(lambda: step(fn, fresh_logits(leaf), target))
    if launches:  # the Triton path: which configuration ran (rows per program, split rows)
        benchmark.extra_info.update(launch_configs=launches)
    if device == "cuda":
        peak, ms = cuda_peak_and_time(fn, leaf, target)
        torch_peak, torch_ms = cuda_peak_and_time(F.cross_entropy, leaf, target)
        ceiling = copy_gb_per_s(leaf)
        gb_per_s = bytes_moved / (ms / 1e3) / 1e9
        benchmark.extra_info.update(
            peak_bytes=peak, torch_peak_bytes=torch_peak, peak_ratio_vs_torch=peak / torch_peak,
            median_ms=ms, torch_median_ms=torch_ms, time_ratio_vs_torch=ms / torch_ms,
            bytes_moved=bytes_moved, gb_per_s=gb_per_s, copy_gb_per_s=ceiling,
            pct_of_copy=100 * gb_per_s / ceiling, device_name=torch.cuda.get_device_name(),
        )

    def setup():
        return (fresh_logits(leaf), target), {}

    def run(logits, target):
        result = step(fn, logits, target)
        synchronize(device)
        return result

    benchmark.pedantic(run, setup=setup, warmup_rounds=2, rounds=5 if device == "cpu" else 30)
    if device == "cpu" and benchmark.stats is not None:  # None under --benchmark-disable
        seconds = benchmark.stats.stats.min
        benchmark.extra_info.update(bytes_moved=bytes_moved, gb_per_s=bytes_moved / seconds / 1e9, seconds=seconds,
                                    threads=torch.get_num_threads())
