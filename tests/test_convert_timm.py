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

from effilayers import convert, fit, memory, revert
from effilayers.convert import FusedActivation
from effilayers.memory import activation_bytes
from effilayers.nn import ABN, InPlaceABN, InPlaceABNSync

from .equivalence import assert_close_scaled, assert_same_results, forward_backward, inputs
from .torchvision_style import randomize_norms

try:
    import timm
    import timm.utils
    from timm.layers import BatchNormAct2d, FrozenBatchNormAct2d, freeze_batch_norm_2d
    from timm.models.densenet import (
        DenseBlock as TimmDenseBlock,
        DenseLayer as TimmDenseLayer,
        DenseTransition as TimmDenseTransition,
    )
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
    # LeakyReLU everywhere: in place keeps the function, so the SE tail is compared with timm's own
    "seresnet50": dict(layers=(1, 1, 1, 1), channels=(4, 8, 8, 8), act_layer=nn.LeakyReLU),
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
    """A dense layer that keeps timm's forward (its norm1 applies a
    LeakyReLU, which the recomputing DenseNet path does not implement) has
    its norms fused one by one: norm2 in place over conv1's fresh output,
    norm1 (reading the concatenated maps) not."""
    original = timm_model("densenet121")
    original.features.denseblock1.denselayer1.norm1.act = nn.LeakyReLU(0.1)
    model = copy.deepcopy(original)
    report = convert(model, mode="inplace")
    assert not report.left_alone, str(report)
    layer = model.features.denseblock1.denselayer1
    assert type(layer) is TimmDenseLayer and "features.denseblock1.denselayer1" not in report.memory_efficient
    # its block hands shared statistics to its layers: not with this one in timm's forward
    assert type(model.features.denseblock1) is TimmDenseBlock
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


# ---- timm's DenseNet: effilayers' memory-efficient path -----------------------------------


@pytest.mark.parametrize("mode", ["abn", "inplace"])
def test_timm_densenet_recomputes_with_its_norms_and_state_unchanged(mode):
    original = timm_model("densenet121")
    model = copy.deepcopy(original)
    before_classes, before_state = classes(model), snapshot(model)
    report = convert(model, mode=mode)
    # timm's own classes still, with effilayers' forward
    swapped = {"features.denseblock1": TimmDenseBlock, "features.denseblock1.denselayer2": TimmDenseLayer,
               "features.transition3": TimmDenseTransition}
    for path, timm_class in swapped.items():
        module = model.get_submodule(path)
        assert isinstance(module, timm_class) and type(module) is not timm_class and path in report.memory_efficient
    assert len(report.memory_efficient) == 4 + 8 + 3
    # every layer's and transition's norm is recomputed, the same module at the same path;
    # only the stem's and the final norm are fused
    norms = [path for path, module in original.named_modules() if isinstance(module, BatchNormAct2d)]
    assert report.fused_paths == ["features.norm0", "features.norm5"] and not report.left_alone, str(report)
    assert [entry.norm for entry in report.recomputed] == norms[1:-1]
    assert f"recomputed in backward ({len(norms) - 2}):" in str(report)
    assert all(type(model.get_submodule(path)) is BatchNormAct2d for path in norms[1:-1])
    assert sum(isinstance(module, _BatchNorm) for module in model.modules()) == len(norms)
    after = snapshot(model)
    assert list(after) == list(before_state) and all(after[key] is before_state[key] for key in after)
    assert report.function_changed == (mode == "inplace")  # norm0 only: ReLU -> leaky_relu in place

    x = inputs((4, 3, 32, 32))
    # the model runs with the pickled classes too; in place, norm0 computes leaky_relu:
    # compared with the reverted copy
    reference = pickle.loads(pickle.dumps(model))
    assert classes(reference) == classes(model)
    restored = revert(reference)
    assert set(restored.restored_classes) == set(report.memory_efficient)
    if mode == "abn":
        assert classes(reference) == before_classes
    for training in (True, False):
        assert_same_results(forward_backward(model, x, training), forward_backward(reference, x, training))

    revert(model)
    assert {path: kind for path, kind in classes(model).items() if not path.endswith(".act")} == {
        path: kind for path, kind in before_classes.items() if not path.endswith(".act")}
    after = snapshot(model)
    assert list(after) == list(before_state) and all(after[key] is before_state[key] for key in after)


def test_timm_densenet_step_with_a_hooked_norm_calls_its_modules(fresh_warnings):
    """A norm hooked before convert keeps its layer (and block) in timm's
    forward; one hooked afterwards makes its step call the modules, the hook
    runs, and the results stay timm's."""
    original = timm_model("densenet121")
    seen = []
    original.features.denseblock2.denselayer1.norm1.register_forward_hook(lambda *args: seen.append(1))
    model = copy.deepcopy(original)
    report = convert(model, mode="abn")
    assert type(model.features.denseblock2.denselayer1) is TimmDenseLayer
    assert type(model.features.denseblock2) is TimmDenseBlock
    assert "has hooks" in report.reason("features.denseblock2.denselayer1.norm1")
    assert type(model.features.denseblock2.denselayer2) is not TimmDenseLayer  # the other layer recomputes
    model.features.denseblock3.denselayer1.norm1.act.register_forward_hook(lambda *args: seen.append(2))
    x = inputs((4, 3, 32, 32))
    with pytest.warns(UserWarning, match="hooks"):
        result = forward_backward(model, x)
    assert seen == [1, 2]
    assert_same_results(result, forward_backward(original, x))


