"""MaxPool2d that recomputes its indices: same values and gradients, fewer bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effilayers import memory
from effilayers.nn import MaxPool2d


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2),
                                    dict(kernel_size=(3, 2), stride=(1, 2), dilation=2, ceil_mode=True)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_matches_torch_including_ties(kwargs, layout):
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64)
    x[:, :, ::2, ::2] = 1.0  # plenty of ties inside windows
    x = x.contiguous(memory_format=memory_format).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    out, expected = MaxPool2d(**kwargs)(x), nn.MaxPool2d(**kwargs)(x_torch)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(x.grad, x_torch.grad)


def test_gradcheck():
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(MaxPool2d(3, 2, 1), (x,))


def test_keeps_no_indices():
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    ours = memory.activation_bytes(MaxPool2d(3, 2, 1), x)
    theirs = memory.activation_bytes(nn.MaxPool2d(3, 2, 1), x)
    indices_bytes = 2 * 8 * 8 * 8 * 8  # one int64 per output value
    assert ours == x.numel() * 4
    assert theirs == ours + indices_bytes


def test_return_indices_behaves_like_torch():
    x = torch.randn(1, 1, 4, 4)
    out, indices = MaxPool2d(2, return_indices=True)(x)
    expected, expected_indices = nn.MaxPool2d(2, return_indices=True)(x)
    assert torch.equal(out, expected) and torch.equal(indices, expected_indices)
