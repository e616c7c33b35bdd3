"""effilayers.models ResNets: torchvision's state-dict keys for every
norm_act, checkpoints that load across modes, the same function as
torchvision's ("plain", "abn") or its leaky_relu variant ("inplace"), and
the activation memory the in-place form saves."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import effilayers
from effilayers import memory, models, revert
from effilayers.convert import FusedActivation
from effilayers.models import resnet as effi_resnet
from effilayers.nn import ABN, InPlaceABN, MaxPool2d

from . import torchvision_style as tv
from .equivalence import assert_same_results, forward_backward, inputs
from .torchvision_style import randomize_norms, relu_to_leaky

KEYS = json.loads((Path(__file__).parent / "data" / "torchvision_state_dict_keys.json").read_text())
ARCHITECTURES = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2"]
NORM_ACTS = ["plain", "abn", "inplace"]
# Training-mode equivalence needs a few values per channel in the last
# stage: at 32x32 it is 1x1, batch statistics of two values, and float64
# rounding differences grow to ~1e-6 there; at 64x64 (2x2) they stay ~1e-12.
EQUIVALENCE_INPUT = (2, 3, 64, 64)
# Expected type of the norms followed by an activation, per norm_act.
FUSED_TYPE = {"plain": nn.BatchNorm2d, "abn": ABN, "inplace": InPlaceABN}


@pytest.fixture(autouse=True)
def reference_kernels():
    # As in test_convert: model structure and equivalence, not kernels.
    with effilayers.use_backend("reference"):
        yield


def build(name: str, norm_act: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return getattr(models, name)(norm_act=norm_act, **kwargs)


# ---- state dicts ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_act", NORM_ACTS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_state_dict_keys_are_torchvisions(name, norm_act):
    with torch.device("meta"):  # shapes and names only: no memory, no init time
        model = build(name, norm_act)
    assert list(model.state_dict()) == KEYS[name]


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2"])
def test_parameter_shapes_match_the_torchvision_style_reference(name):
    # The recorded keys say nothing about shapes: the hand-written reference
    # (same architecture, written independently) does.
    block = tv.BasicBlock if name == "resnet18" else tv.Bottleneck
    layers = [2, 2, 2, 2] if name == "resnet18" else [3, 4, 6, 3]
    options = {"resnext50_32x4d": {"groups": 32, "width_per_group": 4},
               "wide_resnet50_2": {"width_per_group": 128}}.get(name, {})
    with torch.device("meta"):
        reference = tv.ResNet(block, layers, num_classes=1000, **options)
        model = build(name, "inplace")
    assert list(reference.state_dict()) == KEYS[name]
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_state_dicts_load_across_modes_strictly(name):
    sources = {norm_act: randomize_norms(build(name, norm_act, seed=1, num_classes=10), seed=2)
               for norm_act in NORM_ACTS}
    targets = {norm_act: build(name, norm_act, seed=3, num_classes=10) for norm_act in NORM_ACTS}
    for source_mode, source in sources.items():
        state = source.state_dict()
        for target_mode, target in targets.items():
            result = target.load_state_dict(state, strict=True)
            assert not result.missing_keys and not result.unexpected_keys
            loaded = target.state_dict()
            assert list(loaded) == list(state), (source_mode, target_mode)
            assert all(torch.equal(loaded[key], state[key]) for key in state), (source_mode, target_mode)


def torchvision_or_stand_in(name: str):
    """A torchvision model when torchvision imports; otherwise an effilayers
    plain-mode model with non-trivial norms, which has torchvision's keys
    (test_state_dict_keys_are_torchvisions) and function
    (test_plain_matches_the_torchvision_style_reference)."""
    try:
        import torchvision
    except ImportError:
        model = randomize_norms(build(name, "plain", seed=4), seed=5)
        return model, "effilayers plain-mode stand-in (torchvision is not importable)"
    torch.manual_seed(4)
    model = randomize_norms(getattr(torchvision.models, name)(weights=None), seed=5)
    return model, f"torchvision {torchvision.__version__}"


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_a_torchvision_checkpoint_loads_with_load_state_dict(name):
    # The recipe from the effilayers.models.resnet docstring; runs on the
    # stand-in when torchvision is absent, never skips.
    source, origin = torchvision_or_stand_in(name)
    source = source.double().eval()
    x = inputs((2, 3, 64, 64))
    with torch.no_grad():
        expected = source(x)
        expected_leaky = relu_to_leaky(copy.deepcopy(source))(x)
    for norm_act in NORM_ACTS:
        model = build(name, norm_act).double().eval()
        model.load_state_dict(source.state_dict())  # strict by default
        with torch.no_grad():
            out = model(x)
        reference = expected_leaky if norm_act == "inplace" else expected
        error = (out - reference).abs().max().item()
        assert error <= 1e-9 * reference.abs().max().item(), f"{norm_act} vs {origin}: max error {error:.3g}"


# ---- structure ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_act", NORM_ACTS)
def test_module_types_per_norm_act(norm_act):
    model = build("resnet50", norm_act, num_classes=10)
    fused_type = FUSED_TYPE[norm_act]
    assert type(model.bn1) is fused_type
    block = model.layer2[0]
    assert [type(block.bn1), type(block.bn2), type(block.bn3)] == [fused_type] * 3
    # The shortcut norm has no activation after it: plain BatchNorm, except in
    # place, where an identity InPlaceABN saves keeping the 1x1 conv output.
    shortcut_norm = block.downsample[1]
    if norm_act == "inplace":
        assert type(shortcut_norm) is InPlaceABN and shortcut_norm.activation == "identity"
        assert isinstance(model.maxpool, MaxPool2d)
    else:
        assert type(shortcut_norm) is nn.BatchNorm2d and type(model.maxpool) is nn.MaxPool2d
    if norm_act == "plain":
        assert type(model.relu) is nn.ReLU and type(block.relu) is nn.ReLU
    else:
        assert isinstance(model.relu, FusedActivation) and "relu" not in block._modules
        expected = ("relu", 0.0) if norm_act == "abn" else ("leaky_relu", 0.01)
        fused = [m for m in model.modules() if isinstance(m, ABN) and m.activation != "identity"]
        assert len(fused) == 1 + 16 * 3
        assert {(m.activation, m.activation_param) for m in fused} == {expected}
        shortcut_norms = [m for m in model.modules() if isinstance(m, ABN) and m.activation == "identity"]
        assert len(shortcut_norms) == (4 if norm_act == "inplace" else 0)


@pytest.mark.parametrize("name,groups,width", [("resnext50_32x4d", 32, 128), ("wide_resnet50_2", 1, 128),
                                               ("resnet50", 1, 64)])
def test_bottleneck_width_and_groups(name, groups, width):
    with torch.device("meta"):
        model = build(name, "inplace")
    conv2 = model.layer1[0].conv2
    assert (conv2.groups, conv2.in_channels, conv2.out_channels) == (groups, width, width)
    assert model.layer1[0].conv3.out_channels == 256 and model.fc.in_features == 2048


def test_replace_stride_with_dilation():
    model = build("resnet50", "inplace", num_classes=10, replace_stride_with_dilation=[False, True, True])
    features = model.forward_features(torch.randn(2, 3, 64, 64))
    assert features.shape == (2, 2048, 8, 8)  # output stride 8 instead of 32
    assert model.layer4[1].conv2.dilation == (4, 4) and model.layer4[0].conv2.dilation == (2, 2)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


@pytest.mark.parametrize("norm_act", NORM_ACTS)
def test_zero_init_residual(norm_act):
    model = build("resnet18", norm_act, zero_init_residual=True, num_classes=10)
    assert all(torch.count_nonzero(block.bn2.weight) == 0 for stage in (model.layer1, model.layer4) for block in stage)
    assert torch.all(model.layer1[0].bn1.weight == 1)


@pytest.mark.parametrize("name", ["resnet18", "resnext50_32x4d"])
def test_builders_take_torchvisions_no_weights_call(name):
    with torch.device("meta"):
        for kwargs in (dict(weights=None), dict(progress=True), dict(pretrained=False),
                       dict(weights=None, progress=False, num_classes=10)):
            model = getattr(models, name)(**kwargs)
            assert model.fc.out_features == kwargs.get("num_classes", 1000), kwargs


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm_act must be one of 'plain', 'abn', 'inplace'"):
        models.resnet18(norm_act="fused")
    with pytest.raises(TypeError, match="ship no weights"):
        models.resnet50(weights="IMAGENET1K_V2")
    with pytest.raises(TypeError, match="ship no weights"):
        models.resnet18(pretrained=True)
    with pytest.raises(ValueError, match="fixes groups=32"):
        models.resnext50_32x4d(groups=8)
    with pytest.raises(ValueError, match="groups=1 and base_width=64"):
        models.resnet18(groups=2)
    with pytest.raises(NotImplementedError, match="dilation"):
        models.resnet18(replace_stride_with_dilation=[False, False, True])
    with pytest.raises(ValueError, match="three bools"):
        models.resnet50(replace_stride_with_dilation=[True])
    with pytest.raises(ValueError, match="four positive ints"):
        effi_resnet.ResNet(effi_resnet.Bottleneck, [3, 4, 6])
    with pytest.raises(TypeError, match="BasicBlock or Bottleneck"):
        effi_resnet.ResNet(tv.Bottleneck, [3, 4, 6, 3])


# ---- function ------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_act", NORM_ACTS)
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_forward_backward_runs(name, norm_act):
    model = build(name, norm_act, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert int(model.bn1.num_batches_tracked) == 1
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()


def same_weights_pair(name: str, norm_act: str, **kwargs):
    """A plain model with non-trivial norms, and a ``norm_act`` model holding
    the same weights, both float64."""
    plain = randomize_norms(build(name, "plain", seed=6, **kwargs), seed=7).double()
    other = build(name, norm_act, seed=8, **kwargs).double()
    other.load_state_dict(plain.state_dict())
    return plain, other


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_abn_matches_plain_outputs_and_gradients(name):
    plain, fused = same_weights_pair(name, "abn", num_classes=10)
    x = inputs(EQUIVALENCE_INPUT)
    assert_same_results(forward_backward(fused, x), forward_backward(plain, x))
    assert_same_results(forward_backward(fused, x, training=False), forward_backward(plain, x, training=False))


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_inplace_matches_plain_with_leaky_relu(name):
    plain, fused = same_weights_pair(name, "inplace", num_classes=10)
    leaky = relu_to_leaky(plain, 0.01)
    x = inputs(EQUIVALENCE_INPUT)
    assert_same_results(forward_backward(fused, x), forward_backward(leaky, x))
    assert_same_results(forward_backward(fused, x, training=False), forward_backward(leaky, x, training=False))


@pytest.mark.parametrize("block,name", [(tv.BasicBlock, "resnet18"), (tv.Bottleneck, "resnet50")])
def test_plain_matches_the_torchvision_style_reference(block, name):
    torch.manual_seed(9)
    layers = [2, 2, 2, 2] if name == "resnet18" else [3, 4, 6, 3]
    reference = randomize_norms(tv.ResNet(block, layers, num_classes=10), seed=10).double()
    model = build(name, "plain", num_classes=10).double()
    model.load_state_dict(reference.state_dict())
    x = inputs(EQUIVALENCE_INPUT)
    assert_same_results(forward_backward(model, x), forward_backward(reference, x))


@pytest.mark.parametrize("norm_act", ["abn", "inplace"])
def test_revert_gives_a_plain_model_with_the_same_function(norm_act):
    model = randomize_norms(build("resnet50", norm_act, num_classes=10)).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = inputs(EQUIVALENCE_INPUT)
    expected = forward_backward(copy.deepcopy(model), x)
    report = revert(model)
    shortcuts = 4 if norm_act == "inplace" else 0  # identity InPlaceABN shortcut norms
    assert len(report.restored) == 1 + 16 * 3 + shortcuts and not report.left_alone
    assert not any(isinstance(m, (ABN, FusedActivation, MaxPool2d)) for m in model.modules())
    assert type(model.layer2[0].downsample[1]) is nn.BatchNorm2d
    activation = nn.ReLU if norm_act == "abn" else nn.LeakyReLU
    assert type(model.relu) is activation and type(model.layer3[2].relu) is activation
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert_same_results(forward_backward(model, x), expected)


def test_converting_a_plain_model_gives_the_fused_one():
    plain = build("resnet50", "plain", num_classes=10)
    report = effilayers.convert(plain, mode="inplace")
    # 49 norm + activation pairs, 4 shortcut norms; 16 blocks and the stem pool swapped.
    assert len(report.fused) == 1 + 16 * 3 + 4 and len(report.replaced_blocks) == 16
    assert report.replaced_pools == ["maxpool"]
    built = build("resnet50", "inplace", num_classes=10)
    assert [(n, type(m)) for n, m in plain.named_modules()] == [(n, type(m)) for n, m in built.named_modules()]


# ---- memory ---------------------------------------------------------------------------------------


def map_bytes(*shape: int) -> int:
    size = 4  # float32
    for dim in shape:
        size *= dim
    return size


@pytest.mark.parametrize("norm_act", ["plain", "inplace"])
def test_bottleneck_with_identity_shortcut_keeps_half_the_maps_in_place(norm_act):
    # Hand count, N=2, 8x8, 256 -> 64 -> 256 channels. Both keep the block
    # input (conv1's input, also the shortcut) and two float32 statistics
    # per norm channel. Plain keeps conv1/conv2/conv3 outputs (BatchNorm
    # inputs) and the three ReLU outputs; in place keeps the three fused
    # outputs only -- the shortcut it needs for backward is the input.
    block = effi_resnet.Bottleneck(256, 64, norm_act=norm_act)
    x = torch.randn(2, 256, 8, 8)
    shared = map_bytes(2, 256, 8, 8) + 2 * 4 * (64 + 64 + 256)
    narrow, wide = map_bytes(2, 64, 8, 8), map_bytes(2, 256, 8, 8)
    kept = memory.activation_bytes(block, x)
    if norm_act == "plain":
        assert kept == shared + 2 * (narrow + narrow + wide)
    else:
        assert kept == shared + narrow + narrow + wide


def test_bottleneck_with_projection_shortcut_keeps_the_shortcut_twice_in_place():
    # The in-place block must keep the shortcut for its fused sum; the plain
    # downsample BatchNorm keeps its own input as well: two wide maps the
    # plain block only keeps one of.
    downsample = nn.Sequential(nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256))
    x = torch.randn(2, 64, 8, 8)
    narrow, wide = map_bytes(2, 64, 8, 8), map_bytes(2, 256, 8, 8)
    shared = narrow + 2 * 4 * (64 + 64 + 256 + 256)
    plain = effi_resnet.Bottleneck(64, 64, downsample=copy.deepcopy(downsample), norm_act="plain")
    fused = effi_resnet.Bottleneck(64, 64, downsample=downsample, norm_act="inplace")
    assert memory.activation_bytes(plain, x) == shared + 2 * (narrow + narrow + wide) + wide
    assert memory.activation_bytes(fused, x) == shared + narrow + narrow + wide + 2 * wide


def test_bottleneck_with_fused_projection_shortcut_keeps_it_once():
    # With the shortcut norm an identity InPlaceABN over its 1x1 conv output
    # (as norm_act="inplace" builds it), the shortcut is kept once, by the
    # fused sum.
    model = build("resnet50", "inplace", num_classes=10)
    block = model.layer1[0]
    x = torch.randn(2, 64, 8, 8)
    narrow, wide = map_bytes(2, 64, 8, 8), map_bytes(2, 256, 8, 8)
    shared = narrow + 2 * 4 * (64 + 64 + 256 + 256)
    assert memory.activation_bytes(block, x) == shared + narrow + narrow + wide + wide


def test_resnet50_inplace_activation_bytes_ratio():
    x = torch.randn(2, 3, 64, 64)
    measured = {norm_act: memory.activation_bytes(build("resnet50", norm_act, num_classes=10), x)
                for norm_act in NORM_ACTS}
    ratio = measured["inplace"] / measured["plain"]
    fused = build("resnet50", "inplace", num_classes=10)
    with memory.track_activations(exclude=fused) as meter:
        out = fused(x)
    largest = [(s.nbytes, s.shape, str(s.dtype).replace("torch.", ""), s.saved_by) for s in meter.largest(6)]
    del out
    # Identity-shortcut blocks keep exactly half (test above); what lifts the
    # whole network above that is listed in the message.
    assert ratio <= 0.55, (
        f"resnet50 activation bytes at 2x3x64x64: inplace/plain = {ratio:.4f} "
        f"(inplace {measured['inplace']}, plain {measured['plain']}, abn {measured['abn']}); "
        f"largest saved in place (bytes, shape, dtype, saved by): {largest}; "
        "identity-shortcut blocks keep half; projection-shortcut blocks keep their shortcut once; the input "
        "and per-channel statistics cost the same in both"
    )
