"""cross_entropy: every backend against torch.nn.functional.cross_entropy in
float64: values, odd and long rows, extreme and infinite logits, ignored and
empty targets, layouts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import effilayers
from effilayers._core.layout import three_view
from effilayers.functional import cross_entropy
from effilayers.ops.cross_entropy import REFERENCE_CHUNK_ELEMENTS

from .accuracy import assert_close
from .conftest import required_backend
from .cross_entropy_cases import (
    OP,
    assert_matches_torch,
    backend_of,
    make_logits,
    make_target,
    make_weight,
    ours,
    torch_expected,
)
from .helpers import LaunchSpy

# --------------------------------------------------------------------------
# Values against torch
# --------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("shape", [(6, 11), (3, 5, 2, 3)], ids=["NC", "NCd1d2"])
def test_matches_torch_float64(ce_device, ce_small_triton_block, reduction, label_smoothing, weighted, shape):
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
def test_low_precision_vs_float64(ce_device, ce_small_triton_block, dtype, reduction):
    if dtype == torch.bfloat16 and ce_device.type == "cpu" and backend_of(ce_device) == "triton":
        pytest.skip("the Triton interpreter has no bfloat16 arithmetic (covered by triton-cuda)")
    shape = (7, 37)
    logits = make_logits(shape, dtype, ce_device, seed=3)
    target = make_target((7,), 37, ce_device, ignore_every=5)
    grad_output = make_logits((7,), dtype, ce_device, seed=4) if reduction == "none" else None
    assert_matches_torch(logits, target, dtype, grad_output, reduction=reduction, label_smoothing=0.05,
                         weight=make_weight(37, ce_device).to(dtype))


@pytest.mark.parametrize("classes", [1, 2, 13, 17, 300])
def test_odd_vocab_sizes(ce_device, ce_small_triton_block, classes):
    logits = make_logits((5, classes), torch.float32, ce_device, seed=classes)
    target = make_target((5,), classes, ce_device)
    assert_matches_torch(logits, target, torch.float32, reduction="sum")
    assert_matches_torch(logits, target, torch.float32, reduction="mean", label_smoothing=0.2)


def test_one_class_is_zero_loss(ce_device):
    logits = make_logits((4, 1), torch.float32, ce_device)
    loss, grad = ours(logits, torch.zeros(4, dtype=torch.int64, device=ce_device), reduction="sum")
    assert float(loss) == 0.0 and bool((grad == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_rows_65537_classes(ce_cpu_device, dtype):
    classes = 65537  # more than REFERENCE_CHUNK_ELEMENTS and 32 C++ chunks, plus one
    assert classes > REFERENCE_CHUNK_ELEMENTS
    logits = make_logits((3, classes), dtype, ce_cpu_device, scale=4.0)
    target = torch.tensor([0, classes - 1, 12345], device=ce_cpu_device)
    assert_matches_torch(logits, target, dtype, reduction="mean", label_smoothing=0.1)


@pytest.mark.parametrize("fused", [64, 128], ids=["walking", "whole-row"])
def test_triton_row_just_over_one_block(monkeypatch, fused):
    """65 classes over blocks of 64 (the walking path), or held whole in a
    block of 128 (SINGLE: one read, the gradient from the same registers)."""
    from effilayers.ops.cross_entropy import triton as kernels

    # Skips only where Triton cannot run; fails instead under EFFILAYERS_REQUIRE_COMPILED=1 (CI).
    with required_backend(OP, "triton", "cpu"):
        monkeypatch.setattr(kernels, "MAX_BLOCK", 64)
        monkeypatch.setattr(kernels, "MAX_FUSED_BLOCK", fused)
        assert kernels._rows_block_and_warps(65)[0] == (64 if fused == 64 else 128)
        logits = make_logits((3, 65), torch.float32, torch.device("cpu"))
        target = torch.tensor([64, 0, 63])
        assert_matches_torch(logits, target, torch.float32, label_smoothing=0.1, weight=make_weight(65, "cpu"))


@pytest.mark.parametrize("block", [32, 8], ids=["one-piece", "3-pieces"])
def test_triton_split_rows(monkeypatch, block):
    """Rows with a gradient cut into pieces of ``block`` classes, one program
    each (the ``split`` configurations): 20 classes in one piece or in three
    whose last is partial, 5 rows, an ignored target, weights and label
    smoothing, and -inf logits (a row with one finite value, an infinite
    target logit). Under the interpreter every piece but a row's last
    computes the other pieces' statistics itself, so both merges run."""
    from effilayers.ops.cross_entropy import triton as kernels

    with required_backend(OP, "triton", "cpu"):
        monkeypatch.setattr(kernels, "_rows_config",
                            lambda logits, write_grad: {"BLOCK": block, "num_warps": 4, "split": write_grad})
        cpu = torch.device("cpu")
        logits = make_logits((5, 20), torch.float32, cpu, seed=2)
        target = torch.tensor([3, -100, 19, 0, 12])
        assert_matches_torch(logits, target, torch.float32, reduction="mean", label_smoothing=0.1,
                             weight=make_weight(20, "cpu"))
        logits[1, 5] = -math.inf  # the target: infinite loss, finite gradient
        logits[2, :19] = -math.inf  # one finite value left in the row
        target = torch.tensor([3, 5, 19, 0, 12])
        exp_loss, exp_grad = torch_expected(logits, target, reduction="none")
        loss, grad = ours(logits, target, reduction="none")
        assert_close(loss.double(), exp_loss, torch.float32)
        assert_close(grad.double(), exp_grad, torch.float32)


