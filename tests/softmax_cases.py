"""What the softmax test files share: the backend fixture (outputs poisoned,
the Triton interpreter's block limits lowered), input makers, the float64
expectation and the comparisons."""

from __future__ import annotations

import math

import pytest
import torch

from effilayers.ops.softmax import reference as softmax_reference

from .accuracy import assert_close, tolerance
from .conftest import activate_backend, backend_params, poison_cpp_allocations

# The Triton interpreter gets small shapes and lowered block limits so the
# multi-block paths run (and tiles narrowed to 4 columns before they do).
INTERPRETER_LIMITS = dict(MAX_FUSED_BLOCK=32, ONLINE_BLOCK=16, SPLIT_BLOCK=16, MAX_TILE=64, MIN_TILE_COLUMNS=4)


def _is_interpreter(backend, device):
    return backend == "triton" and device == "cpu"


def softmax_backend_fixture(**selection):
    """A fixture over ``backend_params("softmax_forward", **selection)`` that
    runs each test with that backend forced (see _forced) and yields
    (backend name, device). A test module names it by assignment:
    ``backend = softmax_backend_fixture()``."""

    @pytest.fixture(params=backend_params("softmax_forward", **selection))
    def fixture(request, monkeypatch):
        yield from _forced(request, monkeypatch)

    return fixture


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
    actual = actual.double().cpu()
    # An exact gradient beyond the output dtype's range (log-softmax's
    # g - exp(y) * sum(g) over a long row of large g) rounds to an infinity
    # of its sign, in torch as in any kernel: expected there, the rest
    # compared as usual.
    overflow = reference.to(dtype).isinf()
    assert torch.equal(actual[overflow], reference[overflow].sign() * math.inf), "overflowed gradient not +-inf"
    actual, reference = actual[~overflow], reference[~overflow]
    # Relative to the largest gradient of the tensor (accuracy.py says why).
    scale = reference.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual / scale, reference / scale, **tolerance(dtype, "softmax_grad"))


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
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def dtypes_for(name, device):
    # The interpreter has no bf16 arithmetic (bf16 Triton runs on the GPU tests).
    return [d for d in DTYPES if not (_is_interpreter(name, device) and d == torch.bfloat16)]
