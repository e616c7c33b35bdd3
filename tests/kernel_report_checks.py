"""Compiles a representative part of the kernel report for
tests/test_kernel_report.py: one spec of every launched Triton kernel at
sm_90 and sm_80 (the full sweep is ``python -m effilayers.info --kernels``;
CI runs it for sm_90); with ``--toys`` instead, a toy copy kernel with a
unit stride (128-bit accesses) and with a run-time stride (one 32-bit
access per element), so the width check is seen to pass and to fail.

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels by Python functions): ``python -m tests.kernel_report_checks
[--toys]`` prints the rows as JSON.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl


@triton.jit
def _toy_copy(x_ptr, y_ptr, n, stride, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets * stride, tl.load(x_ptr + offsets * stride, mask=mask), mask=mask)


def toy_spec(stride: int):
    from effilayers._core.kernel_spec import KernelSpec

    return KernelSpec(_toy_copy, dict(x_ptr=torch.float32, y_ptr=torch.float32, n=1 << 20, stride=stride),
                      dict(BLOCK=1024), 4, f"stride={stride}", 8, 8)


def main(toys: bool = False) -> None:
    from effilayers import _kernel_report

    if toys:
        rows = [_kernel_report.spec_row("toy", toy_spec(stride), 90) for stride in (1, 3)]
    else:
        rows, seen = [], set()
        for family, spec in _kernel_report.iter_specs():
            if (spec.name, spec.targets) in seen:  # a kernel with a tile table per architecture: one spec of each
                continue
            seen.add((spec.name, spec.targets))
            rows.extend(_kernel_report.spec_row(family, spec, capability) for capability in _kernel_report.TARGETS
                        if spec.targets is None or capability in spec.targets)
    for row in rows:
        row["problems"] = _kernel_report.problems(row)
    print(json.dumps({"toys" if toys else "rows": rows}))


if __name__ == "__main__":
    import sys

    main(toys=sys.argv[1:] == ["--toys"])
