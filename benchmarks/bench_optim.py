"""One optimizer step: effilayers ChunkedAdamW (fp32, bf16 and 8-bit states) against
torch.optim.AdamW (foreach and fused) and, when installed, DeepSpeed's
DeepSpeedCPUAdam, on the same parameters and the same thread count.

    python -m pytest benchmarks/bench_optim.py --benchmark-group-by=group

Groups: ``adamw <device> <numel>`` (100M fp32 parameters, the issue's target
size, and 4M for a quick run), ``chunk_size cpu 256M`` (ChunkedAdamW at chunk
sizes 2^20 to 2^26, on 4x the largest; see ``DEFAULT_CHUNK_SIZE``), ``adamw
cpu 2000 tensors x 2048`` and ``step overhead cpu 5000 tensors x 256``
(per-tensor overhead; the second is dominated by Python and dispatch work).
The step of an optimizer on 100M parameters is memory-bound:
``extra_info["bytes_moved"]`` counts the bytes a one-pass update must read
and write (28 per parameter with fp32 states, 20 with bf16 states, 16 + 4 *
4 / 256 with 8-bit states: two code bytes and, per 256-element block, two
float32 scales, each read and written);
GB/s = bytes_moved / time. ``extra_info["state_bytes_per_param"]`` is the
optimizer-state memory (8, 4, or 2 + 8 / 256).

Parameters are split like a transformer's (a few large matrices, many small
vectors), so per-tensor overheads show up as they would in a model.
"""

from __future__ import annotations

import gc

import pytest
import torch

from effilayers.optim import ChunkedAdamW

from .conftest import devices, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "adam", "kernels": ("effilayers/ops/adam", "effilayers/optim", "csrc/cpu/adam.cpp"),
          "prefix": "optim",
          "target": ">= 90% of 28 B/param floor, <= 1.0x torch fused", "baseline": "torch-fused",
          "met": (("time_ratio", 1.0),), "cases": 2, "gpu_seconds": 40}

SIZES = {"cpu": [100_000_000, 4_000_000], "cuda": [100_000_000, 1_000_000_000]}
IMPLEMENTATIONS = ["torch-foreach", "torch-fused", "effilayers", "effilayers-bf16-states", "effilayers-8bit-states",
                   "effilayers-offload", "deepspeed-cpu-adam"]
# optimizer-state bytes per parameter (exp_avg + exp_avg_sq)
STATE_BYTES = {"effilayers-bf16-states": 4.0, "effilayers-8bit-states": 2.0 + 8 / 256}


