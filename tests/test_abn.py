"""ABN / InPlaceABN / InPlaceABNSync against BatchNorm + activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import memory
from effilayers._core import registry
from effilayers.functional import abn, inplace_abn
from effilayers.nn import ABN, InPlaceABN, InPlaceABNSync

from .accuracy import assert_close, tolerance
from .conftest import REQUIRE_COMPILED, activate_backend, backend_names, backend_params, forced_backend
from .distributed_cases import gloo, run_ranks, save
from .helpers import channel_varied, to_layout

ACTIVATIONS = [("leaky_relu", 0.1), ("elu", 0.8), ("identity", 0.0)]
ALL_ACTIVATIONS = ACTIVATIONS + [("relu", 0.0)]
# Not invertible: ABN only, which keeps the norm's input and recomputes the
# pre-activation in backward. Each with the torch module it stands for.
SMOOTH_ACTIVATIONS = {
    "silu": nn.SiLU(),
    "gelu": nn.GELU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "hardswish": nn.Hardswish(),
    "mish": nn.Mish(),
    "relu6": nn.ReLU6(),
    "sigmoid": nn.Sigmoid(),
    "tanh": nn.Tanh(),
}


@pytest.fixture(params=backend_params("abn_forward"))
def device(request):
    yield from forced_backend(request, "abn_forward")


def batch_norm_class(rank):
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[rank]


def activation_fn(activation, param):
    return {
        "leaky_relu": lambda t: F.leaky_relu(t, param),
        "elu": lambda t: F.elu(t, param),
        "identity": lambda t: t,
        "relu": F.relu,
        **SMOOTH_ACTIVATIONS,
    }[activation]


def randomize(module, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        channels = module.weight.numel()
        sign = torch.where(torch.rand(channels, generator=generator) < 0.3, -1.0, 1.0)
        module.weight.copy_(sign * (0.5 + torch.rand(channels, generator=generator)))
        module.bias.copy_(torch.randn(channels, generator=generator) * 0.5)


def twin_modules(cls, channels, rank, activation, param, device, dtype=torch.float32, **kwargs):
    ours = cls(channels, activation=activation, activation_param=param, **kwargs).to(device=device, dtype=dtype)
    plain = batch_norm_class(rank)(channels, **{k: v for k, v in kwargs.items() if k != "weight_eps"})
    plain = plain.to(device=device, dtype=dtype)
    if ours.affine:
        randomize(ours)
    plain.load_state_dict(ours.state_dict())
    return ours, plain


def run_ours(module, x, residual=None):
    # In-place modules need a non-leaf input; the clone is the caller's buffer.
    inputs = x.clone() if isinstance(module, InPlaceABN) else x
    return module(inputs, residual) if residual is not None else module(inputs)


# ---- gradcheck ------------------------------------------------------------------------------


@pytest.mark.parametrize("activation, param", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
def test_gradcheck(device, activation, param, training, affine, with_residual, inplace):
    generator = torch.Generator().manual_seed(1)
    x = (channel_varied((3, 4, 5), torch.float64, device) * 0.7).requires_grad_()
    weight = bias = None
    if affine:
        weight = (torch.rand(4, generator=generator, dtype=torch.float64) + 0.5).to(device)
        weight[1] = -weight[1]
        weight.requires_grad_()
        bias = (torch.randn(4, generator=generator, dtype=torch.float64) * 0.3).to(device).requires_grad_()
    running_mean = torch.randn(4, dtype=torch.float64, generator=generator).to(device)
    running_var = (torch.rand(4, dtype=torch.float64, generator=generator) + 0.5).to(device)
    residual = (torch.randn(3, 4, 5, dtype=torch.float64, generator=generator).to(device).requires_grad_()
                if with_residual else None)

    def function(x, weight, bias, residual):
        if inplace:
            return inplace_abn(x.clone(), weight, bias, running_mean.clone(), running_var.clone(), training=training,
                               activation=activation, activation_param=param, residual=residual)
        return abn(x, weight, bias, running_mean.clone(), running_var.clone(), training=training,
                   activation=activation, activation_param=param, residual=residual)

    assert torch.autograd.gradcheck(function, (x, weight, bias, residual))


def test_gradcheck_relu_abn(device):
    x = channel_varied((4, 3, 6), torch.float64, device).requires_grad_()
    weight = torch.tensor([0.7, -1.2, 1.5], dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, b: abn(a, w, b, activation="relu"), (x, weight, bias))


@pytest.mark.parametrize("activation", list(SMOOTH_ACTIVATIONS))
def test_gradcheck_smooth_abn(device, activation):
    # Residual on every other activation; pre-activations spread over the
    # kinks and saturations (|y| up to ~4).
    index = list(SMOOTH_ACTIVATIONS).index(activation)
    x = (channel_varied((3, 3, 4), torch.float64, device) * 0.7).requires_grad_()
    weight = torch.tensor([0.7, -1.2, 2.5], dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.tensor([0.1, -0.2, -1.1], dtype=torch.float64, device=device, requires_grad=True)
    residual = (torch.randn(3, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(index))
                .to(device).requires_grad_() if index % 2 else None)
    assert torch.autograd.gradcheck(lambda a, w, b, r: abn(a, w, b, activation=activation, residual=r),
                                    (x, weight, bias, residual))


def test_activation_table_matches_torch():
    # The float64 rows every kernel is checked against: forward is torch's
    # function, the derivative torch's autograd, kinks and saturation included.
    from effilayers.ops._activation import TABLE

    y = torch.cat([torch.linspace(-12, 12, 481, dtype=torch.float64),
                   torch.tensor([-3.0, 0.0, 3.0, 6.0, -40.0, 40.0], dtype=torch.float64)]).requires_grad_()
    for name, module in {**SMOOTH_ACTIVATIONS, "relu": nn.ReLU()}.items():
        expected = module(y)
        (derivative,) = torch.autograd.grad(expected.sum(), y)
        row = TABLE[name]
        torch.testing.assert_close(row.forward(y.detach(), 0.0), expected.detach(), rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(row.derivative(y.detach(), 0.0), derivative, rtol=1e-12, atol=1e-14, msg=name)
        assert row.inverse is None and (row.derivative_from_output is None) == (name != "relu")


def test_activation_names_agree_across_languages():
    # csrc/common/activation.h's enum order (kActivationNames), the Python
    # table, and the kernel report's decoding of template arguments.
    import re
    from pathlib import Path

    from effilayers import _kernel_report
    from effilayers.ops._activation import INVERTIBLE_ACTIVATIONS, TABLE

    header = (Path(__file__).resolve().parent.parent / "csrc" / "common" / "activation.h").read_text()
    names = re.findall(r'"(\w+)"', header.split("kActivationNames[kActivationCount] = {")[1].split("};")[0])
    assert tuple(names) == _kernel_report._ACTIVATIONS and set(names) == set(TABLE)
    # The enum numbers its members from 0 in order: each is its name in CamelCase.
    enum = re.findall(r"\w+", header.split("enum class Activation : int {")[1].split("}")[0])
    assert enum == ["".join(part.capitalize() for part in name.split("_")) for name in names]
    invertible = header.split("constexpr bool invertible(Activation a) {")[1].split("}")[0]
    assert {names[value] for value, name in enumerate(enum) if f"Activation::{name}" in invertible} == set(
        INVERTIBLE_ACTIVATIONS)


@pytest.mark.parametrize("activation", list(SMOOTH_ACTIVATIONS))
@pytest.mark.parametrize("dtype, shape, layout", [
    (torch.float32, (3, 5, 6, 7), "contiguous"), (torch.float16, (3, 5, 6, 7), "channels_last"),
    (torch.bfloat16, (3, 5, 6, 7), "strided"), (torch.float32, (2, 11, 3, 4, 5), "channels_last"),
    (torch.float64, (6, 5), "contiguous")], ids=["f32", "f16-cl", "bf16-strided", "f32-3d-cl", "f64-2d"])
def test_smooth_abn_matches_batchnorm_activation(device, activation, dtype, shape, layout):
    # ABN(act) against BatchNorm + torch's activation module over two
    # training steps (outputs, input/parameter gradients, running stats).
    ours, plain = twin_modules(ABN, shape[1], len(shape), activation, 0.0, device)
    if dtype == torch.float64:
        ours, plain = ours.double(), plain.double()
    act = SMOOTH_ACTIVATIONS[activation]
    tol = tolerance(dtype, "vs_torch_batch_norm")
    grad_tol = dict(rtol=tol["rtol"], atol=tol["atol"] * 10)
    for step in range(2):
        x = to_layout(channel_varied(shape, dtype, device, seed=step) * 2, layout)
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step)).to(device=device, dtype=dtype)
        x_ours = x.detach().clone().requires_grad_()
        x_plain = x.detach().clone().requires_grad_()
        out = ours(x_ours)
        low = dtype in (torch.float16, torch.bfloat16)
        if low:
            expected = act(plain(x_plain.float())).to(dtype)
        else:
            # torch's CUDA hardswish multiplies by a float32 sixth
            # (opmath_t(1.0f / 6.0f)) in float64 too; its CPU kernels compute
            # in the dtype: the reference activation runs there.
            expected = act(plain(x_plain).cpu()).to(device)
        assert out.dtype == dtype and out.shape == x.shape
        assert layout == "strided" or out.stride() == x.stride()
        # Compared in float64: rounding both to float32 would turn a float64
        # difference far below the tolerance into a whole float32 ulp.
        assert_close(out.double(), expected.double(), dtype, "vs_torch_batch_norm")
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(x_ours.grad.double(), x_plain.grad.double(), **grad_tol)
    torch.testing.assert_close(ours.running_mean, plain.running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.running_var, plain.running_var, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, **grad_tol)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, **grad_tol)


def test_smooth_backward_from_output_is_refused(device):
    # The in-place backward rebuilds y from the output, which a smooth
    # activation cannot give back: every backend says so.
    x = channel_varied((2, 3, 4), torch.float32, device)
    ones, zeros = torch.ones(3, device=device), torch.zeros(3, device=device)
    reduce = effilayers._core.registry.kernel("abn_backward_reduce", x.device)
    with pytest.raises((ValueError, RuntimeError), match="'silu' is not invertible, so backward needs the saved input"):
        reduce(x, x, zeros, ones, None, None, None, "silu", 0.0, 0.0, True)


# ---- parity with BatchNorm + activation ----------------------------------------------------


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
@pytest.mark.parametrize("activation, param", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, layout", [((6, 5), "contiguous"), ((4, 5, 7), "contiguous"),
                                           ((3, 5, 6, 7), "contiguous"), ((3, 5, 6, 7), "channels_last"),
                                           ((2, 5, 3, 4, 5), "channels_last"), ((3, 5, 6, 7), "strided")])
def test_matches_batchnorm_over_steps(device, cls, activation, param, dtype, shape, layout):
    ours, plain = twin_modules(cls, shape[1], len(shape), activation, param, device)
    act = activation_fn(activation, param)
    tol = tolerance(dtype, "vs_torch_batch_norm")
    # the input and parameter gradients hold sums over the batch (mean(dy),
    # mean(dy * x_hat)): ten times the absolute part
    grad_tol = dict(rtol=tol["rtol"], atol=tol["atol"] * 10)
    for step in range(3):
        x = to_layout(channel_varied(shape, dtype, device, seed=step), layout)
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step)).to(device=device, dtype=dtype)
        x_ours = x.detach().clone().requires_grad_()
        x_plain = x.detach().clone().requires_grad_()
        with torch.autocast(device.type, enabled=False):
            out = run_ours(ours, x_ours)
            expected = act(plain(x_plain.float()).to(dtype)) if dtype != torch.float32 else act(plain(x_plain))
        assert out.dtype == dtype and out.shape == x.shape
        assert_close(out.float(), expected.float(), dtype, "vs_torch_batch_norm")
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(x_ours.grad.float(), x_plain.grad.float(), **grad_tol)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(ours, name), getattr(plain, name), rtol=1e-4, atol=1e-5)
    assert int(ours.num_batches_tracked) == int(plain.num_batches_tracked) == 3
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, **grad_tol)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, **grad_tol)


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
@pytest.mark.parametrize("momentum", [None, 0.3])
@pytest.mark.parametrize("affine, track", [(True, True), (False, True), (True, False)])
def test_options_match_batchnorm(device, cls, momentum, affine, track):
    ours, plain = twin_modules(cls, 3, 4, "leaky_relu", 0.2, device, torch.float64, momentum=momentum,
                               affine=affine, track_running_stats=track)
    for step in range(3):
        x = channel_varied((4, 3, 5, 5), torch.float64, device, seed=step)
        torch.testing.assert_close(run_ours(ours, x), F.leaky_relu(plain(x), 0.2), rtol=1e-10, atol=1e-10)
    ours.eval()
    plain.eval()
    x = channel_varied((2, 3, 5, 5), torch.float64, device, seed=9).requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    out = run_ours(ours, x)
    expected = F.leaky_relu(plain(x_plain), 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.sum().backward()  # an expanded gradient
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-9, atol=1e-10)
    if track:
        torch.testing.assert_close(ours.running_mean, plain.running_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.running_var, plain.running_var, rtol=1e-12, atol=1e-12)
    assert ours.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
def test_residual_variant_matches_add_then_activation(device, cls):
    ours, plain = twin_modules(cls, 6, 4, "leaky_relu", 0.01, device, torch.float64)
    x = channel_varied((3, 6, 4, 5), torch.float64, device).requires_grad_()
    identity = channel_varied((3, 6, 4, 5), torch.float64, device, seed=4).requires_grad_()
    x_plain, identity_plain = (t.detach().clone().requires_grad_() for t in (x, identity))
    out = run_ours(ours, x, identity)
    expected = F.leaky_relu(plain(x_plain) + identity_plain, 0.01)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for got, want in ((x.grad, x_plain.grad), (identity.grad, identity_plain.grad),
                      (ours.weight.grad, plain.weight.grad), (ours.bias.grad, plain.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_abn_relu_matches_batchnorm_relu(device):
    ours, plain = twin_modules(ABN, 4, 4, "relu", 0.0, device, torch.float64)
    x = channel_varied((3, 4, 5, 5), torch.float64, device).requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    out, expected = ours(x), F.relu(plain(x_plain))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.backward(torch.ones_like(out))
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-9, atol=1e-12)


def test_autocast_keeps_fp32_statistics(device):
    conv = nn.Conv2d(3, 8, 3, padding=1).to(device)
    abn_module = InPlaceABN(8).to(device)
    x = torch.randn(2, 3, 8, 8, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = abn_module(conv(x))
    assert out.dtype == torch.bfloat16
    assert abn_module.running_mean.dtype == torch.float32 and abn_module.weight.dtype == torch.float32
    out.float().sum().backward()
    assert abn_module.weight.grad.dtype == torch.float32 and conv.weight.grad is not None


# ---- weight clamp -----------------------------------------------------------------------------


def test_batchnorm_checkpoint_loads_unchanged(device):
    plain = nn.BatchNorm2d(4).to(device)
    with torch.no_grad():
        plain.weight.copy_(torch.tensor([1.5, -0.7, 0.002, -0.01]))
        plain.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.4]))
        plain.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0, 0.0]))
        plain.running_var.copy_(torch.tensor([2.0, 0.5, 1.0, 3.0]))
    ours = InPlaceABN(4, activation="identity").to(device)
    ours.load_state_dict(plain.state_dict())
    ours.eval()
    plain.eval()
    x = channel_varied((2, 4, 3, 3), torch.float32, device)
    # Every |weight| >= weight_eps (1e-3): same function as the BatchNorm.
    torch.testing.assert_close(run_ours(ours, x), plain(x), rtol=1e-6, atol=1e-6)


def test_tiny_weights_are_clamped_with_their_sign(device):
    ours = InPlaceABN(3, activation="identity", weight_eps=1e-2).to(device).eval()
    with torch.no_grad():
        ours.weight.copy_(torch.tensor([0.0, -1e-4, 0.5]))
    x = channel_varied((2, 3, 4), torch.float32, device)
    out = run_ours(ours, x)
    expected_scale = torch.tensor([1e-2, -1e-2, 0.5], device=device).view(1, 3, 1)
    torch.testing.assert_close(out, x * expected_scale / torch.sqrt(torch.tensor(1 + 1e-5)), rtol=1e-5, atol=1e-7)
    # The gradient passes straight through the clamp, so tiny (even zero)
    # weights still train.
    ours.train()
    x = channel_varied((4, 3, 4), torch.float32, device).requires_grad_()
    run_ours(ours, x).pow(2).sum().backward()
    assert (ours.weight.grad != 0).all()


def test_zero_initialised_weight_trains(device):
    module = InPlaceABN(3).to(device)
    nn.init.zeros_(module.weight)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        x = channel_varied((8, 3, 4), torch.float32, device, seed=step)
        target = channel_varied((8, 3, 4), torch.float32, device, seed=10 + step)
        (run_ours(module, x) - target).pow(2).mean().backward()
        optimizer.step()
    assert (module.weight.abs() > 1e-3).any()


# ---- memory --------------------------------------------------------------------------------------


def test_inplace_abn_keeps_only_its_output(device):
    channels = 8
    module = InPlaceABN(channels).to(device)
    x = channel_varied((4, channels, 6, 6), torch.float32, device)
    # x * 1 saves nothing; InPlaceABN keeps its output plus mean and invstd.
    saved = memory.activation_bytes(lambda t: module(t * 1), x, exclude=module)
    assert saved == x.numel() * 4 + 2 * channels * 4

    plain = nn.Sequential(nn.BatchNorm2d(channels), nn.LeakyReLU(0.01)).to(device)
    saved_plain = memory.activation_bytes(lambda t: plain(t * 1), x, exclude=plain)
    assert saved_plain == 2 * x.numel() * 4 + 2 * channels * 4


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "hardswish"])
def test_exact_abn_keeps_only_input_and_statistics(device, activation):
    # BatchNorm + SiLU keeps the norm's input and its output (the
    # activation's input); ABN keeps the input and the per-channel mean and
    # invstd, and recomputes the rest in backward.
    channels = 8
    module = ABN(channels, activation=activation).to(device)
    x = channel_varied((4, channels, 6, 6), torch.float32, device)
    saved = memory.activation_bytes(lambda t: module(t * 1), x, exclude=module)
    assert saved == x.numel() * 4 + 2 * channels * 4

    plain = nn.Sequential(nn.BatchNorm2d(channels), SMOOTH_ACTIVATIONS[activation]).to(device)
    saved_plain = memory.activation_bytes(lambda t: plain(t * 1), x, exclude=plain)
    assert saved_plain == 2 * x.numel() * 4 + 2 * channels * 4


def test_residual_variant_keeps_output_and_identity(device):
    module = InPlaceABN(8).to(device)
    x = channel_varied((4, 8, 6, 6), torch.float32, device)
    identity = channel_varied((4, 8, 6, 6), torch.float32, device, seed=3)
    saved = memory.activation_bytes(lambda t: module(t * 1, identity), x, exclude=module)
    assert saved == 2 * x.numel() * 4 + 2 * 8 * 4


# ---- safety and errors --------------------------------------------------------------------------


def test_overwritten_input_is_caught_by_autograd(device):
    module = InPlaceABN(3).to(device)
    x = channel_varied((4, 3, 5), torch.float32, device).requires_grad_()
    hidden = x.exp()  # exp saves its output, which InPlaceABN then overwrites
    out = module(hidden)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_leaf_input_that_requires_grad_is_refused(device):
    x = torch.randn(4, 3, 5, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        InPlaceABN(3).to(device)(x)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: InPlaceABN(4, activation="relu"), ValueError, "not invertible.*leaky_relu.*ABN"),
        (lambda: InPlaceABN(4, activation="leaky_relu", activation_param=0.0), ValueError, "slope > 0"),
        (lambda: InPlaceABN(4, activation="elu", activation_param=-1.0), ValueError, "elu alpha must be > 0"),
        # In place: only the invertible choices are listed; what ABN takes besides is said apart.
        (lambda: InPlaceABN(4, activation="swish"), ValueError,
         r"activation must be one of leaky_relu, elu, identity, got 'swish' \(effilayers.nn.ABN, which keeps its "
         r"input instead, also takes relu, silu, gelu, gelu_tanh, hardswish, mish, relu6, sigmoid, tanh\)"),
        (lambda: ABN(4, activation="swish"), ValueError,
         r"ABN: activation must be one of leaky_relu, elu, identity, relu, silu, gelu, gelu_tanh, hardswish, mish, "
         r"relu6, sigmoid, tanh, got 'swish'$"),
        (lambda: ABN(4, activation_param="big"), TypeError, "activation_param must be a float"),
        (lambda: ABN(4, activation_param=float("nan")), ValueError, "must be finite"),
        (lambda: ABN(0), ValueError, "num_features must be a positive int"),
        (lambda: ABN(4, eps=0), ValueError, "eps must be positive"),
        (lambda: ABN(4, momentum=1.5), ValueError, "momentum must be None or a float in"),
        (lambda: InPlaceABN(4, weight_eps=0), ValueError, "weight_eps must be a positive float"),
    ],
)
def test_constructor_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("cls", [InPlaceABN, InPlaceABNSync])
def test_inplace_refusal_lists_exactly_what_it_accepts(cls):
    # InPlaceABN(activation='gelu'): the choices it names are the ones it
    # takes, no more (relu and gelu are ABN's) and no fewer.
    from effilayers.ops._activation import ACTIVATIONS

    with pytest.raises(ValueError, match="not invertible") as raised:
        cls(4, activation="gelu")
    message = str(raised.value)
    listed = message.split(f"{cls.__name__} takes one of ")[1].split(".")[0].split(", ")
    accepted = []
    for name in ACTIVATIONS:
        try:
            cls(4, activation=name, activation_param=0.5)
            accepted.append(name)
        except ValueError:
            pass
    assert listed == accepted == ["leaky_relu", "elu", "identity"]
    assert "ABN, which keeps its input and takes 'gelu'" in message


@pytest.mark.parametrize(
    "make_input, error, message",
    [
        (lambda: torch.randn(4, 5, 3), ValueError, "expected 3 channels"),
        (lambda: torch.randn(4), ValueError, "expected 2D to 5D input"),
        (lambda: torch.randn(1, 3, 1, 1, 1, 1), ValueError, "expected 2D to 5D input"),
        (lambda: torch.ones(4, 3, dtype=torch.int32), TypeError, "dtype must be float16"),
        (lambda: torch.randn(1, 3), ValueError, "more than 1 value per channel when training"),
        (lambda: [[1.0, 2.0, 3.0]], TypeError, "input must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
def test_input_errors(cls, make_input, error, message):
    with pytest.raises(error, match=message):
        cls(3)(make_input())


def test_residual_aliasing_the_input_is_refused(device):
    hidden = channel_varied((4, 3, 5), torch.float32, device) * 1
    with pytest.raises(ValueError, match="residual shares memory with the input"):
        InPlaceABN(3).to(device)(hidden, hidden)


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
def test_empty_batch_like_batchnorm(device, cls):
    ours, plain = twin_modules(cls, 3, 4, "leaky_relu", 0.01, device)
    x = torch.empty(0, 3, 5, 5, device=device)
    out = run_ours(ours, x)
    expected = F.leaky_relu(plain(x), 0.01)
    assert out.shape == expected.shape == x.shape
    assert int(ours.num_batches_tracked) == int(plain.num_batches_tracked) == 1
    assert torch.equal(ours.running_mean, plain.running_mean) and torch.equal(ours.running_var, plain.running_var)


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
def test_tracking_switched_off_after_construction_like_batchnorm(device, cls):
    ours, plain = twin_modules(cls, 3, 4, "leaky_relu", 0.01, device, torch.float64)
    x = channel_varied((4, 3, 5, 5), torch.float64, device)
    run_ours(ours, x), plain(x)  # one training step fills the running statistics
    for module in (ours, plain):
        module.track_running_stats = False
    for training in (True, False):
        ours.train(training), plain.train(training)
        y = channel_varied((4, 3, 5, 5), torch.float64, device, seed=int(training))
        torch.testing.assert_close(run_ours(ours, y), F.leaky_relu(plain(y), 0.01), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours.running_mean, plain.running_mean)
        assert int(ours.num_batches_tracked) == int(plain.num_batches_tracked)


def test_double_backward_through_parameters_raises(device):
    first = nn.Linear(5, 3).to(device=device, dtype=torch.float64)
    module = ABN(3).to(device=device, dtype=torch.float64)
    x = torch.randn(8, 5, dtype=torch.float64, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(module(first(x)).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="activated BatchNorm has no double backward"):
        torch.autograd.grad(grad.pow(2).sum(), [first.weight])


# The C++ autograd (csrc/common/abn_autograd.h) serves eager calls on one
# rank when the compiled library is loaded; the Python Function serves the
# rest. The `device` rows above run both: "cpp" the C++ one, "reference" the
# Python one. These check that the choice is the one meant and that the
# two agree on everything the layer does.

def _compiled_autograd_or_skip():
    if not registry.compiled_autograd("activated_batch_norm", torch.empty(1, 1)):
        if REQUIRE_COMPILED:
            pytest.fail(f"the C++ autograd of activated BatchNorm is not registered: {registry.library_report()}")
        pytest.skip("the compiled CPU library is not loaded")


def test_eager_calls_take_the_compiled_autograd():
    _compiled_autograd_or_skip()
    x = channel_varied((2, 3, 4), torch.float64).requires_grad_()
    assert "ActivatedBatchNorm<true>" in InPlaceABN(3).double()(x.clone()).grad_fn.name()
    assert "ActivatedBatchNorm<false>" in ABN(3).double()(x).grad_fn.name()
    with effilayers.use_backend("reference"):
        assert type(ABN(3).double()(x).grad_fn).__name__ == "_ActivatedBatchNormBackward"


def _python_function_call(module, x, residual):
    """What module(x, residual) computes, through the Python Function."""
    from effilayers.ops.abn.op import _ActivatedBatchNorm

    tracked = module.num_batches_tracked if module.training else None
    settings = (module.training, module.momentum, module.eps, module.activation, module.activation_param,
                module._weight_eps(), None, module._inplace)
    return _ActivatedBatchNorm.apply(x, module.weight, module.bias, residual, module.running_mean, module.running_var,
                                     tracked, settings)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_compiled_and_python_autograd_agree(inplace, affine, with_residual, training, momentum):
    _compiled_autograd_or_skip()
    kind = InPlaceABN if inplace else ABN
    results = []
    for path in ("compiled", "python"):
        torch.manual_seed(0)
        module = kind(3, affine=affine, momentum=momentum, activation="leaky_relu", activation_param=0.1).double()
        if affine:
            with torch.no_grad():
                module.weight.copy_(torch.tensor([0.7, -1.3, 2.0]))
                module.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        module.train(training)
        x = channel_varied((4, 3, 5), torch.float64, seed=1).requires_grad_()
        residual = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True) if with_residual else None
        grad = torch.randn(4, 3, 5, dtype=torch.float64)
        with memory.ActivationMeter() as meter:
            source = x.clone()
            out = module(source, residual) if path == "compiled" else _python_function_call(module, source, residual)
        kept = meter.bytes
        out.backward(grad)
        params = [p.grad for p in module.parameters()]
        results.append((out.detach(), x.grad, residual.grad if with_residual else None, params, kept,
                        [b.clone() for b in module.buffers()]))
    compiled, python = results
    torch.testing.assert_close(compiled, python, rtol=0, atol=0)


def test_compiled_autograd_create_graph_and_inference_mode():
    _compiled_autograd_or_skip()
    module = InPlaceABN(3).double()
    x = channel_varied((4, 3, 5), torch.float64).requires_grad_()
    grad = torch.randn(4, 3, 5, dtype=torch.float64)
    plain = torch.autograd.grad(module(x.clone()), (x, module.weight), grad)
    # create_graph=True: the same first-order gradients, tied to a node that
    # refuses a second backward.
    graphed = torch.autograd.grad(module(x.clone()), (x, module.weight), grad, create_graph=True)
    torch.testing.assert_close(graphed, plain)
    with pytest.raises(RuntimeError, match="activated BatchNorm has no double backward"):
        graphed[0].sum().backward()
    module.eval()
    with torch.no_grad():
        expected = module(x.detach().clone())
    with torch.inference_mode():
        torch.testing.assert_close(module(x.detach().clone()), expected, rtol=0, atol=0)


def test_sync_only_communicates_while_training(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        module = InPlaceABNSync(3, track_running_stats=False)
        assert module._group() is dist.group.WORLD
        module.eval()
        assert module._group() is None
    finally:
        dist.destroy_process_group()


def test_residual_must_match():
    with pytest.raises(ValueError, match="residual must match input"):
        ABN(3)(torch.randn(4, 3, 2), torch.randn(4, 3, 3))


# ---- InPlaceABNSync ---------------------------------------------------------------------------


def test_sync_without_process_group_is_inplace_abn():
    torch.manual_seed(0)
    sync, local = InPlaceABNSync(3), InPlaceABN(3)
    local.load_state_dict(sync.state_dict())
    x = channel_varied((4, 3, 5), torch.float32)
    torch.testing.assert_close(sync(x.clone()), local(x.clone()))


SYNC_SIZES = {"3+5": [3, 5], "0+4": [0, 4]}
SYNC_CASES = [(backend, sizes) for sizes in SYNC_SIZES for backend in backend_names("abn_forward", "cpu")]


def _sync_worker(rank, world, workdir, cases):
    # Every case in one process group: spawning two ranks costs more than a case.
    results = {}
    with gloo(rank, world, workdir):
        for backend, sizes_id in cases:
            sizes = SYNC_SIZES[sizes_id]
            with effilayers.use_backend(backend):
                torch.manual_seed(0)
                module = InPlaceABNSync(3, activation="leaky_relu", activation_param=0.1).double()
                randomize(module)
                whole = channel_varied((sum(sizes), 3, 4, 4), torch.float64, seed=11)
                grad = torch.randn(whole.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
                start = sum(sizes[:rank])
                part = whole[start:start + sizes[rank]].clone().requires_grad_()
                outs = []
                for _ in range(2):  # two steps: running statistics too
                    out = module(part.clone())
                    out.backward(grad[start:start + sizes[rank]])
                    outs.append(out.detach())
                results[backend, sizes_id] = {"out": outs, "grad": part.grad, "weight_grad": module.weight.grad,
                                              "bias_grad": module.bias.grad, "state": module.state_dict()}
    save(workdir, rank, results)


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory):
    """Each rank's results of every SYNC_CASES case, from one spawn."""
    if any(backend == "cpp" for backend, _ in SYNC_CASES):
        # built here once, not by each rank
        activate_backend("abn_forward", "cpp", "cpu").__exit__(None, None, None)
    return run_ranks(_sync_worker, tmp_path_factory.mktemp("sync"), SYNC_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("backend, sizes_id", SYNC_CASES, ids=[f"{b}-{s}" for b, s in SYNC_CASES])
def test_sync_two_gloo_processes_match_whole_batch(sync_results, backend, sizes_id):
    sizes = SYNC_SIZES[sizes_id]
    results = [rank_results[backend, sizes_id] for rank_results in sync_results]

    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3).double()
    randomize(reference)
    whole = channel_varied((sum(sizes), 3, 4, 4), torch.float64, seed=11).requires_grad_()
    grad = torch.randn(whole.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    for step in range(2):
        expected = F.leaky_relu(reference(whole), 0.1)
        expected.backward(grad)
        got = torch.cat([results[rank]["out"][step] for rank in range(2)])
        torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-10)
    got_grad = torch.cat([results[rank]["grad"] for rank in range(2)])
    torch.testing.assert_close(got_grad, whole.grad, rtol=1e-9, atol=1e-10)
    # Each rank returns its own share of the parameter gradients (DDP sums/averages them).
    torch.testing.assert_close(sum(r["weight_grad"] for r in results), reference.weight.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sum(r["bias_grad"] for r in results), reference.bias.grad, rtol=1e-9, atol=1e-10)
    for rank in range(2):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(results[rank]["state"][name], reference.state_dict()[name], rtol=1e-10,
                                       atol=1e-12)


