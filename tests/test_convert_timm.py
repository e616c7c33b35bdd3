"""effilayers.convert / revert on timm's own model classes (random weights).

timm and torchvision are the ``timm`` extra, installed in CI's torch 2.11
environment only; elsewhere the module skips, saying why."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from effilayers import convert, revert
from effilayers.nn import ABN, InPlaceABN

from .equivalence import assert_same_results, forward_backward, inputs
from .torchvision_style import randomize_norms

try:
    import timm
    from timm.layers import BatchNormAct2d
except (ImportError, RuntimeError) as error:  # a torchvision built for another torch raises RuntimeError
    pytest.skip(f"timm is not importable here ({type(error).__name__}: {error}); install the 'timm' extra",
                allow_module_level=True)

# (model, the last part of the paths that mode="abn" leaves plain: the projection
# shortcuts' norms, which no activation follows)
MODELS = {
    "resnet18": {"1"},
    "resnet26d": {"2"},  # deep stem (a Sequential) and an AvgPool in the projection shortcut
    "seresnet18": {"bn2", "1"},  # SE reads bn2's output before the sum
    "resnext50_32x4d": {"1"},  # Bottleneck blocks with grouped convolutions
}
# timm's own classes and forwards, made small: one block a stage, narrow stages
SMALL = {
    "resnet18": dict(layers=(1, 1, 1, 1), channels=(8, 16, 16, 32), stem_width=8),
    "resnet26d": dict(layers=(1, 1, 1, 1), channels=(8, 16, 16, 32), stem_width=8),
    "seresnet18": dict(layers=(1, 1, 1, 1), channels=(8, 16, 16, 32)),
    "resnext50_32x4d": dict(layers=(1, 1, 1, 1), channels=(4, 8, 8, 8), cardinality=4, base_width=16),
    "densenet121": dict(growth_rate=8, block_config=(2, 2, 2, 2)),
}


# Batch 4 at 32x32: the last stage is 1x1, and a batch of 2 would normalise each
# channel over 2 values, whose ill-conditioned gradient magnifies float64
# rounding to ~1e-7 relative (both ways of computing it agree only that far).


def timm_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return randomize_norms(timm.create_model(name, pretrained=False, num_classes=4, **SMALL[name]).double())


def snapshot(model):
    return {key: value for key, value in model.state_dict(keep_vars=True).items()}


def classes(model):
    return {path: type(module) for path, module in model.named_modules()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_resnets_convert_exactly_and_revert_to_timm_classes(name):
    original = timm_model(name)
    model = copy.deepcopy(original)
    before_classes, before_state = classes(model), snapshot(model)
    report = convert(model, mode="abn")
    assert {entry.path.rsplit(".", 1)[-1] for entry in report.left_alone} == MODELS[name], str(report)
    # the residual tail included: each non-SE block sums inside its last norm
    assert any(pair.residual for pair in report.fused) == (name != "seresnet18")
    assert len(report.fused) + len(report.left_alone) == sum(
        isinstance(module, nn.BatchNorm2d) for module in original.modules())
    assert all(entry.reason for entry in report.left_alone)
    x = inputs((4, 3, 32, 32))
    assert_same_results(forward_backward(model, x), forward_backward(original, x))

    revert(model)
    assert classes(model) == before_classes
    after = snapshot(model)
    assert list(after) == list(before_state) and all(after[key] is before_state[key] for key in after)
    assert_same_results(forward_backward(model, x, training=False), forward_backward(original, x, training=False))


@pytest.mark.parametrize("name", ["resnext50_32x4d", "seresnet18"])
def test_timm_resnets_in_place_match_their_reverted_form(name):
    model = timm_model(name)
    report = convert(model, mode="inplace")
    fused = [module for module in model.modules() if isinstance(module, ABN)]
    assert fused and all(isinstance(module, InPlaceABN) for module in fused), str(report)
    # the fused blocks' run-time classes survive pickling, as torch.save(model) needs
    reference = pickle.loads(pickle.dumps(model))
    assert [type(module) for module in reference.modules()] == [type(module) for module in model.modules()]
    revert(reference)
    assert not any(isinstance(module, ABN) for module in reference.modules())
    x = inputs((4, 3, 32, 32))
    assert_same_results(forward_backward(model, x), forward_backward(reference, x))


def test_batchnorm_act2d_in_place_where_its_input_is_fresh():
    original = timm_model("densenet121")
    model = copy.deepcopy(original)
    report = convert(model, mode="inplace")
    assert not report.left_alone, str(report)
    layer = model.features.denseblock1.denselayer1
    # norm2 reads conv1's fresh output: in place; norm1 reads the concatenated features: not
    assert type(layer.norm2) is InPlaceABN and type(layer.norm1) is ABN
    assert type(model.features.norm0) is InPlaceABN  # after conv0 in the features Sequential
    x = inputs((4, 3, 32, 32))
    reference = copy.deepcopy(model)
    revert(reference)
    assert type(reference.features.denseblock1.denselayer1.norm2) is BatchNormAct2d
    assert type(reference.features.denseblock1.denselayer1.norm2.act) is nn.LeakyReLU
    assert_same_results(forward_backward(model, x), forward_backward(reference, x))

    # mode="abn" keeps timm's function and reverts to timm's classes, state dict untouched
    model = copy.deepcopy(original)
    before_classes, before_state = classes(model), snapshot(model)
    convert(model, mode="abn")
    assert_same_results(forward_backward(model, x), forward_backward(original, x))
    revert(model)
    assert classes(model) == before_classes
    assert all(snapshot(model)[key] is value for key, value in before_state.items())
