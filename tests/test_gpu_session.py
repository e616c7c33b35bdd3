"""benchmarks/gpu_session.py, the one command a lent GPU runs: its plan fits
the time a GPU call has, and every selection, script and option it names
exists, so that no GPU minute is lost to a typo. Also the prebuilt library's
stamp: taken when it matches, refused when the sources changed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def run(*arguments: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *arguments], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env})


def test_dry_run_prints_each_step_and_a_total_within_the_call_limit():
    done = run("all", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("gpu_session:")]
    steps = [re.fullmatch(r"step (\w+) budget (\d+)s: (.+)", line) for line in lines[:-1]]
    assert all(steps), lines
    names = [m.group(1) for m in steps]
    # The order for what the ledger does not reorder: build and the
    # self-test first, the tests next, the sanitizer last.
    assert names[:3] == ["build", "selftest", "tests"] and names[-1] == "sanitizer", names
    total = re.fullmatch(r"total budget (\d+)s", lines[-1])
    assert total and int(total.group(1)) == sum(int(m.group(2)) for m in steps) <= 540, lines[-1]
    assert steps[1].group(3).startswith("python3 -m effilayers.info --selftest")


def _steps(*families):
    from benchmarks.gpu_session import Step

    head = [Step("build", 10, ("b",)), Step("tests", 100, ("t",))]
    measured = [Step(name, budget, (name,), family=name) for name, budget in families]
    return head + measured + [Step("sanitizer", 60, ("s",))]


def test_time_goes_to_stale_families_first_and_whole():
    from benchmarks.gpu_session import SHORTEST, allocate

    steps = _steps(("abn", 20), ("max_batch", 180), ("fit", 120), ("softmax", 60), ("adam", 40))
    given = allocate(steps, fresh={"abn", "softmax", "adam"}, total=500)
    budgets = {s.name: s.budget for s in given}
    # 500 - 110 for build and tests - SHORTEST kept for the sanitizer: the
    # stale max_batch and fit whole, then the fresh abn whole, softmax what
    # is left, adam nothing (dropped, not started with seconds to spare).
    assert [s.name for s in given] == ["build", "tests", "max_batch", "fit", "abn", "softmax", "sanitizer"]
    assert budgets["max_batch"] == 180 and budgets["fit"] == 120 and budgets["abn"] == 20
    assert budgets["softmax"] == 500 - 110 - SHORTEST - 320
    assert sum(budgets.values()) == 500 and budgets["sanitizer"] == SHORTEST
    # A stale step that does not fit whole gets what is left.
    assert {s.name: s.budget for s in allocate(steps, {"abn", "softmax", "adam"}, total=400)}["fit"] == 95
    # Without a ledger every family is stale: plan order, same rule.
    assert [s.name for s in allocate(steps, None, total=400)][2:5] == ["abn", "max_batch", "fit"]
    # Room for everything: the sanitizer gets the rest.
    roomy = allocate(steps, fresh=set(), total=1000)
    assert {s.name for s in roomy} == {s.name for s in steps} and roomy[-1].budget == 1000 - 530


def test_stale_families_go_least_recently_measured_first():
    from benchmarks.gpu_session import SHORTEST, allocate

    steps = _steps(("pooling", 30), ("softmax", 60), ("max_batch", 180), ("fit", 120), ("abn", 20))
    measured = {"abn": "2026-11-28", "softmax": "2026-11-27", "max_batch": None, "pooling": "2026-11-28"}
    given = allocate(steps, fresh=set(), total=110 + 300 + SHORTEST, measured=measured)
    # Never measured (max_batch, and fit, which the ledger does not name) in
    # plan order; only those two fit, and softmax, pooling and abn wait.
    assert [s.name for s in given] == ["build", "tests", "max_batch", "fit", "sanitizer"]
    roomy = allocate(steps, fresh=set(), total=1000, measured=measured)
    # Then the oldest result; pooling and abn, measured the same day, in plan order.
    assert [s.name for s in roomy][2:-1] == ["max_batch", "fit", "softmax", "pooling", "abn"]
    # Once measured, those go to the back: the next call takes the rest.
    later = dict(measured, max_batch="2026-11-30", fit="2026-11-30")
    assert [s.name for s in allocate(steps, fresh=set(), total=1000, measured=later)][2:-1] == [
        "softmax", "pooling", "abn", "max_batch", "fit"]


def test_the_tuning_sweep_waits_for_the_stale_families():
    from benchmarks.gpu_session import SHORTEST, Step, allocate

    build, tests, *families, sanitizer = _steps(("abn", 20), ("max_batch", 180), ("softmax", 60))
    steps = [build, tests, Step("tune", 120, ("tune",)), *families, sanitizer]
    # After the stale max_batch and before the fresh abn and softmax, which
    # get what the sweep leaves.
    given = allocate(steps, fresh={"abn", "softmax"}, total=500)
    assert [s.name for s in given] == ["build", "tests", "max_batch", "tune", "abn", "softmax", "sanitizer"]
    assert {s.name: s.budget for s in given}["softmax"] == 500 - 110 - SHORTEST - 180 - 120 - 20
    # When the stale families take everything, the sweep is not started.
    assert "tune" not in [s.name for s in allocate(steps, fresh={"abn", "softmax"}, total=110 + SHORTEST + 190)]


def test_some_steps_only_and_unknown_steps():
    done = run("tests", "fit_resnet50=90", "--dry-run")
    assert done.returncode == 0, done.stderr
    names = re.findall(r"^step (\w+) budget (\d+)s", done.stdout, flags=re.MULTILINE)
    # the libraries are loaded before any rerun; STEP=SECONDS sets its budget
    assert names == [("build", "20"), ("tests", "150"), ("fit_resnet50", "90")]
    bad = run("nope", "--dry-run")
    assert bad.returncode == 2 and "unknown step ['nope']" in bad.stderr


def test_no_gpu_no_run():
    done = run("all", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


@pytest.mark.slow
def test_every_command_of_the_plan_collects_and_parses():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "check-plan"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "check-plan: 0 problems" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_prebuilt_library_is_taken_only_when_its_stamp_matches(tmp_path, monkeypatch):
    from effilayers._core import build

    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    shipped.mkdir()
    monkeypatch.setenv("EFFILAYERS_CACHE_DIR", str(cache))
    (shipped / "effilayers_cpu.so").write_bytes(b"not really a library")
    stamp = build._fingerprint("cpu", build.sources("cpu"), python_version=False)
    (shipped / "effilayers_cpu.stamp").write_text("0" * len(stamp) + "\n")
    assert "stale" in build.import_library("cpu", shipped)
    assert not cache.exists() or not any(cache.iterdir())

    (shipped / "effilayers_cpu.stamp").write_text(stamp + "\n")
    assert "matches" in build.import_library("cpu", shipped)
    placed = cache / f"effilayers_cpu-{build._fingerprint('cpu', build.sources('cpu'))}" / "effilayers_cpu.so"
    assert placed.read_bytes() == b"not really a library"
    assert "no prebuilt" in build.import_library("cuda", shipped)


@pytest.mark.slow
def test_export_then_import_round_trip(tmp_path):
    """The CPU library, exported and placed in an empty cache, loads from
    there without a compiler. In fresh processes: a process can register
    the library's ops once only."""
    shipped = tmp_path / "shipped"
    export = f"from effilayers._core import build; print(build.export_library('cpu', {str(shipped)!r}))"
    load = ("from effilayers._core import build; "
            f"print(build.import_library('cpu', {str(shipped)!r})); print(build.build_and_load('cpu'))")
    done = subprocess.run([sys.executable, "-c", export], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and (shipped / "effilayers_cpu.stamp").exists(), done.stderr[-2000:]
    env = {**os.environ, "EFFILAYERS_CACHE_DIR": str(tmp_path / "fresh-cache"), "CXX": "no-such-compiler"}
    done = subprocess.run([sys.executable, "-c", load], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    placed, loaded = done.stdout.splitlines()[-2:]
    assert "matches" in placed and loaded.startswith("cached in"), done.stdout
