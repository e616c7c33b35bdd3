"""effilayers.convert / revert on timm's own model classes (random weights).

timm and torchvision are the ``timm`` extra, installed in CI's torch 2.11
environment only; elsewhere the module skips, saying why."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from effilayers import convert, memory, revert
from effilayers.convert import FusedActivation
from effilayers.nn import ABN, InPlaceABN, InPlaceABNSync

from .equivalence import assert_close_scaled, assert_same_results, forward_backward, inputs
from .torchvision_style import randomize_norms

try:
    import timm
    import timm.utils
    from timm.layers import BatchNormAct2d, FrozenBatchNormAct2d, freeze_batch_norm_2d
    from timm.models.resnet import BasicBlock as TimmBasicBlock
    from torchvision.ops.misc import FrozenBatchNorm2d
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
    # (their classes are the timm form of InPlaceABN / ABN, see the freeze tests below)
    assert isinstance(layer.norm2, InPlaceABN) and isinstance(layer.norm1, ABN)
    assert not isinstance(layer.norm1, InPlaceABN)
    assert isinstance(model.features.norm0, InPlaceABN)  # after conv0 in the features Sequential
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


# ---- timm's freeze helpers on converted models --------------------------------------------


def frozen_norms(model):
    return [module for module in model.modules() if isinstance(module, (FrozenBatchNormAct2d, FrozenBatchNorm2d))]


def eval_output(model, x):
    with torch.no_grad():
        return model.eval()(x.clone())


def assert_frozen_training_step(model, x, expected):
    """In training mode the frozen model computes the converted model's eval
    function; its norms have no parameters and their statistics do not move."""
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.train()
    out = model(x.clone())
    assert_close_scaled(out.detach(), expected, "frozen output in training mode")
    out.square().sum().backward()
    norms = frozen_norms(model)
    assert norms and all(not list(norm.parameters()) for norm in norms)
    assert all(p.grad is not None for p in model.parameters())  # the rest trains
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


@pytest.mark.parametrize("name, mode", [("resnet18", "inplace"), ("resnet18", "abn"), ("resnet26d", "inplace"),
                                        ("densenet121", "inplace"), ("densenet121", "abn")])
def test_timm_freeze_swaps_every_converted_norm_and_keeps_the_function(name, mode):
    model = timm_model(name)
    report = convert(model, mode=mode)
    fused = [module for module in model.modules() if isinstance(module, ABN)]
    assert len(fused) == len(report.fused) and all(isinstance(module, BatchNormAct2d) for module in fused)
    norms = sum(isinstance(module, _BatchNorm) for module in model.modules())
    x = inputs((4, 3, 32, 32))
    expected = eval_output(model, x)

    assert freeze_batch_norm_2d(model) is model
    # every norm swapped, fused or left plain by convert; a residual tail's
    # activation now runs after the sum, in the block
    assert not any(isinstance(module, _BatchNorm) for module in model.modules())
    assert len(frozen_norms(model)) == norms
    acts = [type(norm.act) for norm in frozen_norms(model) if isinstance(norm, FrozenBatchNormAct2d)]
    assert nn.LeakyReLU in acts if mode == "inplace" else nn.ReLU in acts
    assert_close_scaled(eval_output(model, x), expected, "frozen output")
    assert_frozen_training_step(model, x, expected)


def test_timm_utils_freeze_of_some_blocks_then_revert():
    """timm.utils.freeze on the stem norm and layer1 (converted norms among
    them); revert then gives timm's classes back, leaving the frozen norms."""
    model = timm_model("resnet18")
    convert(model, mode="inplace")
    x = inputs((4, 3, 32, 32))
    expected = eval_output(model, x)
    timm.utils.freeze(model, ["bn1", "layer1"])
    assert isinstance(model.bn1, FrozenBatchNormAct2d) and type(model.bn1.act) is nn.LeakyReLU
    assert isinstance(model.layer1[0].bn2, FrozenBatchNormAct2d) and type(model.layer1[0].bn2.act) is nn.Identity
    assert isinstance(model.layer2[0].bn1, InPlaceABN)
    assert_close_scaled(eval_output(model, x), expected, "partly frozen output")

    report = revert(model)
    assert not any(isinstance(module, ABN) for module in model.modules())
    assert all(type(block) is TimmBasicBlock for block in (model.layer1[0], model.layer2[0]))
    assert isinstance(model.layer1[0].bn2, FrozenBatchNormAct2d) and type(model.layer1[0].act2) is nn.LeakyReLU
    assert isinstance(model.act1, FusedActivation)  # the frozen stem norm applies it
    assert {entry.path for entry in report.left_alone} == {"act1", "layer1.0.act1"}, str(report)
    assert type(model.layer2[0].bn1) is nn.BatchNorm2d and type(model.layer2[0].act1) is nn.LeakyReLU
    assert_close_scaled(eval_output(model, x), expected, "reverted output")


