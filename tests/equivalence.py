"""Float64 comparisons of two models: outputs, input and parameter
gradients, and running statistics after one training step."""

from __future__ import annotations

import torch
from torch import nn

from .accuracy import tolerance


def inputs(shape=(4, 3, 16, 16), seed=2) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def forward_backward(model: nn.Module, x: torch.Tensor, training: bool = True):
    """Outputs, input gradient and parameter gradients (by name) of one
    weighted-sum backward, plus the buffers afterwards (running statistics)."""
    model.train(training)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return out.detach(), x.grad, grads, buffers


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    # The floor covers gradients that are zero in exact arithmetic (a conv
    # bias right before a BatchNorm) and come out as rounding noise.
    scale = max(expected.abs().max().item(), 1e-3)
    error = (actual - expected).abs().max().item()
    bound = tolerance(torch.float64, "float64_model", scale)["atol"]
    assert error <= bound, f"{what}: max error {error:.3g} for max |expected| {scale:.3g}"


def assert_same_results(actual, expected):
    out, x_grad, grads, buffers = actual
    ref_out, ref_x_grad, ref_grads, ref_buffers = expected
    assert_close_scaled(out, ref_out, "output")
    assert_close_scaled(x_grad, ref_x_grad, "input gradient")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], f"gradient of {name}")
    assert buffers.keys() == ref_buffers.keys()
    for name in buffers:
        assert_close_scaled(buffers[name], ref_buffers[name], f"buffer {name}")
