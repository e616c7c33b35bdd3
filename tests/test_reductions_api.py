"""The reductions' signatures against torch's: var/std's ``unbiased`` and
``correction=None`` forms, and every order ``norm`` takes (``ord=`` or
``p=``), compared with torch in float64, gradients included."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import effilayers.functional as EF


def values(shape, seed=0):
    """float64 values of varied magnitudes and both signs, no zeros."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 0.1 + 3 * torch.rand(shape, generator=generator, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=generator) < 0.4, -1.0, 1.0).double()
    return magnitude * sign


def assert_same_as_torch(ours, theirs, x):
    """Value and gradient of ``ours(x)`` equal ``theirs(x)`` in float64."""
    leaf, reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    actual, expected = ours(leaf), theirs(reference)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    weights = values(expected.shape, seed=99) if expected.dim() else torch.tensor(0.7, dtype=torch.float64)
    (actual * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-10, atol=1e-12)


VARIANCE_FORMS = {
    "unbiased-positional": ((1, False), {}),
    "unbiased-keyword": ((1,), {"unbiased": False}),
    "unbiased-true-keepdim": ((0, True, True), {}),
    "unbiased-only": ((False,), {}),
    "unbiased-only-true": ((True,), {}),
    "dims-unbiased-keyword-keepdim": (((0, 2),), {"unbiased": False, "keepdim": True}),
    "correction-none": ((1,), {"correction": None}),
    "correction-none-all": ((), {"correction": None}),
    "correction-half": ((2,), {"correction": 0.5, "keepdim": True}),
    "correction-zero-all": ((None,), {"correction": 0}),
}


@pytest.mark.parametrize("kind", ["var", "std"])
@pytest.mark.parametrize("form", list(VARIANCE_FORMS))
def test_variance_forms_like_torch(kind, form):
    args, kwargs = VARIANCE_FORMS[form]
    x = values((4, 5, 6), seed=1)
    assert_same_as_torch(lambda t: getattr(EF, kind)(t, *args, **kwargs),
                         lambda t: getattr(torch, kind)(t, *args, **kwargs), x)


def test_variance_argument_errors():
    x = values((3, 4))
    with pytest.raises(TypeError, match="pass unbiased or correction, not both"):
        EF.var(x, 1, unbiased=True, correction=1)
    with pytest.raises(TypeError, match="unbiased must be a bool"):
        EF.std(x, 1, "yes")
    with pytest.raises(TypeError, match="got a bool dim"):
        EF.var(x, True, False)
    with pytest.raises(TypeError, match="correction must be an int or a float"):
        EF.var(x, correction="1")


VECTOR_ORDERS = [2, 1, math.inf, -math.inf, 0, 3, 0.5, 1.5, -1, -0.5]


@pytest.mark.parametrize("order", VECTOR_ORDERS)
@pytest.mark.parametrize("dim, keepdim", [(None, False), (1, False), ((0, 2), True)])
def test_every_vector_order_like_torch(order, dim, keepdim):
    x = values((3, 5, 4), seed=2)
    assert_same_as_torch(lambda t: EF.norm(t, dim, keepdim, ord=order),
                         lambda t: torch.linalg.vector_norm(t, order, dim, keepdim), x)
    # torch.norm's name for the order, and torch.norm's result
    assert_same_as_torch(lambda t: EF.norm(t, dim, keepdim, p=order),
                         lambda t: torch.norm(t, order, dim, keepdim), x)


def test_order_zero_counts_nonzeros():
    x = values((4, 6), seed=3)
    x[1, 2] = x[3, 0] = x[3, 5] = 0.0
    expected = torch.tensor([6.0, 5.0, 6.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(EF.norm(x, 1, ord=0), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dim, keepdim", [(None, False), (1, False), ((0, 2), True), ((1, 2), False)])
def test_frobenius_like_torch_norm(dim, keepdim):
    x = values((3, 5, 4), seed=4)
    assert_same_as_torch(lambda t: EF.norm(t, dim, keepdim, p="fro"),
                         lambda t: torch.norm(t, "fro", dim, keepdim), x)


@pytest.mark.parametrize("shape, dim, keepdim", [((5, 4), None, False), ((5, 4), None, True),
                                                 ((3, 5, 4), (0, 2), False), ((3, 5, 4), (1, 2), True)])
def test_nuclear_like_torch_norm(shape, dim, keepdim):
    x = values(shape, seed=5)
    assert_same_as_torch(lambda t: EF.norm(t, dim, keepdim, ord="nuc"),
                         lambda t: torch.norm(t, "nuc", dim, keepdim), x)


@pytest.mark.parametrize("order", [3, -1, 0.5, "nuc", -math.inf, 0])
def test_fallback_orders_of_half_precision_match_float64_rounded(order):
    # torch refuses "nuc" for fp16/bf16; the fallbacks compute in float32 and round once.
    x = values((6, 5), seed=6)
    for dtype, rtol in ((torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
        rounded = x.to(dtype)
        expected = torch.norm(rounded.double(), order)
        actual = EF.norm(rounded, ord=order)
        assert actual.dtype == dtype
        torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=0)
        wide = EF.norm(rounded, ord=order, dtype=torch.float32)
        assert wide.dtype == torch.float32
        torch.testing.assert_close(wide.double(), expected, rtol=1e-5, atol=0)


def test_norm_order_errors():
    x = values((2, 3, 4))
    with pytest.raises(TypeError, match="pass ord or p, not both"):
        EF.norm(x, ord=2, p=2)
    for bad in ("max", float("nan"), True, 1j):
        with pytest.raises(ValueError, match="ord must be a real number"):
            EF.norm(x, ord=bad)
    with pytest.raises(ValueError, match="ord='nuc' is a matrix norm: dim must name two dims"):
        EF.norm(x, ord="nuc")
    with pytest.raises(ValueError, match="ord='nuc' is a matrix norm"):
        EF.norm(x, 1, p="nuc")
    with pytest.raises(ValueError, match="ord='fro' takes one or two dims"):
        EF.norm(x, (0, 1, 2), p="fro")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EF.norm(x, p="fro")  # dim=None: all dims, as torch.norm
