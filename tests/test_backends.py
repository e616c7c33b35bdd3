"""Backend selection, the first-use build, the no-compiler fallback and
``python -m effilayers.info``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import effilayers
from effilayers import backends

from .conftest import REQUIRE_COMPILED, RUNS_ON, backend_names, backend_params

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, tmp_path: Path, **env_overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("EFFILAYERS_BACKEND", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'gpu'; allowed: reference, cpp, cuda, triton"):
        with effilayers.use_backend("gpu"):
            pass


def test_forced_backend_that_cannot_run_raises_with_reasons():
    x = torch.randn(4, 3)
    with effilayers.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="no usable backend on cpu.*cuda kernels run on cuda tensors"):
            effilayers.batch_stats(x)
    with effilayers.use_backend("triton"):
        with pytest.raises(RuntimeError, match="batch_stats has no triton kernel"):
            effilayers.batch_stats(x)


def test_preference_list_takes_first_usable():
    with effilayers.use_backend("triton, cuda, reference"):
        chosen = backends.choice("batch_stats", "cpu")
        assert chosen.backend == "reference"
        assert "forced by use_backend=triton,cuda,reference" in chosen.reason
        mean, var, _ = effilayers.batch_stats(torch.ones(2, 3))
        assert torch.equal(var, torch.zeros(3))


def test_use_backend_restores_previous_choice():
    before = backends.current_preference()
    with effilayers.use_backend("reference"):
        assert backends.current_preference() == ("reference",)
    assert backends.current_preference() == before


def test_automatic_choice_prefers_compiled_kernel():
    if backends.current_preference() is not None:
        pytest.skip("EFFILAYERS_BACKEND is set for this run")
    chosen = backends.choice("batch_stats", "cpu")
    if chosen.backend != "cpp":
        if REQUIRE_COMPILED:
            pytest.fail(f"C++ kernels required: {chosen.reason}")
        pytest.skip(chosen.reason)
    assert chosen.reason == "compiled kernel"


def test_no_compiler_warns_once_and_falls_back(tmp_path):
    result = run_python(
        """
        import warnings, torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import effilayers
            x = torch.randn(6, 3, 4)
            first = effilayers.batch_stats(x)
            second = effilayers.batch_stats(x.double())
            third = effilayers.batch_stats(x.contiguous(memory_format=torch.contiguous_format), 1)
        ours = [w for w in caught if "effilayers" in str(w.message)]
        print(len(ours))
        print(ours[0].message if ours else "")
        expected = effilayers.ops.batch_stats_reference(x)
        print(torch.equal(first[0], expected[0]) and torch.equal(first[1], expected[1]))
        print(effilayers.backends.choice("batch_stats", "cpu").backend)
        """,
        tmp_path,
        CXX="/nonexistent/c++",
        EFFILAYERS_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert result.returncode == 0, result.stderr
    count, message, equal, backend = result.stdout.strip().splitlines()
    assert count == "1"
    assert "using the pure-PyTorch reference" in message and "no C++ compiler found" in message
    assert equal == "True"
    assert backend == "reference"


def test_forced_compiled_backend_without_compiler_fails_loudly(tmp_path):
    result = run_python(
        """
        import torch, effilayers
        effilayers.batch_stats(torch.randn(2, 3))
        """,
        tmp_path,
        CXX="/nonexistent/c++",
        EFFILAYERS_CACHE_DIR=str(tmp_path / "cache"),
        EFFILAYERS_BACKEND="cpp",
    )
    assert result.returncode != 0
    assert "no usable backend on cpu for EFFILAYERS_BACKEND=cpp" in result.stderr
    assert "no C++ compiler found" in result.stderr


def test_bad_environment_variable_fails_at_import(tmp_path):
    result = run_python("import effilayers", tmp_path, EFFILAYERS_BACKEND="fast")
    assert result.returncode != 0
    assert "EFFILAYERS_BACKEND / use_backend: unknown backend 'fast'" in result.stderr


@pytest.mark.slow
def test_build_optimisation_level_comes_from_the_environment(monkeypatch):
    from effilayers._core import build

    monkeypatch.delenv(build.OPT_LEVEL_VAR, raising=False)
    assert "-O3" in build.cflags("cpu")
    default_key = build._fingerprint("cpu", build.sources("cpu"))
    monkeypatch.setenv(build.OPT_LEVEL_VAR, "1")
    assert "-O1" in build.cflags("cpu") and "-O3" not in build.cflags("cuda")
    # the flags are part of the cache key, so the two builds never share a directory
    assert build._fingerprint("cpu", build.sources("cpu")) != default_key
    monkeypatch.setenv(build.OPT_LEVEL_VAR, "fast")
    with pytest.raises(ValueError, match="EFFILAYERS_OPT_LEVEL must be 0, 1, 2 or 3"):
        build.cflags("cpu")


def test_two_processes_building_at_once(tmp_path):
    """Both processes get a working library from one build into a cache that
    holds only an older build, and that build seeds the new one: ninja links
    the library from its objects instead of compiling them again."""
    from effilayers._core import build as _build

    if REQUIRE_COMPILED:
        _build.build_and_load("cpu")
    current = _build.cache_root() / f"{_build.library_name('cpu')}-{_build._fingerprint('cpu', _build.sources('cpu'))}"
    if not (current / f"{_build.library_name('cpu')}.so").exists():
        pytest.skip("no finished build of the cpu library in this session's cache to seed from")
    seed = tmp_path / "cache" / f"{_build.library_name('cpu')}-seed"
    shutil.copytree(current, seed, ignore=shutil.ignore_patterns("*.lock", "lock"))
    # The building process asks ninja, in its own build directory just before
    # it builds, which objects it will compile and why: ninja's judgment on
    # the exact files and manifest it then builds from.
    code = """
        import subprocess, sys
        from torch.utils import cpp_extension
        run_ninja = cpp_extension._run_ninja_build

        def explained(build_directory, *args, **kwargs):
            dry = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=build_directory, capture_output=True,
                                 text=True)
            print("<dry-run>" + dry.stdout + dry.stderr + "</dry-run>", file=sys.stderr, flush=True)
            return run_ninja(build_directory, *args, **kwargs)

        cpp_extension._run_ninja_build = explained
        import torch, effilayers
        from effilayers import backends
        x = torch.arange(24, dtype=torch.float32).view(4, 3, 2)
        mean, var, count = effilayers.batch_stats(x, 1)
        print(backends.choice("batch_stats", "cpu").backend)
        print(backends.library_report()["cpu"])
        print(mean.tolist(), var.tolist(), int(count))
    """
    env = dict(os.environ)
    env.pop("EFFILAYERS_BACKEND", None)
    env.update(EFFILAYERS_CACHE_DIR=str(tmp_path / "cache"), EFFILAYERS_BACKEND="cpp",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    processes = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err
    lines = [out.strip().splitlines() for out, _ in outputs]
    assert all(line[0] == "cpp" for line in lines)
    origins = sorted(line[1].split(" ")[1].strip("(") for line in lines)
    assert origins == ["built", "cached"], origins  # one compiled, the other waited and loaded
    # the one that compiled said so on stderr (a first call can take a minute); the other did not
    notices = sorted("effilayers: compiling the cpu kernels" in err for _, err in outputs)
    assert notices == [False, True], [err for _, err in outputs]
    assert lines[0][2] == lines[1][2]
    expected = effilayers.ops.batch_stats_reference(torch.arange(24, dtype=torch.float32).view(4, 3, 2), 1)
    assert lines[0][2] == f"{expected[0].tolist()} {expected[1].tolist()} 8"
    # Seeded, not compiled: every object ninja took for up to date is the
    # seed's own file, untouched. ninja may still compile some (a log from
    # another ninja version is discarded; a checkout dated after the seed's
    # objects makes them older than their sources), but never because the
    # command changed: that would mean a seed can never be reused.
    (dry_run,) = [err.split("<dry-run>")[1].split("</dry-run>")[0] for _, err in outputs if "<dry-run>" in err]
    assert "command line changed" not in dry_run, dry_run
    steps = [line for line in dry_run.splitlines() if line.startswith("[")]
    assert any("-shared" in line for line in steps), dry_run
    objects = sorted(seed.glob("*.o"))
    assert objects
    for path in objects:
        compiled = any(line.endswith(f"-o {path.name}") or f" -o {path.name} " in line for line in steps)
        reused = (tmp_path / "cache" / current.name / path.name).stat().st_mtime == path.stat().st_mtime
        assert reused is not compiled, (path.name, dry_run)


def test_info_command_prints_backend_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "effilayers.info"], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"torch                {torch.__version__}" in out
    assert "backends" in out and "batch_stats" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("batch_stats") and " cpu " in line)
    assert row.split()[2] in ("cpp", "reference")


def test_info_json_and_function():
    import io

    buffer = io.StringIO()
    report = effilayers.info(file=buffer)
    assert "batch_stats" in buffer.getvalue()
    assert {row["op"] for row in report["ops"]} == set(backends.registered_ops())
    json.dumps(report)  # serialisable for benchmark results
    assert report["torch"] == torch.__version__


def test_info_stays_callable_after_its_command_module_is_imported():
    """Importing ``effilayers.info`` (the ``python -m`` module) rebinds the
    package's ``info`` to the module; it must still print and return the report."""
    import importlib
    import io

    importlib.import_module("effilayers.info")
    buffer = io.StringIO()
    report = effilayers.info(file=buffer)
    assert "batch_stats" in buffer.getvalue() and report["torch"] == torch.__version__


