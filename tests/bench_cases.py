"""What the bench test files share: running the bench into a JSON report
and reading it. (The small models the bench imports by name,
``tests.test_bench:<builder>``, are in test_bench.py.)"""

from __future__ import annotations

import importlib.util
import json

import pytest

from effilayers import bench

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB,
                                      reason="matplotlib is not installed (pip install 'effilayers[bench]')")


def run_bench(tmp_path, *args: str, plot: bool = False, status: int = 0) -> dict:
    json_path = tmp_path / "bench.json"
    argv = [*args, "--json", str(json_path)]
    if plot:
        argv += ["--plot", str(tmp_path / "bench.png")]
    assert bench.main(argv) == status
    return json.loads(json_path.read_text())


def by_variant(report: dict) -> dict:
    return {result["variant"]: result for result in report["results"]}


def check_ratios_against_plain(results: dict, plain_name: str, batch: int = 2) -> None:
    plain = results[plain_name]
    for result in results.values():
        assert result["cuda_peak_bytes"] is None and result["ratios"]["cuda_peak_bytes"] is None
        assert result["ratios"]["activation_bytes"] == pytest.approx(
            result["activation_bytes"] / plain["activation_bytes"])
        assert result["ratios"]["step_time"] == pytest.approx(result["step_time_s"] / plain["step_time_s"])
        assert result["images_per_s"] == pytest.approx(batch / result["step_time_s"])
        assert len(result["step_times_s"]) == 1
        # One timed step: its own minimum and maximum, no spread.
        assert result["step_time_min_s"] == result["step_time_max_s"] == result["step_time_s"]
        assert result["step_time_spread"] == 0
