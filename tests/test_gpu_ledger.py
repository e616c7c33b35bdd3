"""benchmarks/ledger.py, the ledger of GPU evidence: the committed
benchmarks/results/GPU.md is what the script makes of this checkout, and in
throwaway trees (a git repository with dated commits, and the same tree
without git) results come out fresh or stale by the rules its docstring gives."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ledger

ROOT = Path(__file__).resolve().parents[1]
NAMES = [family.name for family in ledger.FAMILIES]


def _git(root: Path, *args: str, date: str = "2026-11-20T12:00:00+00:00") -> str:
    # The caller's git environment (a hook's GIT_DIR) must not redirect these
    # commands; the dates make the ledger's day comparisons deterministic.
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    done = subprocess.run(["git", "-C", str(root), "-c", "user.name=ledger test", "-c", "user.email=ledger@test",
                           "-c", "commit.gpgsign=false", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _write(root: Path, relative: str, content) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))


def _pytest_benchmark(*groups: tuple[float, float, float], commit: str | None = None) -> dict:
    """A pytest-benchmark JSON with one group per (torch median, effilayers
    median, effilayers pct_of_copy), each also holding a torch-compile row
    that the headline must ignore."""
    benchmarks = []
    for index, (torch_median, ours_median, pct) in enumerate(groups):
        case = f"cuda-{index}x1024-bfloat16"
        group = f"softmax cuda {index}x1024 bfloat16"
        for label, median, extra in (("torch", torch_median, {}), ("torch-compile", torch_median / 10, {}),
                                     ("effilayers", ours_median, {"pct_of_copy": pct})):
            benchmarks.append({"group": group, "name": f"test_softmax[{label}-softmax-{case}]",
                               "stats": {"median": median}, "extra_info": extra})
    info = {"device": "NVIDIA H200"} if commit is None else {"device": "NVIDIA H200", "commit": commit}
    return {"machine_info": {"effilayers": info}, "benchmarks": benchmarks}


def _tree(root: Path) -> None:
    """Kernel sources of softmax, cross_entropy and pooling, and results:
    softmax's GPU result is from the day before the kernels' commit,
    cross_entropy's newest from the same day, pooling's newest is a log;
    the rest must not count (CPU, a '-before-' baseline, a qualifier where
    the device goes, another family's prefix)."""
    (root / "benchmarks").mkdir()
    # the script, and the bench files whose LEDGER entries it reads
    for script in [ROOT / "benchmarks" / "ledger.py", *(ROOT / "benchmarks").glob("bench_*.py")]:
        shutil.copy(script, root / "benchmarks" / script.name)
    for kernel in ("effilayers/ops/softmax/kernel.py", "effilayers/ops/cross_entropy/kernel.py",
                   "effilayers/nn/pooling.py"):
        _write(root, kernel, "# kernel\n")
    results = "benchmarks/results/"
    _write(root, results + "softmax-h200-2026-11-19.json", _pytest_benchmark((1.0, 0.9, 80.0)))
    _write(root, results + "cross_entropy-h100-2026-11-18.json", _pytest_benchmark((1.0, 2.0, 10.0)))
    _write(root, results + "cross_entropy-h200-2026-11-20.json",
           _pytest_benchmark((2.0, 1.0, 91.0), (1.0, 0.8, 95.0)))
    _write(root, results + "cross_entropy-cpu-2026-11-25.json", _pytest_benchmark((1.0, 3.0, 1.0)))
    _write(root, results + "linear_cross_entropy-h200-2026-11-25.json", _pytest_benchmark((1.0, 3.0, 1.0)))
    _write(root, results + "pooling-h100-2026-11-21.log", "pooling bench log\n")
    _write(root, results + "pooling-h100-2026-11-22-before-abc1234.json", _pytest_benchmark((1.0, 3.0, 1.0)))
    _write(root, results + "optim-chunk-size-h200-2026-11-25.json", _pytest_benchmark((1.0, 3.0, 1.0)))


def _kernel_repo(root: Path) -> None:
    """_tree as a git repository whose one commit, on 2026-11-20, holds the
    kernels only: the results are untracked, so dates alone decide."""
    _tree(root)
    _git(root, "init", "-q")
    _git(root, "add", "effilayers")
    _git(root, "commit", "-q", "-m", "kernels")


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "benchmarks" / "ledger.py"), *args], capture_output=True,
                          text=True, cwd=root)


