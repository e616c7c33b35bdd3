"""The self-test's inputs for the adam ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

import torch

from ..._core.selftest import Case, f32, positive, randn

TIERS = {
    # 8-bit optimizer states against the reference's: a code one step off moves
    # an element's update by ~1e-6; codes themselves may differ by one.
    "adam_8bit": {f32: (1e-5, 2e-5), torch.int8: (0, 1), torch.uint8: (0, 1)},
}

def _hyper():
    """The hyper-parameters, flat at the end of the kernels' arguments."""
    from .contract import AdamHyperParams

    return AdamHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                           decoupled_weight_decay=True, maximize=False)


def _adam(device, dtype, g):
    cases = []
    for shapes in (((37,),), ((3, 5), (300,), (1,))):
        params = [randn(s, g, dtype, device) for s in shapes]
        grads = [randn(s, g, dtype, device, 3.0) for s in shapes]
        total = sum(p.numel() for p in params)
        exp_avg = randn((total,), g, f32, device, 0.1)
        exp_avg_sq = positive((total,), g, device, 1e-4, 1e-2)
        cases.append((params, grads, exp_avg, exp_avg_sq, exp_avg_sq * 1.5, None, torch.tensor([3.0], device=device),
                      None, None, *_hyper()))
    return cases


def _adam_8bit(device, dtype, g):
    from .contract import QUANT_BLOCK, padded_numel

    cases = []
    for shapes in (((37,),), ((3, 5), (300,), (1,))):
        params = [randn(s, g, dtype, device) for s in shapes]
        grads = [randn(s, g, dtype, device, 3.0) for s in shapes]
        total = sum(padded_numel(p.numel()) for p in params)
        blocks = total // QUANT_BLOCK
        # The states of a first step: all codes and scales zero.
        states = (torch.zeros(total, dtype=torch.int8, device=device), torch.zeros(blocks, device=device),
                  torch.zeros(total, dtype=torch.uint8, device=device), torch.zeros(blocks, device=device))
        cases.append((params, grads, *states, None, None, None, torch.tensor([1.0], device=device), None, None,
                      *_hyper()))
    return cases


CASES = {
    "adam_step_": Case(_adam, dtypes=(f32,), float64_oracle=False),
    "adam_step_8bit_": Case(_adam_8bit, dtypes=(f32,), tier="adam_8bit", float64_oracle=False),
}
