"""The bench's timing, plot and command line: CUDA events or the clock, the
plot's panels, argument and model errors (exit 2), output paths, the
headline tables of the README and the docs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from benchmarks import headline, ledger
from effilayers import bench

from .bench_cases import HAVE_MATPLOTLIB, needs_matplotlib, run_bench

# The bench on CPU, without the peer libraries (conftest.on_cpu_without_peers).
pytestmark = pytest.mark.usefixtures("on_cpu_without_peers")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- timing --------------------------------------------------------------------------------


class FakeEvent:
    recorded = []

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        FakeEvent.recorded.append(self)

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 250.0  # milliseconds


def test_time_call_uses_cuda_events_on_cuda_and_the_clock_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.recorded = []
    assert bench.time_call(lambda: calls.append(1), torch.device("cuda")) == pytest.approx(0.25)
    assert len(FakeEvent.recorded) == 2 and calls == [1]
    FakeEvent.recorded = []
    seconds = bench.time_call(lambda: calls.append(2), torch.device("cpu"))
    assert FakeEvent.recorded == [] and calls == [1, 2] and 0 <= seconds < 0.25


def test_the_cpu_clock_does_not_count_time_the_process_waits():
    cpu = torch.device("cpu")
    assert bench.time_call(lambda: time.sleep(0.05), cpu) >= 0.05
    assert bench.time_call(lambda: time.sleep(0.05), cpu, "cpu") < 0.025
    with pytest.raises(ValueError, match="clock must be one of wall, cpu, got 'gpu'"):
        bench.time_call(lambda: None, cpu, "gpu")


def test_clock_and_threads_are_in_the_table_and_the_json_and_threads_are_restored(tmp_path, capsys):
    threads = torch.get_num_threads()
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--steps", "1", "--clock", "cpu", "--threads", "1")
    assert torch.get_num_threads() == threads
    assert report["settings"]["clock"] == "process CPU time" and report["settings"]["threads"] == 1
    assert report["environment"]["threads"] == 1  # collected while the run's setting held
    out = capsys.readouterr().out
    assert "timed by process CPU time, 1 thread\n" in out and "cpu step ms" in out


def test_the_cpu_clock_is_refused_on_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--clock", "cpu"]) == 2
    assert "--clock cpu times the host; CUDA steps are timed with CUDA events" in capsys.readouterr().err


# ---- the plot ------------------------------------------------------------------------------


def fake_result(variant: str, activation: int, step: float, peak=None, max_batch=None, losses=None) -> bench.Result:
    return bench.Result("resnet50", variant, True, activation, peak, [step], step, 2 / step, max_batch=max_batch,
                        losses=losses)


def with_ratios(results):
    plain = results[0]
    for r in results:
        r.ratios = {"activation_bytes": r.activation_bytes / plain.activation_bytes,
                    "step_time": r.step_time_s / plain.step_time_s,
                    "cuda_peak_bytes": None if r.cuda_peak_bytes is None else r.cuda_peak_bytes / plain.cuda_peak_bytes,
                    "max_batch": None if r.max_batch is None else r.max_batch / plain.max_batch}
    return results


@needs_matplotlib
def test_plot_has_a_panel_per_measurement_with_ratio_labels(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    results = with_ratios([
        fake_result("plain PyTorch", 4 * 2**20, 0.1, peak=8 * 2**20, max_batch=100, losses=[3.0, 2.9]),
        fake_result("effilayers InPlaceABN", 2 * 2**20, 0.12, peak=5 * 2**20, max_batch=250, losses=[3.0, 2.9]),
    ])
    results[1].loss_rel_errors, results[0].loss_tolerances = [1e-7, 2e-7], [1e-5, 1e-5]
    figure = bench.plot(results, str(tmp_path / "plot.png"), pyplot)
    try:
        titles = [axis.get_title() for axis in figure.axes]
        assert titles == ["activation MiB (one forward)", "median step time, ms", "CUDA peak MiB (one step)",
                          "largest batch that trains", "resnet50\ntraining loss (same weights and data)",
                          "resnet50\n|loss - float64 reference| / reference"]
        for axis in figure.axes[:4]:
            assert len(axis.patches) == 2
        labels = {title: [text.get_text() for text in axis.texts] for title, axis in zip(titles, figure.axes)}
        assert labels["largest batch that trains"] == ["1.00x", "2.50x"]
        assert labels["activation MiB (one forward)"] == ["1.00x", "0.50x"]
        assert [bar.get_height() for bar in figure.axes[3].patches] == [100, 250]
        curves, errors = figure.axes[4], figure.axes[5]
        # Equal losses, yet no curve under another: each variant is offset along the steps.
        first, second = (line.get_xdata() for line in curves.lines)
        assert all(a != b for a, b in zip(first, second))
        # One tolerance band for the model, the legend outside the data.
        (band,) = errors.collections
        assert band.get_label() == "tolerance (inside: agree)"
        legend = errors.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().x0 > errors.get_window_extent().x1
        assert curves.get_legend() is None
    finally:
        pyplot.close(figure)
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG_SIGNATURE

    setup = bench.Setup(torch.device("cpu"), batch=2, size=64, dtype=torch.bfloat16, channels_last=False, steps=3,
                        train_steps=0)
    figure = bench.plot(with_ratios([fake_result("plain PyTorch", 1, 0.1), fake_result("effilayers", 1, 0.2)]),
                        str(tmp_path / "small.png"), pyplot, setup)
    assert [axis.get_title() for axis in figure.axes] == ["activation MiB (one forward)", "median step time, ms"]
    assert figure.get_suptitle().startswith("effilayers bench: cpu, batch 2, 64x64, bfloat16 autocast, 3 timed steps")
    pyplot.close(figure)


# ---- timing in turn, its spread, the table -------------------------------------------------


def test_timed_steps_take_turns_and_report_their_spread(monkeypatch):
    order = []
    seconds = {"a": iter([1.0, 2.0, 4.0]), "b": iter([1.0, 1.0, 1.1])}

    def fake_time_call(call, device, clock):
        call()
        return next(seconds[order[-1]])

    monkeypatch.setattr(bench.measure, "time_call", fake_time_call)
    sessions = [bench.measure._Session(None, None, None, [], True, None, None, bench.measure._CountedTick(lambda: None),
                                       step=lambda name=name: order.append(name)) for name in "ab"]
    setup = bench.Setup(torch.device("cpu"), 2, 32, torch.float32, False, steps=3, train_steps=0)
    bench.measure._time_in_turn(sessions, setup)
    assert order == ["a", "b", "a", "b", "a", "b"]
    a, b = (session.measured for session in sessions)
    assert a["step_times_s"] == [1.0, 2.0, 4.0] and a["step_time_s"] == 2.0
    assert (a["step_time_min_s"], a["step_time_max_s"], a["step_time_spread"]) == (1.0, 4.0, 1.5)
    assert b["step_time_spread"] == pytest.approx(0.1) and b["images_per_s"] == 2.0
    assert all(session.step is None for session in sessions)  # the optimizer and batch are let go
    assert all(session.tick.count == 3 for session in sessions)


def spread_result(variant: str, times: list[float]) -> bench.Result:
    median = sorted(times)[len(times) // 2]
    return bench.Result("resnet50", variant, True, 2**20, None, times, median, 2 / median,
                        step_time_min_s=min(times), step_time_max_s=max(times),
                        step_time_spread=(max(times) - min(times)) / median)


def test_a_spread_over_15_percent_warns_in_one_line():
    steady = spread_result("plain PyTorch", [1.0, 1.05, 1.1])  # 10 %
    loaded = spread_result("effilayers ABN", [1.0, 1.2, 1.5])  # 42 %
    assert bench.timing_warning([steady]) is None
    line = bench.timing_warning([steady, loaded])
    assert "\n" not in line and "1 of 2 variants" in line and "more than 15% of their median" in line
    assert "resnet50 / effilayers ABN, 42%" in line and "rerun on an idle machine" in line


def test_table_columns_line_up():
    results = with_ratios([
        spread_result("plain PyTorch", [0.0123, 0.0125, 0.013]),
        spread_result("effilayers InPlaceABN, a long name", [12.3, 12.5, 13.0]),
        spread_result("x", [1.0, 1.0, 1.0]),
    ])
    results[2].activation_bytes = 123456789 * 2**10
    for r in results:
        r.ratios["images_per_s"] = 1.0
    lines = bench.format_table(results).splitlines()
    assert set(lines[1]) == {"-"} and len(lines[1]) == max(len(line) for line in lines)
    # Cells are separated by two spaces at least; a cell holds single spaces.
    cells = [[match.span() for match in re.finditer(r"\S+(?: \S+)*", line)] for line in lines[:1] + lines[2:]]
    assert len({len(row) for row in cells}) == 1
    columns = list(zip(*cells))
    for column in columns[:2]:  # text: same start
        assert len({start for start, _ in column}) == 1
    for column in columns[2:]:  # numbers: same end
        assert len({end for _, end in column}) == 1
    assert "12300.0-13000.0" in lines[3] and "12.3-13.0" in lines[2]


def test_the_cuda_peak_column_is_there_on_cuda_only():
    results = with_ratios([spread_result("plain PyTorch", [1.0]), spread_result("effilayers ABN", [2.0])])
    on_cuda, on_cpu = bench.format_table(results), bench.format_table(results, cuda=False)
    assert "CUDA peak MiB" in on_cuda.splitlines()[0] and "n/a" in on_cuda
    assert "CUDA peak" not in on_cpu and "n/a" not in on_cpu
    # the same rows otherwise, one cell fewer (cells stand two spaces apart at least)
    cells = lambda table: [re.split(r"\s{2,}", line) for line in table.splitlines()[2:]]  # noqa: E731
    assert cells(on_cpu) == [row[:3] + row[4:] for row in cells(on_cuda)]


def conclusion_result(variant: str, activation=None, step=None) -> bench.Result:
    """A row; without measurements, one that ran out of memory."""
    return bench.Result("resnet50", variant, True, activation, None, [], step, None,
                        out_of_memory=activation is None)


def test_the_conclusion_names_the_fewest_bytes_and_their_step_time():
    results = with_ratios([conclusion_result("plain PyTorch", 1000, 0.10), conclusion_result("ABN", 800, 0.09),
                           conclusion_result("InPlaceABN", 420, 0.118), conclusion_result("more", 1200, 0.05)])
    assert bench.conclusion(results) == ("resnet50: InPlaceABN saves 58% of the activation bytes "
                                         "(0.42x plain PyTorch) at 1.18x the step time")
    # bytes equal at the table's two decimals: the faster one
    results = with_ratios([conclusion_result("plain PyTorch", 10000, 0.1), conclusion_result("slow", 4200, 0.3),
                           conclusion_result("fast", 4201, 0.2)])
    assert bench.conclusion(results).startswith("resnet50: fast saves 58% ")
    results = with_ratios([conclusion_result("plain PyTorch", 1000, 0.1), conclusion_result("bigger", 1500, 0.1)])
    assert bench.conclusion(results) == "resnet50: no variant keeps fewer activation bytes than plain PyTorch"
    results = [conclusion_result("plain PyTorch"), conclusion_result("ABN", 5, 0.1)]
    for r in results:
        r.ratios = {"activation_bytes": None, "step_time": None}
    assert bench.conclusion(results) == "resnet50: nothing to compare, plain PyTorch did not fit at this batch"


def test_a_cpu_run_prints_no_cuda_column_and_a_conclusion_from_its_rows(tmp_path, capsys):
    report = run_bench(tmp_path, "--model", "tests.test_bench:tiny_convertible_model", "--size", "32",
                       "--steps", "1")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("model "))
    assert "activation MiB" in header and "CUDA peak" not in header
    plain, converted = report["results"]
    kept, time = converted["ratios"]["activation_bytes"], converted["ratios"]["step_time"]
    assert kept == converted["activation_bytes"] / plain["activation_bytes"] < 1
    assert f"{plain['model']}: {converted['variant']} saves {1 - kept:.0%} of the activation bytes ({kept:.2f}x " \
           f"as given) at {time:.2f}x the step time\n" in out


def test_kernels_are_loaded_before_the_progress_bar(monkeypatch, capsys):
    from effilayers._core import registry

    events = []
    real_load = bench.cli._load_kernels

    def load(device_type):
        events.append("kernels")
        real_load(device_type)

    monkeypatch.setattr(bench.cli, "_load_kernels", load)
    monkeypatch.setattr(bench.cli, "_progress", lambda total: events.append("bar") or bench.cli._NoBar())
    assert bench.main(["--model", "tests.test_bench:tiny_model_without_norm", "--size", "32", "--steps", "1"]) == 0
    assert events == ["kernels", "bar"]
    assert all((name, "cpu") in registry._state.choices for name in registry.registered_ops())


def test_help_documents_device_and_verbose(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--device {cuda,cpu}" in out and "default: cuda when available, else cpu" in out
    assert "--verbose" in out and "under 30 lines" in out


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("model, message", [
    ("resnet9000", "expected one of resnet18, resnet34, resnet50, resnet101, resnet152, resnext50_32x4d, "
                   "wide_resnet50_2, densenet121, densenet161, densenet169, densenet201, densenet264 "
                   "or 'module:callable'"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("tests.test_bench:no_such_function", "has no attribute 'no_such_function'"),
    ("tests.test_bench:not_a_module", "expected an nn.Module"),
    ("tests.test_bench:raises_while_building",
     "--model 'tests.test_bench:raises_while_building': building the model raised RuntimeError: boom at build"),
])
def test_bad_model_exits_2_with_a_message(model, message, capsys):
    assert bench.main(["--model", model, "--size", "32", "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_a_model_normalising_with_batch_statistics_in_eval_is_probed_with_two_images(tmp_path, capsys):
    """The class-count probe (eval mode) used one image, which such a norm
    refuses whatever --batch was."""
    model = "tests.test_bench:tiny_model_with_batch_statistics_in_eval"
    report = run_bench(tmp_path, "--model", model, "--size", "32", "--batch", "4", "--steps", "1")
    assert report["results"][0]["variant"] == "as given"
    assert all(r["activation_bytes"] > 0 for r in report["results"])
    assert bench.main(["--model", model, "--size", "32", "--batch", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "the model failed on a (1, 3, 32, 32) image batch" in err and "use a larger --batch" in err


def test_channels_last_with_5d_weights_exits_2_with_a_message(capsys):
    argv = ["--model", "tests.test_bench:tiny_model_with_a_conv3d", "--size", "32", "--steps", "1"]
    assert bench.main([*argv, "--channels-last"]) == 2
    err = capsys.readouterr().err
    assert "effilayers-bench: error: --channels-last: the model has 5-D weights (1.weight)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "float16 needs CUDA"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--size", "16"], "--size must be >= 32, got 16"),
    (["--max-batch-limit", "64"], "--max-batch-limit needs --max-batch"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
])
def test_bad_settings_exit_2(argv, message, capsys):
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_states_the_size_minimum():
    assert "height and width, >= 32" in " ".join(bench.cli._parser().format_help().split())


def output_path_cases():
    yield pytest.param(["--json", "{tmp}/no/such/dir/out.json"], "does not exist", id="json-missing-dir")
    yield pytest.param(["--json", "{tmp}"], "is a directory", id="json-is-a-directory")
    yield pytest.param(["--plot", "{tmp}/missing/plot.png"], "does not exist", id="plot-missing-dir")
    if HAVE_MATPLOTLIB:
        yield pytest.param(["--plot", "{tmp}/plot.xyz"], "the file name must end in one of", id="plot-format")


@pytest.mark.parametrize("argv, message", list(output_path_cases()))
def test_unwritable_outputs_fail_before_the_benchmark(argv, message, tmp_path, capsys):
    assert bench.main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"effilayers-bench: error: {argv[0]} ") and message in captured.err
    assert captured.out == ""  # nothing was benchmarked


def test_both_kinds_of_error_share_one_prefix(capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--dtype", "int8"])
    assert exited.value.code == 2
    assert "effilayers-bench: error: argument --dtype: invalid choice" in capsys.readouterr().err
    assert bench.main(["--batch", "0"]) == 2
    assert capsys.readouterr().err.startswith("effilayers-bench: error: --batch")


@pytest.mark.parametrize("page, name", headline.SECTIONS)
def test_headline_tables_are_generated_from_the_committed_results(page, name, monkeypatch):
    """The headline tables of the README and of the docs' benchmark pages are
    exactly what benchmarks/headline.py makes of the results files each names:
    nobody edits the numbers by hand."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / page).read_text()
    sources = headline.sources(text, name)
    assert sources, f"the {name} section of {page} names no results file"
    monkeypatch.chdir(root)
    for source in sources:
        report = json.loads(Path(source).read_text())
        assert {"command", "settings", "environment", "results"} <= set(report)
    assert headline.section(text, name).strip() == headline.render_section(name, sources).strip()



