"""cross_entropy: every backend against torch.nn.functional.cross_entropy in float64."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import effilayers
import effilayers.kernels  # noqa: F401
from effilayers import memory
from effilayers.functional import cross_entropy
from effilayers.nn import CrossEntropyLoss
from effilayers.ops.cross_entropy import REFERENCE_CHUNK_ELEMENTS, _as_rows

from .conftest import forced_backend

OP = "cross_entropy"

# The brief's BACKEND_PARAMS list a CUDA-C++ backend this op does not have
# (its GPU kernel is Triton), so the pairs are listed here.
CE_PARAMS = [
    pytest.param(("reference", "cpu"), id="reference-cpu"),
    pytest.param(("cpp", "cpu"), id="cpp-cpu"),
    pytest.param(("triton", "cpu"), id="triton-interpreter"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("reference", "cuda"), id="reference-cuda", marks=pytest.mark.gpu),
]
CPU_PARAMS = CE_PARAMS[:2]

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


@pytest.fixture(params=CE_PARAMS)
def ce_device(request):
    yield from forced_backend(request, OP)


@pytest.fixture(params=CPU_PARAMS)
def cpu_device(request):
    yield from forced_backend(request, OP)


@pytest.fixture
def small_triton_block(monkeypatch):
    """Blocks of 8 classes, so rows of more than 8 classes run the Triton
    kernel's multi-block loop under the interpreter."""
    from effilayers.kernels import cross_entropy as kernels

    monkeypatch.setattr(kernels, "MAX_BLOCK", 8)


def backend_of(device):
    return effilayers.backends.choice(OP, device.type).backend


def make_logits(shape, dtype, device, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale + 0.5
    return values.to(dtype=dtype, device=device)


def make_target(shape, classes, device, seed=1, ignore_every=0, ignore_index=-100):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, shape, generator=generator)
    if ignore_every:
        target.view(-1)[::ignore_every] = ignore_index
    return target.to(device)


def make_weight(classes, device, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(classes, generator=generator, dtype=torch.float64) + 0.25).to(device)


def torch_expected(logits, target, grad_output=None, **kwargs):
    """torch's loss and gradient from the same (rounded) logits in float64."""
    x = logits.detach().double().requires_grad_()
    weight = kwargs.pop("weight", None)
    loss = F.cross_entropy(x, target, weight=None if weight is None else weight.double(), **kwargs)
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output.double()
    (grad,) = torch.autograd.grad(loss, x, grad_output)
    return loss.detach(), grad


def ours(logits, target, grad_output=None, **kwargs):
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, target, **kwargs)
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output
    loss.backward(grad_output)
    return loss.detach(), x.grad


def assert_matches_torch(logits, target, dtype, grad_output=None, **kwargs):
    exp_loss, exp_grad = torch_expected(logits, target, grad_output, **kwargs)
    loss, grad = ours(logits, target, grad_output, **kwargs)
    assert loss.dtype == logits.dtype and grad.dtype == logits.dtype
    assert loss.shape == exp_loss.shape and grad.shape == logits.shape
    torch.testing.assert_close(loss.double(), exp_loss, **TOL[dtype])
    torch.testing.assert_close(grad.double(), exp_grad, **TOL[dtype])


