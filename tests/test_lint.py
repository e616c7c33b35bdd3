"""The code is clean under ruff ([tool.ruff] in pyproject.toml: pycodestyle, pyflakes, import order).

ruff is in the test extra, so a missing ruff fails here rather than skipping: CI must lint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("effilayers", "tests", "benchmarks")


def test_ruff_check_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS], cwd=ROOT,
                          capture_output=True, text=True)
    output = done.stdout + done.stderr
    assert "No module named ruff" not in output, "ruff is not installed: pip install -e '.[test]'\n" + output
    assert done.returncode == 0, f"ruff check {' '.join(PATHS)} (run from {ROOT}) is not clean:\n{output}"
