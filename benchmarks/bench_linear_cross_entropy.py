"""linear_cross_entropy forward + backward against torch's unfused
F.linear + F.cross_entropy, eager and under torch.compile, and Liger-Kernel's
LigerFusedLinearCrossEntropyLoss when installed (GPU only).

    python -m pytest benchmarks/bench_linear_cross_entropy.py --benchmark-group-by=group

One timed call is ``loss = fn(x, weight, bias, target)`` then
``torch.autograd.grad(loss, (x, weight, bias))``: the language-model head and
its loss, with the gradients of the hidden states and of the head's
parameters.

Recorded in ``extra_info``:

* ``logits_bytes``: the whole logits in the input's dtype (what the unfused
  computation materialises, and a fused one never does);
* ``activation_bytes`` (effilayers.memory's meter: what autograd keeps
  between forward and backward, the head's parameters and the input
  excluded) and its ratio to the unfused computation's (not for
  torch-compile: the meter does not see inside compiled graphs);
* ``peak_bytes``: how far forward + backward raise memory above what was
  held before, gradients included, and ``peak_ratio_vs_torch`` against the
  unfused eager computation measured in the same test. CUDA:
  ``max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the growth
  of the peak resident set (VmHWM, reset through /proc/self/clear_refs;
  Linux only) over one call in a fresh process after a small warm-up call
  (in this process, memory the allocator kept from earlier calls would hide
  the growth); not for torch-compile (its compilation in a fresh process
  would dominate);
* ``time_ratio_vs_torch`` (CUDA: median of CUDA-event timings; CPU: fastest
  round, as in bench_cross_entropy.py) against the unfused eager computation.

* ``gradient_bytes``: the gradients' own bytes (input, weight, bias in
  their dtypes), the memory no implementation can avoid above the inputs,
  and ``peak_ratio_vs_lower_bound``, the peak over it (CUDA).

The GPU cases are Gemma-2-2B's head (8192 tokens, hidden 2304, 256000
classes) and Llama-3-8B's (8192 x 4096 x 128256), bf16: 3.9 and 2.0 GiB of
bf16 logits. On CUDA ``effilayers`` is the fused path (no logits in memory)
and ``effilayers-chunked`` the chunked one at its default chunk (the
``chunk_size`` the op would pick, passed explicitly, which selects it).
torch's own ``F.linear_cross_entropy`` rows (with and without its batch
chunking) skip on torch 2.11, which has neither it nor
``LinearCrossEntropyOptions``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory
from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import chunk_tokens

from .conftest import devices, synchronize

# (tokens, hidden, classes)
CPU_SHAPES = [(1024, 128, 32768), (4096, 128, 32768)]
GPU_SHAPES = [(8192, 2304, 256000), (8192, 4096, 128256)]
IMPLEMENTATIONS = ["torch", "torch-compile", "torch-linear_cross_entropy", "torch-linear_cross_entropy-chunked",
                   "effilayers", "effilayers-chunked", "liger"]


def cases():
    for device in devices():
        shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
        dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16]
        for shape in shapes:
            for dtype in dtypes:
                yield pytest.param(device, shape, dtype, id=f"{device}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}")


def unfused(x, weight, bias, target):
    return F.cross_entropy(F.linear(x, weight, bias), target)


def fused(x, weight, bias, target):
    return linear_cross_entropy(x, weight, target, bias)


def chunked(x, weight, bias, target):
    """The chunked path at the chunk the op picks by default (an explicit
    chunk_size selects the chunked path on CUDA too)."""
    tokens, hidden = x.shape
    chunk = chunk_tokens(tokens, weight.shape[0], x.element_size(), x.numel() * x.element_size(), None)
    return linear_cross_entropy(x, weight, target, bias, chunk_size=chunk)


_compiled = {}


def implementation_fn(name, device):
    if name == "torch":
        return unfused
    if name == "torch-compile":
        if "fn" not in _compiled:
            _compiled["fn"] = torch.compile(unfused)
        return _compiled["fn"]
    if name.startswith("torch-linear_cross_entropy"):
        # torch's own fused head (2.13; absent from 2.11, the GPU image's):
        # without options its reference path, with LinearCrossEntropyOptions
        # the batch-chunked one whose logits never exist whole.
        native = getattr(F, "linear_cross_entropy", None)
        if native is None:
            pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
        options = torch.nn.LinearCrossEntropyOptions() if name.endswith("chunked") else None
        return lambda x, weight, bias, target: native(x, weight, target, linear_bias=bias, options=options)
    if name == "effilayers":
        return fused
    if name == "effilayers-chunked":
        return chunked
    if name == "liger":
        liger = pytest.importorskip("liger_kernel.transformers", reason="Liger-Kernel is not installed")
        if device != "cuda":
            pytest.skip("Liger-Kernel's kernels run on CUDA only")
        loss = liger.LigerFusedLinearCrossEntropyLoss()
        return lambda x, weight, bias, target: loss(weight, x, target, bias)
    raise ValueError(name)


def make_inputs(device, shape, dtype):
    tokens, hidden, classes = shape
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=generator).requires_grad_()
    weight = (torch.randn(classes, hidden, device=device, generator=generator) / hidden ** 0.5 * 2).to(dtype)
    bias = torch.randn(classes, device=device, generator=generator).to(dtype)
    target = torch.randint(0, classes, (tokens,), device=device, generator=generator)
    target[::17] = -100
    return x, weight.requires_grad_(), bias.requires_grad_(), target


def step(fn, x, weight, bias, target):
    loss = fn(x, weight, bias, target)
    return loss, torch.autograd.grad(loss, (x, weight, bias))


def saved_bytes(fn, x, weight, bias, target):
    with memory.track_activations(exclude=[x, weight, bias]) as meter:
        loss = fn(x, weight, bias, target)
    saved = meter.bytes
    del loss
    return saved


def _high_water_mark():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def peak_and_time(fn, device, inputs, repeats):
    """(peak bytes above what was held before or None, time in ms) of
    forward + backward: CUDA, the largest peak and the median time of
    `repeats` calls; CPU, no peak (see fresh_process_peak) and the fastest
    of `repeats`."""
    step(fn, *inputs)  # warm-up (compilation, the C++ library, torch's kernels)
    peaks, times = [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = step(fn, *inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - before)
        else:
            start = time.perf_counter()
            result = step(fn, *inputs)
            times.append((time.perf_counter() - start) * 1e3)
        del result
    if device == "cuda":
        return max(peaks), statistics.median(times)
    return None, min(times)


def fresh_process_peak(variant: str, dtype: torch.dtype, shape) -> int:
    """CPU: measure_peak in a new Python process."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys; from benchmarks.bench_linear_cross_entropy import measure_peak; "
            "print(json.dumps(measure_peak(sys.argv[1], sys.argv[2], tuple(map(int, sys.argv[3:])))))")
    done = subprocess.run([sys.executable, "-c", code, variant, str(dtype)[6:], *map(str, shape)], cwd=root,
                          check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


@pytest.mark.parametrize("device, shape, dtype", list(cases()))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_backward(benchmark, implementation, device, shape, dtype):
    fn = implementation_fn(implementation, device)
    inputs = make_inputs(device, shape, dtype)
    benchmark.group = f"linear_cross_entropy fwd+bwd {device} {'x'.join(map(str, shape))} {str(dtype)[6:]}"
    tokens, _, classes = shape
    benchmark.extra_info.update(logits_bytes=tokens * classes * inputs[0].element_size())
    if implementation != "torch-compile":
        ours_saved, torch_saved = saved_bytes(fn, *inputs), saved_bytes(unfused, *inputs)
        benchmark.extra_info.update(activation_bytes=ours_saved, activation_ratio_vs_torch=ours_saved / torch_saved)
    repeats = 3 if device == "cpu" else 10
    peak, ms = peak_and_time(fn, device, inputs, repeats)
    torch_peak, torch_ms = peak_and_time(unfused, device, inputs, repeats)
    if device == "cpu" and implementation in MEMORY_VARIANTS:
        peak, torch_peak = fresh_process_peak(implementation, dtype, shape), fresh_process_peak("torch", dtype, shape)
    if peak is not None:
        benchmark.extra_info.update(peak_bytes=peak, torch_peak_bytes=torch_peak,
                                    peak_ratio_vs_torch=peak / torch_peak)
        if device == "cuda":
            gradient_bytes = sum(t.numel() * t.element_size() for t in inputs[:3])
            benchmark.extra_info.update(gradient_bytes=gradient_bytes,
                                        peak_ratio_vs_lower_bound=peak / gradient_bytes)
    benchmark.extra_info.update(ms=ms, torch_ms=torch_ms, time_ratio_vs_torch=ms / torch_ms,
                                threads=torch.get_num_threads())
    if device == "cuda":
        benchmark.extra_info.update(device_name=torch.cuda.get_device_name())

    def run():
        result = step(fn, *inputs)
        synchronize(device)
        return result

    benchmark.pedantic(run, warmup_rounds=1, rounds=3 if device == "cpu" else 20)


# --------------------------------------------------------------------------
# The README's memory table: one step per fresh process
#
#     python -m benchmarks.bench_linear_cross_entropy
# --------------------------------------------------------------------------

MEMORY_SHAPE = (4096, 128, 32768)


def _unfused_inplace(x, weight, bias, target):
    from effilayers.functional import cross_entropy

    return cross_entropy(F.linear(x, weight, bias), target, inplace_backward=True)


MEMORY_VARIANTS = {"torch": unfused, "effilayers-cross_entropy-inplace": _unfused_inplace, "effilayers": fused}
MEMORY_LABELS = {"torch": "F.linear + F.cross_entropy",
                 "effilayers-cross_entropy-inplace": "F.linear + effilayers cross_entropy(inplace_backward=True)",
                 "effilayers": "effilayers linear_cross_entropy"}


def measure_peak(variant: str, dtype_name: str, shape=MEMORY_SHAPE) -> dict:
    """In this process: one warm-up step on small tensors, then the growth of
    the peak resident set over one forward + backward at ``shape``."""
    fn = MEMORY_VARIANTS[variant]
    dtype = getattr(torch, dtype_name)
    tokens, hidden, classes = shape
    step(fn, *make_inputs("cpu", (16, hidden, 100), dtype))
    inputs = make_inputs("cpu", shape, dtype)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _high_water_mark()
    result = step(fn, *inputs)
    growth = _high_water_mark() - before
    del result
    return dict(variant=variant, dtype=dtype_name, growth=growth,
                logits_fp32=tokens * classes * 4, logits=tokens * classes * inputs[0].element_size())


def main() -> None:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for variant in MEMORY_VARIANTS:
            growth = fresh_process_peak(variant, dtype, MEMORY_SHAPE)
            rows.append((dtype, variant, growth))
    tokens, hidden, classes = MEMORY_SHAPE
    print(f"CPU peak RSS growth over forward + backward, {tokens} tokens x hidden {hidden} x {classes} classes, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| dtype | implementation | peak growth MiB | x logits (own dtype) | x fp32 logits |")
    print("| --- | --- | --- | --- | --- |")
    for dtype, variant, growth in rows:
        logits = tokens * classes
        print(f"| {str(dtype)[6:]} | {MEMORY_LABELS[variant]} | {growth / 2**20:.1f} | "
              f"{growth / (logits * dtype.itemsize):.3f} | {growth / (logits * 4):.3f} |")


if __name__ == "__main__":
    main()
