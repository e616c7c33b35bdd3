"""effilayers.functional.sum/mean/var/std/norm: every backend against float64.

Includes the overflow table of issue 5: inputs where torch's own fp16/bf16
reduction (or the naive formula a user would write) gives inf/nan or a wrong
value while the true result is representable, with both results asserted.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import effilayers
import effilayers.functional as EF
from effilayers import backends, memory
from effilayers.ops.reductions import _reduce_op, as_three

from .accuracy import assert_close, tolerance
from .conftest import (
    backend_names,
    backend_params,
    fake_cuda_autocast,
    far_apart_rows,
    forced_backend,
    peak_rss_growth,
    required_backend,
)


@pytest.fixture(params=backend_params("reduce"))
def backend(request):
    """Forces the reduce op onto one backend; yields (backend name, device)."""
    for device in forced_backend(request, "reduce"):
        yield request.param[0], device


def interpreted(backend) -> bool:
    return backend[0] == "triton" and backend[1].type == "cpu"


def skip_unsupported(backend, *dtypes):
    # The Triton interpreter has neither bf16 arithmetic nor float64 loads
    # done right; bf16/float64 Triton run in the gpu-marked parameters.
    if interpreted(backend) and any(d in (torch.bfloat16, torch.float64) for d in dtypes):
        pytest.skip("the Triton interpreter has no bf16/float64 arithmetic (covered by triton-cuda)")


KINDS = ["sum", "mean", "var", "std", "norm"]


def kinds_for(backend):
    """All kinds; under the (slow) interpreter one per partial the kernel
    forms (mean and std share sum's and var's; test_matches_float64 still
    runs all five there)."""
    return ["sum", "var", "norm"] if interpreted(backend) else KINDS


def ours(kind, x, dim=None, keepdim=False, dtype=None, correction=1):
    if kind in ("var", "std"):
        return getattr(EF, kind)(x, dim, correction=correction, keepdim=keepdim, dtype=dtype)
    return getattr(EF, kind)(x, dim, keepdim=keepdim, dtype=dtype)


def truth(kind, x, dim=None, keepdim=False, correction=1):
    """torch in float64 on the same (already rounded) values."""
    wide = x.double()
    if dim is None:
        dim = tuple(range(x.dim()))
    if kind == "sum":
        return wide.sum(dim, keepdim=keepdim)
    if kind == "mean":
        return wide.mean(dim, keepdim=keepdim)
    if kind == "norm":
        return torch.linalg.vector_norm(wide, 2, dim, keepdim)
    with warnings.catch_warnings():  # "degrees of freedom is <= 0": the cases test that
        warnings.simplefilter("ignore", UserWarning)
        return getattr(torch, kind)(wide, dim, correction=correction, keepdim=keepdim)


def values(shape, dtype, device, seed=0, offset=2.0):
    """Random values with varied magnitudes around ``offset`` (no zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * torch.rand(
        shape, generator=generator, dtype=torch.float64).add(0.5) + offset
    return x.to(dtype=dtype, device=device)


def assert_matches(actual, expected, dtype):
    assert actual.dtype == dtype and actual.shape == expected.shape
    assert_close(actual.double().cpu(), expected.cpu(), dtype, "reduction", equal_nan=True)


CASES = [
    ((7,), None, False),
    ((), None, False),
    ((1,), 0, True),
    ((5, 7, 9), 1, False),
    ((5, 7, 9), -1, True),
    ((5, 7, 9), 0, False),
    ((5, 7, 9), (0, 2), False),  # not a run of dims: one input copy
    ((5, 7, 9), (1, 2), True),
    ((5, 7, 9), (-3, -2), False),
    ((3, 4, 5, 6), (1, 2), False),
    ((3, 1, 5), 1, False),
    ((13, 1), 0, False),  # one column
]


@pytest.mark.parametrize("shape,dim,keepdim", CASES, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_matches_float64(backend, shape, dim, keepdim, kind, dtype):
    skip_unsupported(backend, dtype)
    x = values(shape, dtype, backend[1], seed=len(shape) + 3 * KINDS.index(kind))
    actual = ours(kind, x, dim, keepdim)
    assert_matches(actual, truth(kind, x, dim, keepdim).to(dtype).double(), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_result_of_half_input(backend, kind, dtype):
    # dtype=float32: the float32 result, not the fp16/bf16 one upcast.
    skip_unsupported(backend, dtype)
    x = values((6, 301), dtype, backend[1], seed=5)
    for dim in (1, 0, None):
        actual = ours(kind, x, dim, dtype=torch.float32)
        assert_matches(actual, truth(kind, x, dim), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_long_rows(backend, dtype):
    # 65,537 values per output: several CPU blocks and a ragged last block.
    # Under the interpreter, a row just over one Triton tile instead.
    skip_unsupported(backend, dtype)
    columns = 4097 if interpreted(backend) else 65537
    x = values((2, columns), dtype, backend[1], seed=11)
    for kind in kinds_for(backend):
        for dim in (1, None):
            assert_matches(ours(kind, x, dim), truth(kind, x, dim).to(dtype).double(), dtype)
        assert_matches(ours(kind, x.t(), 0), truth(kind, x.t(), 0).to(dtype).double(), dtype)
        assert_matches(ours(kind, x, 1, dtype=torch.float32), truth(kind, x, 1), torch.float32)


def layouts(device, dtype):
    base = values((4, 6, 5, 3), dtype, device, seed=2)
    matrix = values((9, 37), dtype, device, seed=3)
    return {
        "transposed": (matrix.t(), [0, 1, None, (0, 1)]),
        "channels_last": (base.contiguous(memory_format=torch.channels_last), [1, (2, 3), (0, 2, 3), None, 0]),
        "strided": (base[:, :, ::2], [-1, (1, 2), None, 0]),
        "permuted": (base.permute(2, 0, 3, 1), [0, 3, (1, 2), None]),
    }


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "strided", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_layouts(backend, layout, dtype):
    skip_unsupported(backend, dtype)
    x, dims = layouts(backend[1], dtype)[layout]
    for kind in kinds_for(backend):
        for dim in dims:
            assert_matches(ours(kind, x, dim), truth(kind, x, dim).to(dtype).double(), dtype)


def test_dense_full_reduction_reads_in_place():
    # Order does not matter for a full reduction: a dense permuted tensor is
    # read in memory order, an input with gaps is copied.
    base = values((4, 6, 5, 3), torch.float32, "cpu")
    channels_last = base.contiguous(memory_format=torch.channels_last)
    view = as_three(channels_last, (0, 1, 2, 3))
    assert view.data_ptr() == channels_last.data_ptr() and view.stride(1) == 1
    assert as_three(base.transpose(0, 3), (0, 1, 2, 3)).data_ptr() == base.data_ptr()
    assert as_three(base[:, :, ::2], (0, 1, 2, 3)).data_ptr() != base.data_ptr()
    # channel dim of channels_last and a transposed matrix: views too
    assert as_three(channels_last, (1,)).data_ptr() == channels_last.data_ptr()
    assert as_three(base[0, 0].t(), (0,)).data_ptr() == base.data_ptr()


@pytest.mark.parametrize("shape,dims", [((3, 37, 5), (1,)), ((130,), (0,)), ((37, 6), (0,)), ((2, 3, 25), (0, 1, 2))],
                         ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_multi_tile_and_split(monkeypatch, shape, dims, dtype):
    # Tiny tiles and a small program target so every output needs several
    # tiles and the long reductions split across programs (float64 combine).
    with required_backend("reduce", "triton", "cpu"):  # a failure, not a skip, under EFFILAYERS_REQUIRE_COMPILED=1
        from effilayers.ops.reductions import triton as kernels

        monkeypatch.setattr(kernels, "TILE_ELEMENTS", 16)
        monkeypatch.setattr(kernels, "MAX_BLOCK_I", 4)
        monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 8)
        assert kernels._config(1, 300, 1)[2] > 1  # the split path is taken
        x = values(shape, dtype, "cpu", seed=9)
        for kind in KINDS:
            assert_matches(ours(kind, x, dims, dtype=torch.float32), truth(kind, x, dims), torch.float32)
        flipped = x.transpose(0, -1)
        flipped_dims = tuple(x.dim() - 1 - k for k in dims)
        for kind in ("sum", "var", "norm"):
            assert_matches(ours(kind, flipped, flipped_dims), truth(kind, flipped, flipped_dims).to(dtype).double(),
                           dtype)


@contextlib.contextmanager
def poisoned_allocations():
    """Every floating tensor allocated inside, by torch or by a kernel's own
    ``at::empty``, starts as NaN (torch's deterministic mode fills
    uninitialised memory), so an output element a kernel does not write
    fails its comparison."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.empty(3).isnan().all()  # the poison is really there
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


@pytest.mark.parametrize("shape,dims", [((5, 7, 9), (1,)), ((5, 7, 9), (0,)), ((9, 37), (1,)), ((5, 7, 9), (0, 1, 2)),
                                        ((2, 5000), (1,))], ids=lambda c: str(c).replace(" ", ""))
def test_kernels_write_every_output(backend, shape, dims):
    # Call the kernel itself with every allocation NaN-poisoned: an output it
    # does not write stays NaN and fails.
    x = values(shape, torch.float32, backend[1], seed=4)
    for layout in (x, x.transpose(0, -1)):
        d = dims if layout is x else tuple(sorted(x.dim() - 1 - k for k in dims))
        for kind in kinds_for(backend):
            with poisoned_allocations():
                out = backends.kernel("reduce", backend[1])(layout, list(d), kind, 1, False, None)
            expected = truth(kind, layout, d).float()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the overflow table


@dataclass
class OverflowCase:
    name: str
    make: Callable[[], torch.Tensor]  # the input (CPU)
    torch_result: Callable[[torch.Tensor], torch.Tensor]  # what torch (or the naive formula) gives
    ours: Callable[[torch.Tensor], torch.Tensor]
    true: Callable[[torch.Tensor], torch.Tensor]  # float64 on the same values
    torch_is: str  # "inf", "nan" or "off" (finite but wrong by more than 1%)


def _cancelling_bf16():
    # Every partial sum is a whole multiple of one bf16 value, so float64
    # holds it exactly in any order: the total is 3e38 on every device.
    # (With a trailing +1 and a total of 1, as here before, a parallel
    # float64 sum on the H200 lost the 1 in a partial sum of order 1e41:
    # the true sum depended on the order, so no GPU reduction could meet it.)
    big = torch.full((1000,), 3e38, dtype=torch.bfloat16)
    return torch.cat([big, -big[:999]])


def _seeded(n, scale, dtype, offset=0.0):
    generator = torch.Generator().manual_seed(n)
    return (offset + scale * torch.randn(n, generator=generator, dtype=torch.float64)).to(dtype)


def _norm64(x, **kw):
    return torch.linalg.vector_norm(x.double(), 2, **kw)


OVERFLOW_TABLE = [
    OverflowCase("bf16 mean of 100000 x 3e38", lambda: torch.full((100000,), 3e38, dtype=torch.bfloat16),
                 torch.mean, EF.mean, lambda x: x.double().mean(), "inf"),
    OverflowCase("bf16 mean(dim=1) of (3, 100000) x 3e38",
                 lambda: torch.full((3, 100000), 3e38, dtype=torch.bfloat16),
                 lambda x: x.mean(1), lambda x: EF.mean(x, 1), lambda x: x.double().mean(1), "inf"),
    OverflowCase("bf16 mean(dim=0) of (100000, 3) x 3e38",
                 lambda: torch.full((100000, 3), 3e38, dtype=torch.bfloat16),
                 lambda x: x.mean(0), lambda x: EF.mean(x, 0), lambda x: x.double().mean(0), "inf"),
    OverflowCase("bf16 mean(dtype=float32) of 100000 x 3e38",
                 lambda: torch.full((100000,), 3e38, dtype=torch.bfloat16),
                 lambda x: x.mean(dtype=torch.float32), lambda x: EF.mean(x, dtype=torch.float32),
                 lambda x: x.double().mean(), "inf"),
    OverflowCase("bf16 sum of +3e38 x 1000, -3e38 x 999 (partial sums overflow, total 3e38)", _cancelling_bf16,
                 torch.sum, EF.sum, lambda x: x.double().sum(), "nan"),
    OverflowCase("bf16 vector_norm of 1000 x 1e20 (squares overflow float32)",
                 lambda: torch.full((1000,), 1e20, dtype=torch.bfloat16),
                 torch.linalg.vector_norm, EF.norm, _norm64, "inf"),
    OverflowCase("bf16 vector_norm(dtype=float32) of randn(1000) * 1e20", lambda: _seeded(1000, 1e20, torch.bfloat16),
                 lambda x: torch.linalg.vector_norm(x, dtype=torch.float32), lambda x: EF.norm(x, dtype=torch.float32),
                 _norm64, "inf"),
    OverflowCase("bf16 vector_norm(dim=0) of (1000, 4) x 1e20",
                 lambda: torch.full((1000, 4), 1e20, dtype=torch.bfloat16),
                 lambda x: torch.linalg.vector_norm(x, dim=0), lambda x: EF.norm(x, 0), lambda x: _norm64(x, dim=0),
                 "inf"),
    OverflowCase("fp32 vector_norm of 10 x 1e20", lambda: torch.full((10,), 1e20),
                 torch.linalg.vector_norm, EF.norm, _norm64, "inf"),
    OverflowCase("fp16 naive x.pow(2).sum().sqrt() of randn(1000) * 300", lambda: _seeded(1000, 300, torch.float16),
                 lambda x: x.pow(2).sum().sqrt(), EF.norm, _norm64, "inf"),
    OverflowCase("fp16 naive x.sum() / n of 100000 x 60000",
                 lambda: torch.full((100000,), 60000.0, dtype=torch.float16),
                 lambda x: x.sum() / x.numel(), EF.mean, lambda x: x.double().mean(), "inf"),
    OverflowCase("fp16 naive one-pass var E[x^2] - E[x]^2 in float32 of 1e4 + 16 randn(10000)",
                 lambda: _seeded(10000, 16, torch.float16, offset=1e4),
                 lambda x: x.float().pow(2).mean() - x.float().mean() ** 2,
                 lambda x: EF.var(x, correction=0, dtype=torch.float32), lambda x: x.double().var(correction=0), "off"),
]


@pytest.mark.parametrize("case", OVERFLOW_TABLE, ids=lambda c: c.name)
def test_overflow_table(backend, case):
    x = case.make()
    skip_unsupported(backend, x.dtype)
    expected = case.true(x)
    theirs = case.torch_result(x).double()
    if case.torch_is == "inf":
        assert bool(torch.isinf(theirs).all()), f"torch gave {theirs}"
    elif case.torch_is == "nan":
        assert bool(torch.isnan(theirs).all()), f"torch gave {theirs}"
    else:
        assert bool(((theirs - expected).abs() > 0.01 * expected.abs()).all()), f"torch gave {theirs}, true {expected}"
    mine = case.ours(x.to(backend[1]))
    assert bool(torch.isfinite(mine).all()), f"ours gave {mine}"
    # the true result is representable in the output dtype
    assert bool(torch.isfinite(expected.to(mine.dtype)).all())
    torch.testing.assert_close(mine.double().cpu(), expected.to(mine.dtype).double(),
                               rtol=tolerance(mine.dtype, "reduction")["rtol"], atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rescaled_blocks_of_huge_values(backend, dtype):
    # Blocks whose float32 sums overflow go through the power-of-two rescue
    # (CPU) / the running exponent (Triton), in the row and the column
    # layouts: the mean is exact, var of a constant is 0, the norm finite.
    skip_unsupported(backend, dtype)
    x = torch.full((5000, 3), 3e38, dtype=dtype, device=backend[1])
    x[::2, 1] = 1e38  # a column with spread: var 1e76 is out of range (inf), as it should be
    for layout, dim in ((x, 0), (x.t().contiguous(), 1), (x, None)):
        for kind in KINDS:
            actual = ours(kind, layout, dim, dtype=torch.float32)
            expected = truth(kind, layout, dim).float()
            # 5000 float32 values of 24 bits summed in float32: ~1e-5 off
            torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=1e-4, atol=0, equal_nan=True)
    assert ours("var", x[:, 0], 0).item() == 0.0


def test_fp16_sum_beyond_fp16_range(backend):
    # 6e9 is not representable in fp16: inf is the right fp16 answer; with
    # dtype=float32 the float32 result comes back.
    x = torch.full((100000,), 60000.0, dtype=torch.float16, device=backend[1])
    assert torch.isinf(EF.sum(x)).item()
    assert EF.sum(x, dtype=torch.float32).item() == 6e9
    assert EF.mean(x).item() == 60000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_large_mean_keeps_variance(backend, dtype):
    # 1e4 + noise: a one-pass E[x^2] - E[x]^2 in float32 loses the variance.
    skip_unsupported(backend, dtype)
    noise = {torch.float32: 1.0, torch.float16: 16.0, torch.bfloat16: 256.0}[dtype]
    generator = torch.Generator().manual_seed(7)
    x = (1e4 + noise * torch.randn(40, 301, generator=generator, dtype=torch.float64)).to(dtype).to(backend[1])
    for dim in (1, 0, None):
        for kind in ("var", "std"):
            assert_matches(ours(kind, x, dim, dtype=torch.float32), truth(kind, x, dim), torch.float32)


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("kind", KINDS)
def test_empty_reduction_like_torch(backend, kind):
    x = torch.empty(0, 3, device=backend[1])
    for dim in (0, None):
        actual = ours(kind, x, dim)
        expected = truth(kind, x, dim).float()
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual.cpu(), expected.cpu(), equal_nan=True)
    assert ours(kind, x, 1).shape == (0,)


@pytest.mark.parametrize("kind", ["var", "std"])
def test_correction_at_least_n_like_torch(backend, kind):
    for data, correction in (([1.0, 2.0], 2), ([1.0, 2.0], 3), ([1.0], 1), ([1.0, 1.0], 2), ([1.0, 2.0, 4.0], 0)):
        x = torch.tensor(data, device=backend[1])
        actual = ours(kind, x, correction=correction)
        expected = truth(kind, x.cpu(), correction=correction)
        torch.testing.assert_close(actual.double().cpu(), expected, equal_nan=True)


@pytest.mark.parametrize("kind", ["var", "std"])
def test_float_and_negative_correction_like_torch(backend, kind):
    # torch.var/std take any real correction (dividing M2 by max(0, n - c)).
    x = values((4, 9), torch.float32, backend[1], seed=14)
    for correction in (0.5, 1.5, -1.0, 2, 8.5, 9.0):
        for dim in (1, None):
            actual = ours(kind, x, dim, correction=correction)
            expected = truth(kind, x.cpu(), dim, correction=correction)
            torch.testing.assert_close(actual.double().cpu(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    leaf = x.clone().requires_grad_()
    ours(kind, leaf, 1, correction=0.5).sum().backward()
    reference = x.cpu().double().requires_grad_()
    getattr(torch, kind)(reference, 1, correction=0.5).sum().backward()
    torch.testing.assert_close(leaf.grad.double().cpu(), reference.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_dim_empty_tuple_and_zero_dim_like_torch(backend, kind):
    x = values((3, 4), torch.float32, backend[1])
    torch.testing.assert_close(ours(kind, x, ()), ours(kind, x, None))
    assert ours(kind, x, (), keepdim=True).shape == (1, 1)
    scalar = torch.tensor(2.5, device=backend[1])
    for dim in (None, 0, -1, ()):
        actual = ours(kind, scalar, dim)
        assert actual.shape == ()
        torch.testing.assert_close(actual.double().cpu(), truth(kind, scalar, dim if dim != () else None).cpu(),
                                   equal_nan=True)


def test_integer_input_with_a_floating_dtype_like_torch(backend):
    # torch.sum / torch.mean take integer and bool x with a floating dtype;
    # without one (or for var/std/norm) both refuse, torch.sum aside (an int64 sum).
    device = backend[1]
    values = (torch.arange(24, device=device).view(2, 3, 4) * 977 - 9000)
    for x in (values, values.to(torch.int32), (values % 200).to(torch.uint8), values > 0):
        for kind in ("sum", "mean"):
            for dtype in (torch.float32, torch.float16):
                for dim in (None, 1, (0, 2)):
                    expected = getattr(torch, kind)(x.cpu().double(), () if dim is None else dim)
                    result = getattr(EF, kind)(x, dim, dtype=dtype)
                    assert result.dtype == dtype
                    torch.testing.assert_close(result.cpu().double(), expected.to(dtype).double(),
                                               rtol=tolerance(dtype, "reduction")["rtol"], atol=0)
            with pytest.raises(TypeError, match="pass a floating dtype="):
                getattr(EF, kind)(x)
        for kind in ("var", "std", "norm"):
            with pytest.raises(TypeError, match="x must be float16, bfloat16, float32 or float64"):
                getattr(EF, kind)(x, dtype=torch.float32)


def test_forward_mode_ad_is_refused(backend):
    # No forward-mode rule: torch would hand back a zero tangent silently.
    device = backend[1]
    x, tangent = values((3, 5), torch.float32, device), values((3, 5), torch.float32, device, seed=1)
    for kind in KINDS:
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(lambda t: getattr(EF, kind)(t, 1), (x,), (tangent,))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda t: EF.norm(t, ord=1), (x,), (tangent,))
    # ord=inf is torch's own vector_norm: its tangent is right, so it runs
    _, expected = torch.func.jvp(lambda t: torch.linalg.vector_norm(t, math.inf), (x,), (tangent,))
    torch.testing.assert_close(torch.func.jvp(lambda t: EF.norm(t, ord=math.inf), (x,), (tangent,))[1], expected)


def test_norm_second_positional_argument_is_dim():
    # The README's warning: unlike torch.norm(x, p), norm(x, 1) reduces dim 1 (2-norm); ord is keyword-only.
    x = values((3, 4), torch.float32, "cpu")
    torch.testing.assert_close(EF.norm(x, 1), torch.linalg.vector_norm(x, 2, dim=1))
    assert EF.norm(x, 1).shape == (3,) and torch.norm(x, 1).shape == ()
    assert EF.norm(x, 1, True).shape == (3, 1)
    with pytest.raises(TypeError):
        EF.norm(x, 1, False, 1)


def test_bad_arguments():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="x must be float16, bfloat16, float32 or float64"):
        EF.sum(torch.arange(5))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        EF.mean([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype must be None, float16"):
        EF.sum(x, dtype=torch.int64)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        EF.var(x, 2)
    with pytest.raises(ValueError, match="appears more than once"):
        EF.norm(x, (1, -1))
    with pytest.raises(TypeError, match="dim must contain ints"):
        EF.std(x, (0.5,))
    with pytest.raises(TypeError, match="correction must be an int or a float"):
        EF.var(x, correction="1")
    with pytest.raises(TypeError, match="correction must be an int or a float"):
        EF.std(x, correction=True)
    with pytest.raises(TypeError, match="keepdim must be a bool"):
        EF.sum(x, 0, 1)
    for backend in ("reference", None):  # the op checks before its Python kernels; the C++ one checks itself
        with effilayers.use_backend(backend), pytest.raises(ValueError, match="kind must be one of"):
            _reduce_op(x, [0], "max", 0, False, None)


def test_cpp_is_deterministic_across_thread_counts():
    x = values((3, 70001), torch.bfloat16, "cpu", seed=1)
    threads = torch.get_num_threads()
    with effilayers.use_backend("cpp"):
        try:
            torch.set_num_threads(1)
            one = [ours(kind, x, dim) for kind in KINDS for dim in (1, 0, None)]
            torch.set_num_threads(max(2, threads))
            many = [ours(kind, x, dim) for kind in KINDS for dim in (1, 0, None)]
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- autograd


GRAD_DIMS = [None, 1, (0, 2), -1]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keepdim", [False, True])
def test_gradcheck(backend, kind, keepdim):
    if interpreted(backend):
        pytest.skip("float64 gradcheck runs on the CPU paths; the Triton one is compared in float32 below")
    x = values((3, 4, 5), torch.float64, backend[1], seed=6).requires_grad_()
    for dim in GRAD_DIMS:
        assert torch.autograd.gradcheck(lambda t: ours(kind, t, dim, keepdim), (x,))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_gradients_match_reference(kind):
    x = values((3, 4, 5), torch.float32, "cpu", seed=8)
    results = []
    for backend_name in ("reference", "triton"):
        # Skips only where Triton cannot run; fails instead under EFFILAYERS_REQUIRE_COMPILED=1 (CI).
        with required_backend("reduce", backend_name, "cpu"):
            leaf = x.clone().requires_grad_()
            out = ours(kind, leaf, (0, 2))
            out.backward(torch.linspace(0.5, 1.5, out.numel()).view(out.shape))
            results.append(leaf.grad)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_zero_result_gradients_like_torch(backend):
    # norm of zeros and std of a constant: gradient 0, as torch gives.
    for kind, x in (("norm", torch.zeros(2, 5)), ("std", torch.full((2, 5), 3.0))):
        leaf = x.detach().to(backend[1]).clone().requires_grad_()
        ours(kind, leaf, 1).sum().backward()
        reference = x.detach().clone().requires_grad_()
        (torch.linalg.vector_norm(reference, dim=1) if kind == "norm" else reference.std(1)).sum().backward()
        assert torch.equal(leaf.grad.cpu(), reference.grad)


def test_half_backward_does_not_overflow(backend):
    # var's 2 (x - mean) / (n - 1) * g: x - mean = 90000 overflows fp16 (torch:
    # inf), the gradient 60000 does not. std: torch gives nan there.
    x = torch.tensor([60000.0, -60000.0, -60000.0, -60000.0], dtype=torch.float16)
    for kind in ("var", "std"):
        leaf = x.detach().to(backend[1]).clone().requires_grad_()
        ours(kind, leaf).backward()
        wide = x.detach().double().requires_grad_()
        getattr(torch, kind)(wide).backward()
        theirs = x.detach().clone().requires_grad_()
        getattr(torch, kind)(theirs).backward()
        assert not bool(torch.isfinite(theirs.grad).all())  # torch's fp16 backward
        torch.testing.assert_close(leaf.grad.double().cpu(), wide.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_bf16_norm_backward_of_huge_values(backend, dtype):
    skip_unsupported(backend, dtype)
    x = torch.full((1000,), 1e20, dtype=dtype)
    leaf = x.detach().to(backend[1]).clone().requires_grad_()
    EF.norm(leaf).backward()
    theirs = x.detach().clone().requires_grad_()
    torch.linalg.vector_norm(theirs).backward()
    assert bool((theirs.grad == 0).all())  # torch: norm inf, gradient 0
    torch.testing.assert_close(leaf.grad.double().cpu(), torch.full((1000,), 1 / math.sqrt(1000), dtype=torch.float64),
                               rtol=1e-2, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_bytes(kind):
    # sum/mean keep nothing for backward; var keeps the input; std and norm
    # the input and their (small) output.
    x = values((64, 33), torch.float16, "cpu").requires_grad_()
    with memory.track_activations() as meter:
        out = ours(kind, x, 1)
    expected = {"sum": 0, "mean": 0, "var": x.nbytes}.get(kind, x.nbytes + out.nbytes)
    assert meter.bytes == expected
    out.sum().backward()
    assert x.grad.dtype == torch.float16 and x.grad.shape == x.shape


# ---------------------------------------------------------------- the custom op


def test_opcheck():
    x = values((3, 4, 5), torch.float32, "cpu").requires_grad_()
    torch.library.opcheck(_reduce_op, (x, [1], "var", 1, False, None))
    torch.library.opcheck(_reduce_op, (x.detach().half(), [0, 2], "norm", 0, True, torch.float32))
    torch.library.opcheck(_reduce_op, (x, [0, 1, 2], "mean", 0, False, None))


@pytest.mark.parametrize("layout", ["permuted", "channels_last"])
def test_opcheck_layouts(backend, layout):
    # Dense inputs whose dims merge only partly: the output's strides must be
    # the fake kernel's on every backend.
    base = values((2, 3, 4, 5), torch.float32, backend[1])
    x = base.permute(1, 0, 2, 3) if layout == "permuted" else base.contiguous(memory_format=torch.channels_last)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for dims, kind, keepdim in (([1], "sum", False), ([3], "var", True), ([0, 2], "norm", False),
                                ([1, 2, 3], "var", True)):
        torch.library.opcheck(_reduce_op, (x, dims, kind, 1, keepdim, None), test_utils=utils)


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def standardized_norm(x):
        centered = x - EF.mean(x, -1, keepdim=True)
        scale = EF.std(x, -1, keepdim=True) + EF.norm(x, (0, 1)) / x.numel()
        return (centered / scale).square().sum(dim=(0, 1)) + EF.var(x, 0).sum() + EF.sum(x)

    x = values((4, 5, 6), torch.float32, "cpu").requires_grad_()
    compiled = torch.compile(standardized_norm, fullgraph=True)
    expected, actual = standardized_norm(x), compiled(x)
    torch.testing.assert_close(actual, expected)
    grad_out = torch.linspace(0.5, 1.5, expected.numel()).view(expected.shape)
    (expected_grad,) = torch.autograd.grad(expected, x, grad_out)
    (actual_grad,) = torch.autograd.grad(actual, x, grad_out)
    torch.testing.assert_close(actual_grad, expected_grad)


@pytest.mark.parametrize("backend_name", backend_names("reduce", "cpu", without=["reference"]))
def test_offsets_past_2_31_elements(backend_name):
    # Rows 2**30 + 1 elements apart in one uninitialised storage: the third
    # row starts past element 2**31, read in place as (outer, reduced, inner)
    # with a row stride beyond int32 (and, transposed, an inner stride). Only
    # the rows' pages become resident.
    data = values((3, 45), torch.float16, "cpu", seed=13)
    def run(rows=far_apart_rows):
        x = rows(data)
        for kind in ("sum", "var", "norm"):
            assert_matches(ours(kind, x, 1), truth(kind, data, 1), torch.float16)
            assert_matches(ours(kind, x.t(), 0), truth(kind, data, 1), torch.float16)

    with required_backend("reduce", backend_name, "cpu"):  # fails under EFFILAYERS_REQUIRE_COMPILED if it cannot run
        run(rows=torch.clone)  # the same calls on small tensors first: lazy initialisation is not counted
        assert peak_rss_growth(run) < 64 * 2**20


AUTOCAST_PAIRS = [  # (name, ours, torch's)
    ("sum", lambda t: EF.sum(t), lambda t: torch.sum(t)),
    ("sum dim", lambda t: EF.sum(t, 1), lambda t: torch.sum(t, 1)),
    ("sum dtype=float16", lambda t: EF.sum(t, 1, dtype=torch.float16), lambda t: torch.sum(t, 1, dtype=torch.float16)),
    ("mean", lambda t: EF.mean(t, 1), lambda t: torch.mean(t, 1)),
    ("var", lambda t: EF.var(t, 1), lambda t: torch.var(t, 1)),
    ("std", lambda t: EF.std(t), lambda t: torch.std(t)),
    ("norm", lambda t: EF.norm(t, 1), lambda t: torch.linalg.vector_norm(t, 2, 1)),
    ("norm via torch.norm", lambda t: EF.norm(t), lambda t: torch.norm(t)),
    ("norm ord=1", lambda t: EF.norm(t, 1, ord=1), lambda t: torch.linalg.vector_norm(t, 1, 1)),
    ("norm ord=inf", lambda t: EF.norm(t, 1, ord=math.inf), lambda t: torch.linalg.vector_norm(t, math.inf, 1)),
    ("norm dtype=float64", lambda t: EF.norm(t, dtype=torch.float64),
     lambda t: torch.linalg.vector_norm(t, dtype=torch.float64)),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_dtypes_follow_torch(device):
    # Measured in torch 2.13: CUDA autocast returns float32 from sum and
    # vector_norm/norm given no dtype, and leaves mean/var/std alone; CPU
    # autocast leaves all of them alone. CUDA runs on fake CUDA tensors here
    # (torch's AutocastCUDA kernels need no GPU); test_cuda_autocast_* below
    # checks the values on a real one.
    for autocast_dtype in (torch.float16, torch.bfloat16):
        context = torch.autocast("cpu", dtype=autocast_dtype) if device == "cpu" else fake_cuda_autocast(autocast_dtype)
        with context:
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                x = torch.ones(4, 8, dtype=dtype, device=device)
                for name, mine, theirs in AUTOCAST_PAIRS:
                    assert mine(x).dtype == theirs(x).dtype, (device, autocast_dtype, dtype, name)
                if device == "cuda":
                    half = x.to(autocast_dtype)
                    assert EF.sum(half).dtype == EF.norm(half).dtype == torch.float32
                    assert EF.mean(half).dtype == autocast_dtype


@pytest.mark.gpu
def test_cuda_autocast_sum_is_float32_and_finite():
    # 1e5 x 60000 in fp16: torch's autocast sum is 6e9 in float32; rounding
    # the same float32 result to fp16 would give inf.
    x = torch.full((100_000,), 60000.0, dtype=torch.float16, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        expected, actual = torch.sum(x), EF.sum(x)
        norm_expected, norm_actual = torch.linalg.vector_norm(x), EF.norm(x)
    assert actual.dtype == expected.dtype == torch.float32 == norm_actual.dtype == norm_expected.dtype
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(norm_actual, norm_expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("order", [1, math.inf])
def test_norm_other_orders(backend, order):
    skip_unsupported(backend, torch.bfloat16)
    x = values((5, 7, 9), torch.float32, backend[1], seed=12) - 2.0  # signs of both kinds
    for dim in (None, 1, (0, 2)):
        expected = torch.linalg.vector_norm(x.double(), order, dim)
        torch.testing.assert_close(EF.norm(x, dim, ord=order).double(), expected, rtol=1e-5, atol=1e-6)
    # ord=1 sums like EF.sum: 1e5 x 3e38 is beyond float32 (torch's float32
    # result is inf, rightly), and dtype=float64 returns the float64 value.
    big = torch.full((100000,), 3e38, dtype=torch.bfloat16, device=backend[1])
    assert torch.isinf(torch.linalg.vector_norm(big.cpu(), 1, dtype=torch.float32)).item()
    expected = torch.linalg.vector_norm(big.cpu().double(), order)
    torch.testing.assert_close(EF.norm(big, ord=order, dtype=torch.float64).cpu(), expected, rtol=1e-12, atol=0)
    leaf = x.detach().clone().requires_grad_()
    EF.norm(leaf, 1, ord=order).sum().backward()
    reference = x.detach().double().requires_grad_()
    torch.linalg.vector_norm(reference, order, 1).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)
    # A narrower output dtype, as ord=2 allows: the result rounded once.
    narrow = EF.norm(x, 1, ord=order, dtype=torch.float16)
    assert narrow.dtype == torch.float16
    torch.testing.assert_close(narrow.double(), torch.linalg.vector_norm(x.double(), order, 1), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="ord must be a real number"):
        EF.norm(x, ord="max")


@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_sum_mean_gradient_is_a_broadcast(kind):
    # No input-sized buffer in backward: the gradient is the output-sized
    # gradient, rounded once to fp16, expanded.
    x = values((64, 33), torch.float16, "cpu").requires_grad_()
    out = ours(kind, x, 1)
    (grad,) = torch.autograd.grad(out, x, torch.linspace(1, 2, 64))
    assert grad.dtype == torch.float16 and grad.stride()[1] == 0
    expected = torch.linspace(1, 2, 64).double()[:, None].expand(64, 33) / (33 if kind == "mean" else 1)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-3, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter: inf - inf
@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_non_finite_input_propagates_like_torch(backend, special):
    # The overflow rescue must not hide inf/nan that are in the data.
    x = values((3, 70), torch.float32, backend[1], seed=13)
    x[1, 5] = special
    for kind in KINDS:
        for dim in (1, 0, None):
            expected = truth(kind, x.cpu(), dim).float()
            torch.testing.assert_close(ours(kind, x, dim).cpu(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)
