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
    # The order for what is not reordered by the ledger: build and
    # the self-test first, the tests next, the sanitizer last.
    assert names[:3] == ["build", "selftest", "tests"] and names[-1] == "sanitizer", names
    assert {"abn", "densenet", "adam", "max_batch", "softmax", "cross_entropy", "reductions",
            "linear_cross_entropy", "fit", "offload"} <= set(names), names
    total = re.fullmatch(r"total budget (\d+)s", lines[-1])
    assert total and int(total.group(1)) == sum(int(m.group(2)) for m in steps) <= 540, lines[-1]
    assert steps[1].group(3).startswith("python3 -m effilayers.info --selftest")


def test_some_steps_only_and_unknown_steps():
    done = run("tests", "fit", "--dry-run")
    assert done.returncode == 0, done.stderr
    names = re.findall(r"^step (\w+)", done.stdout, flags=re.MULTILINE)
    assert names == ["build", "tests", "fit"]  # the libraries are loaded before any rerun
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
