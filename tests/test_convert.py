"""effilayers.convert / revert: which pairs are fused, that the function is
kept (mode="abn") or changed only relu -> leaky_relu (mode="inplace"), that
state moves over untouched, and that revert undoes it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import effilayers
from effilayers import convert, revert
from effilayers.convert import BatchNormAct, ConversionReport, FusedActivation, RevertReport
from effilayers.models import resnet as effi_resnet
from effilayers.nn import ABN, InPlaceABN, InPlaceABNSync, MaxPool2d

from . import torchvision_style as tv
from .equivalence import assert_same_results, forward_backward, inputs
from .torchvision_style import randomize_norms, relu_to_leaky


@pytest.fixture(autouse=True)
def reference_kernels():
    # These tests are about model surgery, not kernels (tests of the ABN ops
    # cover those): the reference keeps them independent of whether, and how
    # recently, the C++ library was built here.
    with effilayers.use_backend("reference"):
        yield


# ---- helpers --------------------------------------------------------------------------------


def small_cnn() -> nn.Module:
    """Conv/BN/act chains in Sequentials, 1d and 2d norms, several activations."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.BatchNorm2d(8, eps=1e-3, momentum=None),
        nn.LeakyReLU(0.2),
        nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8, momentum=0.3), nn.ELU(alpha=0.7)),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )
    return randomize_norms(model).double()


def small_resnet(block) -> nn.Module:
    torch.manual_seed(1)
    model = tv.ResNet(block, [2, 1, 1, 1], num_classes=7, widths=(8, 8, 16, 16))
    return randomize_norms(model).double()


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_same_state(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(snapshot)
    for name, tensor in state.items():
        assert tensor.dtype == snapshot[name].dtype and tensor.device == snapshot[name].device, name
        assert torch.equal(tensor, snapshot[name]), name


# ---- Sequential chains ----------------------------------------------------------------------


def test_sequential_cnn_abn_is_exact_in_training_and_eval():
    original = small_cnn()
    converted = copy.deepcopy(original)
    report = convert(converted, mode="abn")

    assert report.fused_paths == ["1", "4", "6.1", "10"]
    assert [type(converted[i]) for i in (1, 4, 10)] == [ABN] * 3 and type(converted[6][1]) is ABN
    assert [converted[i].activation for i in (1, 4, 10)] == ["relu", "leaky_relu", "relu"]
    assert converted[4].activation_param == 0.2
    assert (converted[6][1].activation, converted[6][1].activation_param) == ("elu", 0.7)
    assert all(isinstance(converted[i], FusedActivation) for i in (2, 5, 11))
    assert not report.function_changed and not report.left_alone

    x = inputs()
    assert_same_results(forward_backward(converted, x), forward_backward(original, x))
    assert_same_results(forward_backward(converted, x, training=False), forward_backward(original, x, training=False))


def test_sequential_cnn_inplace_matches_the_leaky_relu_original():
    original = small_cnn()
    converted = copy.deepcopy(original)
    report = convert(converted, mode="inplace")

    # The first norm's input is the model input's conv output -- fresh -- so
    # every pair runs in place.
    assert [pair.module for pair in report.fused] == ["InPlaceABN"] * 4
    assert [pair.function_changed for pair in report.fused] == [True, False, False, True]
    assert report.function_changed
    assert (converted[1].activation, converted[1].activation_param) == ("leaky_relu", 0.01)
    assert converted[4].activation_param == 0.2  # a leaky_relu keeps its slope

    x = inputs()
    reference = relu_to_leaky(copy.deepcopy(original), 0.01)
    assert_same_results(forward_backward(converted, x), forward_backward(reference, x))
    assert_same_results(forward_backward(converted, x, training=False),
                        forward_backward(reference, x, training=False))


def test_activation_param_sets_the_slope_that_replaces_relu():
    model = small_cnn()
    report = convert(model, mode="inplace", activation_param=0.1)
    assert model[1].activation_param == 0.1 and model[10].activation_param == 0.1
    assert model[4].activation_param == 0.2
    assert "leaky_relu(0.1)" in report.fused[0].after


def test_state_moves_over_untouched_and_parameters_keep_their_identity():
    model = small_cnn()
    snapshot = state_snapshot(model)
    parameters = {name: p for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert(model, mode="inplace")

    assert_same_state(model, snapshot)
    assert {name: p for name, p in model.named_parameters()}.keys() == parameters.keys()
    assert all(p is parameters[name] for name, p in model.named_parameters())
    for index in (1, 4, 10):
        fused = model[index]
        assert fused.num_features == snapshot[f"{index}.weight"].numel()
    assert (model[4].eps, model[4].momentum) == (1e-3, None)
    assert model[6][1].momentum == 0.3

    # The optimizer built before converting still trains the converted model.
    before = model[1].weight.detach().clone()
    model(inputs()).sum().backward()
    optimizer.step()
    assert not torch.equal(model[1].weight, before)


@pytest.mark.parametrize("affine,track", [(False, True), (True, False), (False, False)])
def test_affine_and_running_stats_variants(affine, track):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=affine, track_running_stats=track),
                             nn.ReLU()).double()
    randomize_norms(original)
    converted = copy.deepcopy(original)
    convert(converted, mode="abn")
    fused = converted[1]
    assert (fused.affine, fused.track_running_stats) == (affine, track)
    assert (fused.weight is None) == (not affine) and (fused.running_mean is None) == (not track)
    assert list(converted.state_dict()) == list(original.state_dict())
    x = inputs((3, 3, 6, 6))
    for training in (True, False):
        assert_same_results(forward_backward(converted, x, training), forward_backward(original, x, training))


