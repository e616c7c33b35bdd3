"""What code written for torch's BatchNorm does with the fused modules:
they are ``_BatchNorm`` subclasses (found by the freezing idioms and by
torch.func), not ``BatchNorm2d``s (left alone by helpers that would swap
them for a plain norm), and ``qconfig`` behaves as on any module."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import effilayers
from effilayers.nn import ABN, InPlaceABN, InPlaceABNSync

from .helpers import channel_varied


def converted_net(mode="inplace"):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
                        nn.Conv2d(5, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).double()
    effilayers.convert(net, mode=mode)
    fused = [m for m in net.modules() if isinstance(m, ABN)]
    assert len(fused) == 2
    return net, fused


@pytest.mark.parametrize("cls", [ABN, InPlaceABN, InPlaceABNSync])
def test_fused_modules_are_batchnorms_but_not_batchnorm2d(cls):
    module = cls(4)
    assert isinstance(module, _BatchNorm) and not isinstance(module, nn.BatchNorm2d)
    assert module.state_dict().keys() == nn.BatchNorm2d(4).state_dict().keys()


@pytest.mark.parametrize("mode", ["inplace", "abn"])
def test_eval_idiom_freezes_the_running_statistics(mode):
    """mmdetection's ``norm_eval`` and most fine-tuning scripts: every
    _BatchNorm in eval while the rest trains."""
    net, fused = converted_net(mode)
    reference = copy.deepcopy(net)
    net.train()
    for module in net.modules():
        if isinstance(module, _BatchNorm):
            module.eval()
    before = {name: buffer.clone() for name, buffer in net.named_buffers()}
    x = channel_varied((4, 3, 6, 6), torch.float64)
    out = net(x.clone())
    out.sum().backward()
    for name, buffer in net.named_buffers():
        assert torch.equal(buffer, before[name]), name
    # it computed with the running statistics, as the whole model in eval would
    torch.testing.assert_close(out, reference.eval()(x.clone()), rtol=0, atol=0)
    assert all(not m.training for m in fused) and net[0].training


def test_requires_grad_idiom_freezes_weight_and_bias():
    net, fused = converted_net()
    for module in net.modules():
        if isinstance(module, _BatchNorm):
            module.requires_grad_(False)
    net(channel_varied((4, 3, 6, 6), torch.float64)).sum().backward()
    assert all(m.weight.grad is None and m.bias.grad is None for m in fused)
    assert net[0].weight.grad is not None


def test_torch_func_replace_all_batch_norm_modules_finds_them():
    """functorch's helper (for vmap over models) drops every _BatchNorm's
    running statistics; the fused modules then use batch statistics."""
    net, fused = converted_net(mode="abn")
    x = channel_varied((4, 3, 6, 6), torch.float64)
    expected = net.train()(x)
    torch.func.replace_all_batch_norm_modules_(net)
    assert all(m.running_mean is None and m.running_var is None and not m.track_running_stats for m in fused)
    torch.testing.assert_close(net.eval()(x), expected, rtol=1e-12, atol=1e-12)


def test_qconfig_is_absent_until_set_and_survives_copies():
    module = InPlaceABN(3)
    assert not hasattr(module, "qconfig")
    with pytest.raises(AttributeError, match="'InPlaceABN' object has no attribute 'qconfig'"):
        module.qconfig
    module.qconfig = "a qconfig"
    assert module.qconfig == "a qconfig"
    assert copy.deepcopy(module).qconfig == "a qconfig"
    assert pickle.loads(pickle.dumps(module)).qconfig == "a qconfig"


def test_a_norm_frozen_before_convert_is_left_alone():
    """torchvision's FrozenBatchNorm2d (what freeze helpers produce) is not a
    BatchNorm: convert leaves it and the model computes what it did."""
    ops = pytest.importorskip("torchvision.ops", reason="torchvision does not import with this torch build")
    torch.manual_seed(0)
    frozen = ops.FrozenBatchNorm2d(5)
    with torch.no_grad():
        frozen.weight.uniform_(0.5, 1.5)
        frozen.running_var.uniform_(0.5, 1.5)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), frozen, nn.ReLU()).double()
    x = channel_varied((2, 3, 6, 6), torch.float64)
    expected = net(x)
    effilayers.convert(net)
    assert net[1] is frozen and type(net[2]) is nn.ReLU
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
