"""``python -m effilayers.bench`` end to end on CPU at tiny sizes, and the
max-batch search against a simulated memory limit."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from effilayers import bench

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny_convertible_model() -> nn.Module:
    """Imported by the bench through ``tests.test_bench:tiny_convertible_model``."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def tiny_model_without_norm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def not_a_module() -> int:
    return 3


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    # The bench picks CUDA when it can; these tests pin down the CPU behaviour.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def run_bench(tmp_path, *args: str, plot: bool = False) -> dict:
    json_path = tmp_path / "bench.json"
    argv = [*args, "--json", str(json_path)]
    if plot:
        argv += ["--plot", str(tmp_path / "bench.png")]
    assert bench.main(argv) == 0
    return json.loads(json_path.read_text())


def by_variant(report: dict) -> dict:
    return {result["variant"]: result for result in report["results"]}


def check_ratios_against_plain(results: dict, plain_name: str) -> None:
    plain = results[plain_name]
    for result in results.values():
        assert result["cuda_peak_bytes"] is None and result["ratios"]["cuda_peak_bytes"] is None
        assert result["ratios"]["activation_bytes"] == pytest.approx(
            result["activation_bytes"] / plain["activation_bytes"])
        assert result["ratios"]["step_time"] == pytest.approx(result["step_time_s"] / plain["step_time_s"])
        assert result["images_per_s"] == pytest.approx(2 / result["step_time_s"])
        assert len(result["step_times_s"]) == 1


@pytest.fixture(scope="module")
def resnet_report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resnet")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        report = run_bench(tmp_path, "--model", "resnet50", "--size", "32", "--batch", "2", "--steps", "1",
                           plot=HAVE_MATPLOTLIB)
    return report, tmp_path


def test_resnet50_json_report(resnet_report, capsys):
    report, _ = resnet_report
    assert {"command", "argv", "settings", "environment", "results"} <= set(report)
    assert "effilayers.bench" in report["command"] and "--model resnet50" in report["command"]
    assert report["settings"] == {"device": "cpu", "batch": 2, "size": 32, "dtype": "float32",
                                  "channels_last": False, "steps": 1, "train": 0, "max_batch_limit": None,
                                  "compile": False}
    assert {"torch", "device", "ops"} <= set(report["environment"])
    results = by_variant(report)
    assert list(results) == ["plain PyTorch", "effilayers ABN", "effilayers InPlaceABN"]
    assert all(r["same_weights"] for r in results.values())
    check_ratios_against_plain(results, "plain PyTorch")
    assert results["effilayers InPlaceABN"]["activation_bytes"] < results["plain PyTorch"]["activation_bytes"]


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed (pip install 'effilayers[bench]')")
def test_resnet50_plot_is_a_png(resnet_report):
    _, tmp_path = resnet_report
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_SIGNATURE


def test_densenet121_end_to_end(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "densenet121", "--size", "32", "--batch", "2", "--steps", "1")
    results = by_variant(report)
    assert list(results) == ["plain PyTorch", "effilayers"]
    check_ratios_against_plain(results, "plain PyTorch")
    assert results["effilayers"]["activation_bytes"] < results["plain PyTorch"]["activation_bytes"]
    table = capsys.readouterr().out
    assert "densenet121" in table and "n/a" in table and "images/s" in table


