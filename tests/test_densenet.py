"""DenseNet: the recomputing bottleneck Function against autograd, the
memory-efficient model against the plain one (outputs, gradients, running
statistics), torchvision's state-dict keys, legacy checkpoint keys, and the
activation memory the recomputation saves."""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import memory, models
from effilayers.models.densenet import DenseNet
from effilayers.ops.densenet import bottleneck

from .accuracy import assert_close
from .conftest import activate_backend, backend_names, backend_params, forced_backend

KEYS = json.loads((Path(__file__).parent / "data" / "torchvision_state_dict_keys.json").read_text())
TORCHVISION_DENSENETS = ["densenet121", "densenet161", "densenet169", "densenet201"]

# fp32 precision keys of torch >= 2.9 (parents first: setting one also sets its children).
_PRECISION_KEYS = [("generic", "all"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"), ("cuda", "matmul")]


@contextlib.contextmanager
def _restored_tf32_flags():
    """Puts cuDNN's and cuBLAS's TF32 flags (the legacy booleans and the
    fp32_precision tree) back as they were on exit."""
    legacy = torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32()
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    precisions = [getter(*key) for key in _PRECISION_KEYS] if getter is not None else []
    try:
        yield
    finally:
        torch._C._set_cudnn_allow_tf32(legacy[0])
        torch._C._set_cublas_allow_tf32(legacy[1])
        for key, precision in zip(_PRECISION_KEYS, precisions):
            torch._C._set_fp32_precision_setter(*key, precision)


@pytest.fixture(autouse=True)
def _full_float32():
    """No TF32 in any test here unless it asks (test_tf32_*): PyTorch's cuDNN
    convolutions, and the Triton kernels that follow the same flag, round
    float32 inputs to TF32 by default on a GPU, ~1e-3 off where the float32
    checks below allow ~1e-4. (No effect on CPU.)"""
    with _restored_tf32_flags():
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        yield


def _bottleneck_inputs(channels, dtype=torch.float64, seed=0, size=(3, 4, 5), kernel=1):
    gen = torch.Generator().manual_seed(seed)
    total = sum(channels)
    features = [torch.randn(size[0], c, *size[1:], dtype=dtype, generator=gen).requires_grad_() for c in channels]
    weight = (torch.rand(total, dtype=dtype, generator=gen) + 0.5).requires_grad_()
    bias = torch.randn(total, dtype=dtype, generator=gen).mul_(0.5).requires_grad_()
    conv_weight = torch.randn(4, total, kernel, kernel, dtype=dtype, generator=gen).requires_grad_()
    running_mean = torch.randn(total, dtype=dtype, generator=gen)
    running_var = torch.rand(total, dtype=dtype, generator=gen) + 0.5
    return features, weight, bias, conv_weight, running_mean, running_var


# ---- the Function -----------------------------------------------------------------------------


def _statistics(features):
    """(mean, biased var) of the concatenation, the way a dense block shares them."""
    with torch.no_grad():
        stats = [effilayers.batch_stats(f)[:2] for f in features]
    return torch.cat([m for m, _ in stats]), torch.cat([v for _, v in stats])


@pytest.mark.parametrize(
    "channels, kernel, shared",
    [((2, 3), 1, False), ((1, 2, 3), 1, False), ((1, 2, 3), 1, True), ((3,), 3, False), ((1, 2), 3, True)],
    ids=["2-features", "3-features", "3-features-shared-stats", "one-map-3x3", "2-features-3x3-shared-stats"],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
# float64: the Triton interpreter has no float64 GEMMs
@pytest.mark.parametrize("backend", backend_names("dense_bottleneck_forward", "cpu", without=["triton"]))
def test_bottleneck_gradcheck(training, channels, kernel, shared, backend):
    features, weight, bias, conv_weight, running_mean, running_var = _bottleneck_inputs(
        channels, size=(2, 3, 3), kernel=kernel)

    def fn(weight, bias, conv_weight, *features):
        # Fresh buffers per call: gradcheck evaluates many times. Shared
        # statistics are recomputed from the perturbed features, as the block
        # would, so the analytic backward must account for them.
        return bottleneck(list(features), weight, bias, running_mean.clone(), running_var.clone(), conv_weight,
                          training, padding=kernel // 2,
                          batch_statistics=_statistics(features) if shared else None)

    # Every op on this backend (cpp: the bottleneck's CPU path composes ABN's
    # C++ kernels; the statistics come from the C++ kernel too).
    context = activate_backend("dense_bottleneck_forward", backend, "cpu")
    try:
        assert torch.autograd.gradcheck(fn, (weight, bias, conv_weight, *features))
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_bottleneck_matches_batch_norm_and_updates_running_stats_once(training, momentum):
    features, weight, bias, conv_weight, running_mean, running_var = _bottleneck_inputs((2, 3, 1))
    ours = [running_mean.clone(), running_var.clone(), torch.tensor(4)]
    theirs = [running_mean.clone(), running_var.clone(), torch.tensor(4)]

    out = bottleneck(features, weight, bias, ours[0], ours[1], conv_weight, training, momentum, 1e-5, ours[2])
    out.sum().backward()  # must not touch the running statistics again
    grads = [t.grad.clone() for t in (weight, bias, conv_weight, *features)]
    for t in (weight, bias, conv_weight, *features):
        t.grad = None

    # BatchNorm2d's own update rule for the buffers, F.batch_norm for the
    # function (sharing the leaves, so gradients land in the same place).
    norm = nn.BatchNorm2d(6, momentum=momentum).double().train(training)
    with torch.no_grad():
        norm.running_mean.copy_(theirs[0])
        norm.running_var.copy_(theirs[1])
        norm.num_batches_tracked.fill_(4)
    factor = momentum if momentum is not None else 1.0 / 5
    if not training:
        factor = 0.0
    normalized = F.batch_norm(torch.cat(features, 1), theirs[0], theirs[1], weight, bias, training, factor, 1e-5)
    with torch.no_grad():
        norm(torch.cat(features, 1))
    expected = F.conv2d(F.relu(normalized), conv_weight)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for buffers in (theirs, [norm.running_mean, norm.running_var]):
        torch.testing.assert_close(ours[0], buffers[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(ours[1], buffers[1], rtol=0, atol=1e-14)
    assert int(ours[2]) == int(norm.num_batches_tracked) == (5 if training else 4)
    for ours_grad, t in zip(grads, (weight, bias, conv_weight, *features)):
        torch.testing.assert_close(ours_grad, t.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_shared_statistics_change_nothing(dtype):
    features, weight, bias, conv_weight, running_mean, running_var = _bottleneck_inputs((3, 2, 2), dtype=dtype,
                                                                                        kernel=3)
    results = []
    for shared in (False, True):
        buffers = [running_mean.clone(), running_var.clone(), torch.tensor(0)]
        out = bottleneck(features, weight, bias, buffers[0], buffers[1], conv_weight, True, 0.1, 1e-5, buffers[2],
                         padding=1, batch_statistics=_statistics(features) if shared else None)
        grads = torch.autograd.grad(out.square().sum(), [weight, bias, conv_weight, *features])
        results.append((out, *buffers, *grads))
    for without, with_shared in zip(*results):
        torch.testing.assert_close(with_shared, without, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_feature_map_is_never_written(dtype):
    # One map is normalised as it is, not copied: the in-place shortcut for
    # the recomputed concatenation must not reach it.
    features, weight, bias, conv_weight, running_mean, running_var = _bottleneck_inputs((3,), dtype=dtype)
    before = features[0].detach().clone()
    out = bottleneck(features, weight, bias, running_mean, running_var, conv_weight, True)
    out.sum().backward()
    assert torch.equal(features[0].detach(), before)


def test_bottleneck_keeps_only_its_inputs_and_statistics():
    features = [torch.randn(2, c, 8, 8, requires_grad=True) for c in (16, 8, 8)]
    norm = nn.BatchNorm2d(32)
    conv = nn.Conv2d(32, 16, 1, bias=False)
    with memory.track_activations(exclude=[norm, conv]) as meter:
        out = bottleneck(features, norm.weight, norm.bias, norm.running_mean, norm.running_var, conv.weight,
                         True, 0.1, 1e-5, norm.num_batches_tracked)
    feature_bytes = sum(f.numel() * f.element_size() for f in features)
    stats_bytes = 2 * 32 * 4  # mean and invstd, float32
    assert meter.bytes == feature_bytes + stats_bytes, meter.largest()
    del out


def _running(**more):
    return dict(running_mean=torch.zeros(3), running_var=torch.ones(3), **more)


def _long(*shape):
    return torch.zeros(shape, dtype=torch.long)


# (changes to a valid call, given its features f and conv weight w; error; match)
BAD_BOTTLENECK_ARGUMENTS = {
    "empty": (lambda f, w: dict(features=[]), ValueError, "at least one tensor"),
    "not-a-tensor": (lambda f, w: dict(features=[f, "x"]), TypeError, r"features\[1\] must be a torch.Tensor"),
    "integer-features": (lambda f, w: dict(features=[f.long()]), TypeError, "floating-point tensors, got torch.int64"),
    "mixed-dtypes": (lambda f, w: dict(features=[f, f.double()]), TypeError, r"features\[0\]'s dtype and device"),
    "batch-mismatch": (lambda f, w: dict(features=[f, f[:1]]), ValueError, "same N, H, W"),
    "one-value-per-channel": (lambda f, w: dict(features=[f[:1, :, :1, :1]]), ValueError,
                              r"bottleneck: expected more than 1 value per channel when training, got input size "
                              r"\(1, 3, 1, 1\)"),
    "conv-shape": (lambda f, w: dict(conv_weight=w[:, :2]), ValueError, r"conv_weight must be \(C_out, 3, kH, kW\)"),
    "conv-not-a-tensor": (lambda f, w: dict(conv_weight=w.numpy()), TypeError, "conv_weight must be a torch.Tensor"),
    "conv-integer": (lambda f, w: dict(conv_weight=w.long()), TypeError, "conv_weight must be a floating-point"),
    "conv-device": (lambda f, w: dict(conv_weight=w.to("meta")), ValueError, "conv_weight is on meta"),
    "weight-integer": (lambda f, w: dict(weight=_long(3)), TypeError, "weight must be a floating-point"),
    "weight-list": (lambda f, w: dict(weight=[1.0] * 3), TypeError, "weight must be a torch.Tensor"),
    "bias-shape": (lambda f, w: dict(bias=torch.zeros(4)), ValueError, r"bias must have shape \(3,\)"),
    "half-running": (lambda f, w: dict(running_mean=torch.zeros(3)), ValueError, "both be tensors or both"),
    "running-integer": (lambda f, w: dict(running_mean=_long(3), running_var=torch.ones(3)), TypeError,
                        "running_mean must be a floating-point"),
    "counter-float": (lambda f, w: _running(num_batches_tracked=torch.tensor(0.0)), TypeError,
                      "num_batches_tracked must be an integer tensor"),
    "counter-int": (lambda f, w: _running(num_batches_tracked=3), TypeError,
                    "num_batches_tracked must be an integer tensor"),
    "counter-shape": (lambda f, w: _running(num_batches_tracked=_long(2)), ValueError,
                      "num_batches_tracked must be one value"),
    "cumulative-no-counter": (lambda f, w: _running(momentum=None), ValueError, "needs num_batches_tracked"),
    "momentum-string": (lambda f, w: dict(momentum="0.1"), TypeError, "momentum must be a float"),
    "eps-string": (lambda f, w: dict(eps="1e-5"), TypeError, "eps must be a float"),
    "eps-negative": (lambda f, w: dict(eps=-1e-5), ValueError, "eps must be a finite non-negative"),
    "eps-nan": (lambda f, w: dict(eps=float("nan")), ValueError, "eps must be a finite non-negative"),
    "negative-padding": (lambda f, w: dict(padding=-1), ValueError, "padding must be non-negative"),
    "padding-float": (lambda f, w: dict(padding=1.0), TypeError, "padding must be an int"),
    "statistics-not-a-pair": (lambda f, w: dict(batch_statistics=torch.zeros(3)), TypeError, r"\(mean, var\) pair"),
    "statistics-shape": (lambda f, w: dict(batch_statistics=(torch.zeros(2), torch.ones(2))), ValueError,
                         r"batch_statistics mean must have shape \(3,\)"),
    "statistics-dtype": (lambda f, w: dict(batch_statistics=(torch.zeros(3).double(), torch.ones(3))), TypeError,
                         "batch_statistics mean must be torch.float32"),
}


@pytest.mark.parametrize("case", list(BAD_BOTTLENECK_ARGUMENTS))
def test_bottleneck_rejects_bad_arguments(case):
    changes, error, match = BAD_BOTTLENECK_ARGUMENTS[case]
    features, conv_weight = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 1, 1)
    arguments = dict(features=[features], weight=None, bias=None, running_mean=None, running_var=None,
                     conv_weight=conv_weight, training=True)
    arguments.update(changes(features, conv_weight))
    with pytest.raises(error, match=match):
        bottleneck(**arguments)


# ---- the model: memory_efficient against the plain path ------------------------------------------


def _pair(dtype=torch.float64, seed=0, **kwargs):
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


def _forward_backward(model, x, seed=0):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # same dropout masks in both models
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in model.named_parameters()}


def _assert_same(efficient, naive, x, rtol, atol, seed=0):
    out_e, gx_e, grads_e = _forward_backward(efficient, x, seed)
    out_n, gx_n, grads_n = _forward_backward(naive, x, seed)
    torch.testing.assert_close(out_e, out_n, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_e, gx_n, rtol=rtol, atol=atol)
    assert grads_e.keys() == grads_n.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_e[name], grads_n[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("small_inputs", [True, False], ids=["cifar-stem", "imagenet-stem"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradients_match_the_plain_model_float64(small_inputs, training):
    efficient, naive = _pair(small_inputs=small_inputs)
    efficient.train(training)
    naive.train(training)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    _assert_same(efficient, naive, x, rtol=1e-9, atol=1e-10)


def test_gradients_match_the_plain_model_float32():
    efficient, naive = _pair(dtype=torch.float32, growth_rate=6, block_config=(3, 4), num_init_features=12)
    x = torch.randn(4, 3, 32, 32)
    _assert_same(efficient, naive, x, rtol=1e-4, atol=1e-5)


def test_fp16_model_is_as_accurate_as_the_naive_fp16_model():
    """fp16 on CPU against the naive model in float64. Both fp16 models are
    far from float64 here (relative L2 error: output ~1e-3, all parameter
    gradients together ~0.5 %, input gradient 5-13 %: BatchNorm's backward
    over few values per channel, layer after layer), so the bound is
    relative to the naive fp16 model's own error. Measured, seeds 0-3: the
    memory-efficient model's error is 0.52x to 1.12x the naive one's."""
    options = dict(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=2, num_classes=5,
                   small_inputs=True)
    efficient, naive = _pair(**options)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = _forward_backward(naive, x)

    def errors(model):
        out, grad_x, grads = _forward_backward(copy.deepcopy(model).half(), x.half())
        assert out.dtype == grad_x.dtype == torch.float16
        got = [out, grad_x, torch.cat([grads[k].flatten() for k in grads])]
        want = [expected[0], expected[1], torch.cat([expected[2][k].flatten() for k in grads])]
        return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]

    efficient_errors, naive_errors = errors(efficient), errors(naive)
    for name, ours, theirs in zip(["output", "input gradient", "parameter gradients"], efficient_errors,
                                  naive_errors):
        assert ours <= 2 * theirs, (name, ours, theirs)


def test_dropout_is_identical_under_recomputation():
    # Dropout follows conv2, outside the recomputed bottleneck: one mask per
    # forward, drawn in the same order in both models.
    efficient, naive = _pair(drop_rate=0.3, small_inputs=True)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    _assert_same(efficient, naive, x, rtol=1e-9, atol=1e-10, seed=7)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_running_statistics_match_after_three_training_steps(momentum):
    efficient, naive = _pair(small_inputs=True)
    for model in (efficient, naive):
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = momentum
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (efficient, naive)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64)
        for model, optimizer in zip((efficient, naive), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    buffers_e, buffers_n = dict(efficient.named_buffers()), dict(naive.named_buffers())
    assert buffers_e.keys() == buffers_n.keys()
    for name in buffers_e:
        if name.endswith("num_batches_tracked"):
            assert int(buffers_e[name]) == int(buffers_n[name]) == 3, name
        else:
            assert buffers_e[name].dtype == torch.float64
            torch.testing.assert_close(buffers_e[name], buffers_n[name], rtol=1e-9, atol=1e-11, msg=name)


def test_checkpointing_updates_running_statistics_twice_and_recomputation_once():
    """The README's claim: a bottleneck under torch.utils.checkpoint (the
    construction effilayers-bench and bench_densenet.py time, as torchvision
    builds it) runs norm1's training forward again in backward, so its
    num_batches_tracked counts 2 per step and its running statistics move
    twice; the recomputing Function updates them once, as the naive model
    does."""
    from effilayers.bench import checkpointed_densenet as checkpointed

    efficient, naive = _pair(small_inputs=True)
    checkpointing = checkpointed(copy.deepcopy(naive))
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for model in (efficient, naive, checkpointing):
        model.train()(x).square().mean().backward()
    norms = {name: dict(model.named_buffers()) for name, model in
             [("efficient", efficient), ("naive", naive), ("checkpointing", checkpointing)]}
    norm1_counters = [k for k in norms["naive"] if k.endswith("norm1.num_batches_tracked")]
    assert len(norm1_counters) == 5
    for key in norm1_counters:
        assert int(norms["naive"][key]) == int(norms["efficient"][key]) == 1, key
        assert int(norms["checkpointing"][key]) == 2, key
        mean = key.replace("num_batches_tracked", "running_mean")
        torch.testing.assert_close(norms["efficient"][mean], norms["naive"][mean], rtol=1e-9, atol=1e-12)
        assert not torch.allclose(norms["checkpointing"][mean], norms["naive"][mean], rtol=1e-3, atol=1e-6), mean


# ---- hooks and other reasons to call the modules ------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The fallback warnings are once per process: forget earlier ones."""
    from effilayers.models import densenet as densenet_module

    monkeypatch.setattr(densenet_module, "_WARNED", set(), raising=False)


def _count_bottlenecks(monkeypatch):
    """A list that grows by one per call of the recomputing Function."""
    from effilayers.models import densenet as densenet_module

    calls = []
    original = densenet_module.bottleneck

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(densenet_module, "bottleneck", counting)
    return calls


HOOKED = ["features.denseblock1.denselayer2.norm1", "features.denseblock1.denselayer2.relu1",
          "features.denseblock1.denselayer2.conv1", "features.denseblock2.denselayer1.norm2",
          "features.denseblock2.denselayer1.relu2", "features.denseblock2.denselayer1.conv2",
          "features.transition1.norm", "features.transition1.relu", "features.transition1.conv"]


def test_module_hooks_fire_as_in_the_naive_model(monkeypatch, fresh_warnings):
    """A norm -> relu -> conv whose modules carry hooks is computed by
    calling them (once per forward, as the naive model does); the other
    steps still recompute. Outputs and gradients stay the naive model's."""
    efficient, naive = _pair(small_inputs=True)
    fired = {}
    for name, model in (("efficient", efficient), ("naive", naive)):
        fired[name] = []
        for path in HOOKED:
            module = model.get_submodule(path)
            module.register_forward_pre_hook(lambda m, args, path=path, log=fired[name]: log.append(("pre", path)))
            module.register_forward_hook(lambda m, args, out, path=path, log=fired[name]: log.append(("post", path)))
        model.get_submodule(HOOKED[-1]).register_full_backward_hook(
            lambda m, grad_in, grad_out, log=fired[name]: log.append(("backward", HOOKED[-1])))
    calls = _count_bottlenecks(monkeypatch)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="memory_efficient=True calls the modules.*hooks"):
        _assert_same(efficient, naive, x, rtol=1e-9, atol=1e-10)
    assert fired["efficient"] == fired["naive"]
    assert len(fired["naive"]) == 2 * len(HOOKED) + 1
    # 5 layers x 2 steps + 1 transition, less the three hooked steps.
    assert len(calls) == 11 - 3


def test_global_module_hooks_fire_as_in_the_naive_model(fresh_warnings):
    efficient, naive = _pair(small_inputs=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    seen = {}
    for name, model in (("efficient", efficient), ("naive", naive)):
        seen[name] = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out, log=seen[name]: log.append(type(m).__name__))
        try:
            with pytest.warns(UserWarning, match="hooks") if name == "efficient" else contextlib.nullcontext():
                model(x)
        finally:
            handle.remove()
    assert seen["efficient"] == seen["naive"]
    assert seen["naive"].count("Conv2d") == 1 + 2 * 5 + 1


@pytest.mark.parametrize("change", ["reflect", "replicate", "dilated", "bias"])
def test_convolutions_the_function_does_not_implement_take_the_module_path(monkeypatch, fresh_warnings, change):
    """padding_mode other than "zeros" was computed with zero padding; other
    conv settings the recomputing Function lacks raised mid-forward. Both
    now call the module (for that step only), like the naive model."""
    efficient, naive = _pair(small_inputs=True)
    for model in (efficient, naive):
        conv = model.features.denseblock2.denselayer2.conv2
        if change == "dilated":
            conv.dilation, conv.padding = (2, 2), (2, 2)  # same output size
        elif change == "bias":
            conv.bias = nn.Parameter(torch.linspace(-1, 1, conv.out_channels, dtype=torch.float64))
        else:
            conv.padding_mode = change
    calls = _count_bottlenecks(monkeypatch)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="calls the modules.*convolution it does not implement"):
        _assert_same(efficient, naive, x, rtol=1e-9, atol=1e-10)
    assert len(calls) == 11 - 1


def test_sync_batch_norm_takes_the_module_path_with_a_warning(monkeypatch, fresh_warnings):
    """SyncBatchNorm's statistics span processes, which the recomputing
    Function does not compute: its steps call the modules, saying so."""
    efficient, naive = (nn.SyncBatchNorm.convert_sync_batchnorm(m) for m in _pair(small_inputs=True))
    calls = _count_bottlenecks(monkeypatch)
    with pytest.warns(UserWarning, match="calls the modules.*SyncBatchNorm"):
        _assert_same(efficient, naive, torch.randn(2, 3, 8, 8, dtype=torch.float64), rtol=1e-9, atol=1e-10)
    assert not calls


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_records_the_plain_models_graph(fresh_warnings):
    """Tracing went through the block buffer's Tensor.set_ and failed
    ("unordered_map::at"); traced, the model is the naive one."""
    efficient, naive = (m.eval() for m in _pair(dtype=torch.float32, small_inputs=True))
    with pytest.warns(UserWarning, match="under torch.jit.trace"):
        traced = torch.jit.trace(efficient, torch.randn(2, 3, 16, 16))
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(traced(x), naive(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("memory_efficient", [True, False])
def test_fx_symbolic_trace_gives_the_naive_graph(fresh_warnings, memory_efficient):
    """torch.fx.symbolic_trace (what torchvision's create_feature_extractor
    uses) failed on DenseBlock's branch on x.dim(), in both modes. The
    GraphModule calls the modules and trains like the naive model."""
    efficient, naive = _pair(small_inputs=True)
    model = efficient if memory_efficient else naive
    with pytest.warns(UserWarning, match="torch.fx symbolic tracing") if memory_efficient \
            else contextlib.nullcontext():
        graph = torch.fx.symbolic_trace(model)
    assert sum(node.op == "call_module" and "conv" in str(node.target) for node in graph.graph.nodes) == 12
    _assert_same(graph, copy.deepcopy(naive), torch.randn(2, 3, 8, 8, dtype=torch.float64), rtol=1e-9, atol=1e-10)


def test_torch_func_grad_and_vmap_compute_the_naive_gradients(fresh_warnings):
    """torch.func transforms need setup_context-style autograd Functions;
    under them the layers call their modules."""
    from torch.func import functional_call, grad, vmap

    gradients = []
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    for model in _pair(small_inputs=True):
        model.eval()
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = dict(model.named_buffers())

        def loss(params, x):
            return functional_call(model, (params, buffers), (x,)).square().sum()

        with pytest.warns(UserWarning, match="torch.func") if model.memory_efficient else contextlib.nullcontext():
            gradients.append((grad(loss)(params, x), vmap(grad(loss), in_dims=(None, 0))(params, x[:, None])))
    for got, expected in zip(gradients[0], gradients[1]):
        assert got.keys() == expected.keys()
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.filterwarnings("ignore:effilayers DenseNet")
def test_pruned_convolutions_train_like_the_naive_model():
    """torch.nn.utils.prune recomputes ``weight`` from ``weight_orig`` in a
    forward pre-hook; reading ``conv.weight`` directly used the last step's
    (freed) graph and raised in the second backward."""
    from torch.nn.utils import prune

    efficient, naive = _pair(small_inputs=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    results = []
    for model in (efficient, naive):
        for path in ("features.denseblock1.denselayer1.conv1", "features.denseblock2.denselayer2.conv2",
                     "features.transition1.conv"):
            prune.l1_unstructured(model.get_submodule(path), "weight", amount=0.5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        conv = model.features.denseblock1.denselayer1.conv1
        results.append((model(x).detach(), conv.weight_orig.grad.clone(), conv.weight.detach().clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


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
    efficient, naive = _pair(norm_act="inplace", drop_rate=0.2)
    layer = efficient.features.denseblock1.denselayer1
    assert isinstance(layer.norm2, effilayers.nn.InPlaceABN) and layer.norm2.activation == "leaky_relu"
    assert isinstance(efficient.features.norm0, effilayers.nn.InPlaceABN)
    assert isinstance(efficient.features.pool0, effilayers.nn.MaxPool2d)
    _assert_same(efficient.train(), naive.train(), torch.randn(2, 3, 32, 32, dtype=torch.float64), 1e-9, 1e-10)


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
    _assert_same(inplace.train(), leaky.train(), torch.randn(2, 3, 32, 32, dtype=torch.float64), 1e-9, 1e-10)


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


# ---- memory -----------------------------------------------------------------------------------


def _linear_fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    residual = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - residual / total


def test_activation_bytes_grow_linearly_with_depth():
    depths = [40, 100, 190]
    x = torch.randn(2, 3, 32, 32)
    measured = {}
    for memory_efficient in (True, False):
        measured[memory_efficient] = []
        for depth in depths:
            layers = (depth - 4) // 6
            model = DenseNet(growth_rate=12, block_config=(layers,) * 3, num_init_features=24, small_inputs=True,
                             num_classes=10, memory_efficient=memory_efficient)
            measured[memory_efficient].append(memory.activation_bytes(model, x))
    slope, intercept, r2 = _linear_fit(depths, measured[True])
    naive_slope, naive_intercept, naive_r2 = _linear_fit(depths, measured[False])
    print(f"\nDenseNet-BC k=12, 2x3x32x32, activation bytes at depths {depths}:")
    print(f"  memory_efficient: {measured[True]} -> {slope:.0f} B/depth + {intercept:.0f}, R^2 = {r2:.6f}")
    print(f"  naive:            {measured[False]} -> {naive_slope:.0f} B/depth + {naive_intercept:.0f}, "
          f"R^2 = {naive_r2:.6f}")
    assert r2 > 0.999
    assert slope < 0.5 * naive_slope


def test_densenet121_at_224_keeps_at_most_a_third_of_the_activations():
    """The issue's target: <= 0.33x the naive model's activation bytes at
    224x224 (measured 0.268x; torchvision-style checkpointing: 0.48x)."""
    x = torch.randn(1, 3, 224, 224)
    torch.manual_seed(0)
    efficient = models.densenet121(memory_efficient=True)
    naive = models.densenet121(memory_efficient=False)
    efficient_bytes = memory.activation_bytes(efficient, x)
    naive_bytes = memory.activation_bytes(naive, x)
    inplace_bytes = memory.activation_bytes(models.densenet121(norm_act="inplace"), x)
    ratio = efficient_bytes / naive_bytes
    print(f"\ndensenet121 1x3x224x224: memory_efficient {efficient_bytes} B ({ratio:.3f}x), "
          f"norm_act='inplace' {inplace_bytes} B ({inplace_bytes / naive_bytes:.3f}x), naive {naive_bytes} B")
    assert ratio <= 0.33
    # In place, norm2 keeps the same one map as the recomputation does; the
    # stem (norm0 in place, no int64 pool indices) is where it saves.
    assert inplace_bytes < efficient_bytes


def test_statistics_are_computed_once_per_feature_map(monkeypatch):
    """In training, each channel of a block is reduced once when its map
    appears (plus each layer's norm2 input), not once per later layer."""
    from effilayers.models import densenet as densenet_module
    from effilayers.ops import _batchnorm as ops_module

    reduced = []

    def counting(original):
        def wrapper(x, *args):
            reduced.append(x.shape[1])
            return original(x, *args)
        return wrapper

    monkeypatch.setattr(densenet_module, "batch_stats", counting(densenet_module.batch_stats))
    monkeypatch.setattr(ops_module, "channel_stats", counting(ops_module.channel_stats))
    fused = ops_module.fused_statistics

    def counting_fused(x, *args):  # one tensor's statistics and running update in one call
        result = fused(x, *args)
        if result is not None:
            reduced.append(x.shape[1])
        return result

    monkeypatch.setattr(ops_module, "fused_statistics", counting_fused)
    growth, layers, start, bn_size = 4, 5, 6, 2
    block = densenet_module.DenseBlock(layers, start, bn_size, growth, 0.0, memory_efficient=True)
    block(torch.randn(2, start, 5, 5, requires_grad=True)).sum().backward()
    # block input + every new map, each once; every layer's norm2 input once.
    assert sorted(reduced) == sorted([start] + [growth] * (layers - 1) + [bn_size * growth] * layers)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_without_autograd_matches_the_naive_model(mode, training):
    """Inference tensors have no version counter: the block buffer must not
    watch its output there (it raised "Inference tensors do not track version
    counter"). Training mode still updates the running statistics once."""
    efficient, naive = _pair(small_inputs=True)
    efficient.train(training)
    naive.train(training)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        out_e, out_n = efficient(x), naive(x)
    torch.testing.assert_close(out_e, out_n, rtol=1e-9, atol=1e-10)
    for (name, a), b in zip(efficient.named_buffers(), naive.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_double_backward_raises():
    from effilayers.models import DenseNet

    model = DenseNet(growth_rate=4, block_config=(2,), num_init_features=8, bn_size=2, num_classes=3,
                     small_inputs=True).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)


# ---- the 1x1 ops: PyTorch (CPU path) and Triton (virtual concatenation) -------------------------

from effilayers.ops import densenet as densenet_ops  # noqa: E402


# cpp: the CPU path composes ABN's C++ kernels around PyTorch's convolution.
@pytest.fixture(params=backend_params("dense_bottleneck_forward"))
def op_device(request):
    """Both 1x1 ops forced to one backend (the forward op's name decides the
    skip; both ops have the same backends)."""
    yield from forced_backend(request, "dense_bottleneck_forward")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Triton's output buffers start as NaN, so an element no kernel writes fails."""
    try:
        from effilayers.ops.densenet import triton as kernels
    except ImportError:
        return
    original = kernels._output_like
    monkeypatch.setattr(kernels, "_output_like",
                        lambda first, channels, dtype=None: original(first, channels, dtype).fill_(float("nan")))


def _op_case(device, dtype, layout, channels=(8, 37, 5), size=(2, 7, 5), seed=0, c_out=70):
    gen = torch.Generator().manual_seed(seed)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    features = [(torch.randn(size[0], c, *size[1:], generator=gen) * (1 + i) + i)
                .to(device=device, dtype=dtype).contiguous(memory_format=memory_format)
                for i, c in enumerate(channels)]
    total = sum(channels)
    mean = torch.cat([f.double().mean((0, 2, 3)) for f in features]).float()
    var = torch.cat([f.double().var((0, 2, 3), unbiased=False) for f in features]).float()
    invstd = torch.rsqrt(var + 1e-5)
    weight = torch.rand(total, generator=gen) + 0.5
    bias = torch.randn(total, generator=gen) * 0.3
    conv_weight = (torch.randn(c_out, total, 1, 1, generator=gen) / total ** 0.5).to(dtype)
    vectors = [t.to(device) for t in (mean, invstd, weight, bias)]
    return features, vectors, conv_weight.to(device)


def _op_reference(features, vectors, conv_weight, grad_out, batch_stats, padding=0):
    """float64 autograd through cat, batch_norm, relu, conv2d."""
    x = torch.cat([f.detach().double().cpu() for f in features], 1).requires_grad_()
    mean, invstd, weight, bias = (v.double().cpu().requires_grad_() for v in vectors)
    cw = conv_weight.detach().double().cpu().requires_grad_()
    if batch_stats:
        # The statistics are the batch's own: their dependence on x is part of dx.
        var, mu = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        x_hat = (x - mu.view(1, -1, 1, 1)) * torch.rsqrt(var.view(1, -1, 1, 1) + 1e-5)
    else:
        x_hat = (x - mean.detach().view(1, -1, 1, 1)) * invstd.detach().view(1, -1, 1, 1)
    out = F.conv2d(F.relu(x_hat * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)), cw, padding=padding)
    out.backward(grad_out.double().cpu())
    return out, x.grad, bias.grad, weight.grad, cw.grad


@pytest.mark.parametrize("batch_stats", [True, False], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_pointwise_ops_match_float64(op_device, poisoned_outputs, dtype, layout, batch_stats):
    if dtype == torch.bfloat16 and op_device.type == "cpu" \
            and effilayers.backends.choice("dense_bottleneck_forward", "cpu").backend == "triton":
        pytest.skip("the Triton interpreter has no bf16 arithmetic (bf16 Triton runs on the GPU)")
    features, vectors, conv_weight = _op_case(op_device, dtype, layout)
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(op_device, dtype)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 0)
    grad_input, grad_bias, grad_weight, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, batch_stats, True, True, 0)
    expected = _op_reference(features, vectors, conv_weight, grad_out, batch_stats)
    assert out.dtype == dtype and grad_input.dtype == dtype and grad_conv.dtype == dtype
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"],
                               [out, grad_input, grad_bias, grad_weight, grad_conv], expected):
        assert_close(got.double().cpu(), want, dtype, "densenet_gemm", msg=name)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_padded_ops_match_float64(op_device, layout):
    """A 3x3 convolution (norm2 -> conv2 of a dense layer) through the same
    ops: the CPU kernel composes ABN's C++ kernels, Triton hands it to
    PyTorch ops."""
    features, vectors, _ = _op_case(op_device, torch.float32, layout, channels=(6, 3))
    conv_weight = (torch.randn(5, 9, 3, 3, generator=torch.Generator().manual_seed(2)) / 9).to(op_device)
    grad_out = torch.randn(2, 5, 7, 5, generator=torch.Generator().manual_seed(1)).to(op_device)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 1)
    grads = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, 1)
    expected = _op_reference(features, vectors, conv_weight, grad_out, True, padding=1)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"],
                               [out, *grads], expected):
        assert_close(got.double().cpu(), want, torch.float32, "densenet_gemm", msg=name)


def test_pointwise_ops_skip_what_is_not_asked_for(op_device):
    features, vectors, conv_weight = _op_case(op_device, torch.float32, "contiguous")
    grad_out = torch.randn(2, 70, 7, 5, device=op_device)
    grad_input, grad_bias, grad_weight, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, True, False, True, 0)
    assert grad_input.numel() == grad_bias.numel() == grad_weight.numel() == 0
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)[4]
    assert_close(grad_conv.double().cpu(), expected, torch.float32, "densenet_gemm")
    grad_input, _, _, grad_conv = densenet_ops._backward_op(
        grad_out, features, *vectors, conv_weight, True, True, False, 0)
    assert grad_input.shape == (2, 50, 7, 5) and grad_conv.numel() == 0


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_triton_fp16_grad_input_is_rounded_once(triton_device, poisoned_outputs, layout):
    """dx = scale * (dz - mean(dz) - x_hat * mean(dz * x_hat)) cancels on
    small elements, so dz stays float32 until dx is rounded to fp16: every
    element within about one fp16 rounding of float64. Measured (this case,
    interpreter, both layouts): max |error| / (|expected| + 1e-3 max
    |expected|) 4.8e-4; the kernel that stored dz in fp16 reached 1.6e-2."""
    features, vectors, conv_weight = _op_case(triton_device, torch.float16, layout)
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device, torch.float16)
    grad_input = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, False, 0)[0]
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)[1]
    error = (grad_input.double().cpu() - expected).abs() / (expected.abs() + 1e-3 * expected.abs().max())
    assert error.max() < 1e-3, error.max()


