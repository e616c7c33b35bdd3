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

import json
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from effilayers import memory
from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import chunk_tokens

from .conftest import devices, synchronize

# This family's row in the GPU ledger and its step in the GPU session (benchmarks/ledger.py reads it
# without importing this file; see ledger.op_families).
LEDGER = {"family": "linear_cross_entropy", "kernels": ("effilayers/ops/linear_cross_entropy",),
          "prefix": "linear_cross_entropy",
          "target": "fwd+bwd <= 1.0x torch.compile of the unfused pair; peak <= 1.1x the gradients' bytes",
          "baseline": "torch-compile", "met": (("time_ratio", 1.0), ("peak_ratio_vs_lower_bound", 1.1)),
          "cases": 2, "gpu_seconds": 90}

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
    """CPU: the peak growth of one step (measure_step) in a new Python process."""
    return fresh_process(variant, dtype, shape)["growth"]


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
# The docs' CPU table (docs/benchmarks/results.md): time and peak of a step, one fresh process per row
#
#     python -m benchmarks.bench_linear_cross_entropy --page docs/benchmarks/results.md
#     python -m benchmarks.bench_linear_cross_entropy --table-from benchmarks/results/<file>.json \
#         --page docs/benchmarks/results.md
#
# The first measures and writes benchmarks/results/linear_cross_entropy-cpu-table-<date>.json, the second only
# regenerates the markdown from such a file; tests/test_linear_cross_entropy_api.py checks that the page's table
# is what the committed file generates. (--readme is the option's earlier name, kept for the recorded commands.)
# --------------------------------------------------------------------------

TABLE_SHAPE = (4096, 256, 32768)  # issue 32's CPU comparison: 512 MiB of fp32 logits
TABLE_STEPS = 3
TABLE_THREADS = 1  # one thread: on a shared machine the process's CPU time then is the step's compute alone
TABLE_START = "<!-- lce-cpu-table:start -->"
TABLE_PAGE = "docs/benchmarks/results.md"
TABLE_END = "<!-- lce-cpu-table:end -->"
BASELINE = "torch-linear_cross_entropy-chunked"  # torch's own way to a step without the whole logits


def _unfused_inplace(x, weight, bias, target):
    from effilayers.functional import cross_entropy

    return cross_entropy(F.linear(x, weight, bias), target, inplace_backward=True)


# The variants test_forward_backward measures in fresh processes on CPU (the rest of its rows come from
# implementation_fn); the table has torch's native ones too.
MEMORY_VARIANTS = {"torch": unfused, "effilayers-cross_entropy-inplace": _unfused_inplace, "effilayers": fused}
TABLE_LABELS = {
    "torch": "F.linear + F.cross_entropy",
    "torch-linear_cross_entropy": "torch F.linear_cross_entropy",
    BASELINE: "torch F.linear_cross_entropy, options=LinearCrossEntropyOptions() (chunked)",
    "effilayers-cross_entropy-inplace": "F.linear + effilayers cross_entropy(inplace_backward=True)",
    "effilayers": "effilayers linear_cross_entropy",
}
TABLE_DTYPES = ("float32", "bfloat16")


def _variant_fn(variant: str):
    return MEMORY_VARIANTS[variant] if variant in MEMORY_VARIANTS else implementation_fn(variant, "cpu")


def measure_step(variant: str, dtype_name: str, shape, steps: int = 1, threads: int | None = None) -> dict:
    """In this process: one warm-up step on small tensors (loads the C++
    library and torch's kernels without touching the big sizes), then
    ``steps`` forward + backward steps at ``shape``: the growth of the peak
    resident set over them (VmHWM, reset through /proc/self/clear_refs) and
    the fastest step's process CPU time and wall time."""
    if threads is not None:
        torch.set_num_threads(threads)
    fn = _variant_fn(variant)
    dtype = getattr(torch, dtype_name)
    hidden = shape[1]
    step(fn, *make_inputs("cpu", (16, hidden, 100), dtype))
    inputs = make_inputs("cpu", shape, dtype)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _high_water_mark()
    cpu_seconds, wall_seconds = [], []
    for _ in range(steps):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        result = step(fn, *inputs)
        cpu_seconds.append(time.process_time() - cpu_start)
        wall_seconds.append(time.perf_counter() - wall_start)
        del result  # the next step starts from what the first one did
    return dict(variant=variant, dtype=dtype_name, growth=_high_water_mark() - before,
                cpu_s=min(cpu_seconds), wall_s=min(wall_seconds), cpu_s_all=cpu_seconds, wall_s_all=wall_seconds,
                threads=torch.get_num_threads())


