"""Shared test fixtures.

* ``gpu``-marked tests skip cleanly without CUDA and must pass with it.
* ``EFFILAYERS_REQUIRE_COMPILED=1`` (set by .ci/run) turns "the C++ kernels
  could not be built here" from a skip into a failure, so CI cannot go green
  by silently testing only the reference path.
* Tests that run an op on each backend take their params from
  :func:`backend_params` (the op registry's declared backends), never from a
  hand-written list. Tolerances are in accuracy.py.
* Fixtures shared by the files of one family live here (``adam_device``,
  ``ce_device``, ``full_float32``, ...); helpers shared by them live in
  ``<family>_cases.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

import effilayers

REQUIRE_COMPILED = os.environ.get("EFFILAYERS_REQUIRE_COMPILED", "0") == "1"
HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--each-value-once", action="store_true",
        help="run each test function on a sample of its parametrizations: the fewest rows, taken in order, "
             "in which every value of every parameter appears at least once with each backend (CI's torch 2.11 "
             "environment, which checks the code against older torch and Triton APIs; the whole matrix runs "
             "in the newest environment)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("each_value_once"):
        kept = _each_value_once(items)
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
            items[:] = [item for item in items if item in kept]
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def _each_value_once(items) -> set:
    """The rows that cover, per test function and backend param, every
    (parameter, value) pair: a row is kept when it brings a pair not yet
    seen. Deterministic, in collection order."""
    seen, kept = set(), set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            kept.add(item)
            continue
        backend = next((value for value in callspec.params.values()
                        if isinstance(value, tuple) and len(value) == 2 and value[0] in RUNS_ON), None)
        function = (item.path, item.originalname, repr(backend))
        pairs = {(function, name, repr(value)) for name, value in callspec.params.items()}
        if not pairs <= seen:
            seen |= pairs
            kept.add(item)
    return kept


# Where each backend's kernels run, in the order tests list them. Triton
# runs on CPU tensors through its interpreter (TRITON_INTERPRET=1, small
# shapes; CI does this). test_backends checks that every backend the
# registry knows is placed here.
RUNS_ON = {"reference": ("cpu", "cuda"), "cpp": ("cpu",), "triton": ("cpu", "cuda"), "cuda": ("cuda",)}
_DEVICE_ORDER = ("cpu", "cuda")


def _param_id(backend: str, device: str) -> str:
    return "triton-interpreter" if (backend, device) == ("triton", "cpu") else f"{backend}-{device}"


def backend_params(op_name: str, *, devices=None, backends=None, without=()) -> list:
    """pytest params ``(backend, device)`` for exactly the backends the
    registry declares for ``op_name``, on every device each runs on (ids
    ``reference-cpu``, ``cpp-cpu``, ``triton-interpreter``, ``cuda-cuda``,
    ``triton-cuda``, ``reference-cuda``; CUDA ones marked ``gpu``).
    ``devices`` / ``backends`` keep only those; ``without`` drops params by id.
    A selection that names nothing the op has is an error, not an empty list."""
    kernels = effilayers.backends._state.ops[op_name]
    pairs = [(backend, device) for device in _DEVICE_ORDER for backend in RUNS_ON
             if device in RUNS_ON[backend] and kernels.provides(backend)]
    unknown = set(without) - {_param_id(*pair) for pair in pairs}
    if unknown:
        raise ValueError(f"backend_params({op_name!r}): without names no param of this op: {sorted(unknown)}")
    selected = [pytest.param(pair, id=_param_id(*pair), marks=[pytest.mark.gpu] if pair[1] == "cuda" else [])
                for pair in pairs
                if (devices is None or pair[1] in devices) and (backends is None or pair[0] in backends)
                and _param_id(*pair) not in without]
    if not selected:
        raise ValueError(f"backend_params({op_name!r}, devices={devices}, backends={backends}): the registry "
                         f"declares none of these (it has {[_param_id(*pair) for pair in pairs]})")
    return selected


def backend_names(op_name: str, device: str, *, without=()) -> list[str]:
    """The names of the backends ``op_name`` has on ``device`` (for tests
    parametrised by name on one device), less ``without``."""
    names = [p.values[0][0] for p in backend_params(op_name, devices=(device,))]
    stale = set(without) - set(names)
    if stale:
        raise ValueError(f"backend_names({op_name!r}, {device!r}): without names no backend of this op: "
                         f"{sorted(stale)}")
    return [name for name in names if name not in without]


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
        # through the interpreter included. Triton on CPU tensors is the
        # interpreter: without TRITON_INTERPRET (a GPU machine's run) it
        # cannot run, which is no failure of the build.
        interpreter = os.environ.get("TRITON_INTERPRET") == "1"
        runnable = {"cpp": device == "cpu", "cuda": HAS_CUDA, "triton": HAS_CUDA if device == "cuda" else interpreter}
        required = runnable.get(backend, False)
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


@pytest.fixture(params=backend_params("batch_stats"))
def stats_device(request):
    """Runs the test with batch_stats forced to one backend; yields the device."""
    yield from forced_backend(request, "batch_stats")


@pytest.fixture(params=backend_params("adam_step_"))
def adam_device(request):
    """Runs the test with adam_step_ forced to one backend; yields (backend, device)."""
    backend = request.param[0]
    for device in forced_backend(request, "adam_step_"):
        yield backend, device


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


# fp32 precision keys of torch >= 2.9 (parents first: setting one also sets its children).
_PRECISION_KEYS = [("generic", "all"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"), ("cuda", "matmul")]


@contextlib.contextmanager
def _restored_tf32_flags():
    """Puts cuDNN's and cuBLAS's TF32 flags (the legacy booleans and the
    fp32_precision tree) back as they were on exit."""
    legacy = torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32()
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    precisions = [getter(*key) for key in _PRECISION_KEYS] if getter is not None else []
    try:
        yield
    finally:
        torch._C._set_cudnn_allow_tf32(legacy[0])
        torch._C._set_cublas_allow_tf32(legacy[1])
        for key, precision in zip(_PRECISION_KEYS, precisions):
            torch._C._set_fp32_precision_setter(*key, precision)


@pytest.fixture
def full_float32():
    """No TF32 in a test unless it asks (the DenseNet files use it for all
    their tests; test_tf32_* turn it on): PyTorch's cuDNN convolutions, and
    the Triton kernels that follow the same flag, round float32 inputs to
    TF32 by default on a GPU, ~1e-3 off where the float32 checks allow
    ~1e-4. The flags are restored afterwards. (No effect on CPU.)"""
    with _restored_tf32_flags():
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        yield


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The DenseNet fallback warnings are once per process: forget earlier ones."""
    from effilayers.models import densenet as densenet_module

    monkeypatch.setattr(densenet_module, "_WARNED", set(), raising=False)