def test_triton_tables_merge_a_block_buffer_and_are_cached(triton_device):
    """A dense block's maps are adjacent channel slices of its buffer: one
    table row, full K tiles (growth rate 12: 3 tiles for 36 channels, not
    one per map), the same results as separate maps, and a second call with
    the same maps reuses the device tables (no host-to-device copy)."""
    from effilayers.ops.densenet import triton as kernels

    features, vectors, conv_weight = _op_case(triton_device, torch.float32, "channels_last", channels=(12, 12, 12),
                                              c_out=8)
    slices = _buffer_slices(features)
    assert len(kernels._rows(slices)) == 1 and len(kernels._rows(features)) == 3
    table, tiles, num_tiles = kernels._tables(slices)
    assert num_tiles == 2 and kernels._tables(features)[2] == 3
    assert kernels._tables(slices)[0] is table and kernels._tables(list(slices))[1] is tiles
    grad_out = torch.randn(2, 8, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device)
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)
    for maps in (slices, features):
        out = densenet_ops._forward_op(maps, *vectors, conv_weight, 0)
        grads = densenet_ops._backward_op(grad_out, maps, *vectors, conv_weight, True, True, True, 0)
        for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"], [out, *grads],
                                   expected):
            assert_close(got.double().cpu(), want, torch.float32, "densenet_gemm", msg=name)
    # The same maps in another buffer: another table.
    moved = _buffer_slices(features)
    assert len(kernels._rows(moved)) == 1 and kernels._tables(moved)[0] is not table


