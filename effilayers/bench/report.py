"""How ``effilayers-bench`` shows its results: the table, the --train check's
lines and warnings, the ``--json`` report and the ``--plot`` charts."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Callable, Optional

import torch

from .measure import CLOCKS, LOSS_NOISE_FACTOR, LOSS_TOLERANCE_FLOOR, MAX_BATCH_PRECISION, SPREAD_WARNING, Result, Setup
from .variants import AS_GIVEN, PLAIN, BenchError

__all__ = ["measured_cells", "agreement", "gradient_cell", "format_table", "conclusion", "precision_name",
           "format_losses", "loss_warnings", "plot", "load_pyplot", "write_json", "timing_warning"]

# Plain PyTorch this far from float64 means the check is weak here: say so.
ILL_CONDITIONED = 1e-3


def _in_mib(value: Optional[int]) -> Optional[float]:
    return None if value is None else value / 2**20


def _mib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{_in_mib(value):,.1f}"


def measured_cells(result: dict[str, Any]) -> list[str]:
    """Activation MiB, CUDA peak MiB, step ms, images/s of one result (a
    :class:`Result`'s fields): "OOM" for a variant that did not fit."""
    if result.get("out_of_memory"):
        return ["OOM"] * 4
    return [_mib(result["activation_bytes"]), _mib(result.get("cuda_peak_bytes")),
            f"{result['step_time_s'] * 1e3:.1f}", f"{result['images_per_s']:.1f}"]


def _times(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}x"


def agreement(result: dict[str, Any]) -> str:
    """The --train check of one result (a :class:`Result`'s fields) in words."""
    if result.get("loss_tolerance") is None:
        return "n/a"
    if result.get("losses_agree") is None:
        return f"noise floor {result['loss_noise_floor']:.1e}"
    return ("agree" if result["losses_agree"] else "DIFFER") + f" (tol {result['loss_tolerance']:.1e})"


def gradient_cell(result: dict[str, Any], reference: bool = False) -> str:
    """--budget's gradient check of one result (a :class:`Result`'s fields)
    in the table: "yes", "no (2.1e-01)" (the largest relative difference),
    "reference" for the plain row (``reference``), "n/a" where not checked."""
    if reference:
        return "reference"
    match = result.get("gradients_match")
    if match is None:
        return "n/a"
    return "yes" if match else f"no ({result['gradient_max_rel_diff']:.1e})"


def _with_ratio(value: str, ratio: Optional[float]) -> str:
    return value if ratio is None or value in ("n/a", "OOM") else f"{value} ({_times(ratio)})"


def _spread_cell(r: Result) -> str:
    if r.step_time_min_s is None or r.step_time_max_s is None:
        return "OOM" if r.out_of_memory else "n/a"
    return f"{r.step_time_min_s * 1e3:.1f}-{r.step_time_max_s * 1e3:.1f}"


def format_table(results: list[Result], clock: str = "wall", cuda: bool = True, rate: str = "images/s") -> str:
    """One row per variant; each measurement with its ratio to plain PyTorch
    in one cell, so the header stands over both; text columns start, number
    columns end, at the same place in every row. ``clock``: what timed the
    steps (measure.CLOCKS); the step columns say so when it is CPU time.
    ``cuda``: whether the variants ran on CUDA; elsewhere there is no CUDA
    peak to show, and a column of "n/a" would only push the rest aside.
    ``rate``: the header of the batch-per-second column (``sequences/s`` for
    a language model)."""
    show_max_batch = any(r.max_batch is not None for r in results)
    show_losses = any(r.losses is not None for r in results)
    show_gradients = any(r.gradients_match is not None for r in results)
    step = "step ms" if clock == "wall" else f"{clock} step ms"
    header = ["model", "variant", "activation MiB", "CUDA peak MiB", step, "min-max ms", rate]
    if not cuda:
        header.remove("CUDA peak MiB")
    if show_max_batch:
        header += ["max batch"]
    if show_gradients:
        header += ["grads = plain"]
    if show_losses:
        header += ["losses vs float64"]
    rows = [header]
    # The gradient check's reference: each model's first row.
    firsts = {id(next(r for r in results if r.model == model)) for model in {r.model for r in results}}
    for r in results:
        activation, peak, step, speed = measured_cells(vars(r))
        row = [r.model, r.variant, _with_ratio(activation, r.ratios.get("activation_bytes"))]
        if cuda:
            row += [_with_ratio(peak, r.ratios.get("cuda_peak_bytes"))]
        row += [_with_ratio(step, r.ratios.get("step_time")), _spread_cell(r),
                _with_ratio(speed, r.ratios.get("images_per_s"))]
        if show_max_batch:
            row += [_with_ratio(str(r.max_batch), r.ratios.get("max_batch"))]
        if show_gradients:
            row += [gradient_cell(vars(r), reference=id(r) in firsts)]
        if show_losses:
            row += [agreement(vars(r))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # Text columns left-aligned, numbers right-aligned so digits line up.
    text_columns = {0, 1} | {index for index, name in enumerate(header)
                             if name in ("grads = plain", "losses vs float64")}
    lines = ["  ".join(cell.ljust(w) if i in text_columns else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0].rstrip()))
    return "\n".join(line.rstrip() for line in lines)


def conclusion(results: list[Result]) -> str:
    """One model's result in a line, from its rows (``results[0]`` is plain,
    the baseline of the ratios): the variant that keeps the fewest activation
    bytes and the step time that costs, as ratios to plain. Bytes are
    compared as the table shows them (two decimals), the faster variant
    taking a tie: a few bytes less must not pick a slower row over one the
    table shows as equal."""
    plain, others = results[0], results[1:]
    measured = [r for r in others if r.ratios.get("activation_bytes") is not None]
    if not measured:
        why = f"{plain.variant} did not fit at this batch" if plain.out_of_memory else "no other variant was measured"
        return f"{plain.model}: nothing to compare, {why}"
    best = min(measured, key=lambda r: (round(r.ratios["activation_bytes"], 2),
                                        r.ratios.get("step_time") or float("inf")))
    kept, time = best.ratios["activation_bytes"], best.ratios.get("step_time")
    if round(kept, 2) >= 1.0:
        return f"{plain.model}: no variant keeps fewer activation bytes than {plain.variant}"
    cost = "(step time not measured)" if time is None else f"at {time:.2f}x the step time"
    return (f"{plain.model}: {best.variant} saves {1 - kept:.0%} of the activation bytes ({kept:.2f}x "
            f"{plain.variant}) {cost}")


def timing_warning(results: list[Result]) -> Optional[str]:
    """One line naming the variants whose timed steps spread over more than
    SPREAD_WARNING of their median, and what to do; None when none did."""
    spread = [r for r in results if r.step_time_spread is not None and r.step_time_spread > SPREAD_WARNING]
    if not spread:
        return None
    worst = max(spread, key=lambda r: r.step_time_spread)
    return (f"the step times of {len(spread)} of {len(results)} variants spread over more than "
            f"{SPREAD_WARNING:.0%} of their median (most: {worst.model} / {worst.variant}, "
            f"{worst.step_time_spread:.0%}; min-max in the table): the machine was busy and the time ratios are "
            "uncertain; "
            "rerun on an idle machine or with more --steps (on a shared CPU, --clock cpu --threads 1 does not "
            "count the time other programs take)")


def precision_name(dtype: torch.dtype) -> str:
    """How the losses of a run at ``dtype`` were computed, in words."""
    name = str(dtype).removeprefix("torch.")
    return name if dtype == torch.float32 else f"{name} autocast"


def format_losses(results: list[Result], dtype: torch.dtype = torch.float32) -> str:
    precision = precision_name(dtype)
    lines = [f"training check: each variant's loss against a float64 run of plain PyTorch computing the same "
             f"function; tolerance at step t = max({LOSS_NOISE_FACTOR:g} x plain PyTorch's largest relative "
             f"distance to its float64 run up to t, floor)"]
    for r in results:
        if r.losses is None:
            continue
        line = f"  {r.model:<12} {r.variant:<30} final loss {r.losses[-1]:.4f}"
        if r.loss_rel_errors is not None:
            line += f"  max rel err {max(r.loss_rel_errors):.1e}  {agreement(vars(r))}"
        if r.max_loss_rel_diff is not None and r.variant not in (PLAIN, AS_GIVEN):
            line += f"  (vs plain {precision}: max rel diff {r.max_loss_rel_diff:.1e})"
        lines.append(line)
    return "\n".join(lines)


def loss_warnings(results: list[Result], dtype: torch.dtype = torch.float32) -> list[str]:
    """One line per variant whose losses left the tolerance, and per model
    whose noise floor makes the check weak (``dtype``: the runs' --dtype)."""
    precision = precision_name(dtype)
    lines = []
    for r in results:
        if r.losses_agree is False:
            step = next(t for t, (e, tol) in enumerate(zip(r.loss_rel_errors, r.loss_tolerances)) if not e <= tol)
            lines.append(f"{r.model} / {r.variant}: losses differ from {r.loss_reference} beyond the tolerance: "
                         f"step {step + 1}, relative error {r.loss_rel_errors[step]:.2e} > "
                         f"{r.loss_tolerances[step]:.2e}")
        if r.losses_agree is None and r.loss_noise_floor is not None and r.loss_noise_floor > ILL_CONDITIONED:
            lines.append(f"{r.model}: plain PyTorch's own {precision} losses are up to {r.loss_noise_floor:.1e} "
                         f"(relative) from float64 here, so the check only holds the variants to "
                         f"{r.loss_tolerance:.1e}; BatchNorm over few values per channel (small --batch/--size) "
                         f"and deep networks at initialisation are ill-conditioned in {precision}. "
                         f"{_sharper_check(dtype)}")
    return lines


def _sharper_check(dtype: torch.dtype) -> str:
    advice = "For a sharper check, raise --batch and --size (more values per BatchNorm channel)"
    if dtype != torch.float32:
        advice += ", or check the same variants with --dtype float32, whose rounding noise is far smaller"
    return advice


def plot(results: list[Result], path: str, pyplot: Any, setup: Optional[Setup] = None) -> Any:
    """Save bar charts (activation MiB, step ms, and CUDA peak MiB, max batch
    when measured) and, with --train, one row per model: its loss curves and
    their distance to the float64 reference inside the model's tolerance band
    (``setup`` puts the settings in the title); returns the matplotlib figure."""
    labels = [f"{r.model}\n{r.variant}" for r in results]
    panels: list[tuple[str, Callable[[Result], Optional[float]], str]] = [
        ("activation MiB (one forward)", lambda r: _in_mib(r.activation_bytes), "activation_bytes"),
        ("median step time, ms", lambda r: None if r.step_time_s is None else r.step_time_s * 1e3, "step_time"),
    ]
    if any(r.cuda_peak_bytes is not None for r in results):
        panels.append(("CUDA peak MiB (one step)", lambda r: _in_mib(r.cuda_peak_bytes), "cuda_peak_bytes"))
    if any(r.max_batch is not None for r in results):
        panels.append(("largest batch that trains", lambda r: r.max_batch, "max_batch"))
    trained_models = list(dict.fromkeys(r.model for r in results if r.losses))
    columns = max(len(panels), 2 if trained_models else 1)
    # The loss rows' legends stand right of their second panel: over the empty
    # columns of those rows, or in a margin kept for them.
    margin = 3 if trained_models and columns == 2 else 0
    width = 5 * columns + margin
    figure = pyplot.figure(figsize=(width, 5.5 + 4.5 * len(trained_models)))
    grid = figure.add_gridspec(1 + len(trained_models), columns)
    for column, (title, value, ratio_key) in enumerate(panels):
        axis = figure.add_subplot(grid[0, column])
        shown = [(i, value(r), r.ratios.get(ratio_key)) for i, r in enumerate(results) if value(r) is not None]
        bars = axis.bar([i for i, _, _ in shown], [v for _, v, _ in shown], color="tab:blue")
        axis.bar_label(bars, labels=["" if ratio is None else f"{ratio:.2f}x" for _, _, ratio in shown], fontsize=8)
        axis.set_title(title)
        axis.set_xticks(range(len(results)))
        axis.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    for row, model in enumerate(trained_models, start=1):
        _loss_row(figure.add_subplot(grid[row, 0]), figure.add_subplot(grid[row, 1]), model,
                  [r for r in results if r.model == model])
    if setup is None:
        settings = ", ".join(trained_models or dict.fromkeys(r.model for r in results))
    else:
        settings = (f"{setup.device.type}, batch {setup.batch}, {setup.sample}, "
                    f"{precision_name(setup.dtype)}, {setup.steps} timed steps"
                    + (f", --train {setup.train_steps}" if setup.train_steps else ""))
    figure.suptitle(f"effilayers bench: {settings} (bar labels: ratio to plain PyTorch)")
    figure.tight_layout(rect=(0, 0, 1 - margin / width, 0.98))  # below the title
    figure.savefig(path, dpi=100)
    return figure


def _loss_row(curves: Any, errors: Any, model: str, results: list[Result]) -> None:
    """One model's --train panels. The variants' losses agree to a few
    digits, so each curve is shifted along the step axis by a small offset
    and has its own marker: none hides another."""
    trained = [r for r in results if r.losses]
    markers = "osD^vP*X"
    width = 0.3  # the offsets span this much of a step
    plotted = []
    for i, r in enumerate(trained):
        offset = (i - (len(trained) - 1) / 2) * width / max(len(trained) - 1, 1)
        style = dict(color=f"C{i}", marker=markers[i % len(markers)], markersize=5, linewidth=1, label=r.variant)
        steps = [t + offset for t in range(1, len(r.losses) + 1)]
        curves.plot(steps, r.losses, **style)
        if r.loss_rel_errors is not None:
            shown = [max(e, 1e-12) for e in r.loss_rel_errors]
            errors.semilogy(steps, shown, **style)
            plotted += shown
    tolerances = next((r.loss_tolerances for r in results if r.loss_tolerances is not None), None)
    if tolerances is not None:
        bottom = min(plotted + tolerances) / 10
        # Past the first and last step by the offsets, so every marker sits on the band.
        steps = [1 - width / 2, *range(1, len(tolerances) + 1), len(tolerances) + width / 2]
        bounds = [tolerances[0], *tolerances, tolerances[-1]]
        errors.fill_between(steps, [bottom] * len(steps), bounds, color="tab:green", alpha=0.15,
                            label="tolerance (inside: agree)")
        errors.set_yscale("log")
    curves.set_title(f"{model}\ntraining loss (same weights and data)", fontsize=10)
    errors.set_title(f"{model}\n|loss - float64 reference| / reference", fontsize=10)
    for axis in (curves, errors):
        axis.set_xlabel("training step (variants offset for visibility)")
        axis.xaxis.get_major_locator().set_params(integer=True)
    if errors.get_legend_handles_labels()[0]:
        errors.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    elif curves.get_legend_handles_labels()[0]:
        curves.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def load_pyplot(path: str) -> Any:
    """matplotlib's pyplot (Agg) for ``--plot path``, or a BenchError saying
    why it cannot write there: loaded before the benchmark, so a missing
    matplotlib costs nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as error:
        raise BenchError(f"--plot needs matplotlib ({error}); pip install matplotlib "
                         "or pip install 'effilayers[bench]'") from error
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise BenchError(f"--plot {path!r}: the file name must end in one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")
    return pyplot


def write_json(path: str, argv: list[str], setup: Setup, dtype_name: str, max_batch_limit: Optional[int],
               skipped: list[str], results: list[Result]) -> None:
    """The ``--json`` report: the command, its settings, the peers skipped,
    the environment and every result."""
    from .._info import collect

    report = {
        "command": shlex.join([sys.executable, "-m", "effilayers.bench", *argv]),
        "argv": list(argv),
        "settings": {"device": setup.device.type, "batch": setup.batch, "size": setup.size, "tokens": setup.tokens,
                     "dtype": dtype_name,
                     "channels_last": setup.channels_last, "compile": setup.compile, "steps": setup.steps,
                     "train": setup.train_steps, "max_batch_limit": max_batch_limit,
                     "max_batch_precision": MAX_BATCH_PRECISION if max_batch_limit is not None else None,
                     "loss_noise_factor": LOSS_NOISE_FACTOR,
                     "loss_tolerance_floor": LOSS_TOLERANCE_FLOOR[setup.dtype], "spread_warning": SPREAD_WARNING,
                     "timed_in_turn": not setup.compile,
                     # What timed a step: CUDA events on CUDA, else measure.CLOCKS[clock].
                     "clock": "cuda events" if setup.device.type == "cuda" else CLOCKS[setup.clock],
                     "threads": setup.threads,
                     # What a row's CUDA peak counts (results from before it was a row's own lack the key).
                     "cuda_peak": ("one step's max_memory_allocated less what was allocated outside the row as it "
                                   "began" if setup.device.type == "cuda" else None)},
        "skipped": skipped,
        # The warning printed when a variant's step times spread over more than spread_warning of their median.
        "timing_warning": timing_warning(results),
        "environment": collect(),
        "results": [vars(r) for r in results],
    }
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
