"""softmax / log_softmax / scaled_masked_softmax: every backend against
float64: small and long rows, layouts and output strides, the dtype argument,
infinities, NaNs, subnormals, empty tensors; masks and causal masking
against scaled_dot_product_attention's weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from effilayers._core.layout import three_groups
from effilayers.functional import log_softmax, scaled_masked_softmax, softmax
from effilayers.ops.softmax import op as softmax_op, reference as softmax_reference

from .accuracy import assert_close
from .softmax_cases import assert_matches, check_grad, dtypes_for, expected, softmax_backend_fixture, varied

backend = softmax_backend_fixture()
compiled_backend = softmax_backend_fixture(without=["triton-interpreter"])


SMALL_CASES = [  # (shape, dim): every backend
    ((1, 1), 1),  # one column
    ((5, 1), 1),
    ((3, 7), 1),  # odd, single block
    ((4, 45), -1),  # longer than the interpreter's lowered block: online path
    ((2, 3, 5, 7), 1),  # inner > 1, odd sizes (a tile narrowed to one pass under the interpreter)
    ((2, 20, 9), 1),  # too long even for the narrowest tile: the two-pass tile
    ((2, 3, 5, 7), 0),  # outer == 1
    ((2, 3, 5, 7), 2),
    ((3, 40, 2), 1),  # inner > 1 and longer than the lowered tile
    ((2, 1, 3), 1),  # reduced size 1
    ((17,), 0),
    ((), 0),  # 0-dim: softmax is 1, log-softmax 0
]
LONG_CASES = [  # compiled CPU / reference / GPU only
    ((3, 65537), 1),
    ((2, 4099, 3), 1),
    ((65537, 2), 0),
]


def _case_id(case):
    return f"{'x'.join(map(str, case[0])) or 'scalar'}-dim{case[1]}"


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", SMALL_CASES, ids=_case_id)
def test_forward_and_backward_match_float64(backend, case, log):
    check_forward_and_backward(backend, case, log)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", LONG_CASES, ids=_case_id)
def test_long_rows_match_float64(compiled_backend, case, log):
    # Long rows on the C++/reference/GPU paths; the interpreter covers the
    # multi-block path with lowered block limits on the small cases.
    check_forward_and_backward(compiled_backend, case, log)


def check_forward_and_backward(backend, case, log):
    name, device = backend
    shape, dim = case
    fn = log_softmax if log else softmax
    for dtype in dtypes_for(name, device.type):
        x = varied(shape, dtype, device, seed=len(shape) + dim).requires_grad_()
        y = fn(x, dim)
        assert y.dtype == dtype and y.shape == x.shape
        assert_matches(y, expected(x, dim, log), dtype, log)
        grad = varied(shape, dtype, device, seed=7)
        (gx,) = torch.autograd.grad(y, x, grad)
        assert gx.dtype == dtype
        check_grad(gx, y, grad, dim, log, dtype, x)


LAYOUTS = ["non_contiguous", "transposed", "channels_last", "permuted_copy", "expanded"]


def laid_out(layout, device, dtype):
    """(x, dim) with the same values as a contiguous tensor but other strides."""
    base = varied((3, 6, 5, 7), dtype, device, seed=11)
    if layout == "non_contiguous":
        return base[:, ::2, :, 1:6], 3
    if layout == "transposed":
        return base[0, 0].t(), 1  # rows 7 apart
    if layout == "channels_last":
        return base.contiguous(memory_format=torch.channels_last), 1  # softmax over C of NHWC
    if layout == "permuted_copy":
        return base.permute(1, 0, 2, 3), 2  # dims before `dim` do not merge: the kernels copy
    if layout == "expanded":
        return base[:, :1].expand(3, 4, 5, 7), 3  # stride 0
    raise ValueError(layout)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(backend, layout, log):
    name, device = backend
    fn = log_softmax if log else softmax
    for dtype in (torch.float32, torch.float16):
        x, dim = laid_out(layout, device, dtype)
        x = x.requires_grad_() if x.is_leaf else x.detach().requires_grad_()
        y = fn(x, dim)
        assert_matches(y, expected(x, dim, log), dtype, log)
        if layout == "channels_last":
            assert y.is_contiguous(memory_format=torch.channels_last)
        grad = varied(tuple(x.shape), dtype, device, seed=3).transpose(-1, -2).contiguous().transpose(-1, -2)
        (gx,) = torch.autograd.grad(y, x, grad)
        check_grad(gx, y, grad, dim, log, dtype, x)


def test_output_strides_follow_the_rule(backend):
    _, device = backend
    for layout in LAYOUTS:
        x, dim = laid_out(layout, device, torch.float32)
        y = softmax(x, dim)
        rule = torch.empty(x.shape).stride() if three_groups(x, (dim,)) is None \
            else torch.empty_like(x).stride()
        assert y.stride() == rule, layout


@pytest.mark.parametrize("dtype_out", [torch.float32, torch.float64, torch.float16])
def test_dtype_argument(backend, dtype_out):
    name, device = backend
    for dtype_in in (torch.float16, torch.float32):
        x = varied((4, 45), dtype_in, device, seed=5).requires_grad_()
        for log, fn in ((False, softmax), (True, log_softmax)):
            y = fn(x, -1, dtype=dtype_out)
            assert y.dtype == dtype_out
            # Computed from x's own values (no pre-rounding to dtype_out).
            assert_matches(y, expected(x, -1, log), dtype_out, log)
            grad = varied((4, 45), dtype_out, device, seed=6)
            (gx,) = torch.autograd.grad(y, x, grad)
            assert gx.dtype == dtype_in  # the gradient comes back in the input's dtype
            check_grad(gx, y, grad, -1, log, dtype_in, x)


def test_inf_and_nan_rows(backend):
    _, device = backend
    inf, nan = math.inf, math.nan
    x = torch.tensor([
        [-inf, -inf, -inf, -inf],  # fully masked: zeros (torch: NaN)
        [-inf, 1.0, -inf, 2.0],  # partially masked: as torch
        [0.5, nan, 1.0, 2.0],  # NaN: row NaN, as torch
        [inf, 1.0, 2.0, 3.0],  # +inf: row NaN, as torch
        [3.0, 1.0, -2.0, 0.25],
    ], device=device, requires_grad=True)
    y = softmax(x, 1)
    assert torch.equal(y[0].detach().cpu(), torch.zeros(4))
    torch.testing.assert_close(y[1:].detach().cpu(), torch.softmax(x[1:].detach().cpu(), 1), equal_nan=True)
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    (gx,) = torch.autograd.grad(y[[0, 1, 4]], x, torch.ones(3, 4, device=device))
    assert torch.equal(gx[0].cpu(), torch.zeros(4))  # zero gradient for the fully masked row
    z = log_softmax(x, 1)
    assert torch.equal(z[0].detach().cpu(), torch.full((4,), -inf))
    torch.testing.assert_close(z[1:].detach().cpu(), torch.log_softmax(x[1:].detach().cpu(), 1), equal_nan=True)
    # Rows longer than one block (online path) and inner > 1 (tile path)
    for shape, dim in (((2, 45), 1), ((3, 40, 2), 1), ((2, 5, 19), 1)):  # row, tile, C++ column paths
        x = torch.full(shape, -inf, device=device)
        x[1].uniform_(-1, 1)  # the second slice along dim 0 is ordinary
        y = softmax(x, dim)
        assert torch.equal(y[0].cpu(), torch.zeros(shape[1:]))
        torch.testing.assert_close(y[1].cpu(), torch.softmax(x[1].cpu(), dim - 1))
        assert torch.equal(log_softmax(x, dim)[0].cpu(), torch.full(shape[1:], -inf))


def test_subnormal_outputs(backend):
    # exp(-90) = 8.2e-40 and exp(-103) = 1.4e-45 are float32 subnormals:
    # torch (and float64 rounded once) returns them; the C++ polynomial exp
    # used to flush everything below ~1e-38 to 0. exp(-104) rounds to 0.
    name, device = backend
    x = torch.tensor([[0.0, -90.0, -100.0, -103.0, -103.9, -104.0, -200.0, -math.inf]], device=device)
    for dtype in dtypes_for(name, device.type):
        if dtype == torch.float16:
            continue  # fp16's subnormals start at 6e-5: covered by the random cases
        for source in (x, x.t()):  # a row, and a column (the C++ column path)
            dim = 1 if source is x else 0
            y = softmax(source.to(dtype), dim).cpu()
            exact = torch.softmax(source.double().cpu(), dim)
            # rtol for the normal range; subnormals within the tolerance's 2 units of the smallest one
            assert_close(y.double(), exact.to(dtype).double(), dtype, "softmax")
            assert float(y.flatten()[1]) > 0  # exp(-90): a float32 and bfloat16 subnormal, not flushed
            if dtype == torch.float32:
                assert float(y.flatten()[3]) == 2**-149  # exp(-103): the smallest float32 subnormal
    # The same exp in the log-softmax backward: g - exp(y) * sum(g) with y = -100
    y = torch.tensor([[0.0, -100.0]], device=device)
    grad = softmax_op._softmax_backward_op(torch.tensor([[1.0, 0.0]], device=device), y, 1, True, 1.0,
                                            torch.float32)
    assert float(grad[0, 1].cpu()) == -float(torch.tensor(-100.0).exp())  # -3.8e-44


def test_empty_tensors(backend):
    _, device = backend
    for shape, dim in (((0, 3), 1), ((0, 3), 0), ((3, 0), 1), ((2, 0, 4), 2)):
        x = torch.empty(shape, device=device, requires_grad=True)
        for fn, torch_fn in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
            y = fn(x, dim)
            assert y.shape == torch_fn(x, dim).shape == x.shape
            (gx,) = torch.autograd.grad(y, x, torch.empty_like(y))
            assert gx.shape == x.shape
    assert scaled_masked_softmax(torch.empty(2, 0, 3, device=device), causal=True).shape == (2, 0, 3)


# --------------------------------------------------------------------------- scaled / masked


def sdpa_weights(x, mask, scale, causal):
    """The attention weights SDPA computes, read through an identity V."""
    q_len, k_len = x.shape[-2:]
    # x = q @ k^T with q = x, k = I: SDPA's scores are x * scale.
    q = x.double().cpu()
    k = torch.eye(k_len, dtype=torch.float64).expand(*x.shape[:-2], k_len, k_len)
    v = k
    if mask is not None:
        mask = mask.cpu().expand(x.shape)  # SDPA wants the mask at least 2-D
        mask = mask if mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=causal, scale=scale)


MASK_CASES = [  # (x shape, mask shape)
    ((2, 3, 5, 7), (7,)),
    ((2, 3, 5, 7), (5, 1)),
    ((2, 3, 5, 7), (1, 3, 1, 7)),
    ((2, 3, 5, 7), (2, 1, 5, 7)),
    ((4, 45), (4, 45)),  # longer than the interpreter's block: online path
    ((3, 6, 6), (1, 6)),
]


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-mask{'x'.join(map(str, c[1]))}")
def test_masked_matches_sdpa(backend, case, mask_kind):
    _, device = backend
    shape, mask_shape = case
    generator = torch.Generator().manual_seed(len(mask_shape))
    if mask_kind == "bool":
        mask = torch.rand(mask_shape, generator=generator) > 0.3
        mask[..., 0] = True  # SDPA's math path gives NaN for rows with nothing to attend
    else:
        mask = torch.randn(mask_shape, generator=generator) * 2
    for dtype in (torch.float32, torch.float16):
        x = varied(shape, dtype, device, seed=2)
        m = mask.to(device) if mask_kind == "bool" else mask.to(device=device, dtype=dtype)
        y = scaled_masked_softmax(x, m, scale=0.37)
        assert y.dtype == dtype
        assert_matches(y, sdpa_weights(x, m, 0.37, False), dtype, False)


@pytest.mark.parametrize("shape", [(2, 5, 7), (7, 5), (3, 45, 45), (2, 9, 3)])
def test_causal_matches_sdpa(backend, shape):
    _, device = backend
    x = varied(shape, torch.float32, device, seed=4)
    assert_matches(scaled_masked_softmax(x, causal=True, scale=2.0), sdpa_weights(x, None, 2.0, True),
                   torch.float32, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_causal_ignores_what_lies_above_the_diagonal(backend, dtype):
    """A causal row reads x and the mask only up to its diagonal (rounded up
    to a 32-byte sector in the Triton kernel): NaN scores and a NaN float mask
    above it change nothing. 24 columns cross the sector (8 or 16 values);
    tests/test_softmax_kernels.py's split rows cross pieces."""
    _, device = backend
    x = varied((2, 24, 24), dtype, device, seed=6)
    mask = torch.randn(24, 24, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    above = torch.ones(24, 24, dtype=torch.bool, device=device).triu(1)
    poisoned_x = x.masked_fill(above, float("nan"))
    poisoned_mask = mask.masked_fill(above, float("nan"))
    ref = softmax_reference.scaled_masked_softmax_forward_reference(x.double().cpu(), mask.double().cpu(), 0.6, True)
    assert_matches(scaled_masked_softmax(poisoned_x, poisoned_mask, 0.6, causal=True), ref, dtype, False)


def test_mask_and_causal_with_fully_masked_rows(backend):
    _, device = backend
    x = varied((2, 3, 6, 9), torch.float32, device, seed=8).requires_grad_()
    mask = torch.ones(1, 3, 6, 9, dtype=torch.bool, device=device)
    mask[0, 1, :, 0] = False  # with causal, row 0 of head 1 has nothing left
    mask[0, 2, 3] = False  # row 3 of head 2 is fully masked by the mask alone
    float_mask = torch.zeros(6, 9, device=device)
    float_mask[4] = -math.inf
    for m in (mask, float_mask):
        y = scaled_masked_softmax(x, m, scale=0.5, causal=True)
        ref = softmax_reference.scaled_masked_softmax_forward_reference(x.detach().double().cpu(), m.cpu(), 0.5, True)
        assert_matches(y, ref, torch.float32, False)
        empty_rows = ~(m.cpu().bool() if m.dtype == torch.bool else m.cpu() > -math.inf)
        empty_rows = (empty_rows | ~torch.ones(6, 9, dtype=torch.bool).tril()).all(-1)
        empty_rows = empty_rows.expand(2, 3, 6)
        assert empty_rows.any()
        assert torch.equal(y.detach().cpu()[empty_rows], torch.zeros(int(empty_rows.sum()), 9))
        assert torch.isfinite(y).all()
        grad = varied(tuple(y.shape), torch.float32, device, seed=9)
        (gx,) = torch.autograd.grad(y, x, grad)
        assert torch.equal(gx.cpu()[empty_rows], torch.zeros(int(empty_rows.sum()), 9))
        check_grad(gx, y, grad, -1, False, torch.float32, scale=0.5)  # at our output
        check_grad(gx, ref, grad, -1, False, torch.float32, scale=0.5)  # at the float64 output


def test_mask_read_through_strides(backend):
    # A transposed (non-contiguous) mask and an expanded one give the same
    # result as their contiguous copies.
    _, device = backend
    x = varied((2, 4, 6, 6), torch.float16, device, seed=12)
    mask = (torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) > 0.4).to(device)
    mask.fill_diagonal_(True)
    for m in (mask.t(), mask[None, None].expand(2, 4, 6, 6), mask.t().float().to(torch.float16)[None]):
        ref = softmax_reference.scaled_masked_softmax_forward_reference(x.double().cpu(), m.contiguous().cpu(), 1.5,
                                                                        False)
        assert_matches(scaled_masked_softmax(x, m, 1.5), ref, torch.float16, False)


def test_masked_high_rank_and_transposed(backend):
    _, device = backend
    x = varied((2, 2, 3, 2, 4, 5), torch.float32, device, seed=13).transpose(0, 2)  # leading dims do not merge
    mask = torch.rand(1, 2, 1, 2, 4, 5, generator=torch.Generator().manual_seed(2)).to(device) > 0.5
    ref = softmax_reference.scaled_masked_softmax_forward_reference(x.double().cpu(), mask.cpu(), 0.8, True)
    assert_matches(scaled_masked_softmax(x, mask, 0.8, causal=True), ref, torch.float32, False)
    x1 = varied((9,), torch.float32, device)  # 1-D: one row
    assert_matches(scaled_masked_softmax(x1, None, 2.0), torch.softmax(x1.double().cpu() * 2, 0), torch.float32, False)