def test_a_runs_section_has_a_table_per_command_and_a_column_per_run(tmp_path, monkeypatch):
    """Consecutive files of one command (but for --json) on one machine make
    one table; each run's step ratio gets a column, the byte ratio shows once
    where the runs agree, and a gradient check that differs between runs
    shows each run's answer."""
    def report(json_path: str, fit_step: float, match: bool, model: str = "m") -> dict:
        command = f"/usr/bin/python3 -m effilayers.bench --model {model} --budget 0.5 --json {json_path}"
        rows = [{"model": model, "variant": "plain PyTorch", "ratios": {"activation_bytes": 1.0, "step_time": 1.0},
                 "gradients_match": None},
                {"model": model, "variant": "fit(0.5)", "ratios": {"activation_bytes": 0.5, "step_time": fit_step},
                 "gradients_match": match, "gradient_max_rel_diff": 0.0 if match else 0.25}]
        return {"command": command, "settings": {"batch": 2, "size": 64, "tokens": None, "dtype": "float32",
                                                 "steps": 100, "device": "cpu"},
                "environment": {"device": {"name": "CPU X"}, "threads": 1}, "results": rows}

    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    paths = []
    for name, content in (("a1", report("x/a1.json", 1.1, True)), ("a2", report("x/a2.json", 1.2, False)),
                          ("b1", report("x/b1.json", 1.3, True, model="n"))):
        path = f"benchmarks/results/{name}.json"
        Path(path).write_text(json.dumps(content))
        paths.append(path)
    rendered = headline.render_runs(paths)
    first, second = rendered.split("\n\n2 runs")[0], rendered.split("\n\n1 run of ")[1]
    assert rendered.startswith("2 runs of `python -m effilayers.bench --model m --budget 0.5` (the `--json` file "
                               "left out) on CPU X, 1 thread; batch 2, 64×64, float32; median of 100 steps.")
    assert f"- `{paths[0]}`: run 1\n- `{paths[1]}`: run 2" in first
    assert "| model | variant | activation bytes | step, run 1 | step, run 2 | grads = plain |" in first
    assert "| m | plain PyTorch | 1.00× | 1.00× | 1.00× | reference |" in first
    assert "| m | fit(0.5) | 0.50× | 1.10× | 1.20× | yes / no (2.5e-01) |" in first
    assert second.startswith("`python -m effilayers.bench --model n --budget 0.5`")
    assert "| n | fit(0.5) | 0.50× | 1.30× | yes |" in second
    page = f"<!-- runs:start -->\n{rendered}\n<!-- runs:end -->\n"
    assert headline.sources(page, "runs") == paths


