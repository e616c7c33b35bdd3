"""linear_cross_entropy with the vocabulary split into chunks (an online
log-sum-exp over them), against torch in float64, on every backend of the
two chunk kernels (C++, Triton under the interpreter, the reference); the
kernels themselves on poisoned memory. The chunk budget is made small so
that small shapes take that path; each test checks it does."""

from __future__ import annotations

import math

import pytest
import torch

import effilayers
from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import op
from effilayers.ops.linear_cross_entropy.reference import linear_cross_entropy_reference

from .conftest import backend_params, forced_backend, poison_cpp_allocations
from .linear_cross_entropy_cases import LargestTemporary, assert_same, fused, make_positive, make_problem, unfused

f64 = torch.float64


def _vocab_bytes(dtype=f64, wide_copy=False):
    acc = f64 if dtype == f64 else torch.float32
    return op.vocab_chunk_bytes(dtype, acc, wide_copy)


def _split_vocabulary(monkeypatch, tokens, classes, pieces):
    """Shrink the budget so ``tokens`` float64 tokens take vocabulary chunks
    of ``ceil(classes / pieces)`` classes (the last one shorter); ``pieces``
    over 1, so whole rows overflow it (a chunk holds only its logits)."""
    step = min(tokens, op.MIN_CHUNK_TOKENS)
    classes_per_chunk = math.ceil(classes / pieces)
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", step * _vocab_bytes() * classes_per_chunk)
    assert op.chunk_shape(tokens, classes, 8, _vocab_bytes(), 0, None) == (step, classes_per_chunk)


@pytest.fixture(params=backend_params("cross_entropy_chunk_stats_"))
def vocab_device(request):
    """Both chunk kernels (registered together, with the same backends) forced to one backend; yields the device."""
    yield from forced_backend(request, "cross_entropy_chunk_stats_")