def test_training_flag_device_and_dtype_are_kept():
    model = small_cnn().eval()
    model[4].train()  # a mixed state survives too
    convert(model, mode="inplace")
    assert not model[1].training and model[4].training
    assert model[1].weight.dtype == torch.float64 and model[1].running_mean.dtype == torch.float64
    assert model[1].num_batches_tracked.dtype == torch.long
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_float32_model_stays_float32():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    convert(model, mode="abn")
    assert model[1].weight.dtype == torch.float32
    assert model(torch.randn(2, 3, 5, 5)).dtype == torch.float32


def test_a_norm_first_in_its_sequential_gets_abn_not_in_place():
    # Its input comes from outside the Sequential: the caller may use it
    # again (a residual, say), so it must not be overwritten.
    head = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1))
    outer = nn.Sequential(nn.Conv2d(3, 4, 1), nn.MaxPool2d(2), nn.BatchNorm2d(4), nn.ReLU())
    model = nn.ModuleDict({"head": head, "outer": outer})
    report = convert(model, mode="inplace")
    assert type(head[0]) is ABN and head[0].activation == "relu"
    assert type(outer[2]) is ABN and outer[2].activation == "relu"  # after MaxPool2d: not known to be fresh
    first, after_pool = report.fused
    assert first.norm == "head.0" and "first module" in first.note and not first.function_changed
    assert after_pool.norm == "outer.2" and "MaxPool2d" in after_pool.note


class PreActivation(nn.Module):
    """x + body(x) where body starts with BN -> ReLU: overwriting the body's
    input in place would corrupt the shortcut."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1))

    def forward(self, x):
        return x + self.body(x)


def test_pre_activation_shortcut_survives_inplace_mode():
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 3, 1), PreActivation(), PreActivation()).double()
    randomize_norms(original)
    converted = copy.deepcopy(original)
    report = convert(converted, mode="inplace")
    assert report.fused_paths == ["1.body.0", "2.body.0"]
    assert all(pair.module == "ABN" and not pair.function_changed for pair in report.fused)
    x = inputs((2, 3, 6, 6))
    assert_same_results(forward_backward(converted, x), forward_backward(original, x))


def test_shared_relu_module_in_sequentials_is_fine():
    # A stateless activation reused in several slots: each slot's pair is
    # fused; a use of the same object elsewhere still runs the ReLU.
    torch.manual_seed(0)
    act = nn.ReLU()
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), act,
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act).double()
    randomize_norms(model)
    original = copy.deepcopy(model)
    report = convert(model, mode="abn")
    assert report.fused_paths == ["1", "4"]
    x = inputs((2, 3, 6, 6))
    assert_same_results(forward_backward(model, x), forward_backward(original, x))


# ---- what is left alone -----------------------------------------------------------------------


class ReusedActivation(nn.Module):
    """A norm whose ReLU is called again on something else: only the forward
    knows that, so nothing here is converted."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        return self.relu(y - 1)


