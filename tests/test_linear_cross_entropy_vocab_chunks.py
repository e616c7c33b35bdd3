"""linear_cross_entropy with the vocabulary split into chunks (an online
log-sum-exp over them), against torch in float64. The chunk budget is made
small so that small shapes take that path; each test checks it does."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import op
from effilayers.ops.linear_cross_entropy.reference import linear_cross_entropy_reference

from .linear_cross_entropy_cases import assert_same, fused, make_positive, make_problem, unfused

# float64 bytes per logit of a vocabulary chunk: the logits and three float64 temporaries.
_VOCAB_BYTES = 8 * (1 + op.VOCAB_TEMPORARIES)


def _split_vocabulary(monkeypatch, tokens, classes, pieces):
    """Shrink the budget so ``tokens`` float64 tokens take vocabulary chunks
    of ``ceil(classes / pieces)`` classes (the last one shorter). Whole rows
    must overflow it: ``pieces`` over 4 (a vocabulary chunk's 4 float64s)."""
    step = min(tokens, op.MIN_CHUNK_TOKENS)
    classes_per_chunk = math.ceil(classes / pieces)
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", step * _VOCAB_BYTES * classes_per_chunk)
    assert op.chunk_shape(tokens, classes, 8, _VOCAB_BYTES, 0, None) == (step, classes_per_chunk)


def test_default_shapes_split_only_wide_vocabularies():
    # 4096 tokens x 32K classes in float32: 128-token chunks of whole rows.
    assert op.chunk_shape(4096, 32768, 4, 16, 4096 * 128 * 4, None) == (128, 32768)
    # 262144 classes: 16 tokens would fit; 32 tokens by half the vocabulary instead.
    assert op.chunk_shape(4096, 262144, 4, 16, 4096 * 128 * 4, None) == (32, op.CHUNK_LOGITS_BYTES // (32 * 16))
    # Few tokens: whole rows while they fit.
    assert op.chunk_shape(5, 262144, 8, 32, 5 * 4 * 8, None) == (5, 262144)
    # An explicit chunk_size keeps its tokens; the vocabulary is split when they overflow.
    assert op.chunk_shape(4096, 262144, 4, 16, 0, 64) == (64, op.CHUNK_LOGITS_BYTES // (64 * 16))
    assert op.chunk_shape(4096, 1000, 4, 16, 0, 64) == (64, 1000)


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


def test_vocabulary_chunks_gradcheck(monkeypatch):
    x, w, b, target = make_problem((3,), 3, 7, torch.float64, ignore_every=3)
    _split_vocabulary(monkeypatch, 3, 7, 7)
    token_weight = make_positive((3,), seed=8)
    class_weight = make_positive(7)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, target, b, label_smoothing=0.1, reduction="none",
                                    class_weight=class_weight, token_weight=token_weight)

    assert torch.autograd.gradcheck(fn, tuple(t.clone().requires_grad_() for t in (x, w, b)), eps=1e-6, atol=1e-7)


def test_all_ignored_mean_is_nan_with_vocabulary_chunks(monkeypatch):
    x, w, b, _ = make_problem((4,), 3, 9, torch.float64)
    _split_vocabulary(monkeypatch, 4, 9, 5)
    target = torch.full((4,), -100)
    assert_same(fused(x, w, b, target), unfused(x, w, b, target), torch.float64)


class _LargestTemporary(TorchDispatchMode):
    """The bytes of the largest tensor any op returns, leaving out the
    weight-shaped gradient accumulators (which grow with the vocabulary
    whatever the chunks)."""

    def __init__(self, weight_shapes):
        super().__init__()
        self.weight_shapes, self.largest = weight_shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.weight_shapes:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_temporaries_do_not_grow_with_the_vocabulary(monkeypatch):
    # 32 tokens, float32, a 64 KiB budget: the tokens by 128 classes at a
    # time; the largest temporary is the same for 2048 and 8192 classes
    # (whole rows would be 256 KiB and 1 MiB) and within the budget.
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", 64 << 10)
    largest = []
    for classes in (2048, 8192):
        x, w, b, target = make_problem((32,), 8, classes, torch.float32, ignore_every=5)
        assert op.chunk_shape(32, classes, 4, 16, x.numel() * 4, None) == (32, 128)
        scale = torch.ones(1)
        meter = _LargestTemporary({(classes, 8), (classes,)})
        with meter:
            op._chunks(x, w, target, b, None, -100, 0.1, None, torch.float32, scale, None, (True, True, True),
                       keep_rows=True)
        largest.append(meter.largest)
    assert largest[0] == largest[1] <= 64 << 10, largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_vocabulary_chunks_within_stated_bound(monkeypatch, dtype):
    # 37 tokens (a 32-token chunk and a short one), 300 classes in 60-class
    # chunks: the same bound as whole rows (tests/test_linear_cross_entropy.py).
    x, w, b, target = make_problem((37,), 24, 300, dtype, ignore_every=5)
    itemsize = 4 + (4 if dtype == torch.bfloat16 else 0)
    vocab_itemsize = x.element_size() + 4 * op.VOCAB_TEMPORARIES
    monkeypatch.setattr(op, "CHUNK_LOGITS_BYTES", 32 * vocab_itemsize * 60)
    assert op.chunk_shape(37, 300, itemsize, vocab_itemsize, x.numel() * x.element_size(), None) == (32, 60)
    grad_output = make_positive((37,), seed=4, dtype=dtype)
    options = dict(label_smoothing=0.05, reduction="none")
    loss, grads = actual = fused(x, w, b, target, grad_output, **options)
    assert loss.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert_same(actual, unfused(x, w, b, target, grad_output, **options), dtype, grad_tier="linear_cross_entropy")
