"""cross_entropy's autograd: gradcheck, refused double backward, retained
graphs, inplace_backward (the gradient written over the logits), what
autograd keeps (effilayers.memory) and autocast, offsets past 2**31."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import effilayers
from effilayers import memory
from effilayers.functional import cross_entropy

from .accuracy import assert_close
from .conftest import fake_cuda_autocast, far_apart_rows, peak_rss_growth
from .cross_entropy_cases import OP, Head, make_logits, make_target, make_weight, ours, torch_expected

# --------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck(ce_device, ce_small_triton_block, reduction):
    logits = make_logits((3, 10), torch.float64, ce_device).requires_grad_()
    target = make_target((3,), 10, ce_device, ignore_every=3)
    weight = make_weight(10, ce_device)

    def fn(x):
        return cross_entropy(x, target, weight=weight, label_smoothing=0.1, reduction=reduction)

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7)


def test_double_backward_is_refused(ce_device):
    logits = make_logits((3, 5), torch.float64, ce_device).requires_grad_()
    target = make_target((3,), 5, ce_device)
    loss = cross_entropy(logits, target)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, logits, create_graph=True)


def test_retain_graph_backward_twice(ce_device):
    # the saved gradient is scaled in place only when the graph is not retained
    logits = make_logits((3, 5), torch.float32, ce_device)
    target = make_target((3,), 5, ce_device)
    go = torch.tensor([1.0, 2.0, 3.0], device=ce_device)  # on the logits' device (the H200 run caught a CPU one)
    _, expected = torch_expected(logits, target, reduction="none", grad_output=go)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    (first,) = torch.autograd.grad(loss, x, go, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x, go)
    assert_close(first.double(), expected.to(first.device), torch.float32)
    torch.testing.assert_close(second, first)


def test_no_grad_needed_saves_nothing(ce_device):
    logits = make_logits((5, 9), torch.float32, ce_device)
    target = make_target((5,), 9, ce_device)
    before = logits.clone()
    with memory.track_activations() as meter:
        loss = cross_entropy(logits, target, inplace_backward=True)
    assert loss.grad_fn is None and meter.bytes == 0
    assert torch.equal(logits, before)  # nothing is written when no gradient is wanted
    assert_close(loss.double(), torch_expected(logits, target)[0], torch.float32)
    # logits that require grad, under no_grad / inference_mode: no gradient is computed or written
    head = Head(4, 9, torch.float32).to(ce_device)
    h = make_logits((5, 4), torch.float32, ce_device)
    for mode in (torch.no_grad, torch.inference_mode):
        logits = head(h)
        assert logits.requires_grad
        before = logits.detach().clone()
        with mode():
            loss = cross_entropy(logits, target, inplace_backward=True)
        assert loss.grad_fn is None and torch.equal(logits.detach(), before)


# --------------------------------------------------------------------------
# inplace_backward
# --------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward_gradients(ce_device, ce_small_triton_block, reduction):
    head = Head(6, 13, torch.float32).to(ce_device)
    h = make_logits((8, 6), torch.float32, ce_device).requires_grad_()
    target = make_target((8,), 13, ce_device, ignore_every=3)
    grads = {}
    for name, fn in (("torch", F.cross_entropy), ("saved", cross_entropy),
                     ("inplace", lambda *a, **k: cross_entropy(*a, inplace_backward=True, **k))):
        head.zero_grad()
        h.grad = None
        logits = head(h)
        version = logits._version
        loss = fn(logits, target, label_smoothing=0.1, reduction=reduction)
        if name == "inplace":
            assert logits._version > version  # the custom op declares the mutation: autograd sees it
        loss.backward(torch.linspace(0.5, 1.5, loss.numel(), device=ce_device).view(loss.shape))
        grads[name] = (h.grad.clone(), head.linear.weight.grad.clone())
    for name in ("saved", "inplace"):
        for actual, expected in zip(grads[name], grads["torch"]):
            assert_close(actual, expected, torch.float32)


def test_inplace_backward_overwrites_logits_with_the_gradient(ce_device):
    head = Head(4, 7, torch.float32).to(ce_device)
    logits = head(make_logits((5, 4), torch.float32, ce_device))
    target = make_target((5,), 7, ce_device)
    _, expected_grad = torch_expected(logits, target, reduction="sum")
    cross_entropy(logits, target, reduction="sum", inplace_backward=True)
    assert_close(logits.detach().double(), expected_grad, torch.float32)


def test_inplace_backward_raises_when_logits_are_saved_elsewhere(ce_device):
    head = Head(4, 7, torch.float32).to(ce_device)
    logits = head(make_logits((5, 4), torch.float32, ce_device))
    other = logits.sin()  # sin saves its input: it would now read the gradient
    loss = cross_entropy(logits, make_target((5,), 7, ce_device), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other.sum()).backward()


def test_inplace_backward_refuses_leaves_and_overlapping_logits(ce_device):
    target = make_target((5,), 7, ce_device)
    leaf = make_logits((5, 7), torch.float32, ce_device).requires_grad_()
    with pytest.raises(ValueError, match="inplace_backward=True .* a leaf tensor that requires grad"):
        cross_entropy(leaf, target, inplace_backward=True)
    # Views of such a leaf (a parameter) share its storage: torch refuses
    # in-place ops on them, and the gradient must not overwrite the leaf.
    before = leaf.detach().clone()
    wide = make_logits((5, 14), torch.float32, ce_device).requires_grad_()
    for view in (leaf[:], leaf.view(5, 7), leaf.view(35).view(5, 7), wide[:, ::2]):
        with pytest.raises(RuntimeError, match="view of a leaf Variable"):
            view.add_(0)  # torch's own rule, which the check follows
        with pytest.raises(ValueError, match="inplace_backward=True .* a view of a leaf tensor that requires grad"):
            cross_entropy(view, target, inplace_backward=True)
    assert torch.equal(leaf.detach(), before)
    # not refused: a view of a computed tensor, and any view under no_grad (nothing is written)
    (grad,) = torch.autograd.grad(cross_entropy((leaf * 1)[:], target, inplace_backward=True), leaf)
    assert_close(grad.double(), torch_expected(leaf, target)[1], torch.float32)
    with torch.no_grad():
        cross_entropy(leaf[:], target, inplace_backward=True)
    assert torch.equal(leaf.detach(), before)
    row = make_logits((1, 7), torch.float32, ce_device).requires_grad_()
    expanded = (row * 1).expand(5, 7)
    with pytest.raises(ValueError, match="share memory"):
        cross_entropy(expanded, target, inplace_backward=True)
    # not in place, expanded logits are read as they are
    loss, grad = ours(expanded.detach(), target)
    exp_loss, exp_grad = torch_expected(expanded.detach(), target)
    assert_close(loss.double(), exp_loss, torch.float32)
    assert_close(grad.double(), exp_grad, torch.float32)


# --------------------------------------------------------------------------
# Memory (effilayers.memory's activation-bytes meter)
# --------------------------------------------------------------------------


def _saved(fn, logits, *args, **kwargs):
    with memory.track_activations() as meter:
        loss = fn(logits, *args, **kwargs)
    return meter.storages(), loss


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_saved_memory(ce_cpu_device, dtype):
    rows, classes = 64, 1000
    head = Head(16, classes, torch.float32)
    h = make_logits((rows, 16), torch.float32, ce_cpu_device)
    target = make_target((rows,), classes, ce_cpu_device, ignore_every=7)
    logits_bytes = rows * classes * torch.finfo(dtype).bits // 8

    def logits_fn():
        return head(h).to(dtype)  # a non-leaf in `dtype`

    # default: exactly one logits-sized buffer, in the logits' dtype, not the logits
    logits = logits_fn()
    storages, loss = _saved(cross_entropy, logits, target)
    assert [(s.nbytes, s.dtype) for s in storages] == [(logits_bytes, dtype)]
    assert storages[0].shape == (rows, classes)

    # inplace_backward: the only saved storage is the logits' own
    logits = logits_fn()
    with memory.track_activations(exclude=[logits]) as meter:
        loss = cross_entropy(logits, target, inplace_backward=True)
    assert meter.bytes == 0
    logits = logits_fn()
    with memory.track_activations() as meter:
        loss = cross_entropy(logits, target, inplace_backward=True)
    assert meter.bytes == logits_bytes and len(meter.storages()) == 1
    assert meter.storages()[0].dtype == dtype
    del loss

    # torch: its log-softmax (same size) plus the target, the weight sum...
    logits = logits_fn()
    torch_storages, _ = _saved(F.cross_entropy, logits, target)
    torch_bytes = sum(s.nbytes for s in torch_storages)
    assert torch_bytes >= logits_bytes + target.numel() * 8


def test_saved_memory_under_autocast_vs_torch():
    # CPU autocast, like CUDA's, runs torch's cross_entropy in float32: it
    # saves a float32 log-softmax, twice the bf16 logits; this op saves a
    # bf16 gradient. Both return a float32 loss.
    rows, classes = 32, 500
    head = Head(16, classes, torch.float32)
    h = make_logits((rows, 16), torch.float32, "cpu")
    target = make_target((rows,), classes, "cpu")
    results = {}
    for name, fn in (("torch", F.cross_entropy), ("ours", cross_entropy)):
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with memory.track_activations(exclude=[head, h]) as meter:
                logits = head(h)
                saved_before = meter.bytes
                loss = fn(logits, target)
            results[name] = (meter.bytes - saved_before, loss.dtype, logits.dtype)
        loss.float().backward()
        results[name] += (head.linear.weight.grad.clone(),)
    bf16_bytes = rows * classes * 2
    assert results["torch"][2] == torch.bfloat16 and results["ours"][2] == torch.bfloat16
    assert results["torch"][1] == torch.float32 and results["ours"][1] == torch.float32
    assert results["ours"][0] == bf16_bytes
    assert results["torch"][0] >= 2 * bf16_bytes
    torch.testing.assert_close(results["ours"][3], results["torch"][3], rtol=2e-2, atol=2e-2)


def test_autocast_loss_dtype_follows_torch():
    # CPU autocast runs F.cross_entropy in float32. A sum over 8000 rows of
    # ~11 each is ~9e4: beyond fp16 (65504), so the loss must not be rounded
    # to the logits' dtype (it was: inf).
    logits = make_logits((8000, 1000), torch.float16, "cpu", seed=5)
    target = make_target((8000,), 1000, "cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        expected = F.cross_entropy(logits, target, reduction="sum")
        loss = cross_entropy(logits, target, reduction="sum")
    assert loss.dtype == expected.dtype == torch.float32
    assert 65504 < float(loss) < math.inf
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("inplace", [False, True], ids=["saved", "inplace"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_gradient_keeps_logits_dtype(ce_cpu_device, reduction, inplace):
    # The float32 loss's gradient (per row for "none") scales the saved bf16
    # gradient: the logits get a bf16 gradient, as from torch under autocast.
    head = Head(8, 33, torch.float32)
    h = make_logits((12, 8), torch.float32, ce_cpu_device)
    target = make_target((12,), 33, ce_cpu_device, ignore_every=5)
    grads = {}
    for name, fn in (("torch", F.cross_entropy), ("ours", partial(cross_entropy, inplace_backward=inplace))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(h)
            loss = fn(logits, target, reduction=reduction, label_smoothing=0.1)
        assert loss.dtype == torch.float32
        grad_output = torch.linspace(0.5, 2.0, loss.numel()).view(loss.shape)
        # retain_graph=True takes the out-of-place multiply, the last backward the in-place one
        (retained,) = torch.autograd.grad(loss, logits, grad_output, retain_graph=True)
        (grad,) = torch.autograd.grad(loss, logits, grad_output)
        assert grad.dtype == retained.dtype == torch.bfloat16
        assert torch.equal(retained, grad)
        grads[name] = grad.double()
    torch.testing.assert_close(grads["ours"], grads["torch"], rtol=2e-2, atol=1e-4)


def test_autocast_cuda_loss_dtype_follows_torch():
    # CUDA autocast (fake CUDA tensors: torch's own AutocastCUDA kernels, no
    # GPU needed) runs F.cross_entropy's log_softmax and nll_loss in float32.
    for autocast_dtype in (torch.float16, torch.bfloat16):
        with fake_cuda_autocast(autocast_dtype):
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                logits = torch.empty(6, 11, dtype=dtype, device="cuda")
                target = torch.zeros(6, dtype=torch.int64, device="cuda")
                for reduction in ("mean", "sum", "none"):
                    expected = F.cross_entropy(logits, target, reduction=reduction)
                    for inplace in (False, True):
                        loss = cross_entropy(logits, target, reduction=reduction, inplace_backward=inplace)
                        assert loss.dtype == expected.dtype, (autocast_dtype, dtype, reduction)
                        assert loss.shape == expected.shape


def test_offsets_past_2_31_elements(ce_cpu_or_interpreter_device, ce_small_triton_block):
    # Logits rows 2**30 + 1 elements apart in one uninitialised storage: the
    # third row starts past element 2**31 (an int32 row offset reads the wrong
    # place), yet only the rows' pages become resident.
    device = ce_cpu_or_interpreter_device
    values = make_logits((3, 37), torch.float16, device, seed=6)
    target = torch.tensor([0, 36, 17], device=device)
    exp_loss, exp_grad = torch_expected(values, target, reduction="none", label_smoothing=0.1)
    kernel = effilayers.backends.kernel(OP, device)

    def run(rows=far_apart_rows):
        logits = rows(values).requires_grad_()
        loss = cross_entropy(logits, target, reduction="none", label_smoothing=0.1)
        (grad,) = torch.autograd.grad(loss, logits, torch.ones_like(loss))
        assert_close(loss.double(), exp_loss, torch.float16)
        assert_close(grad.double(), exp_grad, torch.float16)
        # The row kernel writing the gradient over the far-apart logits
        # themselves (inplace_backward's path): int64 offsets for stores too.
        in_place = rows(values)
        as_rows = in_place.unsqueeze(-1)  # (N, C, 1)
        loss_rows = kernel(as_rows, target, None, as_rows, torch.ones(1, device=device), -100, 0.1)
        assert_close(loss_rows.double(), exp_loss, torch.float16)
        assert_close(in_place.double(), exp_grad, torch.float16)

    run(rows=torch.clone)  # the same calls on small tensors first: lazy initialisation is not counted
    assert peak_rss_growth(run) < 64 * 2**20  # GiBs of address space, a few pages resident
