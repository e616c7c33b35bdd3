"""softmax / log_softmax / scaled_masked_softmax: every backend against float64."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import effilayers
import effilayers.nn as enn
from effilayers import memory
from effilayers.functional import log_softmax, scaled_masked_softmax, softmax
from effilayers._core.layout import three_groups
from effilayers.ops.softmax import op as softmax_op
from effilayers.ops.softmax import reference as softmax_reference

from .accuracy import assert_close, tolerance
from .conftest import (HAS_CUDA, REQUIRE_COMPILED, activate_backend, backend_params, fake_cuda_autocast,
                       far_apart_rows, peak_rss_growth, poison_cpp_allocations)

# The Triton interpreter gets small shapes and lowered block limits so the
# multi-block paths run.
INTERPRETER_LIMITS = dict(MAX_FUSED_BLOCK=32, ONLINE_BLOCK=16, MAX_TILE=64)


def _is_interpreter(backend, device):
    return backend == "triton" and device == "cpu"


@pytest.fixture(params=backend_params("softmax_forward"))
def backend(request, monkeypatch):
    yield from _forced(request, monkeypatch)


@pytest.fixture(params=backend_params("softmax_forward", without=["triton-interpreter"]))
def compiled_backend(request, monkeypatch):
    yield from _forced(request, monkeypatch)


def _forced(request, monkeypatch):
    """Forces one backend for the three softmax ops; yields (name, device).
    Every output starts as NaN (poisoned), so an element no kernel writes
    fails: the reference and Triton kernels allocate through output_like,
    patched here; the C++ kernels allocate with at::empty_like, which torch
    itself fills with NaN under use_deterministic_algorithms(True) (with
    torch.utils.deterministic.fill_uninitialized_memory, True by default).
    That mode, rather than an out= argument on the ops, keeps the op schemas
    as they are and poisons exactly the allocations the kernels make."""
    name, device = request.param
    context = activate_backend("softmax_forward", name, device)
    if name == "cpp":
        poison_cpp_allocations(request)

    def poisoned(x, dim, dtype, original=softmax_reference.output_like):
        return original(x, dim, dtype).fill_(float("nan"))

    monkeypatch.setattr(softmax_reference, "output_like", poisoned)
    if name == "triton":
        from effilayers.ops.softmax import triton as kernels

        monkeypatch.setattr(kernels, "output_like", poisoned)
        if device == "cpu":
            for constant, value in INTERPRETER_LIMITS.items():
                monkeypatch.setattr(kernels, constant, value)
    try:
        yield name, torch.device(device)
    finally:
        context.__exit__(None, None, None)


def varied(shape, dtype, device="cpu", seed=0, scale=4.0):
    """Random values whose spread differs along every dimension (no zeros)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    if values.dim() > 0:
        spread = torch.logspace(-1, 1, values.shape[-1], dtype=torch.float64)
        values = values * spread * scale / 4 + torch.rand(shape, generator=generator, dtype=torch.float64)
    return values.to(dtype=dtype, device=device)


def expected(x, dim, log, dtype=None):
    z = x.detach().double().cpu()
    result = torch.log_softmax(z, dim) if log else torch.softmax(z, dim)
    return result


def assert_matches(actual, reference, dtype, log):
    assert_close(actual.detach().double().cpu(), reference, dtype, "log_softmax" if log else "softmax", equal_nan=True)


def assert_grad_matches(actual, reference, dtype):
    # Relative to the largest gradient of the tensor (accuracy.py says why).
    scale = reference.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual.double().cpu() / scale, reference / scale, **tolerance(dtype, "softmax_grad"))


def grad_formula(grad, output, dim, log, scale=1.0):
    """The exact (float64) gradient at a given softmax / log-softmax output."""
    g, y = grad.detach().double().cpu(), output.detach().double().cpu()
    if log:
        return scale * (g - y.exp() * g.sum(dim, keepdim=True))
    return scale * y * (g - (g * y).sum(dim, keepdim=True))