def test_unusable_cache_directory_falls_back_with_the_reason(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    result = run_python(
        """
        import warnings, torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import effilayers
            mean, var, count = effilayers.batch_stats(torch.ones(4, 2))
            effilayers.batch_stats(torch.ones(4, 2))
        ours = [w for w in caught if "effilayers" in str(w.message)]
        print(len(ours), effilayers.backends.choice("batch_stats", "cpu").backend, var.tolist())
        print(ours[0].message)
        """,
        tmp_path,
        EFFILAYERS_CACHE_DIR=str(blocker / "cache"),
    )
    assert result.returncode == 0, result.stderr
    first, message = result.stdout.strip().splitlines()
    assert first == "1 reference [0.0, 0.0]"
    assert "Error" in message  # the OSError's type and text are in the warning


def test_new_build_directory_starts_from_the_newest_finished_build(tmp_path):
    """A changed source rebuilds only what changed: the new cache directory
    gets the newest finished build's objects and ninja state, timestamps kept,
    and no object written there after its library was linked."""
    from effilayers._core import build as _build

    name = _build.library_name("cpu")

    def finished_build(directory: str, linked_at: float, objects: dict[str, float], root=_build.csrc_dir()) -> Path:
        path = tmp_path / directory
        path.mkdir()
        (path / "build.ninja").write_text(f"cflags = -I{root} -O3\n")
        for file_name, modified_at in {**objects, f"{name}.so": linked_at}.items():
            (path / file_name).write_text(directory)
            os.utime(path / file_name, (modified_at, modified_at))
        return path

    finished_build(f"{name}-old", 1000.0, {"abn.o": 900.0, ".ninja_log": 990.0})
    finished_build(f"{name}-new", 2000.0, {"abn.o": 1900.0, "stats.o": 2500.0, ".ninja_log": 2001.0})
    # Newest of all, but built from another checkout: its commands differ.
    finished_build(f"{name}-other-checkout", 3000.0, {"abn.o": 2900.0}, root="/elsewhere/csrc")
    (tmp_path / f"{name}-unfinished").mkdir()
    (tmp_path / f"{name}-unfinished" / "abn.o").write_text("half")

    target = tmp_path / f"{name}-target"
    target.mkdir()
    _build._seed_from_previous_build("cpu", target)
    assert sorted(p.name for p in target.iterdir()) == [".ninja_log", "abn.o"]  # stats.o is newer than the link
    assert (target / "abn.o").read_text() == f"{name}-new"
    assert (target / "abn.o").stat().st_mtime == 1900.0

    # A directory that already has its own build files is left alone.
    (target / "build.ninja").write_text("")
    (target / "abn.o").unlink()
    _build._seed_from_previous_build("cpu", target)
    assert not (target / "abn.o").exists()


def test_an_op_whose_cpu_path_is_pytorch_does_not_warn():
    """An op with a Triton GPU kernel and no C++ kernel by design (its CPU
    path is PyTorch ops): choosing that path on CPU is not a fallback and
    must not warn."""
    import warnings

    name = "test_pytorch_on_cpu"
    backends.register(backends.OpKernels(name=name, reference=lambda x: x, triton=lambda x: x))
    try:
        with effilayers.use_backend(None), warnings.catch_warnings():
            warnings.simplefilter("error")
            chosen = backends.choice(name, "cpu")
    finally:
        backends._state.ops.pop(name)
        backends._state.choices.pop((name, "cpu"), None)
    assert chosen.backend == "reference"
    assert "this op's cpu path" in chosen.reason


def test_a_cpp_kernel_may_be_a_composition_of_compiled_kernels():
    """A cpp kernel given as a Python callable (composing the library's
    compiled kernels) is chosen, as a compiled kernel, exactly when the
    library is."""
    name = "test_cpp_composition"

    def composed(x):
        return torch.ops.effilayers_cpu.batch_stats(x, 0)

    backends.register(backends.OpKernels(name=name, reference=lambda x: x, cpp=composed))
    try:
        with effilayers.use_backend(None):
            chosen = backends.choice(name, "cpu")
    finally:
        backends._state.ops.pop(name)
        backends._state.choices.pop((name, "cpu"), None)
    if chosen.backend != "cpp":
        from .conftest import REQUIRE_COMPILED

        assert not REQUIRE_COMPILED, chosen.reason
        pytest.skip(f"the C++ library is unavailable here: {chosen.reason}")
    assert chosen.kernel is composed
    assert chosen.reason == "compiled kernel"


def _described(params):
    """(backend, device, id, gpu-marked) of each param."""
    return {(*p.values[0], p.id, any(mark.name == "gpu" for mark in p.marks)) for p in params}


def test_backend_params_are_the_registrys_declared_backends():
    """Every test that runs an op on each backend takes its params from
    backend_params: for every registered op, exactly the backends the
    registry declares, on each device they run on, the CUDA ones gpu-marked."""
    assert set(RUNS_ON) == set(backends.BACKENDS)  # a new backend must be placed in conftest.RUNS_ON
    for device, order in backends._DEFAULT_ORDER.items():
        assert all(device in RUNS_ON[backend] for backend in order), (device, order)
    for name in backends.registered_ops():
        kernels = backends._state.ops[name]
        expected = {(backend, device, "triton-interpreter" if (backend, device) == ("triton", "cpu")
                     else f"{backend}-{device}", device == "cuda")
                    for backend in backends.BACKENDS if kernels.provides(backend) for device in RUNS_ON[backend]}
        assert _described(backend_params(name)) == expected, name


def test_backend_params_pick_up_a_new_op_and_its_backends():
    declared = {"test_params_cpp_cuda": dict(cpp="x", cuda="x"), "test_params_triton": dict(triton=lambda x: x)}
    for name, kernels in declared.items():
        backends.register(backends.OpKernels(name=name, reference=lambda x: x, **kernels))
    try:
        assert {p.id for p in backend_params("test_params_cpp_cuda")} == {
            "reference-cpu", "cpp-cpu", "cuda-cuda", "reference-cuda"}
        assert {p.id for p in backend_params("test_params_triton")} == {
            "reference-cpu", "triton-interpreter", "triton-cuda", "reference-cuda"}
        assert backend_names("test_params_triton", "cpu") == ["reference", "triton"]
    finally:
        for name in declared:
            backends._state.ops.pop(name)


def test_backend_params_list_no_kernel_an_op_lacks():
    """Adam's GPU kernel is Triton: no cuda-cuda param (a CUDA machine under
    EFFILAYERS_REQUIRE_COMPILED=1 would fail it), and a selection of a
    backend the op lacks is an error rather than an empty list."""
    for name in ("adam_step_", "adam_step_8bit_"):
        assert "cuda-cuda" not in {p.id for p in backend_params(name)}
        assert [p.id for p in backend_params(name, backends=["triton"])] == ["triton-interpreter", "triton-cuda"]
    with pytest.raises(ValueError, match="declares none of these"):
        backend_params("adam_step_", backends=["cuda"])
    with pytest.raises(ValueError, match="without names no param of this op: \\['cuda-cuda'\\]"):
        backend_params("adam_step_", without=["cuda-cuda"])
    with pytest.raises(ValueError, match="without names no backend of this op"):
        backend_names("batch_stats", "cpu", without=["triton"])


def test_each_value_once_keeps_every_value_of_every_parameter_per_backend():
    """CI's torch 2.11 environment runs `--each-value-once`: per test function
    and backend, the rows in which every parameter value appears once."""
    from pathlib import Path
    from types import SimpleNamespace

    from .conftest import _each_value_once

    class Row:  # a collected item's attributes the sampling reads (pytest items hash by identity)
        def __init__(self, name, **params):
            self.path, self.originalname = Path("test_x.py"), name
            if params:
                self.callspec = SimpleNamespace(params=params)


    grid = [Row("test_a", device=backend, dtype=dtype, shape=shape)
            for backend in (("cpp", "cpu"), ("reference", "cpu")) for dtype in ("f32", "f16")
            for shape in (1, 2, 3)]
    plain = Row("test_b")  # not parametrized: always kept
    kept = _each_value_once([*grid, plain])
    assert plain in kept
    for backend in (("cpp", "cpu"), ("reference", "cpu")):
        rows = [r for r in grid if r in kept and r.callspec.params["device"] == backend]
        assert {r.callspec.params["dtype"] for r in rows} == {"f32", "f16"}
        assert {r.callspec.params["shape"] for r in rows} == {1, 2, 3}
        # (f32, 1), (f32, 2), (f32, 3) bring a new shape each, (f16, 1) brings f16
        assert [(r.callspec.params["dtype"], r.callspec.params["shape"]) for r in rows] == [
            ("f32", 1), ("f32", 2), ("f32", 3), ("f16", 1)]
    assert len(kept) == 2 * 4 + 1


def test_an_effilayers_warning_no_test_expects_fails_it():
    """pyproject's filterwarnings makes effilayers' own warnings errors in the
    suite (third-party ones are filtered there, each with its reason), so a
    warning effilayers starts raising shows up as a failure, not in a summary
    of thousands."""
    from effilayers._core import registry

    with pytest.raises(RuntimeWarning, match="effilayers: compiled test-device kernels are unavailable"):
        registry._warn_fallback("test-device", "a reason for this test")


def test_every_compiled_op_is_declared_once():
    """Every op with a C++ kernel is declared through ``registry.declare``
    (its one schema), and the libraries declare no op of their own: no
    ``effilayers_cpu::`` namespace, no schema written again in C++."""
    from effilayers._core import build

    from .conftest import REQUIRE_COMPILED

    try:
        build.build_and_load("cpu")
    except build.ExtensionUnavailable as error:
        assert not REQUIRE_COMPILED, str(error)
        pytest.skip(f"the C++ library is unavailable here: {error}")
    undeclared = sorted(name for name, kernels in backends._state.ops.items()
                        if kernels.cpp and name not in backends._state.declared)
    assert not undeclared, undeclared
    names = torch._C._dispatch_get_all_op_names()
    assert not [name for name in names if name.startswith(("effilayers_cpu::", "effilayers_cuda::"))]
    assert not (build.csrc_dir() / "common" / "schemas.h").exists()


def test_declared_ops_have_one_schema_and_the_library_kernels():
    """A declared op exists once, ``effilayers::<op>``: the C++ library adds
    its CPU kernel to it (TORCH_LIBRARY_IMPL; torch checks the kernel's
    signature against the declared schema when the library loads) and
    declares no op of its own. A forced backend is registered on the CPU key
    for the ``use_backend`` block only, and the library's kernel is back
    after it."""
    from effilayers._core import build, registry

    from .conftest import REQUIRE_COMPILED

    try:
        build.build_and_load("cpu")
    except build.ExtensionUnavailable as error:
        assert not REQUIRE_COMPILED, str(error)
        pytest.skip(f"the C++ library is unavailable here: {error}")
    declared = {name for name in registry._state.declared if registry._state.ops[name].cpp == name}
    assert {"softmax_forward", "softmax_backward", "scaled_masked_softmax_forward", "batch_stats",
            "normalizing_statistics", "finish_statistics", "abn_forward", "abn_forward_", "abn_backward_reduce",
            "abn_backward_elemt", "abn_backward", "dense_bottleneck_forward", "dense_bottleneck_backward",
            "cross_entropy", "cross_entropy_chunk_stats_", "cross_entropy_chunk_grad_",
            "cross_entropy_soft_chunk_stats_", "cross_entropy_soft_chunk_grad_", "reduce", "adam_step_",
            "adam_step_8bit_"} <= declared
    for name in declared:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"effilayers::{name}", "CPU"), name
        assert not hasattr(torch.ops.effilayers_cpu, name), name

    kernels = registry._state.ops["softmax_forward"]
    calls = []
    reference = kernels.reference

    def counted(*args):
        calls.append(args)
        return reference(*args)

    x = torch.randn(3, 5)
    kernels.reference = counted
    try:
        with backends.use_backend("reference"):
            forced = torch.ops.effilayers.softmax_forward(x, 1, False, None)
        assert len(calls) == 1
        compiled = torch.ops.effilayers.softmax_forward(x, 1, False, None)
        assert len(calls) == 1
    finally:
        kernels.reference = reference
    torch.testing.assert_close(forced, compiled)
    torch.testing.assert_close(compiled, torch.softmax(x, 1))
    with backends.use_backend("cuda"), pytest.raises(RuntimeError, match="no usable backend on cpu"):
        torch.ops.effilayers.softmax_forward(x, 1, False, None)
