"""What the DenseNet test files share: a memory-efficient model and its
plain twin with the same (non-trivial) parameters, and their comparison."""

from __future__ import annotations

import torch
from torch import nn

import effilayers
from effilayers.models.densenet import DenseNet


def efficient_and_naive(dtype=torch.float64, seed=0, **kwargs):
    options = dict(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=2, num_classes=5)
    options.update(kwargs)
    torch.manual_seed(seed)
    efficient = DenseNet(memory_efficient=True, **options).to(dtype)
    naive = DenseNet(memory_efficient=False, **options).to(dtype)
    naive.load_state_dict(efficient.state_dict())
    # Non-trivial affine parameters, so their gradients are exercised.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for a, b in zip(efficient.modules(), naive.modules()):
            if isinstance(a, (nn.BatchNorm2d, effilayers.nn.ABN)):
                a.weight.copy_(torch.rand(a.num_features, generator=gen) + 0.5)
                a.bias.copy_(torch.randn(a.num_features, generator=gen) * 0.2)
                b.weight.copy_(a.weight)
                b.bias.copy_(a.bias)
    return efficient, naive


def run_forward_backward(model, x, seed=0):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # same dropout masks in both models
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in model.named_parameters()}


def assert_models_agree(efficient, naive, x, rtol, atol, seed=0):
    out_e, gx_e, grads_e = run_forward_backward(efficient, x, seed)
    out_n, gx_n, grads_n = run_forward_backward(naive, x, seed)
    torch.testing.assert_close(out_e, out_n, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_e, gx_n, rtol=rtol, atol=atol)
    assert grads_e.keys() == grads_n.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_e[name], grads_n[name], rtol=rtol, atol=atol, msg=name)