class OwnForward(nn.Sequential):
    def forward(self, x):  # skips the activation: not a chain
        return self[1](self[0](x))


def test_left_alone_cases_are_reported_with_reasons():
    shared_bn = nn.BatchNorm2d(4)
    hooked_bn = nn.BatchNorm2d(4)
    hooked_bn.register_forward_hook(lambda module, args, output: None)
    model = nn.ModuleDict({
        "not_adjacent": nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Dropout(0.1), nn.ReLU()),
        "last": nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)),
        "unsupported": nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.PReLU()),
        "negative_slope": nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(-0.1)),
        "reused_relu": ReusedActivation(),
        "shared_a": nn.Sequential(nn.Conv2d(3, 4, 1), shared_bn, nn.ReLU()),
        "shared_b": nn.Sequential(nn.Conv2d(3, 4, 1), shared_bn, nn.ReLU()),
        "hooked": nn.Sequential(nn.Conv2d(3, 4, 1), hooked_bn, nn.ReLU()),
        "own_forward": OwnForward(nn.BatchNorm2d(3), nn.ReLU()),
        "kept": nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()),
    })
    before = {name: [type(m) for m in module.modules()] for name, module in model.items()}
    report = convert(model, mode="inplace")

    assert report.fused_paths == ["kept.1"]
    expected_reasons = {
        "not_adjacent.1": "followed by Dropout",
        "last.1": "last module of its nn.Sequential",
        "unsupported.1": "followed by PReLU, not a supported activation (ReLU, LeakyReLU with slope >= 0, ELU "
                         "with alpha > 0, SiLU, GELU, Hardswish, Mish, ReLU6, Sigmoid, Tanh)",
        "negative_slope.1": "followed by LeakyReLU",
        "reused_relu.bn": "inside ReusedActivation, whose forward decides",
        "shared_a.1": "registered at 2 places (shared_a.1, shared_b.1)",
        "hooked.1": "has hooks",
        "own_forward.0": "inside OwnForward",
    }
    assert sorted(report.left_alone_paths) == sorted(expected_reasons)
    for path, fragment in expected_reasons.items():
        assert fragment in report.reason(path), (path, report.reason(path))
    for name, types in before.items():
        if name != "kept":
            assert [type(m) for m in model[name].modules()] == types, name
    text = str(report)
    assert "kept.1" in text and "not_adjacent.1: followed by Dropout" in text


def test_hooks_on_the_activation_keep_the_pair():
    relu = nn.ReLU()
    relu.register_forward_pre_hook(lambda module, args: None)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), relu)
    report = convert(model, mode="abn")
    assert report.left_alone_paths == ["1"] and "activation has hooks" in report.reason("1")
    assert model[2] is relu


def test_norm_subclass_with_its_own_forward_is_not_a_batchnorm():
    class ScaledBN(nn.BatchNorm2d):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Conv2d(3, 4, 1), ScaledBN(4), nn.ReLU())
    report = convert(model, mode="abn")
    assert not report.fused and report.left_alone_paths == ["1"]
    assert "ScaledBN overrides BatchNorm's forward" in report.reason("1")  # reported, not skipped silently
    assert type(model[1]) is ScaledBN


def test_lazy_and_parametrized_norms_are_left_alone():
    lazy = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d(), nn.ReLU())
    report = convert(lazy, mode="abn")
    assert "lazy" in report.reason("1")

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Double())
    report = convert(model, mode="abn")
    assert "parametrized" in report.reason("1")


def test_the_root_module_is_reported_not_replaced():
    report = convert(nn.BatchNorm2d(4), mode="abn")
    assert report.left_alone_paths == [""] and "root module" in report.reason("")

    block = tv.BasicBlock(4, 4)
    report = convert(block, mode="abn")
    assert report.left_alone_paths == ["bn1", "bn2"] and "nn.Sequential(model)" in report.reason("bn1")
    assert type(block.bn1) is nn.BatchNorm2d

    wrapped = nn.Sequential(block)
    report = convert(wrapped, mode="abn")
    assert report.replaced_blocks == ["0"] and isinstance(wrapped[0], effi_resnet.BasicBlock)


