"""Counts the global memory accesses in the PTX of effilayers' Adam kernels
compiled for sm_90, on any machine (no GPU needed: ``triton.compile`` runs
the whole pipeline, ptxas included, for a named target).

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels by Python functions): ``python -m tests.ptx_accesses`` prints, per
variant, how many loads and stores of each width the PTX holds.
"""

from __future__ import annotations

import json
import re
from collections import Counter

HYPER = ["lr", "log_beta1", "log_beta2", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "weight_decay",
         "decay_factor"]
OPTIONS = dict(HAS_MASTER=False, AMSGRAD=True, SCALED=True, CHECK_INF=True, DECOUPLED=True, MAXIMIZE=False,
               HAS_WEIGHT_DECAY=True)


def _accesses(kernel, pointers: dict, constants: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(pointers)
    signature.update({name: "fp32" for name in HYPER})
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    # what the launcher would specialise on: 16-byte aligned tensors, n % 16 == 0
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*") or name == "n"}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    return dict(Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)))


def main() -> None:
    from effilayers.ops.adam import triton as adam

    results = {}
    tables = {"parameter_table": "*i64", "tile_table": "*i64"}
    plain = {**tables, "first_param": "*fp32", "first_grad": "*fp32", "n": "i64", "exp_avg_ptr": "*fp32",
             "exp_avg_sq_ptr": "*fp32", "max_exp_avg_sq_ptr": "*fp32", "master_ptr": "*fp32", "step_ptr": "*fp32",
             "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
    quantized = {**tables, "first_param": "*fp32", "first_grad": "*fp32", "n": "i64", "exp_avg_ptr": "*i8",
                 "exp_avg_absmax_ptr": "*fp32", "exp_avg_sq_ptr": "*u8", "exp_avg_sq_absmax_ptr": "*fp32",
                 "max_exp_avg_sq_ptr": "*u8", "max_exp_avg_sq_absmax_ptr": "*fp32", "master_ptr": "*fp32",
                 "step_ptr": "*fp32", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
    for variant, single, aligned in (("single", True, False), ("aligned", False, True),
                                     ("unaligned", False, False)):
        results[f"fp32-{variant}"] = _accesses(adam._adam_kernel, plain, dict(
            SINGLE=single, ALIGNED=aligned, VECTOR=4, **OPTIONS, BLOCK=adam.BLOCK))
        results[f"8bit-{variant}"] = _accesses(adam._adam_8bit_kernel, quantized, dict(
            SINGLE=single, ALIGNED=aligned, VECTOR=4, **OPTIONS, QBLOCK=adam.QUANT_BLOCK,
            ROWS=adam.BLOCKS_PER_PROGRAM))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