def test_double_backward_raises_instead_of_being_wrong(device):
    x = channel_varied((4, 3, 5), torch.float64, device).requires_grad_()
    out = InPlaceABN(3).to(device=device, dtype=torch.float64)(x * 1)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


# ---- torch's BatchNorm constructor forms ---------------------------------------------------------

# The constructor arguments of torch's ModuleInfo samples for BatchNorm2d
# (torch/testing/_internal/common_modules.py, module_inputs_torch_nn_BatchNorm2d).
TORCH_BATCHNORM_FORMS = {
    "default": ((3,), {}),
    "simple_average": ((3, 1e-3, None), {}),
    "momentum": ((3, 1e-3, 0.8), {}),
    "not_affine": ((3, 1e-3, 0.8, False), {}),
    "not_tracking_stats": ((3, 1e-3, 0.8, True, False), {}),
}


def _torch_batchnorm_takes_bias() -> bool:
    try:
        nn.BatchNorm2d(3, bias=False)
    except TypeError:
        return False
    return True


# torch's BatchNorm has bias= (and this sample) from 2.13 on; on older torch
# test_bias_false_is_batchnorm_with_the_bias_fixed_at_zero still checks ours.
if _torch_batchnorm_takes_bias():
    TORCH_BATCHNORM_FORMS["affine_not_bias"] = ((3,), {"bias": False})


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
@pytest.mark.parametrize("form", list(TORCH_BATCHNORM_FORMS))
def test_torch_batchnorm_constructor_forms(device, cls, form):
    args, kwargs = TORCH_BATCHNORM_FORMS[form]
    plain = nn.BatchNorm2d(*args, **kwargs).to(device=device, dtype=torch.float64)
    ours = cls(*args, activation="identity", **kwargs).to(device=device, dtype=torch.float64)
    if ours.affine:
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            ours.weight.copy_(0.5 + torch.rand(3, generator=generator, dtype=torch.float64))
            if ours.bias is not None:
                ours.bias.copy_(torch.randn(3, generator=generator, dtype=torch.float64))
    assert ours.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(ours.state_dict())
    for step, training in enumerate((True, True, False)):
        ours.train(training), plain.train(training)
        x = channel_varied((2, 3, 6, 6), torch.float64, device, seed=step).requires_grad_()
        x_plain = x.detach().clone().requires_grad_()
        out, expected = run_ours(ours, x), plain(x_plain)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        grad = channel_varied(out.shape, torch.float64, device, seed=10 + step)
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-9, atol=1e-10)
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(getattr(ours, name).grad, parameter.grad, rtol=1e-9, atol=1e-10)
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(getattr(ours, name), buffer, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [InPlaceABN, ABN], ids=["InPlaceABN", "ABN"])
def test_bias_false_is_batchnorm_with_the_bias_fixed_at_zero(device, cls):
    ours = cls(4, activation="leaky_relu", activation_param=0.2, bias=False).to(device=device, dtype=torch.float64)
    assert ours.bias is None and "bias" not in ours.state_dict() and "bias=False" in repr(ours)
    plain = nn.BatchNorm2d(4).to(device=device, dtype=torch.float64)
    with torch.no_grad():
        ours.weight.copy_(torch.tensor([1.5, -0.7, 0.6, 2.0]))
        plain.weight.copy_(ours.weight)
    plain.bias.requires_grad_(False)
    x = channel_varied((3, 4, 5, 5), torch.float64, device).requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    out, expected = run_ours(ours, x), F.leaky_relu(plain(x_plain), 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = channel_varied(out.shape, torch.float64, device, seed=5)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, rtol=1e-9, atol=1e-10)
    assert torch.equal(plain.bias, torch.zeros(4, dtype=torch.float64, device=device))


def test_bias_must_be_a_bool():
    with pytest.raises(TypeError, match="bias must be a bool"):
        ABN(4, bias=None)
