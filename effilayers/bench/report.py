"""How ``effilayers-bench`` shows its results: the table, the --train check's
lines and warnings, the ``--json`` report and the ``--plot`` charts."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Callable, Optional

import torch

from .measure import LOSS_NOISE_FACTOR, LOSS_TOLERANCE_FLOOR, Result, Setup
from .variants import AS_GIVEN, PLAIN, BenchError

__all__ = ["measured_cells", "agreement", "format_table", "precision_name", "format_losses", "loss_warnings", "plot",
           "load_pyplot", "write_json"]

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


def format_table(results: list[Result]) -> str:
    show_max_batch = any(r.max_batch is not None for r in results)
    show_losses = any(r.losses is not None for r in results)
    header = ["model", "variant", "activation MiB", "", "CUDA peak MiB", "", "step ms", "", "images/s", ""]
    if show_max_batch:
        header += ["max batch", ""]
    if show_losses:
        header += ["losses vs float64"]
    rows = [header]
    for r in results:
        activation, peak, step, speed = measured_cells(vars(r))
        row = [r.model, r.variant, activation, _times(r.ratios["activation_bytes"]),
               peak, _times(r.ratios["cuda_peak_bytes"]), step, _times(r.ratios["step_time"]),
               speed, _times(r.ratios["images_per_s"])]
        if show_max_batch:
            row += [str(r.max_batch), _times(r.ratios["max_batch"])]
        if show_losses:
            row += [agreement(vars(r))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # Text columns left-aligned, numbers right-aligned so digits line up.
    text_columns = {0, 1, len(header) - 1} if show_losses else {0, 1}
    lines = ["  ".join(cell.ljust(w) if i in text_columns else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


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
            lines.append(f"{r.model}: plain PyTorch's own {precision} losses are up to {r.loss_noise_floor:.1e} (relative) "
                         f"from float64 here, so the check only holds the variants to "
                         f"{r.loss_tolerance:.1e}; BatchNorm over few values per channel (small --batch/--size) "
                         f"and deep residual networks at initialisation are ill-conditioned in {precision}")
    return lines


def plot(results: list[Result], path: str, pyplot: Any) -> Any:
    """Save bar charts (activation MiB, step ms, and CUDA peak MiB, max batch,
    loss curves when measured) to ``path``; returns the matplotlib figure."""
    labels = [f"{r.model}\n{r.variant}" for r in results]
    plain_of = {}
    for r in results:
        plain_of.setdefault(r.model, r)
    panels: list[tuple[str, Callable[[Result], Optional[float]], str]] = [
        ("activation MiB (one forward)", lambda r: _in_mib(r.activation_bytes), "activation_bytes"),
        ("median step time, ms", lambda r: None if r.step_time_s is None else r.step_time_s * 1e3, "step_time"),
    ]
    if any(r.cuda_peak_bytes is not None for r in results):
        panels.append(("CUDA peak MiB (one step)", lambda r: _in_mib(r.cuda_peak_bytes), "cuda_peak_bytes"))
    if any(r.max_batch is not None for r in results):
        panels.append(("largest batch that trains", lambda r: r.max_batch, "max_batch"))
    trained = [r for r in results if r.losses]
    count = len(panels) + (2 if trained else 0)
    figure, axes = pyplot.subplots(1, count, figsize=(5 * count, 5.5), squeeze=False)
    axes = list(axes[0])
    for axis, (title, value, ratio_key) in zip(axes, panels):
        shown = [(i, value(r), r.ratios.get(ratio_key)) for i, r in enumerate(results) if value(r) is not None]
        bars = axis.bar([i for i, _, _ in shown], [v for _, v, _ in shown], color="tab:blue")
        axis.bar_label(bars, labels=["" if ratio is None else f"{ratio:.2f}x" for _, _, ratio in shown], fontsize=8)
        axis.set_title(title)
        axis.set_xticks(range(len(results)))
        axis.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    if trained:
        curves, errors = axes[len(panels)], axes[len(panels) + 1]
        for r in trained:
            steps = range(1, len(r.losses) + 1)
            curves.plot(steps, r.losses, marker="o", label=f"{r.model} / {r.variant}")
            if r.loss_rel_errors is not None:
                errors.semilogy(steps, [max(e, 1e-12) for e in r.loss_rel_errors], marker="o",
                                label=f"{r.model} / {r.variant}")
        for r in plain_of.values():
            if r.loss_tolerances is not None:
                errors.semilogy(range(1, len(r.loss_tolerances) + 1), r.loss_tolerances, "k:",
                                label=f"{r.model} tolerance")
        curves.set_title("training loss (same weights and data)")
        errors.set_title("|loss - float64 reference| / reference")
        for axis in (curves, errors):
            axis.set_xlabel("training step")
            axis.xaxis.get_major_locator().set_params(integer=True)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=7)
    figure.suptitle("effilayers bench: " + ", ".join(sorted({r.model for r in results}))
                    + " (bar labels: ratio to plain PyTorch)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return figure



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
        "settings": {"device": setup.device.type, "batch": setup.batch, "size": setup.size, "dtype": dtype_name,
                     "channels_last": setup.channels_last, "compile": setup.compile, "steps": setup.steps,
                     "train": setup.train_steps, "max_batch_limit": max_batch_limit,
                     "loss_noise_factor": LOSS_NOISE_FACTOR,
                     "loss_tolerance_floor": LOSS_TOLERANCE_FLOOR[setup.dtype]},
        "skipped": skipped,
        "environment": collect(),
        "results": [vars(r) for r in results],
    }
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
