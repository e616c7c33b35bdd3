"""``python -m effilayers.info --kernels``: every GPU kernel of the package is
in the report, compiles for sm_90 and sm_80 without spilling, and the width
check can fail. The full sweep (every dtype and configuration) is the
command itself, which CI runs; these tests compile one specialisation of
every Triton kernel and every CUDA kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from effilayers import _kernel_report
from effilayers._core import build

ROOT = Path(__file__).resolve().parents[1]


def _without_interpreter(module: str, *arguments: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", module, *arguments], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def representative():
    return _without_interpreter("tests.kernel_report_checks")


@pytest.fixture(scope="module")
def toys():
    # Its own compile, so that a run without the representative rows (CI's
    # torch 2.11 suite leaves them to its kernel report) compiles two kernels.
    return _without_interpreter("tests.kernel_report_checks", "--toys")["toys"]


def test_every_launched_triton_kernel_has_specialisations():
    """A kernel added to the package without a kernel_specialisations()
    entry next to its launcher fails here."""
    launched = set(_kernel_report.launched_kernels())
    reported = {f"{spec.kernel.fn.__module__}:{spec.name}" for _, spec in _kernel_report.iter_specs()}
    assert launched, "no Triton kernel found in the package"
    assert launched == reported, (launched - reported, reported - launched)
    # the helpers the kernels inline are not launched kernels
    helpers = set(_kernel_report.package_jit_functions()) - launched
    assert "effilayers.ops.softmax.triton:_online_step" in helpers


def test_specs_use_the_launchers_signature_rules():
    """Ints equal to 1 become constants, multiples of 16 and tensors are
    marked divisible (Triton's own launcher rule)."""
    import torch

    from effilayers._core.kernel_spec import specialise

    spec = next(spec for _, spec in _kernel_report.iter_specs() if spec.name == "_row_forward")
    signature, constexprs, divisible = specialise(spec._replace(arguments=dict(spec.arguments, sx3=1, n_cols=17)))
    assert signature["sx3"] == "constexpr" and constexprs["sx3"] == 1
    assert signature["n_cols"] == "i32" and "n_cols" not in divisible
    assert signature["x_ptr"] == "*" + {torch.float32: "fp32", torch.float16: "fp16",
                                        torch.bfloat16: "bf16"}[spec.arguments["x_ptr"]]
    assert "x_ptr" in divisible and "sx0" in divisible
    with pytest.raises(ValueError, match="missing"):
        specialise(spec._replace(arguments={k: v for k, v in spec.arguments.items() if k != "sx0"}))


def test_representative_triton_rows_compile_without_spills(representative):
    rows = representative["rows"]
    kernels = {row["kernel"] for row in rows}
    assert kernels == {name.split(":")[1] for name in _kernel_report.launched_kernels()}
    assert {row["target"] for row in rows} == {"sm_90", "sm_80"}
    for row in rows:
        assert "error" not in row, row
        assert row["registers"] > 0 and row["problems"] == [], row
        # the PTX was read (a kernel may write only through atomic adds)
        assert row["loads"] and (row["stores"] or row["atomics"]), row


def test_width_check_fails_on_a_narrow_toy_kernel(toys):
    wide, narrow = toys
    assert wide["loads"] == {"128": 2} and wide["problems"] == [], wide
    assert "128" not in narrow["loads"] and narrow["narrow_per_thread"], narrow
    assert any("under 128 bits" in problem for problem in narrow["problems"]), narrow


PTX = """
.visible .entry toy(.param .u64 toy_param_0, .param .u64 toy_param_1)
{
    ld.param.u64 %rd1, [toy_param_0];
    ld.param.u64 %rd2, [toy_param_1];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
$L__BB0_1:
    add.s64 %rd4, %rd1, %rd3;
    ld.global.b32 %r2, [ %rd2 + 0 ];
    @%p1 ld.global.v4.b32 { %r3, %r4, %r5, %r6 }, [ %rd4 + 0 ];
    .loc 1 2 3
    st.global.b16 [ %rd4 + 16 ], %rs1;
    cp.async.cg.shared.global [ %r7 + 0 ], [ %rd4 + 0 ], 0x10, %r8;
    ret;
}
"""


def test_ptx_reader_tells_per_thread_from_uniform_accesses():
    accesses = _kernel_report.global_accesses(PTX)
    assert [(a.op, a.bits, a.per_thread, sorted(a.params)) for a in accesses] == [
        ("ld", 32, False, [1]), ("ld", 128, True, [0]), ("st", 16, True, [0]), ("ld", 128, True, [0])]
    assert _kernel_report._narrow(accesses, set()) == [accesses[2]]
    assert _kernel_report._narrow(accesses, {0}) == []


def test_problems_flag_spills_failures_and_narrow_rows():
    clean = dict(spill_stores=0, spill_loads=0, narrow_per_thread=[])
    assert _kernel_report.problems(clean) == []
    assert _kernel_report.problems(dict(clean, spill_stores=8))
    assert _kernel_report.problems(dict(clean, narrow_per_thread=["ld32:x_ptr"]))
    assert _kernel_report.problems({"error": "ptxas failed"}) == ["compile failed"]
    assert _kernel_report.problems(dict(clean, narrow_reason="not bandwidth-bound")) == []
    assert _kernel_report.problems(dict(clean, narrow_reason="a; pending: later")) == [
        "narrower than the layout allows (pending: later)"]
    assert _kernel_report.problems(dict(clean, registers=255)) == ["at the 255-register cap"]
    assert _kernel_report.problems(dict(clean, registers=254)) == []


def test_rows_above_their_roofline_fail_in_memory_bound_families():
    """A memory-bound row that moves more bytes per element than its
    roofline fails unless its spec says why (and not "pending:"); a GEMM
    family's bytes are reported, not held."""
    row = dict(spill_stores=0, spill_loads=0, narrow_per_thread=[], registers=64, family="softmax",
               bytes_per_element=6, roofline_bytes=4, reread_reason="")
    assert _kernel_report.problems(row) == ["moves 6 bytes per element, above its roofline of 4"]
    assert _kernel_report.problems(dict(row, bytes_per_element=4)) == []
    assert _kernel_report.problems(dict(row, reread_reason="a row wider than the registers")) == []
    assert _kernel_report.problems(dict(row, reread_reason="pending: split rows")) == [
        "moves 6 bytes per element, above its roofline of 4 (pending: split rows)"]
    assert _kernel_report.problems(dict(row, family="linear_cross_entropy")) == []
    assert _kernel_report.problems(dict(row, family="stats.cu"))  # a CUDA row, by its source file
    assert [family for family in _kernel_report.TRITON_FAMILIES if _kernel_report.compute_bound(family)] == [
        "linear_cross_entropy"]
    assert _kernel_report.problems(dict(row, family="a_new_family"))  # memory-bound unless it says otherwise


def test_every_memory_bound_spec_at_its_roofline_or_saying_why():
    """The specs' own byte counts (no compilation): every memory-bound
    kernel at the benchmark shapes moves its roofline, except the softmax
    rows' two-pass fallback (beyond MAX_SPLITS pieces, or a tuned
    configuration without split) and cross-entropy rows too long for one
    program's registers, which say so; the split softmax rows, the dim=1
    tiles, the causal row and the DenseNet forward are at their roofline."""
    above = []
    for family, spec in _kernel_report.iter_specs():
        if not _kernel_report.compute_bound(family) and spec.bytes_per_element > spec.roofline_bytes:
            above.append((family, spec.name, spec.config))
            assert spec.reread and "pending:" not in spec.reread, (family, spec.config)
    assert {name for _, name, _ in above} <= {"_row_forward", "_row_backward", "_cross_entropy_rows_kernel"}
    assert all(config.endswith(("online", "online log")) or "131072" in config for _, _, config in above), above
    configs = {spec.config for _, spec in _kernel_report.iter_specs() if spec.bytes_per_element == spec.roofline_bytes}
    for shape in ("cols=65536 BLOCK=16384 split x4", "cols=262144 BLOCK=16384 split x16", "dim=1 of 64x256x64x64",
                  "8192x32000 BLOCK=32768 grad", "64x64x56x56 -> 128 aligned"):
        assert any(shape in config for config in configs), shape
    causal = [spec for _, spec in _kernel_report.iter_specs() if "causal" in spec.config]
    assert len(causal) == 3
    for spec in causal:  # half the row read (plus at most one sector), all of it written
        size = spec.arguments["x_ptr"].itemsize
        assert 1.5 * size < spec.bytes_per_element < (1.5 + 32 / 1024) * size, spec.config
    from effilayers.ops.softmax.triton import causal_fraction

    assert causal_fraction(16, 2) == 1.0 and causal_fraction(32, 4) == (8 * 8 + 8 * 16 + 8 * 24 + 8 * 32) / 32**2


def test_exit_status_and_json(monkeypatch, capsys):
    """main() prints every row (JSON with --json) and fails when one row does."""
    good = dict(kind="triton", family="f", kernel="k", target="sm_90", config="c", registers=32, spill_stores=0,
                spill_loads=0, shared=0, loads={128: 2}, stores={128: 1}, narrow_per_thread=[], bytes_per_element=8,
                roofline_bytes=8, narrow_reason="")
    spilling = dict(good, kernel="spiller", spill_stores=16, spill_loads=16)

    def fake_collect(rows):
        def collect(jobs=0, targets=_kernel_report.TARGETS, pairwise_only=False):
            for row in rows:
                row["problems"] = _kernel_report.problems(row)
            return rows
        return collect

    monkeypatch.setattr(_kernel_report, "collect", fake_collect([dict(good)]))
    assert _kernel_report.main() == 0
    assert "f:k" in capsys.readouterr().out
    monkeypatch.setattr(_kernel_report, "collect", fake_collect([dict(good), dict(spilling)]))
    assert _kernel_report.main(json_output=True) == 1
    report = json.loads(capsys.readouterr().out)
    assert [row["kernel"] for row in report["rows"]] == ["k", "spiller"]
    assert report["rows"][1]["problems"] == ["spills 16/16 bytes"]
    assert "1 rows failing" in report["summary"]
    # a narrow row excused only by a pending reason fails as well
    pending = dict(good, kernel="later", narrow_reason="x_ptr: pending: not vectorised yet")
    monkeypatch.setattr(_kernel_report, "collect", fake_collect([dict(good), pending]))
    assert _kernel_report.main() == 1
    out = capsys.readouterr().out
    assert "narrower than the layout allows (x_ptr: pending: not vectorised yet)" in out
    assert "1 rows narrower than the layout allows (pending)" in out and "1 rows failing" in out
    # above the roofline: fails without a reason, passes and prints it with one
    above = dict(good, family="softmax", kernel="reader", bytes_per_element=12)
    monkeypatch.setattr(_kernel_report, "collect", fake_collect([dict(above)]))
    assert _kernel_report.main() == 1
    assert "above its roofline of 8" in capsys.readouterr().out
    monkeypatch.setattr(_kernel_report, "collect", fake_collect([dict(above, reread_reason="too long a row")]))
    assert _kernel_report.main() == 0
    out = capsys.readouterr().out
    assert "ok, above roofline <1>" in out and "<1> too long a row" in out
    assert "1 memory-bound rows above their roofline in bytes (1 with a reason)" in out


def test_refuses_to_run_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _kernel_report.main() == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


needs_nvcc = pytest.mark.skipif(_kernel_report.cuda_home() is None, reason="nvcc not found (CI has it)")


@needs_nvcc
def test_every_cuda_global_is_reported_without_spills():
    declared = set()
    for source in (build.csrc_dir() / "cuda").glob("*.cu"):
        text = source.read_text()
        declared |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", text))
    assert declared
    rows = _kernel_report.cuda_rows(90)
    assert all("error" not in row for row in rows), [row.get("error") for row in rows]
    assert {row["kernel"] for row in rows} == declared
    for row in rows:
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["loads"] and row["stores"] and _kernel_report.problems(row) == [], row


def test_cuda_compiles_are_kept_in_the_build_cache_by_their_sources(tmp_path, monkeypatch):
    """The second report on the same sources reads nvcc's results from the
    cache; a changed header compiles again."""
    monkeypatch.setenv("EFFILAYERS_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        f"echo run >> {calls}\n"
        'keep=""; prev=""; for a in "$@"; do [ "$prev" = "--keep-dir" ] && keep="$a"; prev="$a"; done\n'
        'echo ptx > "$keep/k.ptx"\n'
        "echo \"ptxas info    : Compiling entry function 'k' for 'sm_90'\" >&2\n")
    nvcc.chmod(0o755)
    csrc = tmp_path / "csrc"
    (csrc / "cuda").mkdir(parents=True)
    (csrc / "common").mkdir()
    source = csrc / "cuda" / "k.cu"
    source.write_text("__global__ void k() {}\n")
    (csrc / "common" / "h.h").write_text("// one\n")
    flags = [str(nvcc), "-arch=sm_90", "-std=c++17", str(source)]

    first = _kernel_report._compile_cuda(flags, csrc, source)
    assert first == ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n", "ptx\n")
    assert calls.read_text().count("run") == 1  # one compile gives the log and the kept PTX
    assert _kernel_report._compile_cuda(flags, csrc, source) == first
    assert calls.read_text().count("run") == 1
    (csrc / "common" / "h.h").write_text("// two\n")
    assert _kernel_report._compile_cuda(flags, csrc, source) == first
    assert calls.read_text().count("run") == 2


def test_target_selection_is_checked():
    from effilayers._info import main

    with pytest.raises(ValueError, match="non-empty selection"):
        _kernel_report.collect(targets=(70,))
    with pytest.raises(SystemExit):
        main(["--target", "sm_90"])  # without --kernels
    with pytest.raises(SystemExit):
        main(["--pairwise"])


def _pairs(specs):
    pairs = set()
    for spec in specs:
        dtypes, settings = _kernel_report._settings(spec)
        pairs |= {(spec.name, dtypes, setting) for setting in (*settings, None)}
    return pairs


@pytest.mark.parametrize("family", _kernel_report.TRITON_FAMILIES)
def test_pairwise_keeps_every_setting_with_every_dtype_of_each_kernel(family):
    specs = _kernel_report._family_specs(family)
    chosen = _kernel_report.pairwise(specs)
    assert chosen == sorted(set(chosen)) and chosen == _kernel_report.pairwise(specs)  # deterministic
    subset = [specs[index] for index in chosen]
    assert {spec.name for spec in subset} == {spec.name for spec in specs}
    assert _pairs(subset) == _pairs(specs)
    if len(specs) > 20:
        assert len(subset) < len(specs)


def test_pairwise_selection_drops_a_configuration_whose_pairs_are_covered():
    """Three block sizes, each used with two dtypes: every (block, dtype)
    pair is in one row only, so all six stay. With one dtype, a repeated
    configuration brings nothing new and goes."""
    import torch

    from tests.kernel_report_checks import toy_spec

    base = toy_spec(1)
    specs = [base._replace(arguments=dict(base.arguments, x_ptr=dtype, y_ptr=dtype), constexprs=dict(BLOCK=block))
             for block in (256, 512, 1024) for dtype in (torch.float32, torch.float16)]
    assert _kernel_report.pairwise(specs) == list(range(6))
    float32_only = [*specs[::2], specs[0]]
    assert _kernel_report.pairwise(float32_only) == [0, 1, 2]


def test_collect_compiles_only_the_pairwise_rows_when_asked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # nothing is compiled: triton_row is replaced
    compiled = []
    monkeypatch.setattr(_kernel_report, "triton_row", lambda family, index, capability: compiled.append(
        (family, index, capability)) or dict(kind="triton", family=family, kernel="k", target=f"sm_{capability}",
                                             config="", error="not compiled here"))
    _kernel_report.collect(jobs=1, families=("reductions",), cuda=False, targets=(90,), pairwise_only=True)
    specs = _kernel_report._family_specs("reductions")
    assert compiled == [("reductions", index, 90) for index in _kernel_report.pairwise(specs)]
