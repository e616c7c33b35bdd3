"""Shared test fixtures.

* ``gpu``-marked tests skip cleanly without CUDA and must pass with it.
* ``EFFILAYERS_REQUIRE_COMPILED=1`` (set by .ci/run) turns "the C++ kernels
  could not be built here" from a skip into a failure, so CI cannot go green
  by silently testing only the reference path.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import effilayers

REQUIRE_COMPILED = os.environ.get("EFFILAYERS_REQUIRE_COMPILED", "0") == "1"
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


# (backend, device) pairs every op test runs on.
BACKEND_PARAMS = [
    pytest.param(("reference", "cpu"), id="reference-cpu"),
    pytest.param(("cpp", "cpu"), id="cpp-cpu"),
    pytest.param(("cuda", "cuda"), id="cuda-cuda", marks=pytest.mark.gpu),
    pytest.param(("reference", "cuda"), id="reference-cuda", marks=pytest.mark.gpu),
]


# Ops whose GPU kernel is written in Triton add these: the same kernels run
# on CPU tensors under TRITON_INTERPRET=1 (small shapes; CI does this).
TRITON_PARAMS = [
    pytest.param(("triton", "cpu"), id="triton-interpreter"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
]


def activate_backend(op_name: str, backend: str, device: str):
    """Context manager forcing ``backend``; skips (or fails under
    EFFILAYERS_REQUIRE_COMPILED=1) when it cannot run here."""
    context = effilayers.use_backend(backend)
    context.__enter__()
    chosen = effilayers.backends.choice(op_name, device)
    if chosen.kernel is None:
        context.__exit__(None, None, None)
        # Under CI (EFFILAYERS_REQUIRE_COMPILED=1, TRITON_INTERPRET=1) every
        # kernel that can run on this machine must run, the Triton ones
        # through the interpreter included.
        required = backend in ("cpp", "cuda", "triton") and (device == "cpu" or HAS_CUDA)
        if REQUIRE_COMPILED and required:
            pytest.fail(f"compiled backend required but unavailable: {chosen.error}")
        pytest.skip(chosen.error)
    return context


@contextlib.contextmanager
def required_backend(op_name: str, backend: str, device: str):
    """``with`` form of :func:`activate_backend`: the block runs with
    ``backend`` forced, and skips (fails under EFFILAYERS_REQUIRE_COMPILED=1)
    when it cannot run here."""
    context = activate_backend(op_name, backend, device)
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def forced_backend(request, op_name: str):
    """Body of a fixture parametrised by (backend, device) pairs: runs the
    test with that backend forced and yields the device."""
    backend, device = request.param
    context = activate_backend(op_name, backend, device)
    try:
        yield torch.device(device)
    finally:
        context.__exit__(None, None, None)


@pytest.fixture(params=BACKEND_PARAMS)
def stats_device(request):
    """Runs the test with batch_stats forced to one backend; yields the device."""
    yield from forced_backend(request, "batch_stats")


@contextlib.contextmanager
def fake_cuda_autocast(dtype: torch.dtype):
    """CUDA autocast without a GPU: inside, ``torch.empty(..., device="cuda")``
    makes fake CUDA tensors (shapes and dtypes only), and ops on them go
    through the AutocastCUDA kernels torch registers, so torch's own output
    dtypes under CUDA autocast can be read, and an op's compared with them,
    on a CPU-only machine."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", previous)


def peak_rss_growth(fn) -> int:
    """Bytes by which the process's peak resident set grows while ``fn`` runs
    (Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current
    RSS, so earlier peaks do not hide this one)."""
    def high_water_mark():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = high_water_mark()
    fn()
    return high_water_mark() - before


# Rows this many elements apart put the third row's offsets past 2**31.
FAR_APART = 2**30 + 1


def far_apart_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` (rows, cols) copied into a view whose rows are FAR_APART
    elements apart in one uninitialised storage of more than 2**31 elements:
    kernels must form int64 offsets, yet only the pages of the rows are
    touched (a few KiB of resident memory for GiBs of address space)."""
    import torch.utils.deterministic as deterministic

    rows, cols = values.shape
    fill, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:  # not NaN-filled even under poison_cpp_allocations: that would make GiBs resident
        storage = torch.empty((rows - 1) * FAR_APART + cols, dtype=values.dtype, device=values.device)
    finally:
        deterministic.fill_uninitialized_memory = fill
    view = storage.as_strided((rows, cols), (FAR_APART, 1))
    view.copy_(values)
    return view


def poison_cpp_allocations(request) -> None:
    """For the rest of the test, tensors allocated by ATen on CPU, the C++
    kernels' outputs included (at::empty / at::empty_like), start as NaN
    (integers at their maximum): torch's use_deterministic_algorithms(True)
    with fill_uninitialized_memory. An output element a kernel forgets to
    write then fails a comparison instead of holding whatever was there."""
    import torch.utils.deterministic as deterministic

    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                deterministic.fill_uninitialized_memory)

    def restore():
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        deterministic.fill_uninitialized_memory = previous[2]

    request.addfinalizer(restore)
    deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True)