def test_committed_ledger_is_up_to_date():
    assert ledger.has_history(ROOT), "the ledger's check needs this checkout's full git history"
    current, diff = ledger.check(ROOT)
    assert current, f"benchmarks/results/GPU.md is out of date; run python3 benchmarks/ledger.py\n{diff}"
    text = (ROOT / ledger.LEDGER).read_text(encoding="utf-8")
    assert "do not edit by hand" in text and "`python3 benchmarks/ledger.py`" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith(
        "| family | kernels last changed | newest GPU result | headline | target | verdict | status")
    assert [line.split(" | ")[0][2:] for line in table[2:]] == NAMES


def test_result_dated_before_the_kernel_change_is_stale_and_on_or_after_is_fresh(tmp_path):
    _kernel_repo(tmp_path)
    rows = {row.family: row for row in ledger.ledger_rows(tmp_path)}
    assert list(rows) == NAMES
    commit = _git(tmp_path, "rev-parse", "HEAD")[:7]

    softmax = rows["softmax"]
    assert softmax.kernel_change.short == commit and softmax.kernel_change.date == "2026-11-20"
    assert (softmax.result, softmax.result_date, softmax.fresh) == ("softmax-h200-2026-11-19.json", "2026-11-19", False)
    assert softmax.reason == f"result dated before {commit} (2026-11-20)"

    entropy = rows["cross_entropy"]
    assert (entropy.result, entropy.fresh) == ("cross_entropy-h200-2026-11-20.json", True)
    assert entropy.headline == ("effilayers/torch median time ratio 0.50–0.80 over 2 groups; "
                                "effilayers at 91–95% of copy bandwidth")

    pooling = rows["pooling"]
    assert (pooling.result, pooling.fresh) == ("pooling-h100-2026-11-21.log", True)
    assert pooling.headline == "see `pooling-h100-2026-11-21.log`"

    # Its kernels have no commit here, so even a GPU result cannot be fresh.
    assert rows["linear_cross_entropy"].result == "linear_cross_entropy-h200-2026-11-25.json"
    assert not rows["linear_cross_entropy"].fresh
    assert rows["linear_cross_entropy"].reason == "no commit touches the kernel paths"
    # optim-chunk-size-h200-... names a qualifier where the device goes.
    assert (rows["adam"].result, rows["adam"].headline, rows["adam"].fresh) == (None, "no GPU result", False)
    assert [name for name, row in rows.items() if row.fresh] == ["cross_entropy", "pooling"]


def test_commits_decide_over_dates(tmp_path):
    """A result committed before the kernel change is stale although its
    date is the change's day; a recorded measured commit decides alone."""
    _tree(tmp_path)
    _git(tmp_path, "init", "-q")
    _write(tmp_path, "benchmarks/results/softmax-h200-2026-11-21.json", _pytest_benchmark((1.0, 0.9, 80.0)))
    _git(tmp_path, "add", "effilayers", "benchmarks/results/softmax-h200-2026-11-21.json")
    _git(tmp_path, "commit", "-q", "-m", "kernels and a result", date="2026-11-20T12:00:00+00:00")
    before = _git(tmp_path, "rev-parse", "HEAD")
    for kernel in ("effilayers/ops/softmax/kernel.py", "effilayers/ops/cross_entropy/kernel.py",
                   "effilayers/ops/reductions/kernel.py", "effilayers/ops/abn/kernel.py"):
        _write(tmp_path, kernel, "# kernel, changed\n")
    _git(tmp_path, "add", "effilayers")
    _git(tmp_path, "commit", "-q", "-m", "kernels changed", date="2026-11-21T12:00:00+00:00")
    after = _git(tmp_path, "rev-parse", "HEAD")
    _write(tmp_path, "benchmarks/results/reductions-h200-2026-11-22.json", _pytest_benchmark((1.0, 0.9, 80.0),
                                                                                            commit=before))
    _write(tmp_path, "benchmarks/results/abn-h200-2026-11-19.json", _pytest_benchmark((1.0, 0.9, 80.0), commit=after))
    rows = {row.family: row for row in ledger.ledger_rows(tmp_path)}

    assert rows["softmax"].result == "softmax-h200-2026-11-21.json" and not rows["softmax"].fresh
    assert rows["softmax"].reason == f"result committed in {before[:7]}, without {after[:7]}"
    assert rows["reductions"].result == "reductions-h200-2026-11-22.json" and not rows["reductions"].fresh
    assert rows["reductions"].reason == f"measured at {before[:7]}, which predates {after[:7]}"
    assert rows["abn"].result == "abn-h200-2026-11-19.json" and rows["abn"].fresh
    assert rows["abn"].reason == f"measured at {after[:7]}, which contains {after[:7]}"