def test_tf32_follows_cudnn_convolution_flags():
    """The Triton GEMMs may use TF32 exactly when PyTorch's cuDNN convolutions
    may, whichever API set it (the legacy flag raised on a read once conv and
    rnn had different new-API settings)."""
    kernels = pytest.importorskip("effilayers.ops.densenet.triton")
    torch.backends.cudnn.allow_tf32 = True
    assert kernels._allow_tf32(torch.float32) and not kernels._allow_tf32(torch.float16)
    assert not kernels._allow_tf32(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    assert not kernels._allow_tf32(torch.float32)
    if not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"):
        return  # torch < 2.9: the legacy flag is the only one
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # rnn still tf32: a legacy read raises
    assert not kernels._allow_tf32(torch.float32)
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    assert kernels._allow_tf32(torch.float32)
    torch.backends.cudnn.conv.fp32_precision = "none"  # defers to cuDNN's, then the generic setting
    torch.backends.cudnn.fp32_precision = "none"
    torch.backends.fp32_precision = "ieee"
    assert not kernels._allow_tf32(torch.float32)
    torch.backends.fp32_precision = "tf32"
    assert kernels._allow_tf32(torch.float32)


class _LaunchSpy:
    """Stands in for a Triton kernel and records the ALLOW_TF32 of each launch."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.append(kwargs["ALLOW_TF32"])
            return launch(*args, **kwargs)
        return run


@pytest.fixture(params=backend_params("dense_bottleneck_forward", backends=("triton",)))
def triton_device(request):
    yield from forced_backend(request, "dense_bottleneck_forward")


@pytest.mark.parametrize("tf32", [False, True], ids=["ieee", "tf32"])
def test_triton_precision_follows_the_flag(triton_device, monkeypatch, tf32):
    """Each Triton GEMM gets ALLOW_TF32 from the cuDNN flag (fp32 only) and
    meets float64 at the precision it allows. Under the interpreter both
    branches compute in full float32 (it ignores input_precision), so there
    this checks the decision and that the ieee branch runs; on a GPU the TF32
    branch is held to TF32's bound and the ieee one to float32's."""
    from effilayers.ops.densenet import triton as kernels

    seen = []
    for name in ("_forward", "_grad_input", "_grad_weight"):
        monkeypatch.setattr(kernels, name, _LaunchSpy(getattr(kernels, name), seen))
    torch.backends.cudnn.allow_tf32 = tf32
    features, vectors, conv_weight = _op_case(triton_device, torch.float32, "channels_last")
    grad_out = torch.randn(2, 70, 7, 5, generator=torch.Generator().manual_seed(1)).to(triton_device)
    out = densenet_ops._forward_op(features, *vectors, conv_weight, 0)
    grads = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, 0)
    assert seen == [tf32] * 3
    expected = _op_reference(features, vectors, conv_weight, grad_out, True)
    for name, got, want in zip(["out", "grad_input", "grad_bias", "grad_weight", "grad_conv"], [out, *grads],
                               expected):
        tier = "densenet_gemm_tf32" if tf32 and triton_device.type == "cuda" else "densenet_gemm"
        assert_close(got.double().cpu(), want, torch.float32, tier, msg=name)
    seen.clear()
    half = _op_case(triton_device, torch.float16, "contiguous")
    densenet_ops._forward_op(*half[:1], *half[1], half[2], 0)
    assert seen == [False]  # fp16 GEMMs never take the TF32 flag


@pytest.fixture(params=backend_params("dense_bottleneck_forward"))
def model_device(request):
    """The 1x1 ops on one backend, every other op on its compiled kernel
    (ABN's ops have no Triton kernels: with Triton they take the device's
    compiled one)."""
    backend, device = request.param
    preference = f"triton,{'cpp' if device == 'cpu' else 'cuda'}" if backend == "triton" else backend
    context = activate_backend("dense_bottleneck_forward", preference, device)
    try:
        yield torch.device(device)
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_model_on_the_pointwise_backend_matches_the_naive_model(model_device, layout):
    """memory_efficient DenseNet with its 1x1 ops on this backend against the
    plain model (float32; the naive model runs PyTorch's own kernels), NCHW
    and channels_last (where the first layer of every block reads a
    non-dense channels_last slice of the block buffer)."""
    op_device = model_device
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    options = dict(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=5,
                   small_inputs=True)
    efficient = DenseNet(memory_efficient=True, **options).to(op_device, memory_format=memory_format)
    naive = DenseNet(memory_efficient=False, **options).to(op_device, memory_format=memory_format)
    naive.load_state_dict(efficient.state_dict())
    x = torch.randn(3, 3, 12, 12, device=op_device).contiguous(memory_format=memory_format)
    _assert_same(efficient.train(), naive.train(), x, rtol=1e-4, atol=1e-4)
    for a, b in zip(efficient.buffers(), naive.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        block_output = efficient.features[:2](x)  # the stem and the first block
    assert block_output.is_contiguous(memory_format=memory_format)


def _buffer_slices(features):
    """The maps as channel slices of one channels_last buffer, as a dense
    block holds them (channels_last but not dense)."""
    first = features[0]
    buffer = torch.empty((first.shape[0], sum(f.shape[1] for f in features) + 3, *first.shape[2:]),
                         dtype=first.dtype, device=first.device, memory_format=torch.channels_last)
    slices = list(torch.split(buffer[:, :-3], [f.shape[1] for f in features], 1))
    for piece, f in zip(slices, features):
        piece.copy_(f)
    assert not slices[0].is_contiguous(memory_format=torch.channels_last)
    return slices


# (layout, a function of the maps): the layouts a model gives the ops, and mixtures.
OPCHECK_LAYOUTS = {
    "contiguous": ("contiguous", lambda f: f),
    "channels_last": ("channels_last", lambda f: f),
    "channels_last-one-slice": ("channels_last", lambda f: _buffer_slices(f)[:1]),
    "channels_last-slices": ("channels_last", _buffer_slices),
    "contiguous-slice": ("contiguous", lambda f: [torch.cat(f, 1)[:, :f[0].shape[1]]]),
    "mixed-channels-last-first": ("channels_last", lambda f: [f[0], f[1].contiguous()]),
    "mixed-contiguous-first": ("contiguous", lambda f: [f[0], f[1].contiguous(memory_format=torch.channels_last)]),
}


@pytest.mark.parametrize("padding", [0, 1], ids=["1x1", "3x3"])
@pytest.mark.parametrize("case", list(OPCHECK_LAYOUTS))
def test_pointwise_ops_opcheck(op_device, case, padding):
    """The fake kernels and every backend agree on shapes, dtypes and strides
    (the first map's suggest_memory_format), for the layouts a channels_last
    or NCHW model hands the ops, non-dense channel slices and mixtures
    included."""
    if padding and effilayers.backends.choice("dense_bottleneck_forward", op_device.type).backend == "triton":
        pytest.skip("the Triton backend hands the 3x3 case to the reference's code")
    layout, arrange = OPCHECK_LAYOUTS[case]
    features, vectors, _ = _op_case(op_device, torch.float32, layout, channels=(3, 2), size=(2, 3, 4))
    features = arrange(features)
    channels = sum(f.shape[1] for f in features)
    kernel = 2 * padding + 1
    conv_weight = torch.randn(4, channels, kernel, kernel, device=op_device) / channels
    vectors = [v[:channels] for v in vectors]
    grad_out = torch.randn(2, 4, 3, 4, device=op_device)
    expected = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    out = densenet_ops._forward_op(features, *vectors, conv_weight, padding)
    grad_input = densenet_ops._backward_op(grad_out, features, *vectors, conv_weight, True, True, True, padding)[0]
    assert out.is_contiguous(memory_format=expected) and grad_input.is_contiguous(memory_format=expected)
    # Every check for the two plain layouts; the others are about layouts,
    # which test_faketensor compares (aot_dispatch_dynamic costs seconds).
    checks = None if case in ("contiguous", "channels_last") else ("test_schema", "test_faketensor")
    kwargs = {} if checks is None else dict(test_utils=checks)
    torch.library.opcheck(densenet_ops._forward_op, (features, *vectors, conv_weight, padding), **kwargs)
    torch.library.opcheck(densenet_ops._backward_op,
                          (grad_out, features, *vectors, conv_weight, True, True, True, padding), **kwargs)


# ---- the block buffer: zero-copy concatenation -------------------------------------------------


def _block(layers=3, start=6, growth=4, bn_size=2):
    from effilayers.models.densenet import DenseBlock

    torch.manual_seed(0)
    return DenseBlock(layers, start, bn_size, growth, 0.0, memory_efficient=True)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_block_keeps_its_maps_once(layout):
    """Saved for backward: the block buffer (input and every new map, once,
    which is also the output), each layer's norm2 input and the per-channel
    statistics; nothing else."""
    layers, start, growth, bn_size = 3, 6, 4, 2
    block = _block(layers, start, growth, bn_size)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, start, 5, 5).contiguous(memory_format=memory_format).requires_grad_()
    with memory.track_activations(exclude=block) as meter:
        out = block(x * 1)
    total = start + layers * growth
    inner = bn_size * growth
    pixels = 2 * 5 * 5
    statistics = sum(2 * (start + i * growth) + 2 * inner for i in range(layers)) * 4  # mean, invstd per norm
    assert meter.bytes == (total + layers * inner) * pixels * 4 + statistics, meter.largest()
    assert out.shape == (2, total, 5, 5)
    assert out.is_contiguous(memory_format=memory_format)
    del out


def test_block_output_changed_in_place_is_caught():
    block = _block()
    x = torch.randn(2, 6, 5, 5, requires_grad=True)
    out = block(x * 1)
    out.relu_()
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        out.sum().backward()


def test_block_output_used_out_of_place_trains():
    block = _block()
    naive = _block()
    for layer in naive.values():
        layer.memory_efficient = False
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    block.double(), naive.double()
    outputs = []
    for model in (block, naive):
        x.grad = None
        out = torch.relu(model(x * 1))
        out.square().sum().backward()
        outputs.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=0, atol=1e-12)
    for a, b in zip(outputs[0][2], outputs[1][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("mode", ["plain", "checkpoint", pytest.param("save_on_cpu", marks=pytest.mark.gpu)])
def test_saved_tensor_hooks_free_the_block_buffer_after_forward(monkeypatch, mode):
    """Under torch.utils.checkpoint nothing of the block but its input may
    stay alive between forward and backward, and under save_on_cpu nothing
    of it on the GPU: the block buffer's storage must be freed once the
    output is dropped (an autograd node kept it through a non-tensor
    attribute, which saved-tensor hooks cannot see). Without hooks the saved
    maps keep it, which shows the probe works. Gradients are the naive
    block's either way."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.checkpoint import checkpoint

    from effilayers.models import densenet as densenet_module

    buffers = []

    class RecordedBuffer(densenet_module._BlockBuffer):
        def __init__(self, like, channels):
            super().__init__(like, channels)
            buffers.append(StorageWeakRef(self.buffer.untyped_storage()))

    monkeypatch.setattr(densenet_module, "_BlockBuffer", RecordedBuffer)
    device = "cuda" if mode == "save_on_cpu" else "cpu"
    block, naive = _block().to(device, torch.float64), _block().to(device, torch.float64)
    for layer in naive.values():
        layer.memory_efficient = False
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, device=device, requires_grad=True)
    if mode == "checkpoint":
        out = checkpoint(block, x, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu() if mode == "save_on_cpu" else contextlib.nullcontext():
            out = block(x)
    loss = (out * 2).square().sum()
    del out
    assert len(buffers) == 1
    assert buffers[0].expired() == (mode != "plain")
    grad = torch.autograd.grad(loss, [x, *block.parameters()])
    expected = torch.autograd.grad((naive(x) * 2).square().sum(), [x, *naive.parameters()])
    for a, b in zip(grad, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.gpu
def test_densenet264_trains_at_batch_64_bf16_224():
    """Issue 4's capacity target: DenseNet-264, batch 64, 224x224, bf16
    autocast, one training step on one 80 GB GPU."""
    model = models.densenet264().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (64,), device="cuda")
    with memory.track_cuda_peak() as peak:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), target)
        loss.backward()
        torch.cuda.synchronize()
    print(f"\ndensenet264 64x3x224x224 bf16: peak {peak.peak_bytes / 2**30:.1f} GiB")
    assert torch.isfinite(loss)
    assert peak.peak_bytes < 80 * 10**9