@pytest.mark.parametrize("config", [{"ROWS": 4}, {"ROWS": 2, "persistent": 1}], ids=["4-rows", "2-rows-persistent"])
def test_triton_rows_per_program(monkeypatch, config):
    """Rows held whole several to a program ([ROWS, BLOCK] blocks, the
    launcher's ``ROWS``) and the persistent grid (``persistent``: programs
    per SM, 2 interpreter SMs, so 2 programs loop over 4 row blocks) against
    float64 torch: 7 rows (no multiple of ROWS) with an ignored target,
    weights and label smoothing, -inf logits (an infinite target logit, a
    row with one finite value), fp16 and bf16, a single row, the loss alone."""
    from effilayers._core import tuning
    from effilayers.ops.cross_entropy import triton as kernels

    with required_backend(OP, "triton", "cpu"):
        monkeypatch.setattr(kernels, "_rows_config",
                            lambda logits, write_grad: dict({"BLOCK": 32, "num_warps": 4}, **config))
        spy = LaunchSpy(kernels._cross_entropy_rows_kernel)
        monkeypatch.setattr(kernels, "_cross_entropy_rows_kernel", spy)
        cpu = torch.device("cpu")
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            logits = make_logits((7, 20), dtype, cpu, seed=2)
            target = torch.tensor([3, -100, 19, 0, 12, 5, 7])
            assert_matches_torch(logits, target, dtype, reduction="mean", label_smoothing=0.1,
                                 weight=make_weight(20, "cpu").to(dtype))
        logits = make_logits((7, 20), torch.float32, cpu, seed=3)
        logits[1, 5] = -math.inf  # the target: infinite loss, finite gradient
        logits[2, :19] = -math.inf  # one finite value left in the row
        target = torch.tensor([3, 5, 19, 0, 12, 5, 7])
        exp_loss, exp_grad = torch_expected(logits, target, reduction="none")
        loss, grad = ours(logits, target, reduction="none")
        assert_close(loss.double(), exp_loss, torch.float32)
        assert_close(grad.double(), exp_grad, torch.float32)
        assert_matches_torch(logits[:1], target[:1], torch.float32, reduction="sum")
        with torch.no_grad():  # the loss alone (no gradient written)
            assert_close(cross_entropy(logits, target, reduction="none").double(), exp_loss, torch.float32)
        launched = [(grid, kwargs) for grid, kwargs in spy.launches]
        assert {kwargs["ROWS"] for _, kwargs in launched} == {1, config["ROWS"]}
        assert {kwargs["WRITE_GRAD"] for _, kwargs in launched} == {True, False}
        if config.get("persistent"):
            assert any(kwargs["PERSISTENT"] for _, kwargs in launched)
            assert all(grid[0] == tuning.multiprocessors(cpu) for grid, kwargs in launched if kwargs["PERSISTENT"])



def test_subnormal_gradients_like_torch(ce_device):
    # softmax(x) of logits 90 and 100 below the maximum is a float32
    # subnormal (8.2e-40, 3.8e-44): torch's gradient keeps it, and so must
    # the kernels' exp (the C++ one used to flush it to 0).
    logits = torch.tensor([[0.0, -100.0, -90.0, -103.0, -200.0] + [-5.0] * 19], device=ce_device)  # vector lanes
    target = torch.tensor([0], device=ce_device)
    exp_loss, exp_grad = torch_expected(logits, target)
    loss, grad = ours(logits, target)
    expected = exp_grad.float().cpu()  # torch's float64 gradient rounded once
    assert float(expected[0, 1]) > 0 and float(expected[0, 3]) == 2**-149
    torch.testing.assert_close(grad.cpu(), expected, rtol=1e-5, atol=2**-148)
    assert bool((grad.cpu()[0, 1:4] > 0).all())