def test_converting_twice_changes_nothing_more():
    model = small_cnn()
    convert(model, mode="inplace")
    modules = list(model.modules())
    report = convert(model, mode="inplace")
    assert not report.fused and not report.left_alone
    assert list(model.modules()) == modules


def test_sync_batchnorm():
    # Without an initialised process group both compute local statistics.
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU()).double()
    randomize_norms(original)
    converted = copy.deepcopy(original)
    report = convert(converted, mode="inplace")
    assert type(converted[1]) is InPlaceABNSync and report.fused[0].module == "InPlaceABNSync"
    x = inputs((3, 3, 6, 6))
    assert_same_results(forward_backward(converted, x), forward_backward(relu_to_leaky(original), x))
    revert(converted)
    assert type(converted[1]) is nn.SyncBatchNorm

    abn_model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU())
    report = convert(abn_model, mode="abn")
    assert "no synchronised non-in-place ABN" in report.reason("1")


class BatchNormAct2d(nn.BatchNorm2d):
    """Stand-in for timm's norm-act layer: a BatchNorm2d that runs its own
    ``drop`` and ``act`` children after normalising."""

    def __init__(self, num_features, act):
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_timm_style_norm_act_layers():
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4, nn.ReLU()), nn.Conv2d(4, 4, 1),
                             BatchNormAct2d(4, nn.SiLU()), BatchNormAct2d(4, nn.Identity())).double()
    randomize_norms(original)
    keys = list(original.state_dict())
    converted = copy.deepcopy(original)
    report = convert(converted, mode="inplace")
    # A convolution's fresh output feeds it in this Sequential: in place, relu made leaky.
    assert type(converted[1]) is InPlaceABN and converted[1].activation == "leaky_relu"
    assert report.fused[0].pattern == "norm_act" and report.fused[0].activation is None
    # SiLU has no inverse: an exact ABN, said so in the pair's note
    assert type(converted[3]) is ABN and converted[3].activation == "silu"
    assert report.fused[1].note.startswith("ABN, not in place: silu is not invertible")
    assert "its act is Identity: nothing to fuse" in report.reason("4")
    assert list(converted.state_dict()) == keys
    x = inputs((2, 3, 6, 6))
    leaky = relu_to_leaky(copy.deepcopy(original))
    assert_same_results(forward_backward(converted, x), forward_backward(leaky, x))

    revert_report = revert(converted)
    assert type(converted[1]) is BatchNormAct and type(converted[1].act) is nn.LeakyReLU
    assert type(converted[3]) is BatchNormAct and type(converted[3].act) is nn.SiLU
    assert revert_report.restored_paths == ["1", "3"]
    assert list(converted.state_dict()) == keys
    assert_same_results(forward_backward(converted, x), forward_backward(leaky, x))

    # First in its Sequential, its input comes from outside: fused, not in place, relu kept.
    first = nn.Sequential(BatchNormAct2d(3, nn.ReLU()), nn.Conv2d(3, 4, 1)).double()
    report = convert(first, mode="inplace")
    assert type(first[0]) is ABN and first[0].activation == "relu"
    assert "first module" in report.fused[0].note or "outside" in report.fused[0].note


SMOOTH = [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Hardswish(), nn.Mish(), nn.ReLU6(),
          nn.Sigmoid(), nn.Tanh()]