def test_without_git_every_family_is_stale(tmp_path, capsys):
    _tree(tmp_path)
    assert not ledger.has_history(tmp_path)
    rows = ledger.ledger_rows(tmp_path)
    assert [row.family for row in rows] == NAMES
    assert all(not row.fresh and row.kernel_change is None for row in rows)
    # The results are still read: only the kernel history is missing.
    entropy = rows[NAMES.index("cross_entropy")]
    assert entropy.result == "cross_entropy-h200-2026-11-20.json"
    assert entropy.reason == "kernel history unknown (no git history here)"
    # All stale: never measured first, in ledger order, then by the date of
    # the newest result (softmax 11-19, cross_entropy 11-20, pooling 11-22).
    dated = {row.family: row.result_date for row in rows if row.result_date}
    assert dated["softmax"] < dated["cross_entropy"] < dated["pooling"] < "2026-11-25"
    expected = [name for name in NAMES if name not in dated] + ["softmax", "cross_entropy", "pooling"] + [
        name for name in NAMES if dated.get(name) == "2026-11-25"]
    assert sorted(expected) == sorted(NAMES)
    assert ledger.stale_first(tmp_path) == expected
    text = ledger.render(tmp_path)
    assert "No git history here" in text and text.count("unknown (no git)") == len(NAMES)
    capsys.readouterr()
    assert ledger.main(["--order"], root=tmp_path) == 0 and capsys.readouterr().out.split() == expected


def test_order_puts_stale_families_first_and_check_tracks_the_file(tmp_path, capsys):
    _kernel_repo(tmp_path)
    rows = {row.family: row for row in ledger.ledger_rows(tmp_path)}
    # The stale ones least recently measured first: never, then softmax's
    # result of 11-19, then those of 11-25 in ledger order.
    never = [name for name in NAMES if name not in ("cross_entropy", "pooling") and not rows[name].result_date]
    latest = [name for name in NAMES if name not in ("cross_entropy", "pooling", "softmax") and rows[name].result_date]
    assert rows["softmax"].result_date == "2026-11-19" and all(rows[n].result_date == "2026-11-25" for n in latest)
    stale = never + ["softmax"] + latest
    assert ledger.stale_first(tmp_path) == stale + ["cross_entropy", "pooling"]
    # The script itself, as benchmarks/gpu_session.py's callers run it.
    order = _run(tmp_path, "--order")
    assert order.returncode == 0 and order.stdout.split() == stale + ["cross_entropy", "pooling"], order.stderr

    capsys.readouterr()
    assert ledger.main(["--check"], root=tmp_path) == 1 and "out of date" in capsys.readouterr().err
    assert ledger.main([], root=tmp_path) == 0
    assert (tmp_path / ledger.LEDGER).read_text(encoding="utf-8") == ledger.render(tmp_path)
    assert ledger.main(["--check"], root=tmp_path) == 0
    # A new GPU result changes the ledger, so the written file is out of date now.
    _write(tmp_path, "benchmarks/results/softmax-h200-2026-11-23.json", _pytest_benchmark((1.0, 0.9, 80.0)))
    capsys.readouterr()
    assert ledger.main(["--check"], root=tmp_path) == 1
    assert "+| softmax | " in capsys.readouterr().err


