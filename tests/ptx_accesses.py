"""Counts the global memory accesses in the PTX of effilayers' Adam kernels
compiled for sm_90, on any machine (no GPU needed), through the kernel
report's own compile and PTX reading (``effilayers/_kernel_report.py``).

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels by Python functions): ``python -m tests.ptx_accesses`` prints, per
variant, how many loads and stores of each width the PTX holds.
"""

from __future__ import annotations

import json
from collections import Counter


def main() -> None:
    from effilayers import _kernel_report
    from effilayers.ops.adam import triton as adam

    results = {}
    for spec in adam.kernel_specialisations():
        # the fp32-parameter, fp32-state (or 8-bit) kernels with every optional branch
        if not spec.config.startswith("float32 params") or "bfloat16 states" in spec.config \
                or not spec.config.endswith("amsgrad+scaler+inf"):
            continue
        kind = "8bit" if "8bit" in spec.config else "fp32"
        layout = spec.config.split(", ")[2]
        ptx = _kernel_report.compile_triton(spec, 90)["ptx"]
        accesses = _kernel_report.global_accesses(ptx)
        results[f"{kind}-{layout}"] = dict(Counter(access.opcode for access in accesses))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