@pytest.mark.parametrize("own", [False, True])
def test_cuda_peaks_from_before_a_row_counted_its_own_are_shown_without_ratios(own):
    settings = {"batch": 8, "size": 224, "tokens": None, "dtype": "bfloat16", "steps": 5, "device": "cuda"}
    if own:
        settings["cuda_peak"] = "one step's max_memory_allocated less what was allocated outside the row"
    rows = [{"model": "m", "variant": name, "activation_bytes": 2**20 * activation, "cuda_peak_bytes": 2**20 * peak,
             "step_time_s": 0.01, "images_per_s": 100.0,
             "ratios": {"activation_bytes": activation / 4, "cuda_peak_bytes": peak / 10, "step_time": 1.0}}
            for name, activation, peak in (("plain PyTorch", 4, 10), ("effilayers ABN", 2, 12))]
    report = {"command": "python -m effilayers.bench --device cuda", "settings": settings,
              "environment": {"device": {"name": "GPU X"}}, "results": rows}
    rendered = headline.table(report, "r.json")
    assert ("| m | effilayers ABN | 2.0 (0.50×) | 12.0 (1.20×) |" in rendered) == own
    assert ("| m | effilayers ABN | 2.0 (0.50×) | 12.0 | 10.0 (1.00×) |" in rendered) != own
    assert ("do not compare across rows" in rendered) != own
    figures = ledger.bench_headline(report)
    assert ("CUDA peak 1.20x" in figures) == own and "effilayers ABN: step 1.00x" in figures


