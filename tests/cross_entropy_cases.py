"""What the cross_entropy test files share: input makers, torch's result in
float64, ours, their comparison, and a small model head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import effilayers
from effilayers.functional import cross_entropy

from .accuracy import assert_close

OP = "cross_entropy"


def backend_of(device):
    return effilayers.backends.choice(OP, device.type).backend


def make_logits(shape, dtype, device, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale + 0.5
    return values.to(dtype=dtype, device=device)


def make_target(shape, classes, device, seed=1, ignore_every=0, ignore_index=-100):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, shape, generator=generator)
    if ignore_every:
        target.view(-1)[::ignore_every] = ignore_index
    return target.to(device)


def make_weight(classes, device, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(classes, generator=generator, dtype=torch.float64) + 0.25).to(device)


def torch_expected(logits, target, grad_output=None, **kwargs):
    """torch's loss and gradient from the same (rounded) logits in float64."""
    x = logits.detach().double().requires_grad_()
    weight = kwargs.pop("weight", None)
    loss = F.cross_entropy(x, target, weight=None if weight is None else weight.double(), **kwargs)
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output.double()
    (grad,) = torch.autograd.grad(loss, x, grad_output)
    return loss.detach(), grad


def ours(logits, target, grad_output=None, **kwargs):
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, target, **kwargs)
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output
    loss.backward(grad_output)
    return loss.detach(), x.grad


def assert_matches_torch(logits, target, dtype, grad_output=None, **kwargs):
    exp_loss, exp_grad = torch_expected(logits, target, grad_output, **kwargs)
    loss, grad = ours(logits, target, grad_output, **kwargs)
    assert loss.dtype == logits.dtype and grad.dtype == logits.dtype
    assert loss.shape == exp_loss.shape and grad.shape == logits.shape
    assert_close(loss.double(), exp_loss, dtype)
    assert_close(grad.double(), exp_grad, dtype)


class Head(torch.nn.Module):
    def __init__(self, features, classes, dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(11)
        self.linear = torch.nn.Linear(features, classes, dtype=dtype)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(classes, features, generator=generator, dtype=dtype))

    def forward(self, h):
        return self.linear(h)