def fresh_process(variant: str, dtype: torch.dtype | str, shape, steps: int = 1, threads: int | None = None) -> dict:
    """measure_step in a new Python process: in this one, memory the
    allocator kept from earlier steps would hide the growth."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dtype_name = dtype if isinstance(dtype, str) else str(dtype)[6:]
    code = ("import json, sys; from benchmarks.bench_linear_cross_entropy import measure_step; "
            "threads = int(sys.argv[4]) or None; "
            "print(json.dumps(measure_step(sys.argv[1], sys.argv[2], tuple(map(int, sys.argv[5:])), "
            "int(sys.argv[3]), threads)))")
    arguments = [variant, dtype_name, str(steps), str(threads or 0), *map(str, shape)]
    done = subprocess.run([sys.executable, "-c", code, *arguments], cwd=root, check=True, capture_output=True,
                          text=True,
                          env={**os.environ, "PYTHONPATH": root})
    return json.loads(done.stdout.strip().splitlines()[-1])


def _machine() -> dict:
    import os
    import platform

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(platform=platform.platform(), cpu=model, cpu_count=os.cpu_count())


def _with_ratios(rows: list) -> list:
    """Each measured row's time and peak over the same dtype's effilayers
    linear_cross_entropy row and torch's chunked row (None where that row is
    absent)."""
    by_key = {(row["dtype"], row["variant"]): row for row in rows if "cpu_s" in row}
    for row in rows:
        if "cpu_s" not in row:
            continue
        for name, reference in (("effilayers", "effilayers"), ("torch_chunked", BASELINE)):
            other = by_key.get((row["dtype"], reference))
            row[f"time_ratio_vs_{name}"] = None if other is None else row["cpu_s"] / other["cpu_s"]
            row[f"peak_ratio_vs_{name}"] = None if other is None else row["growth"] / other["growth"]
        row["peak_ratio_vs_fp32_logits"] = row["growth"] / row["logits_fp32_bytes"]
    return rows


def measure_table(shape=TABLE_SHAPE, steps: int = TABLE_STEPS, threads: int = TABLE_THREADS, command: str = "",
                  dtypes=TABLE_DTYPES) -> dict:
    """Every table row, each in its own process, one at a time."""
    import datetime
    import os

    tokens, hidden, classes = shape
    load_before = os.getloadavg()
    rows = []
    for dtype_name in dtypes:
        for variant in TABLE_LABELS:
            row = dict(variant=variant, dtype=dtype_name, logits_fp32_bytes=tokens * classes * 4)
            if variant.startswith("torch-linear_cross_entropy") and not hasattr(F, "linear_cross_entropy"):
                row["absent"] = f"torch {torch.__version__} has no F.linear_cross_entropy"
            else:
                row.update(fresh_process(variant, dtype_name, shape, steps, threads))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return dict(device="cpu", torch=torch.__version__, threads=threads, machine=_machine(),
                date=datetime.date.today().isoformat(), command=command,
                load_average_before=load_before, load_average_after=os.getloadavg(),
                shape=dict(tokens=tokens, hidden=hidden, classes=classes), steps=steps, dtypes=list(dtypes),
                time="process CPU time (time.process_time) of the fastest step; wall time beside it",
                peak="growth of the peak resident set over the steps (VmHWM), gradients included",
                rows=_with_ratios(rows))


def _ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def render_table(report: dict, source: str) -> str:
    """The page's text between the markers: what the table shows, where
    and how it was measured, then one row per variant."""
    shape, machine = report["shape"], report["machine"]
    load = "/".join(f"{a:.1f}" for a in (report["load_average_before"][0], report["load_average_after"][0]))
    lines = [
        f"CPU, one forward + backward of the head and its loss, {shape['tokens']} tokens × hidden "
        f"{shape['hidden']} × {shape['classes']} classes, gradients included: process CPU time of the fastest of "
        f"{report['steps']} steps and the peak resident-set growth over them, one fresh process per row, each after "
        f"a warm-up on small tensors. {machine['cpu']} ({machine['cpu_count']} cores, shared; load {load} "
        f"before/after), {report['threads']} thread{'s' if report['threads'] != 1 else ''}, torch {report['torch']}, "
        f"{report['date']}; from `{source}`, made by `{report['command']}`.",
        "",
        "| dtype | implementation | CPU s | × effilayers | × torch chunked | peak growth MiB | × torch chunked "
        "| × fp32 logits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        label = TABLE_LABELS[row["variant"]]
        if "absent" in row:
            lines.append(f"| {row['dtype']} | {label} | absent: {row['absent']} | | | | | |")
            continue
        lines.append(f"| {row['dtype']} | {label} | {row['cpu_s']:.2f} | {_ratio(row['time_ratio_vs_effilayers'])} | "
                     f"{_ratio(row['time_ratio_vs_torch_chunked'])} | {row['growth'] / 2**20:.1f} | "
                     f"{_ratio(row['peak_ratio_vs_torch_chunked'])} | {row['peak_ratio_vs_fp32_logits']:.3f} |")
    return "\n".join(lines)


def page_section(page: str) -> str:
    """The text between the table's markers (exactly one pair)."""
    assert page.count(TABLE_START) == 1 and page.count(TABLE_END) == 1, "the page needs one pair of markers"
    return page.split(TABLE_START)[1].split(TABLE_END)[0]


