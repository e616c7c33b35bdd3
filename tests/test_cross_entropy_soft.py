"""cross_entropy against class-probability targets (soft labels, mixup,
distillation) with label smoothing and class weights: torch's values and
gradients, in float64 to the rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from effilayers.functional import cross_entropy
from effilayers.nn import CrossEntropyLoss

from .cross_entropy_cases import make_logits, make_weight


def make_probabilities(shape, seed=5, class_dim=1):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
    return torch.softmax(scores, class_dim)


def mixup(shape, classes, seed=6):
    """Two one-hot targets mixed with a per-row lambda, as mixup makes them."""
    generator = torch.Generator().manual_seed(seed)
    first, second = (F.one_hot(torch.randint(0, classes, shape[:1], generator=generator), classes).double()
                     for _ in range(2))
    lam = torch.rand(shape[0], 1, generator=generator, dtype=torch.float64)
    return lam * first + (1 - lam) * second


@pytest.mark.parametrize("shape", [(6, 7), (3, 5, 4), (7,)], ids=["2d", "spatial", "unbatched"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_probability_targets_match_torch_in_float64(shape, label_smoothing, reduction, weighted):
    class_dim = 0 if len(shape) == 1 else 1
    classes = shape[class_dim]
    logits = make_logits(shape, torch.float64, "cpu").requires_grad_()
    target = make_probabilities(shape, class_dim=class_dim).requires_grad_()
    weight = make_weight(classes, "cpu").double().requires_grad_() if weighted else None
    reference = [t.detach().clone().requires_grad_() if t is not None else None for t in (logits, target, weight)]
    kwargs = dict(label_smoothing=label_smoothing, reduction=reduction)
    actual = cross_entropy(logits, target, weight, **kwargs)
    expected = F.cross_entropy(reference[0], reference[1], reference[2], **kwargs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-13)
    upstream = torch.linspace(0.5, 1.5, actual.numel(), dtype=torch.float64).reshape(actual.shape)
    actual.backward(upstream)
    expected.backward(upstream)
    for got, want in zip((logits, target, weight), reference):
        if got is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-13)


def test_mixup_targets_with_label_smoothing_gradcheck():
    logits = make_logits((5, 6), torch.float64, "cpu").requires_grad_()
    target = mixup((5, 6), 6)
    weight = make_weight(6, "cpu").double()
    torch.autograd.gradcheck(lambda x: cross_entropy(x, target, weight, label_smoothing=0.2), (logits,))
    expected = F.cross_entropy(logits, target, weight, label_smoothing=0.2)
    torch.testing.assert_close(cross_entropy(logits, target, weight, label_smoothing=0.2), expected,
                               rtol=1e-13, atol=1e-13)


def test_one_hot_probabilities_equal_class_indices_with_smoothing():
    # A one-hot probability target is the class-index loss, smoothing included.
    logits = make_logits((8, 9), torch.float64, "cpu")
    indices = torch.arange(8) % 9
    one_hot = F.one_hot(indices, 9).double()
    torch.testing.assert_close(cross_entropy(logits, one_hot, label_smoothing=0.3),
                               cross_entropy(logits, indices, label_smoothing=0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probability_targets_in_low_precision_and_the_module(dtype):
    logits = make_logits((4, 10), dtype, "cpu")
    target = make_probabilities((4, 10)).to(dtype)
    module = CrossEntropyLoss(label_smoothing=0.1)
    actual = module(logits, target)
    expected = F.cross_entropy(logits, target, label_smoothing=0.1)
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_empty_probability_batch_gives_torchs_nan_mean():
    logits, target = torch.empty(0, 5, dtype=torch.float64), torch.empty(0, 5, dtype=torch.float64)
    assert torch.isnan(cross_entropy(logits, target)) and torch.isnan(F.cross_entropy(logits, target))
    assert cross_entropy(logits, target, reduction="sum").item() == 0.0


def test_probability_targets_under_cpu_autocast_follow_torch():
    logits = make_logits((4, 10), torch.bfloat16, "cpu")
    target = make_probabilities((4, 10)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = cross_entropy(logits, target, label_smoothing=0.1)
        expected = F.cross_entropy(logits, target, label_smoothing=0.1)
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
