"""The headline tables of the README and of the docs' benchmark pages,
generated from committed ``effilayers-bench`` results (never typed by hand).

    python -m effilayers.bench --json benchmarks/results/bench-<device>-<date>.json
    python benchmarks/headline.py benchmarks/results/bench-<device>-<date>.json [more.json ...] \
        --page README.md --page docs/benchmarks/index.md

Prints one markdown table per results file (device, settings and the exact
command above it); with ``--page`` the text between
``<!-- headline:start -->`` and ``<!-- headline:end -->`` in each such file is
replaced by them (``--section fit``: between ``<!-- fit:start -->`` and
``<!-- fit:end -->``, the README's second table; ``--section runs``: one
table per group of consecutive files that are runs of one command on one
machine, a step-time column per run, as docs/benchmarks/fit.md sums up its
targets). tests/test_bench_cli.py checks
that each section of ``SECTIONS`` is what this script makes of the files it
names; ``--refresh`` regenerates them all from the files they name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from effilayers.bench import agreement, gradient_cell, measured_cells

HEADLINE = "headline"
# A section of repeated runs: one table per command, a column per run
RUNS = "runs"
# (file, section) of every generated table: the headlines of the README and
# docs/benchmarks/index.md are the bench's own results, the README's fit
# section and docs/benchmarks/fit.md's the `--budget` runs (its gpu section: those on a GPU)
SECTIONS = (("README.md", HEADLINE), ("README.md", "fit"), ("docs/benchmarks/index.md", HEADLINE),
            ("docs/benchmarks/fit.md", RUNS), ("docs/benchmarks/fit.md", HEADLINE), ("docs/benchmarks/fit.md", "gpu"))


def markers(name: str = HEADLINE) -> tuple[str, str]:
    """The comments that open and close section ``name`` of a page."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _with_ratio(text: str, ratio: Optional[float]) -> str:
    return text if ratio is None else f"{text} ({ratio:.2f}×)"


def _device(report: dict) -> str:
    environment = report.get("environment", {})
    device = environment.get("device")
    if isinstance(device, dict):
        name = device.get("name") or device.get("type")
    else:
        name = device
    threads = environment.get("threads")
    shown = f", {threads} thread{'s' * (threads != 1)}" if threads and report["settings"]["device"] == "cpu" else ""
    return f"{name}{shown}"


def _command(report: dict) -> str:
    """The recorded command, with the interpreter's absolute path shortened
    to ``python`` (the rest is verbatim)."""
    words = report["command"].split(" ", 1)
    if words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    return " ".join(words)


def _settings(report: dict) -> str:
    """Where and how a report was measured, in words: the machine, the batch,
    the dtype and layout, the steps."""
    settings = report["settings"]
    tokens = settings.get("tokens")
    return (f"{_device(report)}; batch {settings['batch']}, "
            f"{f'{tokens} tokens' if tokens else '{0}×{0}'.format(settings['size'])}, "
            f"{settings['dtype']}{', channels_last' if settings.get('channels_last') else ''}"
            f"{', torch.compile' if settings.get('compile') else ''}; median of {settings['steps']} steps")