# --------------------------------------------------------------------------
# Values against torch
# --------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("shape", [(6, 11), (3, 5, 2, 3)], ids=["NC", "NCd1d2"])
def test_matches_torch_float64(ce_device, small_triton_block, reduction, label_smoothing, weighted, shape):
    logits = make_logits(shape, torch.float64, ce_device)
    target = make_target(shape[:1] + shape[2:], shape[1], ce_device, ignore_every=4)
    weight = make_weight(shape[1], ce_device) if weighted else None
    grad_output = None
    if reduction == "none":
        grad_output = make_logits(target.shape, torch.float64, ce_device, seed=9)
    assert_matches_torch(logits, target, torch.float64, grad_output, weight=weight, reduction=reduction,
                         label_smoothing=label_smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_vs_float64(ce_device, small_triton_block, dtype, reduction):
    if dtype == torch.bfloat16 and ce_device.type == "cpu" and backend_of(ce_device) == "triton":
        pytest.skip("the Triton interpreter has no bfloat16 arithmetic (covered by triton-cuda)")
    shape = (7, 37)
    logits = make_logits(shape, dtype, ce_device, seed=3)
    target = make_target((7,), 37, ce_device, ignore_every=5)
    grad_output = make_logits((7,), dtype, ce_device, seed=4) if reduction == "none" else None
    assert_matches_torch(logits, target, dtype, grad_output, reduction=reduction, label_smoothing=0.05,
                         weight=make_weight(37, ce_device).to(dtype))


@pytest.mark.parametrize("classes", [1, 2, 13, 17, 1000])
def test_odd_vocab_sizes(ce_device, small_triton_block, classes):
    logits = make_logits((5, classes), torch.float32, ce_device, seed=classes)
    target = make_target((5,), classes, ce_device)
    assert_matches_torch(logits, target, torch.float32, reduction="sum")
    assert_matches_torch(logits, target, torch.float32, reduction="mean", label_smoothing=0.2)


def test_one_class_is_zero_loss(ce_device):
    logits = make_logits((4, 1), torch.float32, ce_device)
    loss, grad = ours(logits, torch.zeros(4, dtype=torch.int64, device=ce_device), reduction="sum")
    assert float(loss) == 0.0 and bool((grad == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_rows_65537_classes(cpu_device, dtype):
    classes = 65537  # more than REFERENCE_CHUNK_ELEMENTS and 32 C++ chunks, plus one
    assert classes > REFERENCE_CHUNK_ELEMENTS
    logits = make_logits((3, classes), dtype, cpu_device, scale=4.0)
    target = torch.tensor([0, classes - 1, 12345], device=cpu_device)
    assert_matches_torch(logits, target, dtype, reduction="mean", label_smoothing=0.1)


def test_triton_row_just_over_one_block(monkeypatch):
    from effilayers.kernels import cross_entropy as kernels

    with effilayers.use_backend("triton"):
        if effilayers.backends.choice(OP, "cpu").kernel is None:
            pytest.skip("Triton kernels need TRITON_INTERPRET=1 on CPU")
        monkeypatch.setattr(kernels, "MAX_BLOCK", 64)
        logits = make_logits((3, 65), torch.float32, torch.device("cpu"))
        target = torch.tensor([64, 0, 63])
        assert_matches_torch(logits, target, torch.float32, label_smoothing=0.1, weight=make_weight(65, "cpu"))


def test_matches_with_other_ignore_index(ce_device):
    logits = make_logits((8, 6), torch.float64, ce_device)
    target = make_target((8,), 6, ce_device, ignore_every=3, ignore_index=2)
    assert_matches_torch(logits, target, torch.float64, ignore_index=2, label_smoothing=0.1)


def test_all_rows_ignored_mean_is_nan_with_zero_grad(ce_device):
    logits = make_logits((3, 5), torch.float32, ce_device)
    target = torch.full((3,), -100, device=ce_device)
    for smoothing in (0.0, 0.1):
        exp_loss, exp_grad = torch_expected(logits, target, label_smoothing=smoothing)
        loss, grad = ours(logits, target, label_smoothing=smoothing)
        assert math.isnan(float(loss)) and math.isnan(float(exp_loss))
        assert bool((grad == 0).all()) and bool((exp_grad == 0).all())


def test_unbatched_and_integer_targets(ce_device):
    logits = make_logits((9,), torch.float64, ce_device)
    target = torch.tensor(4, device=ce_device)
    for reduction in ("mean", "none"):
        assert_matches_torch(logits, target, torch.float64, reduction=reduction)
    batch = make_logits((4, 9), torch.float64, ce_device)
    target64 = make_target((4,), 9, ce_device)
    expected = cross_entropy(batch, target64)
    for dtype in (torch.int32, torch.uint8):
        torch.testing.assert_close(cross_entropy(batch, target64.to(dtype)), expected)


# --------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------


def _layouts(device):
    base = make_logits((6, 10), torch.float32, device, seed=5)
    wide = make_logits((6, 20), torch.float32, device, seed=6)
    spatial = make_logits((2, 5, 3, 4), torch.float32, device, seed=7)
    return {
        "transposed": (base.t().contiguous().t(), (6,)),
        "class_stride_2": (wide[:, ::2], (6,)),
        "row_slice": (wide[:, 3:13], (6,)),
        "channels_last": (spatial.contiguous(memory_format=torch.channels_last), (2, 3, 4)),
        # inner dims whose strides do not nest: the one layout that is copied
        "unmergeable": (spatial.transpose(2, 3).contiguous().transpose(2, 3), (2, 3, 4)),
    }


@pytest.mark.parametrize("layout", ["transposed", "class_stride_2", "row_slice", "channels_last", "unmergeable"])
@pytest.mark.parametrize("inplace", [False, True], ids=["saved", "inplace"])
def test_layouts(ce_device, small_triton_block, layout, inplace):
    logits, target_shape = _layouts(ce_device)[layout]
    assert (_as_rows(logits) is None) == (layout == "unmergeable")
    target = make_target(target_shape, logits.shape[1], ce_device, ignore_every=5)
    exp_loss, exp_grad = torch_expected(logits, target, label_smoothing=0.1)
    # Non-leaf logits with exactly these strides (inplace_backward refuses leaves).
    if layout in ("class_stride_2", "row_slice"):
        wide_leaf = make_logits((6, 20), torch.float32, ce_device, seed=6).requires_grad_()
        wide = wide_leaf * 1
        x = wide[:, ::2] if layout == "class_stride_2" else wide[:, 3:13]
        grad_of = wide_leaf
    else:
        leaf = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=ce_device)
        leaf.copy_(logits.detach())
        leaf.requires_grad_()
        x = leaf * 1  # elementwise ops keep a dense input's strides
        assert x.stride() == logits.stride()
        grad_of = leaf
    loss = cross_entropy(x, target, label_smoothing=0.1, inplace_backward=inplace)
    loss.backward()
    torch.testing.assert_close(loss.double(), exp_loss, **TOL[torch.float32])
    grad = grad_of.grad
    if layout == "class_stride_2":
        grad = grad[:, ::2]
    elif layout == "row_slice":
        assert bool((grad_of.grad[:, :3] == 0).all()) and bool((grad_of.grad[:, 13:] == 0).all())
        grad = grad[:, 3:13]
    torch.testing.assert_close(grad.double(), exp_grad, **TOL[torch.float32])