def make_params(numel: int, device: str) -> list[torch.nn.Parameter]:
    """~numel fp32 parameters: 4096x1024 matrices, each followed by two
    1024-long vectors (bias / norm weight), until the budget is spent. Drawn
    where they live: a billion on the CPU would take most of a GPU session."""
    generator = torch.Generator(device=device).manual_seed(0)
    params, remaining = [], numel
    while remaining > 0:
        rows = min(4096, max(1, remaining // 1024))
        for shape in ((rows, 1024), (1024,), (1024,)):
            if remaining <= 0:
                break
            count = min(remaining, shape[0] * (shape[1] if len(shape) > 1 else 1))
            tensor = torch.randn(count, generator=generator, device=device).div_(32)
            params.append(torch.nn.Parameter(tensor))
            remaining -= count
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, device=device).div_(100)
    return params


def make_optimizer(implementation: str, params, chunk_size=None):
    kwargs = dict(lr=1e-3, weight_decay=0.01)
    if implementation == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    if implementation == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    if implementation == "effilayers":
        extra = {} if chunk_size is None else {"chunk_size": chunk_size}
        return ChunkedAdamW(params, **kwargs, **extra)
    if implementation == "effilayers-bf16-states":
        return ChunkedAdamW(params, state_dtype=torch.bfloat16, **kwargs)
    if implementation == "effilayers-8bit-states":
        return ChunkedAdamW(params, state_dtype="8bit", **kwargs)
    if implementation == "effilayers-offload":
        return ChunkedAdamW(params, offload="cpu", **kwargs)
    if implementation == "deepspeed-cpu-adam":
        deepspeed_adam = pytest.importorskip("deepspeed.ops.adam")
        return deepspeed_adam.DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    raise ValueError(implementation)


def _time_steps(benchmark, optimizer, device, rounds):
    optimizer.step()  # states allocated outside the timing

    def run():
        optimizer.step()
        synchronize(device)

    benchmark.pedantic(run, warmup_rounds=1, rounds=rounds)


SIZE_CASES = [pytest.param(numel, device, id=f"{numel // 10**6}M-{device}")
              for numel in sorted({n for sizes in SIZES.values() for n in sizes})
              for device in devices() if numel in SIZES[device]]


@pytest.mark.parametrize("numel, device", SIZE_CASES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_adamw_step(benchmark, implementation, device, numel):
    if implementation == "deepspeed-cpu-adam" and device != "cpu":
        pytest.skip("DeepSpeedCPUAdam runs on CPU parameters")
    if implementation == "effilayers-offload" and device != "cuda":
        pytest.skip("offload='cpu' moves GPU parameters' states to the CPU")
    params = make_params(numel, device)
    held_before = torch.cuda.memory_allocated() if device == "cuda" else 0
    optimizer = make_optimizer(implementation, params)
    state_bytes = STATE_BYTES.get(implementation, 8.0)
    benchmark.group = f"adamw {device} {numel // 10**6}M fp32 params"
    benchmark.extra_info.update(numel=numel, threads=torch.get_num_threads(), state_bytes_per_param=state_bytes,
                                bytes_moved=int(numel * (12 + 2 * state_bytes)))  # p, g read; p written; m, v both
    try:
        _time_steps(benchmark, optimizer, device, rounds=5 if numel >= 10**8 else 20)
        if device == "cuda":
            # What the optimizer keeps on the GPU after its steps (states,
            # master copies, staging): the offloaded variant's point.
            benchmark.extra_info.update(cuda_optimizer_bytes=torch.cuda.memory_allocated() - held_before)
    finally:
        del optimizer, params
        gc.collect()


# Parameters several times the largest chunk size compared (256M = 4 x 2^26),
# so every size splits the model into several chunks: 2^20 and 2^22 are at
# or below one 4096 x 1024 matrix (each matrix then gets a chunk of its own),
# 2^24 holds ~4 matrices, 2^26 ~16. 4 GiB of parameters, gradients and fp32
# states: runs on a 24 GiB machine.
CHUNK_SIZE_PARAMS = 256 * 2**20


@pytest.mark.parametrize("threads", [2, 1], ids=lambda t: f"{t}threads")
@pytest.mark.parametrize("chunk_size", [1 << 20, 1 << 22, 1 << 24, 1 << 26], ids=lambda c: f"2^{c.bit_length() - 1}")
def test_chunk_size(benchmark, chunk_size, threads):
    """More chunks mean more kernel calls, each one fork/join of the CPU
    threads; with one thread there is no join to wait for."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    params = make_params(CHUNK_SIZE_PARAMS, "cpu")
    optimizer = make_optimizer("effilayers", params, chunk_size=chunk_size)
    benchmark.group = f"chunk_size cpu 256M fp32 params {threads} threads"
    try:
        _time_steps(benchmark, optimizer, "cpu", rounds=9)
        benchmark.extra_info.update(numel=CHUNK_SIZE_PARAMS, chunk_size=chunk_size, threads=threads,
                                    chunks=len(optimizer.chunk_layout()), bytes_moved=28 * CHUNK_SIZE_PARAMS)
    finally:
        torch.set_num_threads(saved_threads)
        del optimizer, params
        gc.collect()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_many_small_tensors(benchmark, implementation):
    """Per-tensor overhead: 2000 tensors of 2048 elements (4M in all), like a
    model with many small layers."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2048, generator=generator)) for _ in range(2000)]
    for p in params:
        p.grad = torch.randn(2048, generator=generator)
    optimizer = make_optimizer(implementation, params)
    benchmark.group = "adamw cpu 2000 tensors x 2048"
    benchmark.extra_info.update(numel=2000 * 2048, tensors=2000, threads=torch.get_num_threads())
    try:
        _time_steps(benchmark, optimizer, "cpu", rounds=20)
    finally:
        del optimizer, params
        gc.collect()


OVERHEAD_IMPLEMENTATIONS = ["torch-foreach", "torch-fused", "effilayers", "effilayers-bf16-params-fp32-master"]


@pytest.mark.parametrize("implementation", OVERHEAD_IMPLEMENTATIONS)
def test_step_overhead_many_tiny_tensors(benchmark, implementation):
    """Host-side cost per tensor: 5000 tensors of 256 elements (1.3M in all),
    where the arithmetic is ~3 ms of a step and the rest is per-tensor Python
    and dispatch work. One thread: on a shared machine every fork/join of a
    multi-threaded kernel waits for preempted threads, which buries the host
    cost (run with ``--benchmark-timer=time.process_time`` there).
    ``effilayers-bf16-params-fp32-master``: bf16 parameters with fp32 master
    weights (the chunks that also track the parameters' version counters)."""
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if implementation == "effilayers-bf16-params-fp32-master" else torch.float32
    params = [torch.nn.Parameter(torch.randn(256, generator=generator).to(dtype)) for _ in range(5000)]
    for p in params:
        p.grad = torch.randn(256, generator=generator).to(dtype)
    optimizer = make_optimizer("effilayers" if dtype == torch.bfloat16 else implementation, params)
    benchmark.group = "step overhead cpu 5000 tensors x 256, 1 thread"
    benchmark.extra_info.update(numel=5000 * 256, tensors=5000, threads=1)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_steps(benchmark, optimizer, "cpu", rounds=20)
    finally:
        torch.set_num_threads(saved_threads)
        del optimizer, params
        gc.collect()