@pytest.mark.parametrize("mode", ["inplace", "abn"])
def test_smooth_activations_fuse_as_exact_abn(mode):
    # Not invertible, so never in place: ABN with the activation unchanged,
    # the same function, and the norm outputs BatchNorm + act kept are gone.
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1)]
    for act in SMOOTH:
        layers += [nn.BatchNorm2d(4), act, nn.Conv2d(4, 4, 1)]
    original = nn.Sequential(*layers).double()
    randomize_norms(original)
    keys = list(original.state_dict())
    converted = copy.deepcopy(original)
    report = convert(converted, mode=mode)
    names = ["silu", "gelu", "gelu_tanh", "hardswish", "mish", "relu6", "sigmoid", "tanh"]
    assert [pair.after for pair in report.fused] == [f"ABN({name})" for name in names]
    assert not report.left_alone and not report.function_changed
    if mode == "inplace":
        assert all(pair.note.startswith(f"ABN, not in place: {name} is not invertible")
                   for pair, name in zip(report.fused, names))
    assert list(converted.state_dict()) == keys
    x = inputs((2, 3, 5, 5))
    assert_same_results(forward_backward(converted, x), forward_backward(original, x))
    plain_bytes = effilayers.memory.activation_bytes(original, x)
    fused_bytes = effilayers.memory.activation_bytes(converted, x)
    # One norm output (2x4x5x5 float64) fewer per pair; but for Sigmoid and
    # Tanh, which torch differentiates from their output (that the next
    # convolution keeps anyway), BatchNorm + act kept no more than ABN does.
    assert plain_bytes - fused_bytes == (len(names) - 2) * 2 * 4 * 5 * 5 * 8
    revert(converted)
    assert [type(m) for m in converted] == [type(m) for m in original]
    assert [m.approximate for m in converted if isinstance(m, nn.GELU)] == ["none", "tanh"]


# ---- torchvision-style ResNets ----------------------------------------------------------------


def shortcut_norms(kind: str) -> list[str]:
    return [f"layer{i}.0.downsample.1" for i in ((2, 3, 4) if kind == "basic" else (1, 2, 3, 4))]


def expected_resnet_pairs(kind: str, mode: str = "abn") -> list[str]:
    """Fused norms in module order; in place, the projection shortcuts' norms
    become identity InPlaceABNs too (after their block's own norms)."""
    norms = ["bn1", "bn2"] if kind == "basic" else ["bn1", "bn2", "bn3"]
    blocks = ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]
    shortcuts = shortcut_norms(kind) if mode == "inplace" else []
    paths = ["bn1"]
    for block in blocks:
        paths += [f"{block}.{norm}" for norm in norms]
        paths += [path for path in shortcuts if path.startswith(block + ".")]
    return paths


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_resnet_abn_is_exact(kind):
    block = tv.BasicBlock if kind == "basic" else tv.Bottleneck
    original = small_resnet(block)
    converted = copy.deepcopy(original)
    snapshot = state_snapshot(converted)
    report = convert(converted, mode="abn")

    assert report.fused_paths == expected_resnet_pairs(kind)
    residual_paths = [pair.norm for pair in report.fused if pair.residual]
    last = "bn2" if kind == "basic" else "bn3"
    assert residual_paths == [f"layer{i}.0.{last}" for i in (1,)] + ["layer1.1." + last] + [
        f"layer{i}.0.{last}" for i in (2, 3, 4)]
    assert report.replaced_blocks == ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]
    assert report.fused[0].pattern == "resnet_stem" and report.fused[0].activation == "relu"
    assert report.fused[1].activation == "layer1.0.relu"
    # Downsample norms: nothing follows them but the sum; exact mode keeps them plain.
    downsample = shortcut_norms(kind)
    assert report.left_alone_paths == downsample
    assert all("norm of the block's shortcut" in report.reason(path) for path in downsample)
    assert not report.function_changed

    fused_block = converted.layer2[0]
    effi_type = effi_resnet.BasicBlock if kind == "basic" else effi_resnet.Bottleneck
    assert type(fused_block) is effi_type and fused_block.is_fused and "relu" not in fused_block._modules
    assert fused_block.conv1 is not None and fused_block.stride == 2
    assert isinstance(converted.relu, FusedActivation) and type(converted.bn1) is ABN
    assert_same_state(converted, snapshot)

    x = inputs((2, 3, 32, 32))
    assert_same_results(forward_backward(converted, x), forward_backward(original, x))
    assert_same_results(forward_backward(converted, x, training=False), forward_backward(original, x, training=False))


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_resnet_inplace_matches_leaky_relu_original(kind):
    block = tv.BasicBlock if kind == "basic" else tv.Bottleneck
    original = small_resnet(block)
    converted = copy.deepcopy(original)
    report = convert(converted, mode="inplace")
    assert report.fused_paths == expected_resnet_pairs(kind, "inplace")
    assert {pair.module for pair in report.fused} == {"InPlaceABN"}
    shortcuts = [pair for pair in report.fused if pair.pattern == "resnet_shortcut"]
    assert [pair.norm for pair in shortcuts] == shortcut_norms(kind)
    assert all(pair.after == "InPlaceABN(identity)" and not pair.function_changed for pair in shortcuts)
    assert all(pair.function_changed for pair in report.fused if pair.pattern != "resnet_shortcut")
    assert not report.left_alone
    assert report.replaced_pools == ["maxpool"] and type(converted.maxpool) is MaxPool2d
    # A pool is not a block: the report lists it under its own heading.
    assert "maxpool" not in report.replaced_blocks and "max pools replaced (1):\n  maxpool" in str(report)
    last = converted.layer1[1].bn2 if kind == "basic" else converted.layer1[1].bn3
    assert type(last) is InPlaceABN and last.activation_param == 0.01

    x = inputs((2, 3, 32, 32))
    reference = relu_to_leaky(copy.deepcopy(original))
    assert_same_results(forward_backward(converted, x), forward_backward(reference, x))
    assert_same_results(forward_backward(converted, x, training=False),
                        forward_backward(reference, x, training=False))