def test_extreme_logits_overflow_like_torch(ce_device):
    # lse - x[t] of logits +-3e38 exceeds float32: inf loss with a finite
    # gradient, as torch's float32 log-softmax gives (bf16 behaves the same).
    logits = torch.tensor([[3e38, -3e38, 0.0], [3e38, 1e38, 0.0]], device=ce_device)
    target = torch.tensor([1, 1], device=ce_device)
    exp_loss = F.cross_entropy(logits.cpu(), target.cpu(), reduction="none")
    leaf = logits.cpu().clone().requires_grad_()
    (exp_grad,) = torch.autograd.grad(F.cross_entropy(leaf, target.cpu(), reduction="sum"), leaf)
    loss, grad = ours(logits, target, reduction="none")
    assert math.isinf(float(exp_loss[0])) and math.isinf(float(loss[0]))
    torch.testing.assert_close(loss.cpu(), exp_loss)
    torch.testing.assert_close(grad.cpu(), exp_grad)


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


def test_weighted_mean_of_zero_total_weight_like_torch(ce_device, ce_small_triton_block):
    # Every target's class weight is 0 (one row ignored): torch's mean is
    # 0 / 0 = NaN with or without label smoothing, its gradient NaN on the
    # counted rows and 0 on the ignored one (smoothing used to give inf).
    logits = make_logits((4, 11), torch.float64, ce_device)
    target = torch.tensor([0, 0, -100, 1], device=ce_device)
    weight = torch.tensor([0.0, 0.0] + [1.0, 2.0, 0.5] * 3, dtype=torch.float64, device=ce_device)
    for label_smoothing in (0.0, 0.1, 1.0):
        exp_loss, exp_grad = torch_expected(logits, target, weight=weight, label_smoothing=label_smoothing)
        loss, grad = ours(logits, target, weight=weight, label_smoothing=label_smoothing)
        assert math.isnan(float(exp_loss)) and bool(exp_grad[[0, 1, 3]].isnan().all())
        assert bool((exp_grad[2] == 0).all())
        torch.testing.assert_close(loss, exp_loss.to(loss.device), equal_nan=True)
        torch.testing.assert_close(grad, exp_grad.to(grad.device), equal_nan=True)


@pytest.mark.parametrize("shape", [(0, 5), (2, 5, 0), (0, 5, 3), (2, 5, 3, 0)])
def test_empty_batch(ce_device, shape):
    # No rows: an empty batch, or empty K dims (N, C, 0) (the reference divided by zero there)
    logits = make_logits(shape, torch.float32, ce_device)
    target = torch.zeros(shape[:1] + shape[2:], dtype=torch.int64, device=ce_device)
    for reduction in ("mean", "sum", "none"):
        for label_smoothing, weight in ((0.0, None), (0.1, make_weight(5, ce_device).float())):
            kwargs = dict(reduction=reduction, label_smoothing=label_smoothing, weight=weight)
            exp_loss, _ = torch_expected(logits, target, **kwargs)
            loss, grad = ours(logits, target, **kwargs)
            assert loss.shape == exp_loss.shape
            torch.testing.assert_close(loss.double(), exp_loss, equal_nan=True)
            assert grad.shape == shape
    # The row kernels themselves, called with no rows, return no losses.
    if len(shape) == 3:
        kernel = effilayers.backends.kernel(OP, ce_device)
        scale = torch.ones(1, device=ce_device)
        for grad in (None, torch.empty_like(logits)):
            assert kernel(logits, target.reshape(-1), None, grad, scale, -100, 0.1).shape == (0,)


def test_zero_classes_like_torch(ce_device):
    # Every target must be ignored (there is no class to point at). torch:
    # sum 0, mean NaN (0 / 0), "none" zeros; with label smoothing NaN
    # everywhere (its eps / C is inf, times a zero sum).
    logits = torch.empty(4, 0, device=ce_device)
    target = torch.full((4,), -100, device=ce_device)
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            for weight in (None, torch.ones(0, device=ce_device)):
                exp_loss, _ = torch_expected(logits, target, reduction=reduction, label_smoothing=smoothing,
                                             weight=weight)
                for inplace in (False, True):
                    leaf = logits.clone().requires_grad_()
                    loss = cross_entropy(leaf * 1, target, reduction=reduction, label_smoothing=smoothing,
                                         weight=weight, inplace_backward=inplace)
                    (grad,) = torch.autograd.grad(loss, leaf, torch.ones_like(loss))
                    assert loss.shape == exp_loss.shape and grad.shape == logits.shape
                    torch.testing.assert_close(loss.double().cpu(), exp_loss.cpu(), equal_nan=True)
    # (N, 0, d) and unbatched (0,): torch 2.13 raises on these shapes (a size
    # mismatch; a probability-target error); the same rule per row applies.
    for shape, target_shape in (((2, 0, 3), (2, 3)), ((0,), ())):
        spatial = torch.full(target_shape, -100, device=ce_device)
        assert torch.equal(cross_entropy(torch.empty(shape, device=ce_device), spatial, reduction="none").cpu(),
                           torch.zeros(spatial.shape))
        assert math.isnan(float(cross_entropy(torch.empty(shape, device=ce_device), spatial, label_smoothing=0.1,
                                              reduction="sum")))