@pytest.fixture(params=backend_params("cross_entropy"))
def ce_device(request):
    """cross_entropy forced to one backend; yields the device."""
    yield from forced_backend(request, "cross_entropy")


@pytest.fixture(params=backend_params("cross_entropy", devices=["cpu"], without=["triton-interpreter"]))
def ce_cpu_device(request):
    yield from forced_backend(request, "cross_entropy")


@pytest.fixture(params=backend_params("cross_entropy", devices=["cpu"]))
def ce_cpu_or_interpreter_device(request):
    yield from forced_backend(request, "cross_entropy")


@pytest.fixture
def ce_small_triton_block(monkeypatch):
    """Blocks of 8 classes, and rows held whole in registers up to 16, so
    under the interpreter rows of 9 to 16 classes run the Triton
    cross_entropy kernel's one-read path (SINGLE) and longer rows its
    multi-block loop."""
    from effilayers.ops.cross_entropy import triton as kernels

    monkeypatch.setattr(kernels, "MAX_BLOCK", 8)
    monkeypatch.setattr(kernels, "MAX_FUSED_BLOCK", 16)


@pytest.fixture
def on_cpu_without_peers(monkeypatch):
    """For the bench tests: the bench picks CUDA when it can; these tests pin
    down the CPU behaviour, with the peer libraries absent unless a test
    injects one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("torchvision", "inplace_abn"):
        monkeypatch.setitem(sys.modules, name, None)


# Guard bands around every Triton launch under the interpreter (tests/guard_bands.py):
# out-of-bounds stores fail the test that made them, out-of-bounds loads read NaN.
GUARD_BANDS = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(scope="session", autouse=True)
def triton_guard_bands():
    uninstall = None
    if GUARD_BANDS:
        try:
            import triton  # noqa: F401
        except ImportError:
            pass
        else:
            from . import guard_bands

            uninstall = guard_bands.install()
    yield
    if uninstall is not None:
        uninstall()


def _whole_suite(session) -> bool:
    """Whether every test file of tests/ ran, unfiltered."""
    import pathlib

    here = pathlib.Path(__file__).parent
    ran = {item.path.name for item in session.items}
    options = session.config.option
    return (not getattr(options, "keyword", "") and not getattr(options, "markexpr", "")
            and not getattr(options, "deselect", None)
            and {path.name for path in here.glob("test_*.py")} <= ran)


def pytest_sessionfinish(session, exitstatus):
    """On a whole run under the interpreter, every Triton kernel of the package
    must have run with guard bands at least once."""
    if not GUARD_BANDS or "tests.guard_bands" not in sys.modules or not _whole_suite(session):
        return
    from . import guard_bands

    missing = [kernel for kernel in guard_bands.package_kernels() if not guard_bands.GUARDED[kernel]]
    session.config._guard_bands_missing = missing
    if missing and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not GUARD_BANDS or "tests.guard_bands" not in sys.modules:
        return
    from . import guard_bands

    counts = guard_bands.GUARDED
    terminalreporter.write_line(
        f"guard bands: {sum(counts.values())} Triton launches of {len(counts)} kernels ran guarded "
        f"({sum(guard_bands.SPARSE.values())} sparse buffers, {sum(guard_bands.RAW_REGIONS.values())} regions "
        f"through address tables)")
    missing = getattr(config, "_guard_bands_missing", None)
    if missing:
        terminalreporter.write_line(f"FAILED: Triton kernels never launched under guard bands: {missing}", red=True)
