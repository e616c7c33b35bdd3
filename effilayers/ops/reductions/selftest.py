"""The self-test's inputs for the reductions ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

from ..._core.selftest import Case, bf16, f16, f32, f64, randn

TIERS = {
    # A reduction against float64: results that cancel to near zero while their terms are not.
    "reduction": {f64: (1e-10, 1e-10), f32: (1e-5, 1e-5), f16: (1e-3, 1e-3), bf16: (1e-2, 1e-2)},
}

def _reduce(device, dtype, g):
    cases = []
    # the last dim, a middle one (strided rows), two that need the copy
    for kind, shape, dims in (("sum", (3, 37), [1]), ("var", (2, 19, 5), [1]), ("norm", (4, 40, 3), [0, 2])):
        x = randn(shape, g, dtype, device, 2.0, 1.0)
        cases.append((x, dims, kind, 1.0 if kind == "var" else 0.0, False, None))
    return cases


CASES = {
    "reduce": Case(_reduce, tier="reduction"),
}
