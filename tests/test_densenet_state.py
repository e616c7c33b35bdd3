"""DenseNet state dicts: torchvision's keys, legacy checkpoint keys,
norm_act="inplace" and revert, the builders and their argument errors."""

from __future__ import annotations

import copy
import json
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import effilayers
from effilayers import models
from effilayers.models.densenet import DenseNet

from .densenet_cases import assert_models_agree, efficient_and_naive

# No TF32 here unless a test asks (conftest.full_float32 says why).
pytestmark = pytest.mark.usefixtures("full_float32")


KEYS = json.loads((Path(__file__).parent / "data" / "torchvision_state_dict_keys.json").read_text())
TORCHVISION_DENSENETS = ["densenet121", "densenet161", "densenet169", "densenet201"]


# ---- state dicts ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_act", ["plain", "inplace"])
@pytest.mark.parametrize("memory_efficient", [True, False])
@pytest.mark.parametrize("name", TORCHVISION_DENSENETS)
def test_state_dict_keys_are_torchvisions(name, memory_efficient, norm_act):
    with torch.device("meta"):
        model = getattr(models, name)(memory_efficient=memory_efficient, norm_act=norm_act)
    assert list(model.state_dict()) == KEYS[name]


# ---- norm_act="inplace": norm2 and norm0 as InPlaceABN ----------------------------------------


def test_inplace_norm_act_uses_in_place_abn_and_matches_its_plain_path():
    efficient, naive = efficient_and_naive(norm_act="inplace", drop_rate=0.2)
    layer = efficient.features.denseblock1.denselayer1
    assert isinstance(layer.norm2, effilayers.nn.InPlaceABN) and layer.norm2.activation == "leaky_relu"
    assert isinstance(efficient.features.norm0, effilayers.nn.InPlaceABN)
    assert isinstance(efficient.features.pool0, effilayers.nn.MaxPool2d)
    assert_models_agree(efficient.train(), naive.train(), torch.randn(2, 3, 32, 32, dtype=torch.float64), 1e-9, 1e-10)


def test_inplace_norm_act_computes_the_leaky_relu_model():
    """The same weights in a plain model whose norm2/norm0 activations are
    leaky_relu(0.01) give the same outputs and gradients: the opt-in changes
    the activation and nothing else."""
    torch.manual_seed(0)
    options = dict(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=2, num_classes=5)
    inplace = DenseNet(norm_act="inplace", **options).double()
    leaky = DenseNet(memory_efficient=False, **options).double()
    leaky.load_state_dict(inplace.state_dict())
    leaky.features.relu0 = nn.LeakyReLU(0.01)
    for module in leaky.modules():
        if isinstance(module, models.densenet.DenseLayer):
            module.relu2 = nn.LeakyReLU(0.01)
    assert_models_agree(inplace.train(), leaky.train(), torch.randn(2, 3, 32, 32, dtype=torch.float64), 1e-9, 1e-10)


def test_revert_gives_back_batch_norm_and_the_same_function(fresh_warnings):
    torch.manual_seed(0)
    model = DenseNet(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=2, num_classes=5,
                     norm_act="inplace").double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = model(x)
    effilayers.revert(model)
    layer = model.features.denseblock2.denselayer3
    assert type(layer.norm2) is nn.BatchNorm2d and isinstance(layer.relu2, nn.LeakyReLU)
    # BatchNorm2d + LeakyReLU is not the recomputing Function's: said once.
    with pytest.warns(UserWarning, match="other than exactly nn.BatchNorm2d and nn.ReLU"):
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-12)


