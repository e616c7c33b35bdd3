"""benchmarks/bench_fsdp_offload.py end to end on the CPU (gloo, a tiny model,
no offload policy: torch needs an accelerator for it), as a subprocess since
the script opens and destroys its own process group."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns a process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_fsdp_offload.py"


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


def test_cpu_run_writes_three_variants(tmp_path):
    out = tmp_path / "result.json"
    result = run_script("--device", "cpu", "--dim", "64", "--layers", "2", "--batch", "32", "--steps", "2",
                        "--warmup", "1", "--dtype", "float32", "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["offload"] is False
    assert summary["settings"]["dim"] == 64 and summary["settings"]["dtype"] == "float32"
    variants = summary["variants"]
    assert set(variants) == {"chunked_adamw", "torch_adamw", "plain"}
    for name, variant in variants.items():
        assert variant["offload"] is False, name
        assert variant["step_seconds"] > 0 and len(variant["steps_seconds"]) == 2, name
        assert math.isfinite(variant["time_ratio"]) and variant["time_ratio"] > 0, name
        assert variant["peak_bytes"] is None and variant["peak_ratio"] is None, name  # no CUDA peak on CPU
        assert math.isfinite(variant["final_loss"]), name
    assert variants["plain"]["time_ratio"] == 1.0
    # same weights and inputs: after the same few steps the three optimizers agree closely
    losses = [variant["final_loss"] for variant in variants.values()]
    assert max(losses) - min(losses) < 1e-4 * max(abs(loss) for loss in losses)
    assert "chunked_adamw" in result.stdout  # the table


def test_help_lists_the_options(monkeypatch, capsys):
    """In this process: a subprocess would spend seconds importing torch for --help."""
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout first on sys.path
    spec = importlib.util.spec_from_file_location("bench_fsdp_offload", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exit_info:
        script.parse(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for option in ("--device", "--dim", "--layers", "--batch", "--steps", "--warmup", "--dtype", "--json"):
        assert option in usage, option