def test_converted_torchvision_style_resnet_is_the_effilayers_fused_model():
    # Same module types and keys as building it fused, and the same function
    # once the weights agree.
    original = tv.ResNet(tv.Bottleneck, [3, 4, 6, 3], num_classes=10)
    convert(original, mode="inplace")
    built = effi_resnet.resnet50(norm_act="inplace", num_classes=10)
    assert list(original.state_dict()) == list(built.state_dict())
    converted_types = [type(m).__name__ for _, m in original.named_modules() if _ != ""]
    built_types = [type(m).__name__ for _, m in built.named_modules() if _ != ""]
    assert converted_types == built_types


def test_block_with_a_hooked_conv_fuses_that_norm_out_of_place():
    model = small_resnet(tv.BasicBlock)
    model.layer1[0].conv2.register_forward_hook(lambda module, args, output: None)
    report = convert(model, mode="inplace")
    pair = next(pair for pair in report.fused if pair.norm == "layer1.0.bn2")
    assert pair.module == "ABN" and "conv2 has hooks" in pair.note and pair.residual
    assert type(model.layer1[0].bn1) is InPlaceABN and type(model.layer1[0].bn2) is ABN


def test_block_with_a_shared_norm_is_left_alone():
    model = small_resnet(tv.BasicBlock)
    model.layer1[1].bn2 = model.layer1[0].bn2
    report = convert(model, mode="abn")
    assert "layer1.0" not in report.replaced_blocks and "layer1.1" not in report.replaced_blocks
    assert "registered at 2 places" in report.reason("layer1.0.bn2")
    assert type(model.layer1[0]) is tv.BasicBlock


def test_zero_weights_are_counted_in_the_report():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        model[1].weight[:2] = 0
    report = convert(model, mode="inplace")
    assert "2 channel(s) with |weight| < 0.001" in report.fused[0].note


# ---- revert -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["abn", "inplace"])
def test_round_trip_on_sequential_cnn(mode):
    original = small_cnn()
    model = copy.deepcopy(original)
    snapshot = state_snapshot(model)
    convert(model, mode=mode)
    x = inputs()
    converted_results = forward_backward(copy.deepcopy(model), x)
    report = revert(model)

    assert isinstance(report, RevertReport) and report.restored_paths == ["1", "4", "6.1", "10"]
    assert report.restored[0].activation == "2"
    assert not any(isinstance(m, (ABN, FusedActivation)) for m in model.modules())
    assert [type(model[i]) for i in (1, 4, 10)] == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]
    activation = nn.ReLU if mode == "abn" else nn.LeakyReLU
    assert [type(model[i]) for i in (2, 5, 11)] == [activation, nn.LeakyReLU, activation]
    assert type(model[6][2]) is nn.ELU and model[6][2].alpha == 0.7
    assert model[2].inplace  # the original flag came back
    assert_same_state(model, snapshot)
    reverted_results = forward_backward(model, x)
    assert_same_results(reverted_results, converted_results)
    if mode == "abn":
        assert_same_results(reverted_results, forward_backward(original, x))


