"""Host time of one ChunkedAdamW step on a tiny model, where the Python path
(not the kernel) is what a step costs.

50 fp32 parameters (16x8, 8 and 3x3x4x4; 5.6k elements in all, one chunk)
with fixed gradients, 1 thread. Reported per step, for fp32 and 8-bit states:

* ``wall_us``: ``time.perf_counter`` over blocks of 200 steps, median of 5;
* ``cpu_us``: the same with ``time.thread_time`` (what other jobs on a shared
  machine do not inflate as much);
* ``python_calls``, ``c_calls``, ``bytecodes``: the Python work of one step
  (``sys.setprofile``, opcode tracing), the same on any machine.

Compare two checkouts by running it in each, alternating, several times::

    for i in 1 2 3; do
        (cd A && OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/optim_host_time.py --label A)
        (cd B && OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/optim_host_time.py --label B)
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from effilayers.optim import ChunkedAdamW

SHAPES = ([(16, 8), (8,), (3, 3, 4, 4)] * 17)[:50]
STEPS_PER_BLOCK = 200
BLOCKS = 5


def build(state_dtype) -> ChunkedAdamW:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return ChunkedAdamW(params, lr=1e-3, state_dtype=state_dtype)


def python_work(optimizer: ChunkedAdamW) -> dict[str, int]:
    calls = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in calls:
            calls[event] += 1

    sys.setprofile(profile)
    optimizer.step()
    sys.setprofile(None)
    bytecodes = 0

    def trace(frame, event, arg):
        nonlocal bytecodes
        frame.f_trace_opcodes = True
        if event == "opcode":
            bytecodes += 1
        return trace

    sys.settrace(trace)
    optimizer.step()
    sys.settrace(None)
    return {"python_calls": calls["call"], "c_calls": calls["c_call"], "bytecodes": bytecodes}


def measure(state_dtype) -> dict[str, float]:
    optimizer = build(state_dtype)
    for _ in range(10):  # chunks made, kernels loaded
        optimizer.step()
    wall, cpu = [], []
    for _ in range(BLOCKS):
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        for _ in range(STEPS_PER_BLOCK):
            optimizer.step()
        wall.append((time.perf_counter() - wall_start) / STEPS_PER_BLOCK * 1e6)
        cpu.append((time.thread_time() - cpu_start) / STEPS_PER_BLOCK * 1e6)
    return {"wall_us": statistics.median(wall), "cpu_us": statistics.median(cpu), **python_work(optimizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="a name for this checkout in the JSON line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"label": args.label, "torch": torch.__version__,
              "fp32": measure(torch.float32), "8bit": measure("8bit")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