@pytest.mark.slow
def test_case_counts_are_the_benches_gpu_cases():
    """A family's ``cases`` is how many groups its bench times on a GPU; a
    result with fewer is a run cut short. Counted by collecting the cuda
    cases here (EFFILAYERS_BENCH_COLLECT_CUDA lists them without a GPU)."""
    code = (
        "import collections, pytest\n"
        "class Count:\n"
        "    def pytest_collection_finish(self, session):\n"
        "        cases = collections.defaultdict(lambda: collections.defaultdict(set))\n"
        "        for item in session.items:\n"
        "            params = {k: repr(v) for k, v in item.callspec.params.items()\n"
        "                      if k not in ('implementation', 'variant')}\n"
        "            key = (item.originalname, tuple(sorted(params.items())))\n"
        "            cases[item.fspath.basename][key].add(item.callspec.params.get('implementation'))\n"
        "        print({name: [sorted(map(str, found)) for found in keys.values()] for name, keys in cases.items()})\n"
        "pytest.main([*FILES, '-k', 'cuda and not deepspeed', '--collect-only', '-q', '-p', 'no:cacheprovider'],"
        " plugins=[Count()])\n"
    )
    benches = {family.name: Path(family.bench).name for family in ledger.op_families() if family.gpu_seconds}
    assert {"softmax", "cross_entropy", "reductions", "linear_cross_entropy", "abn", "densenet", "adam"} <= set(benches)
    files = [f"benchmarks/{name}" for name in benches.values()]
    done = subprocess.run([sys.executable, "-c", code.replace("FILES", repr(files))], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "EFFILAYERS_BENCH_COLLECT_CUDA": "1", "PYTHONPATH": str(ROOT)})
    found = ast.literal_eval([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    families = {family.name: family for family in ledger.FAMILIES}
    for family, bench in benches.items():
        # A group the family's own implementation is not timed in (bench_abn's
        # smooth activations: InPlaceABN refuses SiLU) is not one of its cases.
        cases = [implementations for implementations in found[bench]
                 if implementations == ["None"] or families[family].ours in implementations]
        assert families[family].cases == len(cases), (family, found[bench])


def _budget_result(*rows):
    return {"results": [{"variant": name, "ratios": {"step_time": step, "activation_bytes": activation}}
                        for name, step, activation in rows]}


@pytest.mark.parametrize("rows, met", [
    ((("as given", 1.0, 1.0), ("fit(0.35)", 1.2, 0.33), ("torch checkpoint (every block)", 1.28, 0.06)), True),
    ((("as given", 1.0, 1.0), ("fit(0.35)", 1.3, 0.33), ("torch checkpoint (every block)", 1.4, 0.06)), False),
    ((("as given", 1.0, 1.0), ("fit(0.35)", 1.2, 0.33), ("torch checkpoint (every block)", 1.1, 0.06)), False),
    ((("as given", 1.0, 1.0), ("fit(0.35)", 1.2, 0.36)), False),
    ((("as given", 1.0, 1.0), ("fit(0.25, offload)", 1.1, 0.25)), True),
    ((("as given", 1.0, 1.0), ("fit(0.25, offload)", 1.2, 0.25)), False),
    ((("as given", 1.0, 1.0),), None),
])
def test_fit_targets_read_the_fit_row_of_a_budget_result(rows, met):
    family = next(family for family in ledger.FAMILIES if family.name == "fit_gpt2")
    figures, _ = ledger.figures_and_headline(Path("x.json"), _budget_result(*rows), family)
    assert family.met(figures) is met
    assert ledger.verdict(family, figures) == {True: "met", False: "**missed**", None: "not measured"}[met]