def write_page(path, table: str) -> None:
    from pathlib import Path

    page = Path(path).read_text()
    old = page_section(page)
    Path(path).write_text(page.replace(TABLE_START + old + TABLE_END, f"{TABLE_START}\n{table}\n{TABLE_END}"))


def main(argv=None) -> None:
    import argparse
    import datetime
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description="The docs' CPU table: time and peak of a "
                                     "linear_cross_entropy step beside torch's, one fresh process per row.")
    parser.add_argument("--table-from", metavar="JSON", help="regenerate the table from this results file, "
                        "measuring nothing")
    parser.add_argument("--json", metavar="PATH", help="where to write the results (default: "
                        "benchmarks/results/linear_cross_entropy-cpu-table-<date>.json)")
    parser.add_argument("--page", "--readme", dest="page", metavar="PATH",
                        help=f"also write the table between its markers in this file ({TABLE_PAGE})")
    # bf16 steps at the table's shape take minutes each on one thread of a CPU without a fast bf16 GEMM
    parser.add_argument("--dtypes", nargs="+", choices=TABLE_DTYPES, default=list(TABLE_DTYPES),
                        help="the dtypes to measure (default: all)")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    if args.table_from:
        source = Path(args.table_from)
        report = json.loads(source.read_text())
    else:
        command = " ".join(["python -m benchmarks.bench_linear_cross_entropy", *(argv if argv is not None
                                                                                    else sys.argv[1:])])
        report = measure_table(command=command, dtypes=args.dtypes)
        source = Path(args.json or root / "benchmarks" / "results" /
                      f"linear_cross_entropy-cpu-table-{datetime.date.today().isoformat()}.json")
        source.write_text(json.dumps(report, indent=1) + "\n")
    shown = source.resolve().relative_to(root) if source.resolve().is_relative_to(root) else source
    table = render_table(report, str(shown))
    print(table)
    if args.page:
        write_page(args.page, table)


if __name__ == "__main__":
    main()
