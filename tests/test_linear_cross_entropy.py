"""linear_cross_entropy: values and gradients (input, weight, bias) against
torch's unfused F.linear + F.cross_entropy, on every backend of the
cross_entropy row kernel it runs per chunk (C++, Triton under the
interpreter, the reference): float64 to 1e-10 for every reduction, ignored
rows, label smoothing, class weights and probability targets; the token-weight
mean against an explicit formula; vocabularies of 1 to 262144 classes;
fp16/bf16 within the stated bound; float32 accumulation over many chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import effilayers
from effilayers.functional import linear_cross_entropy
from effilayers.ops.linear_cross_entropy import CHUNK_LOGITS_BYTES, chunk_tokens

from .accuracy import assert_close
from .linear_cross_entropy_cases import assert_same, fused, grad_output_for, make_positive, make_problem, unfused

REDUCTIONS = ["mean", "sum", "none"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("class_weighted", [False, True], ids=["unweighted", "class_weighted"])
def test_matches_torch_float64(ce_device, ce_small_triton_block, reduction, label_smoothing, class_weighted):
    # Leading batch dims (3, 7): 21 tokens in chunks of 4 (the last one short), 13 classes.
    x, w, b, target = make_problem((3, 7), 6, 13, torch.float64, ce_device, ignore_every=4)
    class_weight = make_positive(13, ce_device) if class_weighted else None
    grad_output = grad_output_for((3, 7), reduction, ce_device)
    options = dict(ignore_index=-100, label_smoothing=label_smoothing, reduction=reduction)
    expected = unfused(x, w, b, target, grad_output, class_weight=class_weight, **options)
    actual = fused(x, w, b, target, grad_output, class_weight=class_weight, chunk_size=4, **options)
    assert_same(actual, expected, torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_without_bias_and_custom_ignore_index(ce_device, reduction):
    x, w, _, target = make_problem((11,), 5, 9, torch.float64, ce_device, bias=False, ignore_every=3,
                                   ignore_index=2)
    grad_output = grad_output_for((11,), reduction, ce_device)
    expected = unfused(x, w, None, target, grad_output, ignore_index=2, reduction=reduction)
    actual = fused(x, w, None, target, grad_output, ignore_index=2, reduction=reduction, chunk_size=3)
    assert_same(actual, expected, torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("class_weighted", [False, True], ids=["unweighted", "class_weighted"])
def test_probability_targets_float64(reduction, label_smoothing, class_weighted):
    x, w, b, _ = make_problem((2, 5), 6, 11, torch.float64)
    target = torch.softmax(make_positive((2, 5, 11), seed=3) * 4, dim=-1)
    class_weight = make_positive(11) if class_weighted else None
    grad_output = grad_output_for((2, 5), reduction, "cpu")
    options = dict(label_smoothing=label_smoothing, reduction=reduction)
    expected = unfused(x, w, b, target, grad_output, class_weight=class_weight, **options)
    actual = fused(x, w, b, target, grad_output, class_weight=class_weight, chunk_size=3, **options)
    assert_same(actual, expected, torch.float64)


def _explicit_formula(x, w, b, target, class_weight, token_weight, ignore_index, eps, reduction):
    """The package docstring's definition, written out in float64 without
    F.cross_entropy: l_i = (1 - eps) c_t (lse - z_t) + eps / C sum_k c_k (lse - z_k),
    none = s_i l_i, sum = sum s_i l_i, mean = sum s_i l_i / sum s_i c_{t_i} [t_i != ignore_index]."""
    z = x.reshape(-1, x.shape[-1]) @ w.t() + b
    classes = w.shape[0]
    lse = torch.logsumexp(z, dim=1)
    t = target.reshape(-1)
    valid = t != ignore_index
    safe = torch.where(valid, t, 0)
    c = class_weight
    z_t = z.gather(1, safe[:, None])[:, 0]
    rows = (1 - eps) * c[safe] * (lse - z_t) + eps / classes * (c[None, :] * (lse[:, None] - z)).sum(1)
    s = token_weight.reshape(-1)
    rows = torch.where(valid, rows, 0.0) * s
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (s * torch.where(valid, c[safe], 0.0)).sum()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_token_weight_matches_explicit_formula(ce_device, ce_small_triton_block, reduction):
    x, w, b, target = make_problem((4, 5), 7, 12, torch.float64, ce_device, ignore_every=3)
    class_weight = make_positive(12, ce_device, seed=6)
    token_weight = make_positive((4, 5), ce_device, seed=7)
    grad_output = grad_output_for((4, 5), reduction, ce_device)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    expected = _explicit_formula(xs, ws, bs, target, class_weight, token_weight, -100, 0.1, reduction)
    expected_grads = torch.autograd.grad(expected, (xs, ws, bs),
                                         torch.ones_like(expected) if grad_output is None else grad_output)
    loss, grads = fused(x, w, b, target, grad_output, class_weight=class_weight, token_weight=token_weight,
                        label_smoothing=0.1, reduction=reduction, chunk_size=6)
    assert_close(loss, expected.detach(), torch.float64)
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, torch.float64)


def test_constant_token_weight_leaves_the_mean_unchanged(ce_device):
    # A weighted mean: weights that are all 2 weight numerator and denominator alike.
    x, w, b, target = make_problem((9,), 4, 6, torch.float64, ce_device, ignore_every=4)
    class_weight = make_positive(6, ce_device)
    expected = unfused(x, w, b, target, class_weight=class_weight)
    twos = torch.full((9,), 2.0, dtype=torch.float64, device=ce_device)
    assert_same(fused(x, w, b, target, class_weight=class_weight, token_weight=twos), expected, torch.float64)
    # ... whereas for "sum" they double everything.
    loss, grads = fused(x, w, b, target, class_weight=class_weight, token_weight=twos, reduction="sum")
    exp_loss, exp_grads = unfused(x, w, b, target, class_weight=class_weight, reduction="sum")
    assert_close(loss, 2 * exp_loss, torch.float64)
    assert_close(grads[1], 2 * exp_grads[1], torch.float64)


def test_zero_token_weights_give_nan_mean_like_torch(ce_cpu_device):
    # Every counted token of weight 0: 0 / 0, as torch's mean over all-ignored rows.
    x, w, b, target = make_problem((4,), 3, 5, torch.float64, ce_cpu_device)
    loss = linear_cross_entropy(x, w, target, b, token_weight=torch.zeros(4, dtype=torch.float64))
    assert torch.isnan(loss)
    all_ignored = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(x, w, all_ignored, b))
    assert torch.isnan(F.cross_entropy(F.linear(x, w, b), all_ignored))


@pytest.mark.parametrize("classes", [1, 7, 50257, 128256, 262144])
def test_vocabulary_sizes(ce_cpu_device, classes):
    # Few tokens and a small hidden size keep the big vocabularies fast; 5
    # tokens in chunks of 2 (odd count, a short last chunk).
    x, w, b, target = make_problem((5,), 4, classes, torch.float64, ce_cpu_device, seed=classes,
                                   ignore_every=4)
    for reduction in ("mean", "none"):
        grad_output = grad_output_for((5,), reduction, ce_cpu_device)
        options = dict(label_smoothing=0.1, reduction=reduction)
        expected = unfused(x, w, b, target, grad_output, **options)
        assert_same(fused(x, w, b, target, grad_output, chunk_size=2, **options), expected, torch.float64)
    assert_same(fused(x, w, b, target), unfused(x, w, b, target), torch.float64)  # the default chunk


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.uint8], ids=str)
def test_narrow_integer_targets(ce_device, target_dtype):
    x, w, b, target = make_problem((2, 5), 4, 9, torch.float64, ce_device)
    for reduction in ("mean", "none"):
        expected = unfused(x, w, b, target, reduction=reduction)
        actual = fused(x, w, b, target.to(target_dtype), reduction=reduction, chunk_size=3)
        assert_same(actual, expected, torch.float64)


def test_no_tokens_like_torch(ce_cpu_device):
    # A mean over nothing is NaN (0 / 0), a sum 0, "none" empty; empty input gradient, zero weight gradient.
    x, w, b, target = make_problem((0,), 4, 6, torch.float64, ce_cpu_device)
    for reduction in REDUCTIONS:
        assert_same(fused(x, w, b, target, reduction=reduction), unfused(x, w, b, target, reduction=reduction),
                    torch.float64)


def test_unbatched_input():
    x, w, b, target = make_problem((), 5, 8, torch.float64)
    assert x.shape == (5,) and target.shape == ()
    for reduction in REDUCTIONS:
        assert_same(fused(x, w, b, target, reduction=reduction), unfused(x, w, b, target, reduction=reduction),
                    torch.float64)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck(request, ce_device, ce_small_triton_block, reduction):
    x, w, b, target = make_problem((5,), 3, 10, torch.float64, ce_device, ignore_every=3)
    class_weight = make_positive(10, ce_device)
    token_weight = make_positive((5,), ce_device, seed=8)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, target, b, label_smoothing=0.1, reduction=reduction,
                                    class_weight=class_weight, token_weight=token_weight, chunk_size=2)

    leaves = tuple(t.clone().requires_grad_() for t in (x, w, b))
    # Under the Triton interpreter, fast mode (random directions, not the whole Jacobian).
    fast = "triton" in request.node.callspec.id
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, fast_mode=fast)


def test_gradcheck_probability_targets():
    x, w, b, _ = make_problem((4,), 3, 6, torch.float64)
    target = torch.softmax(make_positive((4, 6), seed=2) * 3, dim=-1)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, target, b, label_smoothing=0.1, chunk_size=3)

    assert torch.autograd.gradcheck(fn, tuple(t.clone().requires_grad_() for t in (x, w, b)), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------
# fp32 / fp16 / bf16 against float64
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_within_stated_bound(ce_device, dtype, reduction):
    if dtype == torch.bfloat16 and ce_device.type == "cpu" and effilayers.backends.choice(
            "cross_entropy", "cpu").backend == "triton":
        pytest.skip("the Triton interpreter has no bfloat16 arithmetic (covered by triton-cuda)")
    x, w, b, target = make_problem((37,), 24, 300, dtype, ce_device, ignore_every=5)
    grad_output = grad_output_for((37,), reduction, ce_device, dtype)
    options = dict(label_smoothing=0.05, reduction=reduction)
    probs = torch.softmax(make_positive((37, 300), ce_device, seed=2) * 6, dim=-1).to(dtype)
    for t in (target, probs):  # class indices, then probabilities (their own kernels)
        loss, grads = actual = fused(x, w, b, t, grad_output, chunk_size=8, **options)
        assert loss.dtype == dtype and all(g.dtype == dtype for g in grads)
        expected = unfused(x, w, b, t, grad_output, **options)
        assert_same(actual, expected, dtype, grad_tier="linear_cross_entropy")


def test_bf16_weight_grad_accumulates_in_float32_over_many_chunks():
    # 512 one-token chunks: the weight gradient is a sum of 512 outer
    # products. Kept in float32 and rounded once it is as close to float64 as
    # one chunk of all tokens (and as torch's unfused bf16); a bf16
    # accumulator (Liger #512) lands ~8x further, beyond the bound.
    generator = torch.Generator().manual_seed(0)
    tokens, hidden, classes = 512, 32, 200
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    w = (torch.randn(classes, hidden, generator=generator) * 0.3).bfloat16()
    target = torch.randint(0, classes, (tokens,), generator=generator)
    _, (_, exact, _) = unfused(x, w, None, target, reduction="sum")

    def error(grad):
        return ((grad.double() - exact).abs().max() / exact.abs().max()).item()

    errors = {}
    for chunk in (1, tokens):
        _, (_, grad_weight, _) = fused(x, w, None, target, reduction="sum", chunk_size=chunk)
        assert grad_weight.dtype == torch.bfloat16
        errors[chunk] = error(grad_weight)
    assert errors[1] <= 1.25 * errors[tokens] + 1e-4, errors

    d_logits = torch.softmax(F.linear(x.double(), w.double()), dim=1) - F.one_hot(target, classes).double()
    bf16_sum = torch.zeros(classes, hidden, dtype=torch.bfloat16)
    for i in range(tokens):
        bf16_sum = (bf16_sum.double() + torch.outer(d_logits[i], x[i].double()).bfloat16().double()).bfloat16()
    bound = 1e-2
    assert errors[1] < bound < error(bf16_sum), (errors, error(bf16_sum))


# --------------------------------------------------------------------------
# The default chunk
# --------------------------------------------------------------------------


def test_default_chunk_bounds_the_logits_bytes():
    # 4096 tokens x 32000 classes in float32: 8 MiB of logits -> 65 tokens.
    assert chunk_tokens(4096, 32000, 4, 4096 * 128 * 4, None) == CHUNK_LOGITS_BYTES // (32000 * 4) == 65
    # An input larger than 8 MiB sets the budget: 16384 x 4096 bf16 (128 MiB) at 128256 classes.
    assert chunk_tokens(16384, 128256, 2, 16384 * 4096 * 2, None) == (16384 * 4096 * 2) // (128256 * 2)
    # At least one token, at most all; an explicit chunk_size wins.
    assert chunk_tokens(3, 262144 * 64, 4, 12, None) == 1
    assert chunk_tokens(10, 5, 4, 200, None) == 10
    assert chunk_tokens(10, 5, 4, 200, 4) == 4 and chunk_tokens(10, 5, 4, 200, 99) == 10
