"""The DenseNet bottleneck's recomputing autograd Function against autograd
through the plain layers: gradients (gradcheck), running statistics,
statistics shared by a dense block, what it keeps, its argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effilayers
from effilayers import memory
from effilayers.ops.densenet import bottleneck

from .conftest import activate_backend, backend_names

# No TF32 here unless a test asks (conftest.full_float32 says why).
pytestmark = pytest.mark.usefixtures("full_float32")


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


def test_double_backward_raises():
    from effilayers.models import DenseNet

    model = DenseNet(growth_rate=4, block_config=(2,), num_init_features=8, bn_size=2, num_classes=3,
                     small_inputs=True).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