def test_default_shapes_split_only_wide_vocabularies():
    fp32 = _vocab_bytes(torch.float32)  # the logits alone
    # 4096 tokens x 32K classes in float32: 64-token chunks of whole rows (8 MiB).
    assert op.chunk_shape(4096, 32768, 4, fp32, 4096 * 128 * 4, None) == (64, 32768)
    # 262144 classes: 8 tokens would fit; 32 tokens by a quarter of the vocabulary instead.
    assert op.chunk_shape(4096, 262144, 4, fp32, 4096 * 128 * 4, None) == (32, 65536)
    # Few tokens: whole rows while they fit.
    assert op.chunk_shape(3, 262144, 8, 8, 3 * 4 * 8, None) == (3, 262144)
    # An explicit chunk_size keeps its tokens; the vocabulary is split when they overflow.
    assert op.chunk_shape(4096, 262144, 4, fp32, 0, 64) == (64, op.CHUNK_LOGITS_BYTES // (64 * fp32))
    assert op.chunk_shape(4096, 1000, 4, fp32, 0, 64) == (64, 1000)
    # bf16 on CPU with a gradient: a float32 copy of each chunk's gradient for the matmuls.
    assert _vocab_bytes(torch.bfloat16, wide_copy=True) == 6 and _vocab_bytes(torch.float32) == 4


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunk_kernels_match_torch_float64(vocab_device, reduction):
    # 5 tokens with leading batch dims, 13 classes in chunks of 3 (the last one short).
    x, w, b, target = make_problem((1, 5), 4, 13, f64, vocab_device, seed=3, ignore_every=4)
    class_weight = make_positive(13, vocab_device, seed=1)
    grad_output = make_positive((1, 5), vocab_device, seed=9) if reduction == "none" else None
    with pytest.MonkeyPatch.context() as patch:
        _split_vocabulary(patch, 5, 13, 5)
        cases = [(b, target, dict()), (b, target, dict(label_smoothing=0.1)),
                 (b, target, dict(class_weight=class_weight, label_smoothing=0.2)),
                 (None, torch.where(target == -100, 3, target), dict(class_weight=class_weight, ignore_index=3))]
        for bias, t, options in cases:
            actual = fused(x, w, bias, t, grad_output, reduction=reduction, **options)
            assert_same(actual, unfused(x, w, bias, t, grad_output, reduction=reduction, **options), f64)
            if vocab_device.type == "cpu":  # the torch-op form of the same chunks
                with effilayers.use_backend("reference"):
                    assert_same(actual, fused(x, w, bias, t, grad_output, reduction=reduction, **options), f64)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_probability_kernels_match_torch_float64(vocab_device, ce_small_triton_block, reduction):
    """Probability targets through the two soft chunk kernels, in whole rows
    (two Triton blocks of 8 classes) and in vocabulary chunks, with smoothing
    and class weights; targets in float32 (another dtype than the logits)
    and with classes not contiguous (read where they lie)."""
    x, w, b, _ = make_problem((1, 5), 4, 13, f64, vocab_device, seed=4)
    probs = torch.softmax(make_positive((1, 5, 13), vocab_device, seed=2) * 4, dim=-1)
    class_weight = make_positive(13, vocab_device, seed=1)
    grad_output = make_positive((1, 5), vocab_device, seed=9) if reduction == "none" else None
    strided = probs.transpose(0, 2).contiguous().transpose(0, 2)
    assert strided.stride(-1) != 1
    cases = [(b, probs, dict()), (b, probs, dict(label_smoothing=0.1)),
             (None, strided, dict(class_weight=class_weight, label_smoothing=0.2)),
             (b, probs.float(), dict(class_weight=class_weight))]
    for pieces in (None, 5):
        with pytest.MonkeyPatch.context() as patch:
            if pieces:
                _split_vocabulary(patch, 5, 13, pieces)
            for bias, target, options in cases:
                actual = fused(x, w, bias, target, grad_output, reduction=reduction, **options)
                assert_same(actual, unfused(x, w, bias, target, grad_output, reduction=reduction, **options), f64)


@pytest.mark.parametrize("classes", [7, 50257, 262144])
def test_vocabulary_chunks_match_torch_float64(monkeypatch, classes):
    # 5 tokens (odd) with leading batch dims on the small vocabulary.
    shape = (5,) if classes > 7 else (1, 5)
    x, w, b, target = make_problem(shape, 4, classes, torch.float64, seed=classes, ignore_every=4)
    _split_vocabulary(monkeypatch, 5, classes, 7 if classes == 7 else 5)
    class_weight = make_positive(classes, seed=1)
    grad_output = make_positive(shape, seed=9)
    for reduction in ("mean", "sum", "none") if classes == 7 else ("mean", "none"):
        go = grad_output if reduction == "none" else None
        smoothed = dict(label_smoothing=0.1)
        for options in (smoothed, dict(class_weight=class_weight, label_smoothing=0.2))[classes > 7:]:
            assert_same(fused(x, w, b, target, go, reduction=reduction, **options),
                        unfused(x, w, b, target, go, reduction=reduction, **options), torch.float64)
    target = torch.where(target == -100, 3 % classes, target)
    assert_same(fused(x, w, None, target, ignore_index=3), unfused(x, w, None, target, ignore_index=3),
                torch.float64)


def test_chunk_kernels_on_poisoned_memory(vocab_device, request):
    """Each kernel writes what it must and nothing else, checked against the
    formulas written out: the chunk is a view with NaN-filled gaps after its
    rows, an ignored row's logits and the statistics a chunk must write are
    NaN beforehand, and C++ allocations start as NaN."""
    poison_cpp_allocations(request)
    generator = torch.Generator().manual_seed(0)
    rows, width, offset, nan = 5, 9, 4, math.nan
    # targets: in the chunk, ignored, its last class, its first class, another chunk
    target = torch.tensor([6, -100, 12, 4, 1], device=vocab_device)
    here = torch.tensor([True, False, True, True, False])
    z = torch.randn(rows, width, generator=generator, dtype=f64) * 3
    storage = torch.full((rows, width + 3), nan, dtype=f64, device=vocab_device)
    chunk = storage[:, :width]
    chunk.copy_(z)
    chunk[1] = nan
    weight = make_positive(width, vocab_device)
    before = torch.stack([torch.randn(rows, generator=generator, dtype=f64), make_positive(rows, seed=2),
                          torch.where(here, nan, 7.0), torch.randn(rows, generator=generator, dtype=f64)])
    stats = before.clone().to(vocab_device)
    torch.ops.effilayers.cross_entropy_chunk_stats_(chunk, target, weight, stats, offset, -100, True)
    new_max = torch.maximum(before[0], z.amax(1))
    sum_exp = before[1] * torch.exp(before[0] - new_max) + torch.exp(z - new_max[:, None]).sum(1)
    target_logit = z.gather(1, (target.cpu() - offset).clamp(0, width - 1)[:, None])[:, 0]
    expected = torch.stack([new_max, sum_exp, torch.where(here, target_logit, 7.0), before[3] + z @ weight.cpu()])
    expected[:, 1] = before[:, 1]  # the ignored row is left alone, NaN included
    torch.testing.assert_close(stats.cpu(), expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.isnan(storage[:, width:]).all()

    row_terms = torch.stack([z.logsumexp(1) + 0.5, make_positive(rows, seed=3), make_positive(rows, seed=4),
                             make_positive(rows, seed=6)]).to(vocab_device)
    class_term = make_positive(width, vocab_device, seed=7) * 0.01
    torch.ops.effilayers.cross_entropy_chunk_grad_(chunk, target, class_term, row_terms, offset, -100)
    lse, coef, target_coef, scale = row_terms.cpu()[:, :, None]
    onehot = torch.arange(width)[None, :] == (target.cpu() - offset)[:, None]
    want = scale * (coef * torch.exp(z - lse) - class_term.cpu() - target_coef * onehot)
    want[1] = 0.0
    torch.testing.assert_close(chunk.cpu(), want, rtol=1e-12, atol=1e-12)
    assert torch.isnan(storage[:, width:]).all()


def test_probability_rows_wider_than_a_cpp_piece(vocab_device):
    """2500 classes: the C++ kernels walk a row in pieces of 2048 (each
    piece's class weights and probabilities at its own offset), in whole
    rows and in vocabulary chunks of 2300 classes."""
    x, w, b, _ = make_problem((3,), 4, 2500, f64, vocab_device, seed=6)
    probs = torch.softmax(make_positive((3, 2500), vocab_device, seed=2) * 8, dim=-1)
    options = dict(class_weight=make_positive(2500, vocab_device, seed=1), label_smoothing=0.1)
    with pytest.MonkeyPatch.context() as patch:
        for pieces in (None, 2):
            if pieces:
                _split_vocabulary(patch, 3, 2500, pieces)
            assert_same(fused(x, w, b, probs, **options), unfused(x, w, b, probs, **options), f64)


def test_soft_chunk_kernels_refuse_bad_arguments():
    """The C++ kernels' own checks, each naming what is wrong."""
    chunk = torch.randn(3, 5, dtype=f64)
    probs = torch.softmax(torch.randn(3, 5, dtype=f64), 1)
    stats = torch.zeros(4, 3, dtype=f64)
    with effilayers.use_backend("cpp"):
        soft_stats = torch.ops.effilayers.cross_entropy_soft_chunk_stats_
        with pytest.raises(ValueError, match=r"probs must have the logits' shape \[3, 5\], got \[3, 4\]"):
            soft_stats(chunk, probs[:, :4], None, None, stats)
        with pytest.raises(TypeError, match="probs must be float16, bfloat16, float32 or float64, got Long"):
            soft_stats(chunk, probs.long(), None, None, stats)
        with pytest.raises(ValueError, match="prob_weight must be a contiguous Double tensor of 5 classes"):
            soft_stats(chunk, probs, torch.ones(5), None, stats)
        with pytest.raises(ValueError, match=r"row_terms must be a contiguous \(3, 3\) Double tensor"):
            torch.ops.effilayers.cross_entropy_soft_chunk_grad_(chunk, probs, None, None, stats)


def test_probability_kernels_on_poisoned_memory(vocab_device, request):
    """The soft chunk kernels against their formulas written out: the chunk
    and its float16 probabilities are views with NaN-filled gaps, the
    statistics carry earlier chunks' values, and C++ allocations start as NaN."""
    poison_cpp_allocations(request)
    generator = torch.Generator().manual_seed(1)
    rows, width, nan = 4, 9, math.nan
    z = torch.randn(rows, width, generator=generator, dtype=f64) * 3
    storage = torch.full((rows, width + 2), nan, dtype=f64, device=vocab_device)
    chunk = storage[:, :width]
    chunk.copy_(z)
    probs_storage = torch.full((rows, width + 3), nan, dtype=torch.float16, device=vocab_device)
    probs = probs_storage[:, :width]
    probs.copy_(torch.softmax(torch.randn(rows, width, generator=generator, dtype=f64), 1))
    p = probs.cpu().double()
    prob_weight, class_term = make_positive(width, vocab_device, seed=3), make_positive(width, vocab_device, seed=4)
    q = p * prob_weight.cpu() + class_term.cpu()
    before = torch.stack([torch.randn(rows, generator=generator, dtype=f64), make_positive(rows, seed=2),
                          torch.randn(rows, generator=generator, dtype=f64), make_positive(rows, seed=6)])
    stats = before.clone().to(vocab_device)
    torch.ops.effilayers.cross_entropy_soft_chunk_stats_(chunk, probs, prob_weight, class_term, stats)
    new_max = torch.maximum(before[0], z.amax(1))
    sum_exp = before[1] * torch.exp(before[0] - new_max) + torch.exp(z - new_max[:, None]).sum(1)
    expected = torch.stack([new_max, sum_exp, before[2] + (q * z).sum(1), before[3] + q.sum(1)])
    torch.testing.assert_close(stats.cpu(), expected, rtol=1e-12, atol=1e-12)

    row_terms = torch.stack([z.logsumexp(1) + 0.5, make_positive(rows, seed=7), make_positive(rows, seed=8)])
    torch.ops.effilayers.cross_entropy_soft_chunk_grad_(chunk, probs, None, None, row_terms.to(vocab_device))
    lse, mass, scale = row_terms[:, :, None]
    torch.testing.assert_close(chunk.cpu(), scale * (mass * torch.exp(z - lse) - p), rtol=1e-12, atol=1e-12)
    assert torch.isnan(storage[:, width:]).all() and torch.isnan(probs_storage[:, width:]).all()


def test_vocabulary_chunks_with_token_weights_and_probabilities(monkeypatch):
    x, w, b, target = make_problem((2, 3), 4, 11, torch.float64, ignore_every=4)
    _split_vocabulary(monkeypatch, 6, 11, 8)
    token_weight = make_positive((2, 3), seed=3)
    class_weight = make_positive(11, seed=4)
    for reduction in ("mean", "none"):
        options = dict(reduction=reduction, label_smoothing=0.1, class_weight=class_weight)
        got = linear_cross_entropy(x, w, target, b, token_weight=token_weight, **options)
        want = linear_cross_entropy_reference(x, w, target, b, token_weight=token_weight, **options)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    probs = torch.softmax(make_positive((2, 3, 11), seed=2) * 3, dim=-1)
    for reduction in ("mean", "none"):
        options = dict(reduction=reduction, label_smoothing=0.1, class_weight=class_weight)
        go = make_positive((2, 3), seed=6) if reduction == "none" else None
        assert_same(fused(x, w, b, probs, go, **options), unfused(x, w, b, probs, go, **options), torch.float64)


def test_vocabulary_chunks_gradcheck(vocab_device, monkeypatch):
    x, w, b, target = make_problem((3,), 3, 7, f64, vocab_device, ignore_every=3)
    _split_vocabulary(monkeypatch, 3, 7, 2)
    token_weight = make_positive((3,), vocab_device, seed=8)
    class_weight = make_positive(7, vocab_device)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, target, b, label_smoothing=0.1, reduction="none",
                                    class_weight=class_weight, token_weight=token_weight)

    assert torch.autograd.gradcheck(fn, tuple(t.clone().requires_grad_() for t in (x, w, b)), eps=1e-6, atol=1e-7)


def test_all_ignored_mean_is_nan_with_vocabulary_chunks(monkeypatch):
    x, w, b, _ = make_problem((4,), 3, 9, torch.float64)
    _split_vocabulary(monkeypatch, 4, 9, 5)
    target = torch.full((4,), -100)
    assert_same(fused(x, w, b, target), unfused(x, w, b, target), torch.float64)


def test_temporaries_do_not_grow_with_the_vocabulary(monkeypatch):
    # 32 tokens, float32, a 64 KiB budget: the tokens by 512 classes at a
    # time (the logits are all a chunk holds); the largest temporary is the
    # same for 2048 and 8192 classes (whole rows would be 256 KiB and 1 MiB)
    # and within the budget.
    # Probability targets (the caller's table, read where it lies: also
    # with the classes not contiguous) take no chunk-sized temporary more.
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", 64 << 10)
    for kind in ("class indices", "probabilities", "transposed probabilities"):
        largest = []
        for classes in (2048, 8192):
            x, w, b, target = make_problem((32,), 8, classes, torch.float32, ignore_every=5)
            if kind != "class indices":
                target = torch.softmax(make_positive((32, classes), seed=2, dtype=torch.float32), dim=1)
                if kind.startswith("transposed"):
                    target = target.t().contiguous().t()
            assert op.chunk_shape(32, classes, 4, _vocab_bytes(torch.float32), x.numel() * 4, None) == (32, 512)
            scale = torch.ones(1)
            meter = LargestTemporary({(classes, 8), (classes,)})
            with meter:
                op._chunks(x, w, target, b, None, -100, 0.1, None, torch.float32, scale, None, (True, True, True),
                           keep_rows=True)
            largest.append(meter.largest)
        assert largest[0] == largest[1] <= 64 << 10, (kind, largest)


def _low_precision_case(monkeypatch, dtype, device):
    # 37 tokens (a 32-token chunk and a short one), 300 classes in 60-class
    # chunks: the same bound as whole rows (tests/test_linear_cross_entropy.py).
    x, w, b, target = make_problem((37,), 24, 300, dtype, device, ignore_every=5)
    itemsize = 4 + (4 if dtype != torch.float32 else 0)
    vocab_itemsize = _vocab_bytes(dtype, wide_copy=dtype != torch.float32)
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", 32 * vocab_itemsize * 60)
    assert op.chunk_shape(37, 300, itemsize, vocab_itemsize, x.numel() * x.element_size(), None) == (32, 60)
    grad_output = make_positive((37,), device, seed=4, dtype=dtype)
    options = dict(label_smoothing=0.05, reduction="none")
    probs = torch.softmax(make_positive((37, 300), device, seed=2) * 6, dim=-1).to(dtype)
    for t in (target, probs):
        loss, grads = actual = fused(x, w, b, t, grad_output, **options)
        assert loss.dtype == dtype and all(g.dtype == dtype for g in grads)
        assert_same(actual, unfused(x, w, b, t, grad_output, **options), dtype, grad_tier="linear_cross_entropy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_vocabulary_chunks_within_stated_bound(monkeypatch, dtype):
    _low_precision_case(monkeypatch, dtype, "cpu")


def test_float16_vocabulary_chunks_on_every_backend(vocab_device, monkeypatch):
    # bfloat16 has no arithmetic in the Triton interpreter; float16 rounds the logits and their gradient alike.
    _low_precision_case(monkeypatch, torch.float16, vocab_device)


def test_chunk_ops_opcheck():
    """The in-place chunk ops: schemas, fake kernels and mutation
    annotations agree with what the kernels do (torch.library.opcheck)."""
    generator = torch.Generator().manual_seed(1)
    chunk = torch.randn(3, 5, generator=generator, dtype=f64)
    target = torch.tensor([1, -100, 7])
    stats = torch.stack([torch.full((3,), -math.inf, dtype=f64)] + [torch.zeros(3, dtype=f64)] * 3)
    torch.library.opcheck(torch.ops.effilayers.cross_entropy_chunk_stats_.default,
                          (chunk, target, make_positive(5), stats, 0, -100, True))
    row_terms = torch.stack([chunk.logsumexp(1), make_positive(3), make_positive(3, seed=2), make_positive(3, seed=3)])
    torch.library.opcheck(torch.ops.effilayers.cross_entropy_chunk_grad_.default,
                          (chunk.clone(), target, None, row_terms, 0, -100))
    probs = torch.softmax(torch.randn(3, 5, generator=generator, dtype=f64), 1)
    torch.library.opcheck(torch.ops.effilayers.cross_entropy_soft_chunk_stats_.default,
                          (chunk, probs, make_positive(5), None, stats.clone()))
    torch.library.opcheck(torch.ops.effilayers.cross_entropy_soft_chunk_grad_.default,
                          (chunk.clone(), probs.float(), None, make_positive(5, seed=4), row_terms[:3].clone()))
