"""The self-test's inputs for the linear_cross_entropy ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

import torch

from ..._core.selftest import Case, bf16, f16, f32, positive, randn

TIERS = {
    # The statistics pass: GEMM tiles (float32 sums in another order than
    # torch's; in fp16/bf16 the error of rounding the GEMM's inputs, atol
    # relative to the largest value) folded into a log-sum-exp.
    "linear_cross_entropy_logits": {f32: (1e-4, 1e-4), f16: (2e-3, 8e-4), bf16: (1.6e-2, 5e-3)},
    # The fused passes: GEMMs whose operand, the logits' gradient, is rounded
    # to fp16/bf16 first (as the chunked path and torch's unfused pair store
    # it); atol relative to the largest value.
    "linear_cross_entropy": {f32: (1e-5, 1e-5), f16: (2e-3, 4e-3), bf16: (1.6e-2, 3e-2)},
}
SCALED = {"linear_cross_entropy_logits": (f16, bf16), "linear_cross_entropy": (f16, bf16)}

def _linear_rows(device, dtype, g):
    """x (7 tokens, hidden 20, rows a gap apart), W (37 classes), b and
    targets (one ignored, one out of range): more than one tile of the
    fused kernels' smallest 16 in every dimension."""
    x = randn((7, 24), g, dtype, device)[:, :20]
    w = randn((37, 20), g, dtype, device, 0.3)
    target = torch.tensor([3, -100, 36, 0, 40, 17, 9], device=device)
    return x, w, randn((37,), g, dtype, device), target


def _linear_cross_entropy_stats(device, dtype, g):
    x, w, b, target = _linear_rows(device, dtype, g)
    return [(x, w, b, target, positive((37,), g, device), True), (x, w, None, target, None, False)]


def _linear_cross_entropy_grads(device, dtype, g):
    """Two chunks of classes: one from class 0 past a 16-wide tile, one
    from class 20 to the end (an offset chunk, its last tile short)."""
    x, w, b, target = _linear_rows(device, dtype, g)
    lse = torch.logsumexp(torch.nn.functional.linear(x.float(), w.float(), b.float()), 1) + 0.25
    row_terms = torch.stack([lse, positive((7,), g, device), positive((7,), g, device), positive((7,), g, device)])

    def out(width):
        return torch.full((7, width), float("nan"), dtype=dtype, device=device)

    return [(x, w, b, target, positive((37,), g, device, 0.001, 0.01), row_terms, -100, 0, out(20)),
            (x, w, None, target, None, row_terms, -100, 20, out(17))]


CASES = {
    "linear_cross_entropy_stats": Case(_linear_cross_entropy_stats, dtypes=(f32, f16, bf16),
                                       tier="linear_cross_entropy_logits"),
    "linear_cross_entropy_grads": Case(_linear_cross_entropy_grads, dtypes=(f32, f16, bf16),
                                       tier="linear_cross_entropy"),
}