def test_densenet264_and_small_inputs_keys():
    with torch.device("meta"):
        model = models.densenet264()
        cifar = DenseNet(growth_rate=12, block_config=(16, 16, 16), num_init_features=24, small_inputs=True,
                         num_classes=10)
    blocks = {k.split(".")[1] for k in model.state_dict() if k.startswith("features.denseblock")}
    assert blocks == {"denseblock1", "denseblock2", "denseblock3", "denseblock4"}
    assert "features.denseblock4.denselayer48.conv2.weight" in model.state_dict()
    assert "features.denseblock3.denselayer64.conv2.weight" in model.state_dict()
    # The CIFAR stem is one 3x3 convolution: no norm0 / pool0 keys.
    keys = list(cifar.state_dict())
    assert keys[0] == "features.conv0.weight" and keys[1].startswith("features.denseblock1.denselayer1.norm1")
    assert not any("norm0" in k for k in keys)
    assert cifar.features.conv0.kernel_size == (3, 3) and cifar.classifier.in_features == 342


def test_legacy_checkpoint_keys_load():
    torch.manual_seed(0)
    source = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, num_classes=3)
    legacy = {re.sub(r"(denselayer\d+\.)(norm|relu|conv)([12])\.", r"\1\2.\3.", k): v
              for k, v in source.state_dict().items()}
    assert "features.denseblock1.denselayer1.norm.1.weight" in legacy
    assert "features.denseblock2.denselayer2.conv.2.weight" in legacy
    target = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, num_classes=3)
    target.load_state_dict(legacy)  # strict
    for key, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)
    # Nested under a prefix (the hook only renames its own keys).
    wrapper = nn.Sequential(copy.deepcopy(target))
    wrapper.load_state_dict({f"0.{k}": v for k, v in legacy.items()})


@pytest.mark.parametrize("norm_act", ["plain", "inplace"])
def test_recorded_legacy_densenet121_keys_load_strictly(norm_act):
    """The old torchvision layout as recorded (tests/data, "how" says how it
    was made): 'norm.1.weight'-style keys and no num_batches_tracked at all,
    which the regex round trip above cannot show. A strict load fills the
    counters (BatchNorm's own rule for pre-counter state dicts) and puts
    every tensor where the current layout has it."""
    recorded = json.loads((Path(__file__).parent / "data" / "torchvision_legacy_densenet121_keys.json").read_text())
    legacy_keys = recorded["densenet121"]
    assert "features.denseblock4.denselayer16.conv.2.weight" in legacy_keys
    assert not any(k.endswith("num_batches_tracked") for k in legacy_keys)
    torch.manual_seed(0)
    source = models.densenet121()
    current = [(k, v) for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")]
    assert len(current) == len(legacy_keys)
    # Paired by position: the recorded list keeps the current order.
    legacy = OrderedDict((old, value) for old, (_, value) in zip(legacy_keys, current))
    target = models.densenet121(norm_act=norm_act)
    target.load_state_dict(legacy)  # strict
    loaded = target.state_dict()
    for key, value in current:
        assert torch.equal(loaded[key], value), key
    counters = [v for k, v in loaded.items() if k.endswith("num_batches_tracked")]
    assert len(counters) == len(KEYS["densenet121"]) - len(legacy_keys)
    assert all(int(c) == 0 for c in counters)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(growth_rate=0), ValueError, "growth_rate must be positive, got 0"),
        (dict(growth_rate=2.5), TypeError, "growth_rate must be an int, got float"),
        (dict(block_config=()), ValueError, "block_config must name at least one dense block"),
        (dict(block_config=(2, 0)), ValueError, r"block_config\[1\] must be positive"),
        (dict(block_config=3), TypeError, "block_config must be a sequence of ints"),
        (dict(drop_rate=1.0), ValueError, r"drop_rate must be in \[0, 1\), got 1.0"),
        (dict(drop_rate=-0.1), ValueError, r"drop_rate must be in \[0, 1\)"),
        (dict(drop_rate="0.1"), TypeError, "drop_rate must be a float, got str"),
        (dict(num_init_features=0), ValueError, "num_init_features must be positive"),
        (dict(bn_size=-1), ValueError, "bn_size must be positive"),
        (dict(num_classes=0), ValueError, "num_classes must be positive"),
        (dict(memory_efficient="yes"), TypeError, "memory_efficient must be a bool, got str"),
        (dict(small_inputs=1), TypeError, "small_inputs must be a bool, got int"),
        (dict(norm_act="abn"), ValueError, "norm_act must be one of 'plain', 'inplace', got 'abn'"),
        (dict(norm_act=None), ValueError, "norm_act must be one of"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=f"^DenseNet: {match}"):
        DenseNet(**kwargs)