@pytest.mark.parametrize("mode", ["abn", "inplace"])
@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_round_trip_on_resnet(kind, mode):
    block = tv.BasicBlock if kind == "basic" else tv.Bottleneck
    original = small_resnet(block)
    model = copy.deepcopy(original)
    snapshot = state_snapshot(model)
    convert(model, mode=mode)
    x = inputs((2, 3, 32, 32))
    converted_results = forward_backward(copy.deepcopy(model), x)
    report = revert(model)

    assert report.restored_paths == expected_resnet_pairs(kind, mode)
    assert not report.left_alone
    assert not any(isinstance(m, (ABN, FusedActivation, MaxPool2d)) for m in model.modules())
    assert type(model.layer2[0].downsample[1]) is nn.BatchNorm2d and type(model.maxpool) is nn.MaxPool2d
    activation = nn.ReLU if mode == "abn" else nn.LeakyReLU
    assert type(model.relu) is activation and type(model.layer2[0].relu) is activation
    assert list(model.layer2[0]._modules) == list(original.layer2[0]._modules)
    assert_same_state(model, snapshot)
    reverted_results = forward_backward(model, x)
    assert_same_results(reverted_results, converted_results)
    if mode == "abn":
        assert_same_results(reverted_results, forward_backward(original, x))
    # And back again: the reverted model converts like the original did.
    assert convert(model, mode="abn").fused_paths == expected_resnet_pairs(kind)


def test_revert_of_a_hand_built_abn_uses_batchnormact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), ABN(4, activation="elu", activation_param=0.5)).double()
    randomize_norms(model)
    keys = list(model.state_dict())
    x = inputs((2, 3, 6, 6))
    expected = forward_backward(copy.deepcopy(model), x)
    report = revert(model)
    assert type(model[1]) is BatchNormAct and type(model[1].act) is nn.ELU and model[1].act.alpha == 0.5
    assert report.restored[0].activation is None
    assert list(model.state_dict()) == keys
    assert_same_results(forward_backward(model, x), expected)


def test_revert_notes_clamped_weights():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), InPlaceABN(4))
    with torch.no_grad():
        model[1].weight[0] = 0
    report = revert(model)
    assert "1 channel(s) with |weight| < 0.001" in report.restored[0].note


def test_revert_leaves_the_root_alone():
    report = revert(ABN(4))
    assert report.left_alone_paths == [""] and "root module" in report.left_alone[0].reason


# ---- arguments --------------------------------------------------------------------------------


def test_bad_arguments():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(TypeError, match="nn.Module"):
        convert("model")
    with pytest.raises(ValueError, match="mode must be one of 'abn', 'inplace'"):
        convert(model, mode="fused")
    with pytest.raises(ValueError, match="mode"):
        convert(model, mode=None)
    with pytest.raises(TypeError, match="activation_param must be a float"):
        convert(model, activation_param="0.01")
    with pytest.raises(TypeError, match="activation_param must be a float"):
        convert(model, activation_param=True)
    for bad in (0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="activation_param"):
            convert(model, activation_param=bad)
    with pytest.raises(TypeError):
        convert(model, "inplace", 0.01)  # activation_param is keyword-only
    with pytest.raises(TypeError, match="nn.Module"):
        revert(3)
    assert type(model[1]) is nn.BatchNorm2d  # nothing happened on the way


def test_report_types_and_exports():
    model = small_cnn()
    report = effilayers.convert(model)
    assert isinstance(report, ConversionReport) and report.mode == "inplace"
    assert effilayers.revert is revert
    assert "effilayers.convert(mode='inplace'" in str(report)



def test_fused_activation_records_what_it_stands_for():
    model = small_cnn()
    convert(model)
    pairs = [(slot, parent._modules[slot.fused_into]) for parent in model.modules()
             for slot in parent._modules.values() if isinstance(slot, FusedActivation)]
    assert len(pairs) == 4
    assert all((slot.activation, slot.activation_param) == (norm.activation, norm.activation_param)
               for slot, norm in pairs)
    assert FusedActivation("bn").activation is None
    with pytest.raises(ValueError, match="FusedActivation: activation must be one of"):
        FusedActivation("bn", activation="swish")
    with pytest.raises(TypeError, match="FusedActivation: activation_param must be a float"):
        FusedActivation("bn", activation="elu", activation_param="1")
