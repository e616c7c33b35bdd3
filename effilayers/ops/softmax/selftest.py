"""The self-test's inputs for the softmax ops (``python -m effilayers.info --selftest``)."""

from __future__ import annotations

import torch

from ..._core.selftest import LONG_ROW, Case, f64, randn


def _softmax_forward(device, dtype, g):
    return [(randn((3, 37), g, dtype, device, 3.0), -1, False, None),
            (randn((2, 5, 3, 4), g, dtype, device, 3.0), 1, True, None),
            (randn((3, LONG_ROW), g, dtype, device, 3.0), -1, True, None)]


def _softmax_backward(device, dtype, g):
    cases = []
    for shape, dim, log in (((3, 37), -1, False), ((2, 5, 3, 4), 1, True), ((3, LONG_ROW), -1, False)):
        x = randn(shape, g, f64, "cpu", 3.0)
        output = (torch.log_softmax(x, dim) if log else torch.softmax(x, dim)).to(dtype).to(device)
        cases.append((randn(shape, g, dtype, device), output, dim, log, 1.0, dtype))
    return cases


def _scaled_masked_softmax(device, dtype, g):
    mask = (torch.rand((1, 1, 6, 9), generator=g) > 0.3).to(device)
    return [(randn((2, 3, 6, 9), g, dtype, device, 3.0), mask, 0.5, False),
            (randn((2, 3, 6, 9), g, dtype, device, 3.0), None, 0.5, True),
            # causal rows 0 and 1 of a long row: every later piece is -inf throughout
            (randn((1, 2, LONG_ROW), g, dtype, device, 3.0), None, 0.5, True)]


CASES = {
    "softmax_forward": Case(_softmax_forward),
    "softmax_backward": Case(_softmax_backward),
    "scaled_masked_softmax_forward": Case(_scaled_masked_softmax),
}