def check_grad(gx, y, grad, dim, log, dtype, x=None, scale=1.0):
    """The kernel's gradient against the float64 formula at the same saved
    output (what backward sees); with ``x``, also against the true float64
    gradient, where the output rounding allows (float32/float64 outputs)."""
    assert_grad_matches(gx, grad_formula(grad, y, dim, log, scale), dtype)
    if x is not None and y.dtype in (torch.float32, torch.float64):
        x64 = x.detach().double().cpu()
        y64 = torch.log_softmax(x64, dim) if log else torch.softmax(x64, dim)
        assert_grad_matches(gx, grad_formula(grad, y64, dim, log, scale), dtype)


SMALL_CASES = [  # (shape, dim): every backend
    ((1, 1), 1),  # one column
    ((5, 1), 1),
    ((3, 7), 1),  # odd, single block
    ((4, 45), -1),  # longer than the interpreter's lowered block: online path
    ((2, 3, 5, 7), 1),  # inner > 1, odd sizes
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
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def dtypes_for(name, device):
    # The interpreter has no bf16 arithmetic (bf16 Triton runs on the GPU tests).
    return [d for d in DTYPES if not (_is_interpreter(name, device) and d == torch.bfloat16)]


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
        ref = softmax_reference.scaled_masked_softmax_forward_reference(x.double().cpu(), m.contiguous().cpu(), 1.5, False)
        assert_matches(scaled_masked_softmax(x, m, 1.5), ref, torch.float16, False)


def test_masked_high_rank_and_transposed(backend):
    _, device = backend
    x = varied((2, 2, 3, 2, 4, 5), torch.float32, device, seed=13).transpose(0, 2)  # leading dims do not merge
    mask = torch.rand(1, 2, 1, 2, 4, 5, generator=torch.Generator().manual_seed(2)).to(device) > 0.5
    ref = softmax_reference.scaled_masked_softmax_forward_reference(x.double().cpu(), mask.cpu(), 0.8, True)
    assert_matches(scaled_masked_softmax(x, mask, 0.8, causal=True), ref, torch.float32, False)
    x1 = varied((9,), torch.float32, device)  # 1-D: one row
    assert_matches(scaled_masked_softmax(x1, None, 2.0), torch.softmax(x1.double().cpu() * 2, 0), torch.float32, False)


# --------------------------------------------------------------------------- gradcheck, memory


@pytest.mark.parametrize("case", [((3, 7), 1), ((2, 3, 2, 3), 1), ((2, 3, 2, 3), 0), ((1, 34), 1)],
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-dim{c[1]}")
def test_gradcheck(backend, case):
    # float64 on every backend: the Triton interpreter computes float64 too.
    _, device = backend
    shape, dim = case
    x = varied(shape, torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softmax(t, dim), (x,))
    assert torch.autograd.gradcheck(lambda t: log_softmax(t, dim), (x,))


def test_gradcheck_channels_last_and_masked(backend):
    _, device = backend
    xl = varied((2, 3, 2, 2), torch.float64, device).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softmax(t, 1), (xl,))
    mask = torch.tensor([True, False, True, True, True], device=device)
    xm = varied((2, 3, 5), torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: scaled_masked_softmax(t, mask, 0.7, causal=True), (xm,))


def test_triton_fp32_backward_matches_reference():
    """The Triton backward in float32 against the reference backward (interpreter)."""
    context = activate_backend("softmax_backward", "triton", "cpu")
    from effilayers.ops.softmax import triton as kernels

    try:
        for shape, dim in ((4, 45), 1), ((3, 40, 2), 1), ((5, 3), 0):
            y = torch.softmax(varied(shape, torch.float32), dim)
            g = varied(shape, torch.float32, seed=1)
            for log, out in ((False, y), (True, y.log())):
                ref = softmax_reference.softmax_backward_reference(g, out, dim, log, 0.5, torch.float32)
                with pytest.MonkeyPatch.context() as patch:
                    for constant, value in INTERPRETER_LIMITS.items():
                        patch.setattr(kernels, constant, value)
                    actual = kernels.softmax_backward(g, out, dim, log, 0.5, torch.float32)
                torch.testing.assert_close(actual, ref, rtol=1e-5, atol=1e-6)
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_saves_only_the_output(backend, out_dtype):
    _, device = backend
    x = varied((4, 6, 45), torch.float16, device).requires_grad_()
    mask = torch.ones(6, 45, dtype=torch.bool, device=device)
    for fn in (lambda t: softmax(t, 1, dtype=out_dtype), lambda t: log_softmax(t, -1, dtype=out_dtype),
               lambda t: scaled_masked_softmax(t, mask, 0.5, causal=True)):
        with memory.track_activations() as meter:
            y = fn(x)
        assert meter.bytes == y.numel() * y.element_size()
        del y


def test_cpu_result_independent_of_thread_count():
    context = activate_backend("softmax_forward", "cpp", "cpu")
    try:
        x = varied((64, 3000), torch.float32)
        xi = varied((8, 300, 40), torch.float32)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            single = [softmax(x, 1), log_softmax(xi, 1)]
            torch.set_num_threads(max(2, threads))
            multi = [softmax(x, 1), log_softmax(xi, 1)]
        finally:
            torch.set_num_threads(threads)
        for a, b in zip(single, multi):
            assert torch.equal(a, b)
    finally:
        context.__exit__(None, None, None)


def _cpp_long_rows():
    """(x, dim) pairs whose C++ work items buffer more values than its
    scratch holds (2**20): the blocked two-pass paths. The first 40% of every
    row is -inf, so the running maximum starts at -inf and grows block by block."""
    rows = varied((1, 1_100_000), torch.float32, seed=2) * 3
    rows[:, :440_000] = -math.inf
    rows[0, 900_000] = 12.0  # a large value in a late block
    columns = varied((70_000, 18), torch.float32, seed=3) * 3  # 16 + 2 neighbouring rows of 70,000
    columns[:28_000] = -math.inf
    columns[50_000, 3] = 12.0
    # Every value far below 0 (the first finite block maximum is about -100:
    # exp(0 - max) overflows, so the empty sum must not be rescaled), and a
    # -1e4 attention-style mask over the first blocks of a row (bf16: the
    # gradients of a 1.1M-value row sum beyond fp16's range).
    negative = varied((300_000, 5), torch.float32, seed=5) - 100.0
    masked = varied((1, 1_100_000), torch.float32, seed=6)
    masked[:, :1_050_000] = -1e4
    return [(rows.to(torch.bfloat16), 1), (columns.half(), 0), (negative, 0), (negative.double(), 0),
            (masked.to(torch.bfloat16), 1)]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_cpp_rows_longer_than_the_scratch(log):
    context = activate_backend("softmax_forward", "cpp", "cpu")
    try:
        fn = log_softmax if log else softmax
        for x, dim in _cpp_long_rows():
            leaf = x.clone().requires_grad_()
            y = fn(leaf, dim)
            assert_matches(y, expected(x, dim, log), x.dtype, log)
            grad = varied(tuple(x.shape), x.dtype, seed=4)
            (gx,) = torch.autograd.grad(y, leaf, grad)
            check_grad(gx, y, grad, dim, log, x.dtype)
        special = torch.full((4, 1_100_000), -math.inf, dtype=torch.float16)
        special[1, 1_050_000], special[2, 1_060_000], special[3, 1] = math.nan, math.inf, 1.0
        y = fn(special, 1)
        assert torch.equal(y[0], torch.full((1_100_000,), -math.inf if log else 0.0, dtype=torch.float16))
        assert bool(y[1].isnan().all()) and bool(y[2].isnan().all())
        assert float(y[3, 1]) == (0.0 if log else 1.0)
    finally:
        context.__exit__(None, None, None)


def test_cpp_scratch_is_bounded():
    # Extra memory beyond the output is at most two 4 MiB buffers per thread,
    # whatever the input's size. Measured before the blocked paths (peak RSS
    # beyond the output, 2 threads, /tmp-style script run as in the commit
    # message): fp32 (1e6, 64) over dim 0 244 MiB (a zero-filled rows x
    # reduced buffer the float column path never used), bf16 122 MiB, one
    # bf16 row of 2e7 76 MiB, the bf16 backward over dim 0 244 MiB; after: 0
    # MiB. The cases below grew by 37, 30 and 38 MiB forward (61 and 76 MiB
    # backward for the bf16 ones) before.
    context = activate_backend("softmax_forward", "cpp", "cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        softmax(torch.randn(4, 4), 0)  # the library is loaded
        allowed = 2 * 2 * 4 * 2**20 + 2 * 2**20  # threads x buffers x 4 MiB, and 2 MiB of slack
        cases = [(torch.randn(150_000, 64), 0), (torch.randn(250_000, 64).bfloat16(), 0),
                 (torch.randn(1, 10_000_000).bfloat16(), 1)]
        for x, dim in cases:
            results = []
            growth = peak_rss_growth(lambda: results.append(softmax(x, dim)))
            assert growth - results[0].nbytes < allowed, (x.dtype, tuple(x.shape), growth)
            grad = torch.ones_like(x)
            growth = peak_rss_growth(
                lambda: results.append(torch.ops.effilayers_cpu.softmax_backward(grad, results[0], dim, False, 1.0,
                                                                                 x.dtype)))
            assert growth - results[1].nbytes < allowed, ("backward", x.dtype, tuple(x.shape), growth)
    finally:
        torch.set_num_threads(threads)
        context.__exit__(None, None, None)


@pytest.fixture(params=backend_params("softmax_forward", devices=["cpu"]))
def cpu_backend(request, monkeypatch):
    yield from _forced(request, monkeypatch)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_offsets_past_2_31_elements(cpu_backend, log):
    # Rows 2**30 + 1 elements apart in one uninitialised storage: the third
    # row starts past element 2**31, so an int32 offset anywhere (row index
    # times stride, or a column index times the inner stride for dim=0) reads
    # the wrong place, while only the rows' pages become resident.
    fn = log_softmax if log else softmax
    values = varied((3, 45), torch.float16)
    grad_values = varied((3, 45), torch.float16, seed=1)
    mask = torch.rand(45, generator=torch.Generator().manual_seed(0)) > 0.3

    def run(rows=far_apart_rows):
        x = rows(values).requires_grad_()
        y = fn(x, -1)
        assert_matches(y, expected(values, -1, log), torch.float16, log)
        grad = rows(grad_values)  # read by backward through its far-apart rows
        (gx,) = torch.autograd.grad(y, x, grad)
        check_grad(gx, y, grad_values, -1, log, torch.float16)
        columns = rows(values).t()  # softmax over dim 0: neighbours 2**30 + 1 apart
        assert_matches(fn(columns, 0), expected(values.t(), 0, log), torch.float16, log)
        if not log:
            masked = scaled_masked_softmax(rows(values), mask, 0.5)
            assert_matches(masked, torch.softmax((values.double() * 0.5).masked_fill(~mask, -math.inf), -1),
                           torch.float16, False)

    run(rows=torch.clone)  # the same calls on small tensors first: lazy initialisation is not counted
    assert peak_rss_growth(run) < 64 * 2**20  # GiBs of address space, a few pages resident


# --------------------------------------------------------------------------- fp16 accuracy cases


def test_fp16_accuracy_cases():
    """Measured cases where a naive fp16 computation is wrong and ours is right."""
    # 1. softmax without max subtraction: exp(12) = 162755 overflows fp16 (max 65504).
    x = torch.tensor([[12.0, 11.0, 10.0, -3.0]], dtype=torch.float16)
    naive = x.exp() / x.exp().sum(-1, keepdim=True)
    exact = torch.softmax(x.double(), -1)
    assert torch.isnan(naive).any()  # inf / inf
    assert_matches(softmax(x, -1), exact, torch.float16, False)
    # 2. log-softmax through a fp16 log-sum-exp: the same overflow gives -inf.
    naive_log = x - x.exp().sum(-1, keepdim=True).log()
    assert torch.isinf(naive_log).all()
    assert_matches(log_softmax(x, -1), torch.log_softmax(x.double(), -1), torch.float16, True)
    # 3. torch.softmax(x, dtype=float16) rounds x to fp16 before the softmax:
    #    1000.3 -> 1000.5 (fp16 spacing 0.5 at 1000) moves the result by ~0.05.
    x32 = torch.tensor([[1000.0, 1000.3]])
    exact = torch.softmax(x32.double(), -1)
    torch_result = torch.softmax(x32, -1, dtype=torch.float16)
    assert (torch_result.double() - exact).abs().max() > 0.04
    ours = softmax(x32, -1, dtype=torch.float16)
    assert ours.dtype == torch.float16
    assert (ours.double() - exact).abs().max() < 1e-3


# --------------------------------------------------------------------------- errors


def test_integer_input_with_a_floating_dtype_like_torch(backend):
    # torch.softmax(x, dim, dtype=...) accepts integer and bool x when dtype
    # is floating (it converts x first); without one both refuse.
    _, device = backend
    values = torch.arange(-7, 8, device=device).view(3, 5) * 3
    for x in (values, values.to(torch.int32), (values + 21).to(torch.uint8), values > 0):
        for fn, theirs in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
            for dtype in (torch.float32, torch.float64, torch.float16):
                y = fn(x, 1, dtype=dtype)
                assert y.dtype == dtype
                reference = theirs(x.cpu().double(), 1)
                assert_matches(y, reference, dtype, fn is log_softmax)
                assert_matches(fn(x.t(), 0, dtype=dtype), reference.t(), dtype, fn is log_softmax)
            with pytest.raises(TypeError, match="integer and bool input needs a floating dtype="):
                fn(x, 1)
            with pytest.raises(TypeError, match="dtype must be float16"):
                fn(x, 1, dtype=torch.int64)


def test_forward_mode_ad_is_refused(backend):
    # No forward-mode rule: torch would hand back a zero tangent silently.
    _, device = backend
    x, tangent = varied((3, 5), torch.float32, device), varied((3, 5), torch.float32, device, seed=1)
    for fn in (lambda t: softmax(t, 1), lambda t: log_softmax(t, 0), lambda t: scaled_masked_softmax(t, None, 0.5),
               lambda t: scaled_masked_softmax(x, t, 0.5)):  # a float mask's tangent too
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(fn, (x,), (tangent,))
        with torch.autograd.forward_ad.dual_level():
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                fn(torch.autograd.forward_ad.make_dual(x, tangent))


def test_errors():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        softmax([1.0, 2.0], 0)
    with pytest.raises(TypeError, match="x dtype must be"):
        softmax(torch.arange(4), 0)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        softmax(x, 2)
    with pytest.raises(IndexError, match="dim -3 is out of range"):
        log_softmax(x, -3)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(x, 1.0)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(x, True)
    with pytest.raises(TypeError, match="dtype must be float16"):
        softmax(x, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        log_softmax(x, 1, dtype="float32")
    with pytest.raises(TypeError, match="mask dtype must be bool"):
        scaled_masked_softmax(x, torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(x, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(x, torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        scaled_masked_softmax(x, [[True] * 4] * 3)
    with pytest.raises(ValueError, match="scale must be finite"):
        scaled_masked_softmax(x, scale=math.inf)
    with pytest.raises(ValueError, match="scale must be finite"):
        scaled_masked_softmax(x, scale=math.nan)
    with pytest.raises(TypeError, match="scale must be a float"):
        scaled_masked_softmax(x, scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="scale must be a float"):
        scaled_masked_softmax(x, scale=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        scaled_masked_softmax(x, causal=1)
    with pytest.raises(ValueError, match="at least 2"):
        scaled_masked_softmax(torch.randn(5), causal=True)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        scaled_masked_softmax(torch.tensor(1.0))


def test_double_backward(backend):
    _, device = backend
    x = varied((2, 5), torch.float64, device).requires_grad_()
    xi = varied((2, 3, 2), torch.float64, device).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: softmax(t, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: log_softmax(t, 1), (xi,))
    mask = torch.tensor([True, False, True, True, True], device=device)
    assert torch.autograd.gradgradcheck(lambda t: scaled_masked_softmax(t, mask, 0.7), (x,))

def test_cpp_kernel_checks_its_arguments():
    context = activate_backend("softmax_forward", "cpp", "cpu")
    context.__exit__(None, None, None)
    ops = torch.ops.effilayers_cpu
    with pytest.raises(IndexError, match="out of range"):
        ops.softmax_forward(torch.randn(2, 3), 2, False, None)
    with pytest.raises(TypeError, match="dtype"):
        ops.softmax_forward(torch.arange(3), 0, False, None)
    with pytest.raises(ValueError, match="grad has shape"):
        ops.softmax_backward(torch.randn(2, 3), torch.randn(3, 2), 1, False, 1.0, torch.float32)
    with pytest.raises(ValueError, match="broadcast"):
        ops.scaled_masked_softmax_forward(torch.randn(2, 3), torch.ones(2, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="finite"):
        ops.scaled_masked_softmax_forward(torch.randn(2, 3), None, math.inf, False)
    with pytest.raises(ValueError, match="causal"):
        ops.scaled_masked_softmax_forward(torch.randn(3), None, 1.0, True)


# --------------------------------------------------------------------------- modules, autocast, compile, registry


def test_modules_are_drop_ins():
    x = varied((2, 3, 4), torch.float32).requires_grad_()
    for ours, theirs in ((enn.Softmax(dim=2), torch.nn.Softmax(dim=2)),
                         (enn.LogSoftmax(dim=-1), torch.nn.LogSoftmax(dim=-1))):
        assert isinstance(ours, type(theirs))
        assert repr(ours) == repr(theirs)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x), theirs(x))
    # dim=None: torch's implicit choice (dim 0 for 3-D, dim 1 for 2-D/4-D), with its warning at the caller
    for shape in ((2, 3, 4), (3, 5), (2, 3, 4, 5), (6,)):
        xs = varied(shape, torch.float32)
        for ours, theirs in ((enn.Softmax(), torch.nn.Softmax()), (enn.LogSoftmax(), torch.nn.LogSoftmax())):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = ours(xs)
                reference = theirs(xs)
            assert [str(w.message) for w in caught][0] == [str(w.message) for w in caught][1]
            assert "Implicit dimension choice" in str(caught[0].message)
            assert caught[0].filename == __file__
            torch.testing.assert_close(result, reference)


@pytest.mark.slow
def test_modules_with_implicit_dim_compile_fullgraph():
    # torch.nn.Softmax() compiles with fullgraph=True (its warning is issued
    # while tracing); a warnings.warn call in the traced forward broke the graph.
    for shape in ((2, 3, 4), (2, 3, 4, 5)):
        x = varied(shape, torch.float32)
        for ours, theirs in ((enn.Softmax(), torch.nn.Softmax()), (enn.LogSoftmax(), torch.nn.LogSoftmax())):
            torch._dynamo.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = torch.compile(ours, fullgraph=True)(x)
                reference = theirs(x)
            assert any("Implicit dimension choice" in str(w.message) for w in caught)
            torch.testing.assert_close(result, reference)


def test_autocast_keeps_the_input_dtype():
    # The documented choice: the input dtype (what torch does on CPU).
    xb = varied((4, 9), torch.bfloat16)
    xf = varied((4, 9), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert softmax(xb, -1).dtype == torch.softmax(xb, -1).dtype == torch.bfloat16
        assert log_softmax(xf, -1).dtype == torch.log_softmax(xf, -1).dtype == torch.float32
        assert scaled_masked_softmax(xb, causal=True).dtype == torch.bfloat16
    # CUDA autocast (fake CUDA tensors run torch's AutocastCUDA kernels without
    # a GPU): torch returns float32, ours the input dtype, as documented.
    with fake_cuda_autocast(torch.float16):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.empty(4, 9, dtype=dtype, device="cuda")
            for mine, theirs in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
                assert theirs(x, -1).dtype == torch.float32 and mine(x, -1).dtype == dtype
                assert mine(x, -1, dtype=torch.float32).dtype == torch.float32
            assert scaled_masked_softmax(x, causal=True).dtype == dtype


@pytest.mark.gpu
def test_autocast_cuda_keeps_fp16_where_torch_gives_fp32():
    x = varied((4, 9), torch.float16, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.softmax(x, -1).dtype == torch.float32  # torch: softmax is on autocast's fp32 list
        assert softmax(x, -1).dtype == torch.float16  # ours: the input dtype, half the saved bytes
        assert softmax(x, -1, dtype=torch.float32).dtype == torch.float32


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(x, mask):
        return softmax(x, 1) * log_softmax(x, -1, dtype=torch.float32) + scaled_masked_softmax(x, mask, 0.5, True)

    x = varied((2, 3, 5, 5), torch.float32).requires_grad_()
    mask = torch.rand(5, 5) > 0.3
    compiled = torch.compile(block, fullgraph=True)
    expected_out = block(x, mask)
    actual = compiled(x, mask)
    torch.testing.assert_close(actual, expected_out)
    grad = torch.randn_like(actual)
    torch.testing.assert_close(torch.autograd.grad(actual, x, grad)[0], torch.autograd.grad(expected_out, x, grad)[0])


def test_opcheck():
    x = varied((3, 4, 5), torch.float32).requires_grad_()
    torch.library.opcheck(softmax_op._softmax_forward_op, (x, 1, False, None))
    torch.library.opcheck(softmax_op._softmax_forward_op, (x.detach().half(), -1, True, torch.float32))
    xl = varied((2, 3, 4, 5), torch.float32).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(softmax_op._softmax_forward_op, (xl, 1, False, None))
    torch.library.opcheck(softmax_op._scaled_masked_softmax_op, (x, torch.rand(5) > 0.5, 0.5, True))
    y = torch.softmax(x.detach(), 1)
    torch.library.opcheck(softmax_op._softmax_backward_op, (torch.randn_like(y), y, 1, False, 1.0, torch.float16))


# Dense layouts whose leading dimensions do not merge for the last dim: a
# kernel that kept the input's strides where the fake kernel says contiguous
# (the C++ scaled_masked_softmax did) fails test_faketensor here, and
# torch.compile's stride assertion in a compiled graph.
OPCHECK_LAYOUTS = {
    "permuted": lambda x: x.permute(1, 0, 2, 3),
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
}
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("layout", list(OPCHECK_LAYOUTS))
def test_opcheck_layouts(backend, layout):
    _, device = backend
    x = OPCHECK_LAYOUTS[layout](varied((2, 3, 4, 5), torch.float32, device, seed=21))
    mask = (torch.rand(5, generator=torch.Generator().manual_seed(3)) > 0.3).to(device)
    for args in ((x, None, 0.5, False), (x, mask, 0.5, True)):
        torch.library.opcheck(softmax_op._scaled_masked_softmax_op, args, test_utils=OPCHECK_UTILS)
    for dim in (1, 3):
        torch.library.opcheck(softmax_op._softmax_forward_op, (x, dim, dim == 3, None), test_utils=OPCHECK_UTILS)
        y = torch.softmax(x, dim)
        # the gradient's layout follows the saved output's: y contiguous, and y laid out like x
        for saved in (y.contiguous(), torch.empty_like(x).copy_(y)):
            for grad in (torch.randn_like(x), torch.randn(x.shape, device=device)):
                torch.library.opcheck(softmax_op._softmax_backward_op, (grad, saved, dim, False, 1.0, torch.float32),
                                      test_utils=OPCHECK_UTILS)
    # In eager too: the leading dims do not merge, so the output is contiguous (the rule of output_like).
    assert scaled_masked_softmax(x, mask, 0.5).stride() == torch.empty(x.shape).stride()


def test_info_lists_the_ops():
    report = effilayers._info.collect()
    cpu = {entry["op"]: entry["backend"] for entry in report["ops"] if entry["device"] == "cpu"}
    for op in ("softmax_forward", "softmax_backward", "scaled_masked_softmax_forward"):
        assert op in cpu
        assert cpu[op] in ("cpp", "reference", "triton")


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [1000, 4096, 32768, 65537, 262144])
def test_triton_gpu_rows(dtype, cols):
    with effilayers.use_backend("triton"):
        x = varied((16, cols), dtype, "cuda").requires_grad_()
        for log, fn in ((False, softmax), (True, log_softmax)):
            y = fn(x, -1)
            assert_matches(y, expected(x, -1, log), dtype, log)
            grad = varied((16, cols), dtype, "cuda", seed=1)
            (gx,) = torch.autograd.grad(y, x, grad)
            check_grad(gx, y, grad, -1, log, dtype)


@pytest.mark.gpu
def test_triton_gpu_over_2_31_elements():
    # 2**31 + 32768 fp16 elements: offsets past int32 must be formed in int64.
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        # An 80 GB GPU has room: in CI (EFFILAYERS_REQUIRE_COMPILED=1) a full
        # GPU is an error to see, not a reason to go green without the test.
        (pytest.fail if REQUIRE_COMPILED else pytest.skip)(f"needs ~12 GiB of free GPU memory, {free / 2**30:.1f} free")
    with effilayers.use_backend("triton"):
        x = torch.randn(65537, 32768, dtype=torch.float16, device="cuda")
        y = softmax(x, -1)
        torch.testing.assert_close(y[-2:].float(), torch.softmax(x[-2:].float(), -1), rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(y[:2].float(), torch.softmax(x[:2].float(), -1), rtol=1e-3, atol=1e-6)