LAYER_ARGUMENTS = dict(num_input_features=8, growth_rate=4, bn_size=2, drop_rate=0.0)
BLOCK_ARGUMENTS = dict(num_layers=2, **LAYER_ARGUMENTS)
TRANSITION_ARGUMENTS = dict(num_input_features=8, num_output_features=4)


@pytest.mark.parametrize(
    "owner, defaults, change, error, match",
    [
        ("DenseLayer", LAYER_ARGUMENTS, dict(drop_rate=2.0), ValueError, r"drop_rate must be in \[0, 1\), got 2.0"),
        ("DenseLayer", LAYER_ARGUMENTS, dict(growth_rate=0), ValueError, "growth_rate must be positive, got 0"),
        ("DenseLayer", LAYER_ARGUMENTS, dict(bn_size=0), ValueError, "bn_size must be positive, got 0"),
        ("DenseLayer", LAYER_ARGUMENTS, dict(num_input_features=2.0), TypeError, "num_input_features must be an int"),
        ("DenseLayer", LAYER_ARGUMENTS, dict(memory_efficient="yes"), TypeError, "memory_efficient must be a bool"),
        ("DenseLayer", LAYER_ARGUMENTS, dict(norm_act="abn"), ValueError, "norm_act must be one of"),
        ("DenseBlock", BLOCK_ARGUMENTS, dict(num_layers=0), ValueError, "num_layers must be positive, got 0"),
        ("DenseBlock", BLOCK_ARGUMENTS, dict(drop_rate=2.0), ValueError, r"drop_rate must be in \[0, 1\)"),
        ("DenseBlock", BLOCK_ARGUMENTS, dict(growth_rate=0), ValueError, "growth_rate must be positive"),
        ("DenseBlock", BLOCK_ARGUMENTS, dict(memory_efficient=1), TypeError, "memory_efficient must be a bool"),
        ("Transition", TRANSITION_ARGUMENTS, dict(num_output_features=0), ValueError,
         "num_output_features must be positive"),
        ("Transition", TRANSITION_ARGUMENTS, dict(num_input_features=None), TypeError,
         "num_input_features must be an int, got NoneType"),
        ("Transition", TRANSITION_ARGUMENTS, dict(memory_efficient="yes"), TypeError,
         "memory_efficient must be a bool"),
    ],
)
def test_building_blocks_reject_bad_arguments(owner, defaults, change, error, match):
    cls = getattr(models.densenet, owner)
    with pytest.raises(error, match=f"^{owner}: {match}"):
        cls(**dict(defaults, **change))


def test_builders_reject_weights_and_other_architectures():
    with pytest.raises(TypeError, match="ship no weights: weights must be None, got 'IMAGENET1K_V1'"):
        models.densenet121(weights="IMAGENET1K_V1")
    with pytest.raises(TypeError, match="ship no weights: pretrained must be False, got True"):
        models.densenet121(pretrained=True)
    with pytest.raises(ValueError, match="fixes growth_rate"):
        models.densenet121(growth_rate=12)


def test_builders_take_torchvisions_no_weights_call():
    """torchvision's signature, densenet121(*, weights=None, progress=True,
    **kwargs): generic code passes the no-weights defaults explicitly."""
    with torch.device("meta"):
        for kwargs in (dict(weights=None), dict(progress=True), dict(pretrained=False),
                       dict(weights=None, progress=False, num_classes=10)):
            model = models.densenet121(**kwargs)
            assert model.classifier.out_features == kwargs.get("num_classes", 1000), kwargs
