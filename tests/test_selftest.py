"""``python -m effilayers.info --selftest`` (effilayers/_selftest.py)."""

from __future__ import annotations

import collections
import os
import re

import pytest
import torch

from effilayers import _info, _selftest
from effilayers._core import registry

from .accuracy import TOLERANCES
from .conftest import REQUIRE_COMPILED

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture
def without_cuda(monkeypatch):
    """As on a machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def cpu_run():
    """The self-test's rows on this machine as if it had no GPU, and the
    Triton launches it made under guard bands (per kernel; empty without
    the interpreter)."""
    from . import guard_bands

    before = collections.Counter(guard_bands.GUARDED)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        rows = _selftest.selftest()
    return rows, guard_bands.GUARDED - before


@pytest.fixture
def cpu_rows(cpu_run):
    return cpu_run[0]


def test_every_registered_op_has_inputs():
    assert set(_selftest.CASES) == set(registry.registered_ops())


def test_passes_on_cpu(cpu_rows):
    failed = [row for row in cpu_rows if row.status == "FAIL"]
    assert not failed, _selftest.format_rows(failed)
    cpp = [row for row in cpu_rows if row.backend == "cpp"]
    assert {row.op for row in cpp} == {op for op in registry.registered_ops()
                                        if registry.op_kernels(op).provides("cpp")}
    if REQUIRE_COMPILED:  # the C++ kernels must have run, not been reported missing
        assert all(row.status == "pass" and row.device == "cpu" for row in cpp), _selftest.format_rows(cpp)
    for row in cpu_rows:
        if row.status == "pass":
            assert 0.0 <= row.worst <= 1.0 and row.max_error is not None


def test_triton_rows_follow_the_interpreter(cpu_rows):
    triton_rows = [row for row in cpu_rows if row.backend == "triton"]
    assert {row.op for row in triton_rows} == {op for op in registry.registered_ops()
                                                if registry.op_kernels(op).provides("triton")}
    try:
        import triton  # noqa: F401
    except ImportError:
        assert all(row.status == "not run" and "triton is not installed" in row.detail for row in triton_rows)
        return
    if INTERPRETER:
        assert all(row.status == "pass" and row.device == "cpu" for row in triton_rows), \
            _selftest.format_rows(triton_rows)
    else:
        assert all(row.status == "not run" and "TRITON_INTERPRET=1" in row.detail for row in triton_rows)


@pytest.mark.skipif(not INTERPRETER, reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1")
def test_every_triton_kernel_ran_guarded(cpu_run):
    """The self-test's inputs reach every Triton kernel of the package, and
    each launch ran inside guard bands (tests/guard_bands.py), whatever else
    the session ran."""
    pytest.importorskip("triton")
    from . import guard_bands

    launched = {kernel for kernel, count in cpu_run[1].items() if count > 0}
    assert set(guard_bands.package_kernels()) <= launched, sorted(set(guard_bands.package_kernels()) - launched)


def test_cuda_kernels_are_reported_not_run_without_cuda(cpu_rows):
    cuda_rows = [row for row in cpu_rows if row.backend == "cuda"]
    assert {row.op for row in cuda_rows} == {op for op in registry.registered_ops()
                                             if registry.op_kernels(op).provides("cuda")}
    assert all(row.status == "not run" and row.detail == "cuda: no CUDA device" for row in cuda_rows)
    table = _selftest.format_rows(cpu_rows)
    assert "not run: cuda: no CUDA device" in table and "no CUDA device: CUDA kernels not run" in table


def test_command_line_passes(without_cuda, monkeypatch, capsys):
    monkeypatch.setattr(registry, "registered_ops", lambda: ["softmax_forward", "batch_stats"])
    assert _info.main(["--selftest"]) == 0
    out = capsys.readouterr().out
    assert "softmax_forward" in out and "batch_stats" in out and "FAIL" not in out


def test_summary_first_and_failures_only(without_cuda, monkeypatch, capsys):
    monkeypatch.setattr(registry, "registered_ops", lambda: ["softmax_forward", "batch_stats"])
    assert _info.main(["--selftest", "--failures"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"\d+ passed, 0 failed, \d+ not run", lines[0]), lines
    table = [line for line in lines if line.startswith(("softmax_forward", "batch_stats"))]
    # Without CUDA the CUDA kernels are the rows left: each says why it did not run.
    assert table and all("not run: " in line for line in table), lines
    with pytest.raises(SystemExit):
        _info.main(["--failures"])
    assert "--failures goes with --selftest" in capsys.readouterr().err


def test_a_broken_kernel_fails_with_a_nonzero_exit(without_cuda, monkeypatch, capsys):
    kernels = registry.op_kernels("softmax_forward")
    with registry.use_backend("cpp"):
        real = registry.kernel("softmax_forward", torch.device("cpu"))

    def broken(x, dim, log, dtype):  # one element off by 1 %
        out = real(x, dim, log, dtype)
        out.view(-1)[3] *= 1.01
        return out

    monkeypatch.setattr(kernels, "cpp", broken)
    monkeypatch.setattr(registry, "registered_ops", lambda: ["softmax_forward"])
    assert _info.main(["--selftest"]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("softmax_forward") and "cpp" in line]
    assert failed and all("FAIL" in line for line in failed), out


def test_a_crashing_kernel_is_a_failed_row(without_cuda, monkeypatch):
    def crashes(*args):
        raise RuntimeError("device-side assert")

    monkeypatch.setattr(registry.op_kernels("batch_stats"), "cpp", crashes)
    rows = _selftest.selftest(["batch_stats"])
    cpp = [row for row in rows if row.backend == "cpp"]
    assert cpp and all(row.status == "FAIL" and "device-side assert" in row.detail for row in cpp)
    monkeypatch.setattr(registry, "registered_ops", lambda: ["batch_stats"])
    assert _selftest.main() == 1


def test_an_op_without_inputs_fails(without_cuda, monkeypatch):
    monkeypatch.delitem(_selftest.CASES, "reduce")
    rows = _selftest.selftest(["reduce"])
    assert rows and all(row.status == "FAIL" and "no self-test inputs" in row.detail for row in rows)


def test_tests_share_the_package_tolerances():
    assert TOLERANCES["default"] == _selftest.TOLERANCES


def test_kernels_see_the_layout_their_case_built(without_cuda, monkeypatch):
    """A case's chunk with gaps between its rows reaches the kernel with
    those gaps (a compacting copy would hide a kernel that ignores the row
    stride)."""
    seen = []

    def records(logits, *rest):
        seen.append(logits.stride())
        return registry.op_kernels("cross_entropy_soft_chunk_stats_").reference(logits, *rest)

    monkeypatch.setattr(registry.op_kernels("cross_entropy_soft_chunk_stats_"), "cpp", records)
    rows = _selftest.selftest(["cross_entropy_soft_chunk_stats_"])
    assert any(row.backend == "cpp" and row.status == "pass" for row in rows)
    assert seen and all(stride == (13, 1) for stride in seen), seen


def test_cases_and_tiers_are_found_in_each_familys_folder(monkeypatch):
    """No central list: every family's ``ops/<family>/selftest.py`` is
    found, and one family declaring another's op or tier again is an error."""
    import types

    from effilayers._core import families

    modules = families.family_modules("selftest")
    assert [m.__name__.split(".")[2] for m in modules] == families.family_names()
    assert set(_selftest.CASES) == {op for m in modules for op in m.CASES}
    assert set(_selftest.TIERS) == {"default"} | {tier for m in modules for tier in getattr(m, "TIERS", {})}

    again = types.SimpleNamespace(__name__="effilayers.ops.copy.selftest", CASES={"reduce": _selftest.CASES["reduce"]})
    monkeypatch.setattr(_selftest, "family_modules", lambda role: [*modules, again])
    with pytest.raises(RuntimeError, match=r"effilayers.ops.copy.selftest.CASES declares \['reduce'\] again"):
        _selftest._family_declarations()
