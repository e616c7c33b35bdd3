"""batch_stats: every backend against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import effilayers
from effilayers.ops import batch_stats, batch_stats_reference, combine_batch_stats

from .accuracy import tolerance
from .helpers import channel_varied, to_layout

SHAPES = [
    (2, 3),  # rank 2
    (7, 1),
    (5, 1030),  # rank 2 with more channels than one channels_last tile
    (3, 4, 5),  # rank 3
    (1, 1, 1, 1),
    (2, 3, 5, 7),  # odd sizes
    (3, 2, 4099),  # one channel's values span several CPU chunks
    (2, 3, 3, 4, 5),  # rank 5
    (1, 2, 131, 131),  # planes longer than one chunk (17161 values)
    (40, 16, 30, 30),  # many chunks per channel in either layout
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def expected_stats(x, correction):
    """Statistics of the same rounded values, computed in float64."""
    mean, var, count = batch_stats_reference(x.double(), correction)
    return mean, var, count


def assert_stats_close(actual, expected, dtype, x):
    mean, var, count = actual
    exp_mean, exp_var, exp_count = expected
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert mean.dtype == acc and var.dtype == acc
    assert count.dtype == torch.int64 and count.dim() == 0
    assert int(count) == int(exp_count)
    rtol = tolerance(dtype, "batch_stats")["rtol"]
    # Means near zero need an absolute floor tied to the data's spread.
    spread = (exp_var.nan_to_num(0.0).clamp_min(0).sqrt() + exp_mean.abs()).cpu()
    mean_error = (mean.double().cpu() - exp_mean.cpu()).abs()
    assert bool((mean_error <= rtol * spread + 1e-300).all()), f"mean off by {mean_error.max():.3g}"
    torch.testing.assert_close(var.double().cpu(), exp_var.cpu(), rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("correction", [0, 1])
def test_matches_float64_reference(stats_device, shape, dtype, correction):
    x = channel_varied(shape, dtype, stats_device, seed=sum(shape))
    actual = batch_stats(x, correction)
    assert_stats_close(actual, expected_stats(x, correction), dtype, x)


@pytest.mark.parametrize("layout", ["channels_last", "strided"])
@pytest.mark.parametrize("shape", [(2, 3), (3, 4, 5), (2, 3, 5, 7), (4, 33, 9, 9), (2, 3, 3, 4, 5), (2, 5, 70, 70),
                                   (8, 48, 30, 30)],
                         ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_layouts_match_contiguous(stats_device, shape, layout, dtype):
    x = channel_varied(shape, dtype, stats_device, seed=3)
    laid_out = to_layout(x, layout)
    assert torch.equal(laid_out, x)
    actual = batch_stats(laid_out, 1)
    assert_stats_close(actual, expected_stats(x, 1), dtype, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_mean_keeps_variance(stats_device, dtype):
    # Values 1e4 + small noise: in fp32 a one-pass E[x^2] - E[x]^2 has an
    # ulp of 8 at 1e8 and loses the variance entirely.
    noise = {torch.float32: 1.0, torch.float16: 64.0, torch.bfloat16: 256.0}[dtype]
    generator = torch.Generator().manual_seed(7)
    base = 1e4 + noise * torch.randn(64, 3, 17, 19, generator=generator, dtype=torch.float64)
    x = base.to(dtype).to(stats_device)
    mean, var, _ = batch_stats(x)
    exact_mean, exact_var, _ = expected_stats(x, 0)
    torch.testing.assert_close(var.double().cpu(), exact_var.cpu(), rtol=1e-4, atol=0)
    torch.testing.assert_close(mean.double().cpu(), exact_mean.cpu(), rtol=1e-7, atol=0)
    if dtype == torch.float32:
        # The test has teeth: the naive formula is far off on the same data.
        xf = x.float().cpu()
        naive = (xf * xf).mean((0, 2, 3)) - xf.mean((0, 2, 3)) ** 2
        assert ((naive.double() - exact_var.cpu()).abs() / exact_var.cpu()).max() > 0.05


def test_fp16_sum_would_overflow(stats_device):
    # 60000 fits fp16 (max 65504) but any sum of two such values does not.
    x = torch.full((64, 2, 8, 8), 6.0e4, dtype=torch.float16, device=stats_device)
    x[:, 1] = -5.0e4
    x[::2, :, 0, 0] += 32  # a little variance
    mean, var, _ = batch_stats(x)
    exact_mean, exact_var, _ = expected_stats(x, 0)
    assert torch.isfinite(mean).all() and torch.isfinite(var).all()
    torch.testing.assert_close(mean.double().cpu(), exact_mean.cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double().cpu(), exact_var.cpu(), rtol=1e-3, atol=0)


def test_empty_batch_is_neutral(stats_device):
    x = torch.empty(0, 4, 3, 3, device=stats_device)
    mean, var, count = batch_stats(x, 1)
    assert int(count) == 0
    assert torch.equal(mean.cpu(), torch.zeros(4)) and torch.equal(var.cpu(), torch.zeros(4))


def test_no_channels(stats_device):
    mean, var, count = batch_stats(torch.empty(3, 0, 2, device=stats_device))
    assert mean.shape == (0,) and var.shape == (0,) and int(count) == 6


def test_single_value_unbiased_is_nan(stats_device):
    x = torch.tensor([[1.5, -2.0]], device=stats_device)
    mean, var, count = batch_stats(x, 1)
    assert int(count) == 1
    assert torch.equal(mean.cpu(), torch.tensor([1.5, -2.0]))
    assert torch.isnan(var).all()
    _, biased, _ = batch_stats(x, 0)
    assert torch.equal(biased.cpu(), torch.zeros(2))


def test_nan_input_propagates(stats_device):
    x = channel_varied((4, 3, 5), torch.float32, stats_device)
    x[1, 2, 3] = float("nan")
    mean, var, _ = batch_stats(x)
    assert torch.isnan(mean[2]) and torch.isnan(var[2])
    assert torch.isfinite(mean[:2]).all() and torch.isfinite(var[:2]).all()


def test_outputs_are_fresh(stats_device):
    # Two calls give equal, distinct tensors; the input is untouched.
    x = channel_varied((6, 5, 7, 3), torch.float16, stats_device)
    before = x.clone()
    first = batch_stats(x)
    second = batch_stats(x)
    assert torch.equal(x, before)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr() or a.numel() == 0


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradcheck(stats_device, correction, layout):
    x = to_layout(channel_varied((3, 4, 5, 2), torch.float64, stats_device), layout).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: batch_stats(t, correction)[:2], (x,))
    assert torch.autograd.gradgradcheck(lambda t: batch_stats(t, correction)[:2], (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gradient_matches_float64(stats_device, dtype):
    x = channel_varied((4, 3, 6), dtype, stats_device).requires_grad_()
    weights = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(stats_device)
    mean, var, _ = batch_stats(x, 1)
    (mean.double() * weights[0] + var.double() * weights[1]).sum().backward()
    assert x.grad.dtype == dtype

    reference = x.detach().double().requires_grad_()
    ref_var, ref_mean = torch.var_mean(reference, dim=(0, 2), correction=1)
    (ref_mean * weights[0] + ref_var * weights[1]).sum().backward()
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(x.grad.double(), reference.grad, rtol=tolerance, atol=tolerance)


def test_count_is_not_differentiable(stats_device):
    x = torch.randn(3, 2, device=stats_device, requires_grad=True)
    _, _, count = batch_stats(x)
    assert not count.requires_grad


def test_cpu_result_independent_of_thread_count():
    context = effilayers.use_backend("cpp")
    with context:
        if effilayers.backends.choice("batch_stats", "cpu").kernel is None:
            pytest.skip("C++ kernels unavailable")
        x = channel_varied((32, 8, 40, 40), torch.float32)
        xl = x.contiguous(memory_format=torch.channels_last)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            single = [batch_stats(x), batch_stats(xl)]
            torch.set_num_threads(max(2, threads))
            multi = [batch_stats(x), batch_stats(xl)]
        finally:
            torch.set_num_threads(threads)
        for a, b in zip(single, multi):
            for ta, tb in zip(a, b):
                assert torch.equal(ta, tb)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dims=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    offset=st.sampled_from([0.0, 3.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_layouts(stats_device, dims, layout, dtype, offset, seed):
    x = to_layout(channel_varied(tuple(dims), dtype, stats_device, seed=seed, offset_scale=offset + 1e-3), layout)
    assert_stats_close(batch_stats(x, 1), expected_stats(x, 1), dtype, x)


# ---- combine_batch_stats -------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[5, 0, 3, 1], [1, 1], [0, 7], [12]])
@pytest.mark.parametrize("correction", [0, 1])
def test_combine_equals_whole_batch(sizes, correction):
    x = channel_varied((sum(sizes), 3, 4), torch.float64, offset_scale=50.0)
    parts = torch.split(x, sizes)
    stats = [batch_stats(part, 0) for part in parts]
    mean, var, count = combine_batch_stats(
        [s[0] for s in stats], [s[1] for s in stats], [s[2] for s in stats], correction=correction
    )
    exact = batch_stats_reference(x, correction)
    torch.testing.assert_close(mean, exact[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, exact[1], rtol=1e-12, atol=1e-12)
    assert int(count) == int(exact[2])


def test_combine_all_empty_gives_zeros():
    mean, var, count = combine_batch_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 0]), correction=1)
    assert int(count) == 0 and torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.zeros(3))


def test_combine_bad_arguments():
    with pytest.raises(ValueError, match="means and variances"):
        combine_batch_stats(torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="counts must be"):
        combine_batch_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="correction"):
        combine_batch_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1, 1]), correction=-1)


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: batch_stats(torch.randn(5)), ValueError, "at least 2 dimensions"),
        (lambda: batch_stats(torch.ones(2, 3, dtype=torch.int64)), TypeError, "dtype must be float16"),
        (lambda: batch_stats(torch.ones(2, 3, dtype=torch.complex64)), TypeError, "dtype must be float16"),
        (lambda: batch_stats(torch.randn(2, 3), correction=-1), ValueError, "correction must be a non-negative int"),
        (lambda: batch_stats(torch.randn(2, 3), correction=True), ValueError, "correction must be"),
        (lambda: batch_stats(torch.randn(2, 3), correction=0.5), ValueError, "correction must be"),
        (lambda: batch_stats([[1.0, 2.0]]), TypeError, "input must be a torch.Tensor"),
    ],
)
def test_bad_input_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_compiled_kernel_checks_its_own_arguments():
    with effilayers.use_backend("cpp"):
        if effilayers.backends.choice("batch_stats", "cpu").kernel is None:
            pytest.skip("C++ kernels unavailable")
    kernel = torch.ops.effilayers.batch_stats
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        kernel(torch.randn(4), 0)
    with pytest.raises(TypeError, match="dtype must be float16"):
        kernel(torch.ones(2, 2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="correction must be non-negative"):
        kernel(torch.randn(2, 2), -2)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_compiled_finish_statistics_is_batchnorms_update_in_float64(momentum):
    from effilayers.ops import _batchnorm

    with effilayers.use_backend("cpp"):
        if effilayers.backends.choice("finish_statistics", "cpu").kernel is None:
            pytest.skip("C++ kernels unavailable")
    kernel = torch.ops.effilayers.finish_statistics
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(5, generator=g, dtype=torch.float64) * 3 + 1
    var = torch.rand(5, generator=g, dtype=torch.float64) * 2 + 0.1
    buffers = [torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64) + 0.5,
               torch.tensor(3)]
    expected = [b.clone() for b in buffers]
    _, invstd = _batchnorm._finish(mean, var, 12, *expected, momentum, 1e-5)
    got = kernel(mean, var, 12, *buffers, 0.0 if momentum is None else momentum, momentum is None, 1e-5)
    torch.testing.assert_close(got, invstd, rtol=1e-14, atol=0)
    for value, reference in zip(buffers, expected):
        torch.testing.assert_close(value, reference, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="contiguous vectors of one length"):
        kernel(mean, var[:4], 12, None, None, None, 0.1, False, 1e-5)
    with pytest.raises(ValueError, match="both be float32 or float64"):
        kernel(mean.float(), var, 12, None, None, None, 0.1, False, 1e-5)
    with pytest.raises(ValueError, match="needs num_batches_tracked"):
        kernel(mean, var, 12, buffers[0], None, None, 0.0, True, 1e-5)