def test_converted_timm_norms_stay_freezable_through_pickle_and_sync():
    model = timm_model("resnet18")
    convert(model, mode="inplace")
    x = inputs((4, 3, 32, 32))
    expected = eval_output(model, x)
    model = InPlaceABNSync.convert_sync_abn(pickle.loads(pickle.dumps(model)))
    fused = [module for module in model.modules() if isinstance(module, ABN)]
    assert fused and all(isinstance(module, InPlaceABNSync) and isinstance(module, BatchNormAct2d) for module in fused)
    assert type(model.layer1[0].bn2.act) is nn.Identity and type(model.layer1[0].bn1.act) is nn.LeakyReLU
    freeze_batch_norm_2d(model)
    assert not any(isinstance(module, _BatchNorm) for module in model.modules())
    assert_close_scaled(eval_output(model, x), expected, "synchronised then frozen output")


@pytest.mark.parametrize("mode", ["inplace", "abn"])
def test_timm_freeze_leaves_converted_torchvision_norms_alone(mode):
    """Outside timm models the fused modules are not BatchNorm2ds: timm's
    freeze leaves them (and their function) as they are; only the plain
    norms convert left (mode="abn": the projection shortcuts') are frozen."""
    import torchvision

    torch.manual_seed(0)
    model = randomize_norms(torchvision.models.resnet18(num_classes=4).double())
    convert(model, mode=mode)
    fused = [module for module in model.modules() if isinstance(module, ABN)]
    x = inputs((2, 3, 32, 32))
    expected = eval_output(model, x)
    freeze_batch_norm_2d(model)
    assert [module for module in model.modules() if isinstance(module, ABN)] == fused
    assert not any(isinstance(module, BatchNormAct2d) for module in fused)
    assert len(frozen_norms(model)) == (3 if mode == "abn" else 0)
    assert_close_scaled(eval_output(model, x), expected, "output")


def test_efficientnet_b0_fuses_its_silu_norms_as_exact_abns():
    # timm's BatchNormAct2d + SiLU throughout: SiLU is not invertible, so each
    # pair becomes an exact ABN, which keeps the norm's input and statistics
    # but not the norm output that BatchNorm + SiLU keeps.
    torch.manual_seed(0)
    original = randomize_norms(timm.create_model("efficientnet_b0", pretrained=False).double())
    model = copy.deepcopy(original)
    keys, before_classes = list(model.state_dict()), classes(model)
    report = convert(model, mode="inplace")
    assert len(report.fused) == 33 and {pair.after for pair in report.fused} == {"ABN(silu)"}
    assert not report.function_changed
    assert all(pair.note.startswith("ABN, not in place: silu is not invertible") for pair in report.fused)
    # the projection norms, which no activation follows
    assert len(report.left_alone) == 16
    assert all("its act is Identity: nothing to fuse" in entry.reason for entry in report.left_alone)
    assert list(model.state_dict()) == keys
    x = inputs((2, 3, 96, 96))
    # one forward and backward each, measured by the meter as they run
    with memory.track_activations(exclude=model) as fused_meter:
        fused = forward_backward(model, x)
    with memory.track_activations(exclude=original) as plain_meter:
        plain = forward_backward(original, x)
    assert fused_meter.peak_bytes <= 0.85 * plain_meter.peak_bytes, (fused_meter.peak_bytes, plain_meter.peak_bytes)
    assert_same_results(fused, plain)
    revert(model)
    assert classes(model) == before_classes and list(model.state_dict()) == keys