def test_module_callable_model_with_training_curves(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--batch", "2", "--steps", "1", "--train", "3", plot=HAVE_MATPLOTLIB)
    results = by_variant(report)
    assert list(results) == ["as given", "effilayers convert(inplace)"]
    check_ratios_against_plain(results, "as given")
    for result in results.values():
        assert len(result["losses"]) == 3 and all(loss > 0 for loss in result["losses"])
    converted = results["effilayers convert(inplace)"]
    expected = abs(converted["losses"][-1] - results["as given"]["losses"][-1]) / results["as given"]["losses"][-1]
    assert converted["final_loss_rel_diff"] == pytest.approx(expected)
    # Same weights and data; leaky_relu(0.01) instead of relu moves the loss only a little.
    assert converted["max_loss_rel_diff"] < 0.05
    assert "final rel diff" in capsys.readouterr().out
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_SIGNATURE


def test_compile_times_compiled_modules_and_counts_eager_activations(tmp_path, capsys):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    args = ("--model", "tests.test_bench:tiny_convertible_model", "--size", "32", "--batch", "2", "--steps", "1")
    compiled = run_bench(tmp_path, *args, "--compile")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # one per variant at least
    assert compiled["settings"]["compile"] is True
    assert "torch.compile" in capsys.readouterr().out
    eager = run_bench(tmp_path, *args)
    assert eager["settings"]["compile"] is False
    for variant, result in by_variant(compiled).items():
        assert result["activation_bytes"] == by_variant(eager)[variant]["activation_bytes"]
        assert result["step_time_s"] > 0
    torch._dynamo.reset()


def test_model_that_does_not_convert_has_one_variant(tmp_path):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_model_without_norm", "--size", "32",
                       "--batch", "2", "--steps", "1")
    assert [r["variant"] for r in report["results"]] == ["as given"]


def simulated_memory(fits_up_to: int):
    calls = []

    def try_step(batch: int) -> bool:
        calls.append(batch)
        return batch <= fits_up_to

    return try_step, calls


@pytest.mark.parametrize("start", [1, 2, 3, 32, 100])
@pytest.mark.parametrize("fits_up_to", [0, 1, 2, 5, 31, 32, 33, 100, 777])
def test_find_max_batch_finds_the_simulated_limit(start, fits_up_to):
    search_limit = 1000
    try_step, calls = simulated_memory(fits_up_to)
    assert bench.find_max_batch(try_step, start, search_limit) == fits_up_to
    assert max(calls) <= search_limit
    assert len(calls) == len(set(calls)), "tried a batch twice"


@pytest.mark.parametrize("search_limit", [1, 7, 64, 100])
def test_find_max_batch_never_exceeds_its_limit(search_limit):
    try_step, calls = simulated_memory(10**6)
    assert bench.find_max_batch(try_step, 3, search_limit) == search_limit
    assert max(calls) <= search_limit


def test_find_max_batch_rejects_nonpositive_arguments():
    with pytest.raises(ValueError):
        bench.find_max_batch(lambda batch: True, 0, 10)


def test_max_batch_on_cpu_exits_2_with_a_message(capsys):
    assert bench.main(["--max-batch"]) == 2
    assert "--max-batch needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("model, message", [
    ("resnet9000", "expected one of resnet50, densenet121 or 'module:callable'"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("tests.test_bench:no_such_function", "has no attribute 'no_such_function'"),
    ("tests.test_bench:not_a_module", "expected an nn.Module"),
])
def test_bad_model_exits_2_with_a_message(model, message, capsys):
    assert bench.main(["--model", model, "--size", "32", "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "float16 needs CUDA"),
    (["--batch", "0"], "--batch must be >= 1"),
])
def test_bad_settings_exit_2(argv, message, capsys):
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_argparse_rejects_unknown_dtype():
    with pytest.raises(SystemExit) as exited:
        bench.main(["--dtype", "int8"])
    assert exited.value.code == 2


def test_readme_headline_is_generated_from_the_committed_results(monkeypatch):
    """The README's headline table is exactly what benchmarks/headline.py makes
    of the results files it names: nobody edits the numbers by hand."""
    import re
    from pathlib import Path

    from benchmarks import headline

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert readme.count(headline.START) == 1 and readme.count(headline.END) == 1
    section = readme.split(headline.START)[1].split(headline.END)[0]
    sources = re.findall(r"^`(benchmarks/results/[^`]+\.json)`:", section, flags=re.MULTILINE)
    assert sources, "the headline section names no results file"
    monkeypatch.chdir(root)
    for source in sources:
        report = json.loads(Path(source).read_text())
        assert {"command", "settings", "environment", "results"} <= set(report)
    assert section.strip() == headline.render(sources).strip()