@pytest.mark.parametrize("arguments", [["--refresh", "benchmarks/results/bench-cpu-2026-11-27.json"],
                                       ["--refresh", "--page", "README.md"], ["--refresh", "--section", "fit"]])
def test_headline_refresh_takes_nothing_else(arguments, capsys):
    with pytest.raises(SystemExit) as exited:
        headline.main(arguments)
    assert exited.value.code == 2
    assert "--refresh takes no results files, --page or --section" in capsys.readouterr().err


def test_a_named_section_is_replaced_alone():
    page = "a\n<!-- headline:start -->\nold\n<!-- headline:end -->\nb\n<!-- fit:start -->\nold fit\n<!-- fit:end -->\n"
    replaced = headline.replace_in(page, "new fit", "fit")
    assert headline.section(replaced, "fit").strip() == "new fit"
    assert headline.section(replaced).strip() == "old" and replaced.startswith("a\n") and replaced.endswith("-->\n")
    with pytest.raises(ValueError, match="one <!-- nope:start --> ... <!-- nope:end --> section"):
        headline.section(page, "nope")


def test_a_train_step_wraps_its_forward_alone_in_the_given_context():
    # On CUDA the bench reads the forward's peak apart from the step's this way.
    events = []

    class Recording:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc_info):
            events.append("exit")

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    model[1].weight.register_hook(lambda grad: events.append("backward"))
    setup = bench.Setup(torch.device("cpu"), 2, 4, torch.float32, False, steps=1, train_steps=0)
    images, labels = setup.data(2, 5, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    bench.measure._train_step(model, optimizer, setup, images, labels, forward=Recording())
    assert events == ["enter", "exit", "backward"]
    assert all(parameter.grad is None for parameter in model.parameters())  # the step ran whole