def test_timm_densenet121_keeps_at_most_035x_the_activation_bytes():
    """The issue's figure: timm's densenet121, random weights, 2x3x64x64,
    activation bytes (effilayers.memory) after convert in either mode."""
    torch.manual_seed(0)
    model = timm.create_model("densenet121", pretrained=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    plain = activation_bytes(model, x)
    for mode in ("abn", "inplace"):
        convert(model, mode=mode)
        ratio = activation_bytes(model, x) / plain
        assert ratio <= 0.35, f"{mode}: {ratio:.3f}x"
        revert(model)


def test_fit_gives_timm_densenet_the_recomputing_path_exactly():
    """fit with exact=True takes no in-place step (it would change norm0's
    ReLU) but the DenseNet one: convert's class swaps, the function kept."""
    original = timm_model("densenet121")
    model = copy.deepcopy(original)
    before_classes = classes(model)
    x = inputs((4, 3, 32, 32))
    converted = copy.deepcopy(original)
    swapped = convert(converted, mode="abn").memory_efficient
    report = fit(model, x, 0.6)
    assert [step.kind for step in report.steps] == ["densenet_memory_efficient"], str(report)
    changed = {path: kind for path, kind in classes(model).items() if before_classes[path] is not kind}
    assert changed == {path: type(converted.get_submodule(path)) for path in swapped}
    assert_same_results(forward_backward(model, x), forward_backward(original, x))
    revert(model)
    assert classes(model) == before_classes


# ---- timm's SE blocks: the last norm in place, identity ---------------------------------------


def test_timm_se_tail_norm_in_place_keeps_the_function_and_the_batchnorm_idioms():
    original = timm_model("seresnet50")
    model = copy.deepcopy(original)
    norms = sum(isinstance(module, _BatchNorm) for module in original.modules())
    before_classes, before_state = classes(model), snapshot(model)
    report = convert(model, mode="inplace")
    assert not report.function_changed and report.left_alone_paths == [
        f"layer{stage}.0.downsample.1" for stage in range(1, 5)], str(report)
    tails = [pair for pair in report.fused if pair.pattern == "timm_se_tail"]
    assert [pair.norm for pair in tails] == [f"layer{stage}.0.bn3" for stage in range(1, 5)]
    for stage in range(1, 5):
        bn3 = model.get_submodule(f"layer{stage}.0.bn3")
        assert isinstance(bn3, InPlaceABN) and bn3.activation == "identity"
        assert isinstance(bn3, BatchNormAct2d) and type(bn3.act) is nn.Identity  # what timm's freeze copies
    # the freeze idiom finds every norm, converted or not
    assert sum(isinstance(module, _BatchNorm) for module in model.modules()) == norms
    x = inputs((4, 3, 32, 32))
    assert_same_results(forward_backward(model, x), forward_backward(original, x))
    assert_same_results(forward_backward(model, x, training=False), forward_backward(original, x, training=False))

    # norm_eval: every _BatchNorm in eval while the rest trains
    results = []
    for net in (model, original):
        net.train()
        for module in net.modules():
            if isinstance(module, _BatchNorm):
                module.eval()
        before = {name: buffer.clone() for name, buffer in net.named_buffers()}
        out = net(x.clone())
        out.square().sum().backward()
        assert all(torch.equal(buffer, before[name]) for name, buffer in net.named_buffers())
        results.append(out.detach())
    assert_close_scaled(results[0], results[1], "norm_eval output")
    # and the requires_grad idiom freezes their weights and biases
    frozen = [p for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters(recurse=False)]
    for parameter in frozen:
        parameter.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    model(x.clone()).square().sum().backward()
    assert all(parameter.grad is None for parameter in frozen) and model.fc.weight.grad is not None
    for parameter in frozen:
        parameter.requires_grad_(True)

    revert(model)
    assert classes(model) == before_classes
    after = snapshot(model)
    assert list(after) == list(before_state) and all(after[key] is before_state[key] for key in after)


class _ScaleInPlace(nn.Module):
    """Not one of timm's SE modules: it writes into its input."""

    def forward(self, x):
        return x.mul_(2.0)


def _hook_keeping_output(kept):
    def hook(module, args, output):
        kept.append((output, output.detach().clone()))
    return hook


@pytest.mark.parametrize("case", ["hooked_conv", "unknown_se", "abn"])
def test_timm_se_tail_norm_left_alone_where_its_input_or_output_may_be_used(case):
    original = timm_model("seresnet50")
    kept = []
    if case == "hooked_conv":  # the hook keeps conv3's output, the norm's input
        original.layer2[0].conv3.register_forward_hook(_hook_keeping_output(kept))
    if case == "unknown_se":
        original.layer2[0].se = _ScaleInPlace()
    model = copy.deepcopy(original)
    report = convert(model, mode="abn" if case == "abn" else "inplace")
    expected = {"hooked_conv": "conv3 has hooks", "unknown_se": "not one of timm's squeeze-excitation",
                "abn": "mode='abn' leaves it a BatchNorm"}[case]
    assert expected in report.reason("layer2.0.bn3"), str(report)
    assert type(model.layer2[0].bn3) is nn.BatchNorm2d
    if case != "abn":
        assert isinstance(model.layer3[0].bn3, InPlaceABN)
    x = inputs((4, 3, 32, 32))
    assert_same_results(forward_backward(model, x), forward_backward(original, x))
    if case == "hooked_conv":
        # what the hook kept is still conv3's output: the norm did not write over it
        assert kept and all(torch.equal(output, copy) for output, copy in kept)


def test_timm_seresnet50_se_tails_in_place_keep_at_most_07x_the_activation_bytes():
    torch.manual_seed(0)
    model = timm.create_model("seresnet50", pretrained=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    plain = activation_bytes(model, x)
    report = convert(model, mode="inplace")
    assert len([pair for pair in report.fused if pair.pattern == "timm_se_tail"]) == 16
    ratio = activation_bytes(model, x) / plain
    assert ratio <= 0.7, f"{ratio:.3f}x"


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