def table(report: dict, source: str) -> str:
    settings = report["settings"]
    results = report["results"]
    max_batch = any(r.get("max_batch") is not None for r in results)
    trained = any(r.get("loss_tolerance") is not None for r in results)
    # --budget's gradient check (reports from before it have no such field)
    gradients = any(r.get("gradients_match") is not None for r in results)
    # --budget runs: their time ratios are the targets, read against the spread of the timed steps
    spread = gradients and any(r.get("step_time_min_s") is not None for r in results)
    tokens = settings.get("tokens")
    header = ["model", "variant", "activation MiB", "CUDA peak MiB", "step ms"] + \
        (["step ms min–max"] if spread else []) + ["sequences/s" if tokens else "images/s"]
    if max_batch:
        header.append("max batch")
    if gradients:
        header.append("grads = plain")
    if trained:
        header.append(f"losses vs float64 ({settings['train']} steps)")
    # Before the bench counted a row's own CUDA peak, each row's also held
    # the models and optimizer states of the rows warmed up before it.
    shared_peaks = settings.get("device") == "cuda" and settings.get("cuda_peak") is None
    lines = [
        f"`{source}`: {_settings(report)}. Command: `{_command(report)}`. Ratios are to plain PyTorch."
        + (" CUDA peaks: measured before the bench counted a row's own, each row's includes the models and "
           "optimizer states of the rows before it, so they are shown without ratios and do not compare across "
           "rows." if shared_peaks else ""),
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    firsts = {id(next(r for r in results if r["model"] == model)) for model in {r["model"] for r in results}}
    for r in results:
        ratios = r.get("ratios", {})
        cells = measured_cells(r)
        row = [r["model"], r["variant"]] + [_with_ratio(cell, None if shared_peaks and key == "cuda_peak_bytes"
                                                        else ratios.get(key)) for cell, key in zip(
            cells, ("activation_bytes", "cuda_peak_bytes", "step_time", "images_per_s"))]
        if spread:
            row.insert(5, "n/a" if r.get("step_time_min_s") is None else
                       f"{r['step_time_min_s'] * 1e3:.1f}–{r['step_time_max_s'] * 1e3:.1f}")
        if max_batch:
            row.append(_with_ratio(str(r.get("max_batch")), ratios.get("max_batch")))
        if gradients:
            row.append(gradient_cell(r, reference=id(r) in firsts))
        if trained:
            row.append(agreement(r))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render(paths: list[str]) -> str:
    blocks = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        blocks.append(table(report, Path(path).as_posix()))
    return "\n\n".join(blocks)


def _without_json(command: str) -> str:
    return re.sub(r" --json \S+", "", command)


def _run_group(report: dict) -> tuple:
    """What runs of one command share: the command but for its --json path,
    the machine and the rows."""
    return (_without_json(_command(report)), _device(report),
            tuple((r["model"], r["variant"]) for r in report["results"]))


def runs_table(named: list[tuple[str, dict]]) -> str:
    """One table for runs of one command (``named``: (path, report) each):
    per row its activation bytes as a ratio to plain's (one figure where
    every run agrees), each run's step time as a ratio to plain's in that
    run, and the gradient check of every run."""
    first = named[0][1]
    count = len(named)
    lines = [
        f"{count} run{'s' * (count != 1)} of `{_without_json(_command(first))}` (the `--json` file left out) on "
        f"{_settings(first)}. Ratios are to plain PyTorch in the same run.",
        "",
        *(f"- `{path}`: run {index}" for index, (path, _) in enumerate(named, 1)),
        "",
    ]
    gradients = any(r.get("gradients_match") is not None for _, report in named for r in report["results"])
    header = ["model", "variant", "activation bytes"] + [f"step, run {index}" for index in range(1, count + 1)]
    if gradients:
        header.append("grads = plain")
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    # The gradient check's reference: each model's first row.
    models = [r["model"] for r in first["results"]]
    firsts = {models.index(model) for model in models}
    for index, r in enumerate(first["results"]):
        rows = [report["results"][index] for _, report in named]
        byte_ratios = sorted({f"{row['ratios']['activation_bytes']:.2f}×" for row in rows
                              if row.get("ratios", {}).get("activation_bytes") is not None})
        cells = [r["model"], r["variant"], " / ".join(byte_ratios) or "n/a"]
        cells += [f"{row['ratios']['step_time']:.2f}×" if row.get("ratios", {}).get("step_time") is not None
                  else "n/a" for row in rows]
        if gradients:
            checks = [gradient_cell(row, reference=index in firsts) for row in rows]
            cells.append(checks[0] if len(set(checks)) == 1 else " / ".join(checks))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_runs(paths: list[str]) -> str:
    """:func:`runs_table` of each group of consecutive files that are runs
    of one command on one machine."""
    groups: list[list[tuple[str, dict]]] = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        if not groups or _run_group(groups[-1][0][1]) != _run_group(report):
            groups.append([])
        groups[-1].append((Path(path).as_posix(), report))
    return "\n\n".join(runs_table(group) for group in groups)


def render_section(name: str, paths: list[str]) -> str:
    """What section ``name`` of a page shows of ``paths``."""
    return render_runs(paths) if name == RUNS else render(paths)


def section(page: str, name: str = HEADLINE) -> str:
    """The text between the markers of section ``name`` of a page."""
    start, end = markers(name)
    if page.count(start) != 1 or page.count(end) != 1 or page.index(start) > page.index(end):
        raise ValueError(f"the page must contain one {start} ... {end} section")
    return page.split(start)[1].split(end)[0]


def sources(page: str, name: str = HEADLINE) -> list[str]:
    """The results files section ``name`` of a page names, in order."""
    return re.findall(r"^(?:- )?`(benchmarks/results/[^`]+\.json)`:", section(page, name), flags=re.MULTILINE)


def replace_in(page: str, rendered: str, name: str = HEADLINE) -> str:
    section(page, name)
    start, end = markers(name)
    head, rest = page.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{rendered}\n{end}{tail}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", help="JSON files written by effilayers-bench --json")
    parser.add_argument("--page", "--readme", dest="page", action="append", default=[],
                        help="replace the section of this file (repeatable; the generated sections: "
                             f"{', '.join(f'{page} {name}' for page, name in SECTIONS)})")
    parser.add_argument("--section", default=HEADLINE, choices=sorted({name for _, name in SECTIONS}),
                        help=f"which section of the pages (default: {HEADLINE}; the README's second table: fit; "
                             f"{RUNS}: a table per command run several times, a column per run)")
    parser.add_argument("--refresh", action="store_true",
                        help="regenerate every section of SECTIONS from the files it names already (after a change "
                             "to how tables are drawn); no results or --page with it")
    args = parser.parse_args(argv)
    if args.refresh:
        if args.results or args.page or args.section != HEADLINE:
            parser.error("--refresh takes no results files, --page or --section: it regenerates every section "
                         "from the files it names")
        # The pages, and the files they name, are relative to the repository's root.
        os.chdir(Path(__file__).resolve().parent.parent)
        for page, name in SECTIONS:
            text = Path(page).read_text()
            named = sources(text, name)
            if not named:
                parser.error(f"--refresh: the {name} section of {page} names no benchmarks/results file")
            Path(page).write_text(replace_in(text, render_section(name, named), name))
            print(f"updated {page} ({name})")
        return 0
    if not args.results:
        parser.error("give the results files (or --refresh)")
    rendered = render_section(args.section, args.results)
    for page in args.page:
        path = Path(page)
        path.write_text(replace_in(path.read_text(), rendered, args.section))
        print(f"updated {path}")
    if not args.page:
        print(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