def test_zero_classes_row_kernels(ce_device):
    # The row kernels themselves (reached only through the op's own early
    # return, but callable directly): no logit is read, ignored rows give 0,
    # others NaN, and nothing is written.
    kernel = effilayers.backends.kernel(OP, ce_device)
    logits = torch.empty(3, 0, 2, device=ce_device)
    target = torch.tensor([-100, -100, 0, -100, 5, -100], device=ce_device)
    scale = torch.ones(1, device=ce_device)
    for grad in (None, torch.empty_like(logits), logits):
        for smoothing in (0.0, 0.1):
            if ce_device.type == "cpu" and backend_of(ce_device) == "cpp":
                with pytest.raises(IndexError, match="out of bounds for 0 classes"):
                    kernel(logits, target, None, grad, scale, -100, smoothing)
                loss = kernel(logits, torch.full_like(target, -100), None, grad, scale, -100, smoothing)
                assert torch.equal(loss.cpu(), torch.zeros(6))
                continue
            loss = kernel(logits, target, None, grad, scale, -100, smoothing)
            assert torch.equal(loss.cpu().isnan(), target.cpu() != -100)
            assert bool((loss.cpu()[target.cpu() == -100] == 0).all())


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


def test_strided_targets(ce_device, ce_small_triton_block):
    # Targets that are views with gaps (a column of a label table, an LM
    # label shift, a permuted K-dim target): the kernels read one int64 per
    # row in row order, so these must not reach them as they are.
    labels = make_target((6, 3), 11, ce_device, ignore_every=4)
    logits = make_logits((6, 11), torch.float64, ce_device)
    assert_matches_torch(logits, labels[:, 1], torch.float64, label_smoothing=0.1)
    narrow = labels.to(torch.int32)[:, 2]  # converted to int64 on the way: the conversion keeps the gaps
    assert not narrow.is_contiguous()
    assert_close(cross_entropy(logits, narrow), F.cross_entropy(logits, labels[:, 2]), torch.float64)
    spatial = make_logits((2, 11, 3, 4), torch.float64, ce_device, seed=3)
    table = make_target((2, 4, 5), 11, ce_device, seed=4, ignore_every=5)
    every_other = make_target((2, 3, 8), 11, ce_device, seed=6)[..., ::2]  # reshape(-1) keeps it a strided view
    for target in (table[:, :, 1:4].transpose(1, 2), table.transpose(1, 2)[:, :3], table[:, :1, :4].expand(2, 3, 4),
                   every_other):
        assert target.shape == (2, 3, 4) and not target.is_contiguous()
        assert_matches_torch(logits=spatial, target=target, dtype=torch.float64, reduction="none",
                             grad_output=make_logits((2, 3, 4), torch.float64, ce_device, seed=5))


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
def test_layouts(ce_device, ce_small_triton_block, layout, inplace):
    logits, target_shape = _layouts(ce_device)[layout]
    assert (three_view(logits, (1,)) is None) == (layout == "unmergeable")
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
    assert_close(loss.double(), exp_loss, torch.float32)
    grad = grad_of.grad
    if layout == "class_stride_2":
        grad = grad[:, ::2]
    elif layout == "row_slice":
        assert bool((grad_of.grad[:, :3] == 0).all()) and bool((grad_of.grad[:, 13:] == 0).all())
        grad = grad[:, 3:13]
    assert_close(grad.double(), exp_grad, torch.float32)


# --------------------------------------------------------------------------
# Infinities
# --------------------------------------------------------------------------


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("classes", [12, 20], ids=["whole-row", "walking"])  # under ce_small_triton_block
def test_minus_inf_logits(ce_device, ce_small_triton_block, label_smoothing, classes):
    logits = make_logits((4, classes), torch.float32, ce_device)
    target = torch.tensor([3, 5, 0, classes - 1], device=ce_device)
    logits[0, 7] = -math.inf  # a non-target class
    logits[1, 5] = -math.inf  # the target: infinite loss, finite gradient
    logits[2, :classes - 1] = -math.inf  # one finite value left in the row
    exp_loss, exp_grad = torch_expected(logits, target, reduction="none", label_smoothing=label_smoothing)
    loss, grad = ours(logits, target, reduction="none", label_smoothing=label_smoothing)
    assert_close(loss.double(), exp_loss, torch.float32)
    assert math.isinf(float(loss[1]))
    assert_close(grad.double(), exp_grad, torch.float32)
    assert bool(torch.isfinite(grad).all())
