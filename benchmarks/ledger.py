"""The ledger of GPU evidence: for each kernel family, the last commit that
changed its kernels, its newest GPU result, that result's headline against
the family's target, and whether the result is fresh or stale.

    python3 benchmarks/ledger.py            # write benchmarks/results/GPU.md
    python3 benchmarks/ledger.py --check    # exit 1 when GPU.md is not what it would write
    python3 benchmarks/ledger.py --order    # family names in the order a GPU session measures them

GPU results are the files in benchmarks/results named
``<prefix>-<device>-<YYYY-MM-DD>[-anything].json`` (or ``.log`` / ``.md``)
with a device other than ``cpu``. A result is fresh when it is dated on or
after the day of the last commit that changed its family's kernels and, if
it is committed, its commit contains that change (a result committed before
the change cannot have measured it, whatever the day). A JSON that records
the commit it measured (``machine_info.effilayers.commit``) is judged by that
commit alone. Without git history every family is stale.

``benchmarks/gpu_session.py`` imports :func:`ledger_rows` to spend a GPU
session on the stale families first, least recently measured first, the
order :func:`stale_first` lists.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class Family:
    name: str
    kernels: tuple[str, ...]  # git pathspecs; a change to any of them makes older results stale
    prefixes: tuple[str, ...]  # result file names start with one of these, then -<device>-<date>
    target: str
    ours: str = "effilayers"  # pytest-benchmark implementation compared ...
    baseline: str = "torch"  # ... with this one, group by group
    # The target as a test of the result's figures (see figures()): True
    # met, False missed, None when the result does not hold what it needs.
    met: Optional[Callable[[dict], Optional[bool]]] = None
    # The groups its bench times on a GPU (its cuda cases, collected with
    # EFFILAYERS_BENCH_COLLECT_CUDA=1; tests/test_gpu_ledger.py checks): a
    # result with fewer, from a run cut short, cannot meet the target.
    cases: int = 0
    # An op family's pytest-benchmark file, and the seconds the GPU session
    # gives its cuda cases (benchmarks/gpu_session.py; 0: no step).
    bench: str = ""
    gpu_seconds: int = 0


def _literal(path: Path, name: str):
    """The literal assigned to ``name`` at the top of ``path`` (None when
    absent): read with ``ast``, so that listing the families imports no
    benchmark."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name):
            return ast.literal_eval(node.value)
    return None


def _all_of(terms: tuple) -> Callable[[dict], Optional[bool]]:
    """A ``met`` from (figure, bound[, above]) terms: each must hold (see
    _all); the first term that does not hold, or has no figures, decides."""
    def met(figures: dict) -> Optional[bool]:
        for term in terms:
            verdict = _all(figures, *term)
            if verdict is not True:
                return verdict
        return True
    return met


def op_families(directory: Path = Path(__file__).resolve().parent) -> tuple[Family, ...]:
    """The families whose pytest-benchmark file declares ``LEDGER``: a dict
    of ``family`` (the name), ``kernels`` (pathspecs), ``prefix`` (of its
    result files), ``target``, ``met`` ((figure, bound[, above]) terms),
    ``cases``, ``gpu_seconds`` and, where they differ from the defaults,
    ``ours`` / ``baseline``. A new family is listed by its bench file alone."""
    found = []
    for path in sorted(directory.glob("bench_*.py")):
        declared = _literal(path, "LEDGER")
        if declared is None:
            continue
        declared = dict(declared)
        terms = declared.pop("met", None)
        found.append(Family(name=declared.pop("family"), prefixes=(declared.pop("prefix"),),
                            kernels=tuple(declared.pop("kernels")), met=_all_of(terms) if terms else None,
                            bench=f"benchmarks/{path.name}", **declared))
    return tuple(found)


# The op families (each declared in its bench file), then the tools'.
# fit's results carry the model and budget before the device
# (budget-resnet50-0.35-<device>-<date>.json): one family per model, each
# with its own target and GPU session step. max_batch's prefix is exactly
# `bench` so that bench-densenet121-... and bench-densenet264-... runs (no
# max-batch search) do not count.
FAMILIES: tuple[Family, ...] = op_families() + (
    Family("max_batch", ("effilayers/max_batch.py", "effilayers/bench", "effilayers/nn", "effilayers/ops/abn/module.py",
                         "effilayers/models"), ("bench",),
           "largest batch >= 1.6x plain (ResNet-50 InPlaceABN), >= 3x (DenseNet-121)"),
    Family("fit_resnet50", ("effilayers/fit.py", "effilayers/checkpoint.py"), ("budget-resnet50-0.35",),
           "ResNet-50 within a 0.35 budget on CUDA peak bytes at <= 1.15x plain's step",
           met=lambda f: _fit_met(f, 0.35, 1.15)),
    Family("fit_densenet121", ("effilayers/fit.py", "effilayers/checkpoint.py"), ("budget-densenet121-0.25",),
           "DenseNet-121 within a 0.25 budget on CUDA peak bytes at <= 1.3x plain's step",
           met=lambda f: _fit_met(f, 0.25, 1.3)),
    Family("fit_gpt2", ("effilayers/fit.py", "effilayers/checkpoint.py"),
           ("budget-gpt2_small-0.35", "budget-gpt2_small-0.25-offload"),
           "GPT-2 small (batch 8, 1024 tokens, bf16) within 0.35 at <= 1.25x plain's step and under torch's "
           "every-block checkpoint; with offload, 0.25 at <= 1.15x", met=lambda f: _fit_gpt2_met(f)),
    Family("offload", ("effilayers/optim/offload.py", "effilayers/optim/sharded.py"), ("fsdp_offload",),
           "<= 0.35x GPU memory at <= 1.5x step time",
           met=lambda f: _offload_met(f, 'chunked_adamw', peak=0.35, time=1.5)),
)

RESULTS = Path("benchmarks") / "results"
LEDGER = RESULTS / "GPU.md"
COMMAND = "python3 benchmarks/ledger.py"
EXTENSIONS = (".json", ".log", ".md")


@dataclass(frozen=True)
class Commit:
    short: str
    full: str
    date: str  # YYYY-MM-DD, committer date


@dataclass(frozen=True)
class Row:
    family: str
    kernel_change: Optional[Commit]  # None: no git history, or no commit touches the kernels
    result: Optional[str]  # file name in benchmarks/results
    result_date: Optional[str]
    headline: str
    target: str
    fresh: bool
    reason: str
    verdict: str  # the target "met", "**missed**" or "not measured" by that result


# --- git ---------------------------------------------------------------------

# A git hook or a `git rebase --exec` exports these; left in place they would
# point every call below at the caller's repository instead of root's.
_GIT_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_LITERAL_PATHSPECS")


def _git(root: Path, *args: str) -> Optional[subprocess.CompletedProcess]:
    env = {key: value for key, value in os.environ.items() if key not in _GIT_ENV}
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, env=env)
    except OSError:  # no git installed
        return None


def _git_out(root: Path, *args: str) -> Optional[str]:
    done = _git(root, *args)
    return done.stdout.strip() if done is not None and done.returncode == 0 else None


def has_history(root: Path) -> bool:
    """Whether root is the top of a git checkout with its full history. A copy
    of the tree inside some other repository is not (its log would be that
    repository's), nor is a shallow clone (its oldest commit would claim every
    file it holds)."""
    top = _git_out(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return False
    return _git_out(root, "rev-parse", "--is-shallow-repository") == "false"


# A family's self-test inputs (ops/<family>/selftest.py) sit beside its
# kernels but change nothing a GPU result measured.
NOT_KERNELS = (":(exclude,glob)effilayers/ops/*/selftest.py",)


def last_change(root: Path, pathspecs: tuple[str, ...]) -> Optional[Commit]:
    line = _git_out(root, "log", "-1", "--format=%H %cs", "--", *pathspecs, *NOT_KERNELS)
    if not line:
        return None
    full, date = line.split()
    # Not %h: its length follows each clone's object count and core.abbrev,
    # and GPU.md must come out the same in every clone for --check.
    return Commit(full[:7], full, date)


def _contains(root: Path, commit: str, change: Commit) -> Optional[bool]:
    """Whether ``commit`` has ``change`` in its history; None when git does
    not know ``commit`` (a measurement taken on a branch never pushed here)."""
    done = _git(root, "merge-base", "--is-ancestor", change.full, commit)
    if done is None or done.returncode not in (0, 1):
        return None
    return done.returncode == 0


def _committed_in(root: Path, path: Path) -> Optional[str]:
    """The commit that holds the file's current content; None when the file
    is untracked or modified, i.e. newer than any commit."""
    relative = path.relative_to(root).as_posix()
    if _git_out(root, "status", "--porcelain", "--", relative) != "":
        return None
    return _git_out(root, "log", "-1", "--format=%H", "--", relative) or None


# --- results -----------------------------------------------------------------

def _result_pattern(prefix: str) -> re.Pattern:
    # The date right after the device is what tells a device token from a
    # qualifier: optim-chunk-size-cpu-<date> is not an `optim` result.
    return re.compile(rf"{re.escape(prefix)}-(?P<device>[A-Za-z0-9]+)-(?P<date>\d{{4}}-\d{{2}}-\d{{2}})(?P<rest>-.*)?")


def _valid_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def gpu_results(results: Path, family: Family) -> list[tuple[str, Path]]:
    """(date, path) of the family's GPU results, newest first; on one day a
    JSON (the only kind with a headline) before a log or a note."""
    found = []
    for path in sorted(results.iterdir()) if results.is_dir() else ():
        if path.suffix not in EXTENSIONS or not path.is_file():
            continue
        for prefix in family.prefixes:
            match = _result_pattern(prefix).fullmatch(path.name[:-len(path.suffix)])
            # A "-before-<commit>" file measured the code as it was before
            # that commit, on purpose: it is not evidence about today's code.
            if (match and match["device"].lower() != "cpu" and _valid_date(match["date"])
                    and "-before-" not in (match["rest"] or "")):
                found.append((match["date"], path))
                break
    return sorted(found, key=lambda item: (item[0], item[1].suffix == ".json", -len(item[1].name), item[1].name),
                  reverse=True)


def _load(path: Path) -> Optional[dict]:
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_commit(data: Optional[dict]) -> Optional[str]:
    try:
        commit = data["machine_info"]["effilayers"]["commit"]
    except (KeyError, TypeError):
        return None
    return commit if isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit) else None


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}}–{high:{fmt}}"


def implementation_labels(ids: list[str]) -> list[str]:
    """Implementation labels of one group's rows: their ids less the tokens
    every row shares at the end (torch-softmax-cuda-4096x32768-dim-1-float16
    and effilayers-softmax-cuda-... -> torch, effilayers), since the benches
    spell the rest of the id each in their own way."""
    tokens = [name.split("-") for name in ids]
    shared = 0
    while (len(tokens) > 1 and all(len(t) > shared + 1 for t in tokens)
           and len({t[-1 - shared] for t in tokens}) == 1):
        shared += 1
    return ["-".join(t[:len(t) - shared]) for t in tokens]


def _all(figures: dict, key: str, bound: float, above: bool = False) -> Optional[bool]:
    """Every value of ``key`` on the right side of ``bound``; None when the
    result has none (a target half measured is not met)."""
    values = figures.get(key) or []
    if not values:
        return None
    return all(v >= bound for v in values) if above else all(v <= bound for v in values)


def _offload_met(figures: dict, variant: str, peak: float, time: float) -> Optional[bool]:
    found = (figures.get("offload") or {}).get(variant)
    return None if found is None else found[0] <= peak and found[1] <= time


# extra_info figures worth a range in the headline, when the rows of ours carry them.
_EXTRA_INFO = (
    ("pct_of_copy", "{ours} at {span}% of copy bandwidth", ".0f"),
    ("activation_bytes_ratio", "activation bytes {span}x plain PyTorch's", ".2f"),
    ("peak_ratio_vs_torch", "peak {span}x torch's", ".2f"),
    ("peak_ratio_vs_lower_bound", "peak {span}x the gradients' bytes", ".2f"),
)


def pytest_benchmark_figures(data: dict, family: Family) -> dict:
    """Per group, ours against the baseline: time ratios (median over
    median), GB/s where the rows record bytes moved and no copy fraction,
    and the extra_info figures of ours (_EXTRA_INFO)."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for bench in data.get("benchmarks") or ():
        if not isinstance(bench, dict):
            continue
        match = re.search(r"\[(.*)\]$", str(bench.get("name", "")))
        groups.setdefault(str(bench.get("group")), []).append((match[1] if match else "", bench))
    figures: dict[str, list[float]] = {"time_ratio": [], "rates": [], "groups": [],
                                       **{key: [] for key, _, _ in _EXTRA_INFO}}
    for rows in groups.values():
        by_label = dict(zip(implementation_labels([id_ for id_, _ in rows]), (bench for _, bench in rows)))
        ours, baseline = by_label.get(family.ours), by_label.get(family.baseline)
        if ours is None:
            continue
        figures["groups"].append(1.0)
        info = ours.get("extra_info") or {}
        for key, _, _ in _EXTRA_INFO:
            value = _number(info.get(key))
            if value is not None:
                figures[key].append(value)
        median = _number((ours.get("stats") or {}).get("median"))
        moved = _number(info.get("bytes_moved"))
        if moved and median and "pct_of_copy" not in info:
            figures["rates"].append(moved / median / 1e9)
        if baseline is not None:
            theirs = _number((baseline.get("stats") or {}).get("median"))
            if median is not None and theirs:
                figures["time_ratio"].append(median / theirs)
    return figures


def pytest_benchmark_headline(figures: dict, family: Family) -> Optional[str]:
    parts = []
    ratios = figures["time_ratio"]
    if ratios:
        parts.append(f"{family.ours}/{family.baseline} median time ratio {_span(ratios, '.2f')} "
                     f"over {len(ratios)} group{'s' * (len(ratios) != 1)}")
    if figures["rates"]:
        parts.append(f"{family.ours} {_span(figures['rates'], '.0f')} GB/s (bytes a one-pass kernel must move / "
                     "median time)")
    for key, text, fmt in _EXTRA_INFO:
        if figures[key]:
            parts.append(text.format(ours=family.ours, span=_span(figures[key], fmt)))
    return "; ".join(parts) or None


def bench_headline(data: dict) -> Optional[str]:
    """effilayers-bench's JSON: each effilayers / fit row's ratios to plain
    PyTorch, as the file holds them."""
    parts = []
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    # Earlier CUDA peaks also counted the rows warmed up before each row (see headline.table).
    peaks = settings.get("device") != "cuda" or settings.get("cuda_peak") is not None
    for result in data.get("results") or ():
        if not isinstance(result, dict):
            continue
        variant = str(result.get("variant", ""))
        if "effilayers" not in variant and not variant.startswith("fit("):
            continue
        ratios = result.get("ratios") or {}
        figures = []
        max_batch, max_batch_ratio = result.get("max_batch"), _number(ratios.get("max_batch"))
        if max_batch_ratio is not None:
            figures.append(f"max batch {max_batch} ({max_batch_ratio:.2f}x)")
        for key, label in (("step_time", "step"), ("cuda_peak_bytes", "CUDA peak"))[:2 if peaks else 1]:
            value = _number(ratios.get(key))
            if value is not None:
                figures.append(f"{label} {value:.2f}x")
        if figures:
            parts.append(f"{result.get('model', '?')} {variant}: {', '.join(figures)}")
    return "; ".join(parts) + " (ratios to plain PyTorch)" if parts else None


def bench_figures(data: dict) -> dict:
    """effilayers-bench's JSON: each row's (step time, activation bytes)
    ratios to plain PyTorch, by variant name."""
    rows = {}
    for result in data.get("results") or ():
        if isinstance(result, dict):
            ratios = result.get("ratios") or {}
            rows[str(result.get("variant", ""))] = (_number(ratios.get("step_time")),
                                                    _number(ratios.get("activation_bytes")))
    return {"rows": rows}


def _fit_met(figures: dict, fraction: float, time: float, below_every_block: bool = False) -> Optional[bool]:
    """Whether the fit row of a --budget result holds ``fraction`` of plain's
    activation bytes at ``time`` x plain's step or less (and, where asked,
    less time than torch's checkpoint around every block); None without a
    fit row."""
    rows = figures.get("rows") or {}
    fitted = next((ratios for name, ratios in rows.items() if name.startswith("fit(")), None)
    if fitted is None or None in fitted:
        return None
    step, activation = fitted
    every_block = rows.get("torch checkpoint (every block)", (None, None))[0]
    return (activation <= fraction and step <= time
            and not (below_every_block and every_block is not None and step >= every_block))


def _fit_gpt2_met(figures: dict) -> Optional[bool]:
    offloaded = any("offload" in name for name in (figures.get("rows") or {}))
    return _fit_met(figures, 0.25, 1.15) if offloaded else _fit_met(figures, 0.35, 1.25, below_every_block=True)


def variants_figures(data: dict) -> dict:
    """benchmarks/bench_fsdp_offload.py's JSON: each offloaded variant's
    (peak, step time) ratios to the plain one, as the file holds them."""
    offload = {}
    for name, variant in (data.get("variants") or {}).items():
        if not isinstance(variant, dict) or not variant.get("offload"):
            continue
        peak, time = _number(variant.get("peak_ratio")), _number(variant.get("time_ratio"))
        if peak is not None and time is not None:
            offload[name] = (peak, time)
    return {"offload": offload}


def figures_and_headline(path: Path, data: Optional[dict], family: Family) -> tuple[dict, str]:
    figures, text = {}, None
    if data is not None and isinstance(data.get("benchmarks"), list):
        figures = pytest_benchmark_figures(data, family)
        text = pytest_benchmark_headline(figures, family)
    elif data is not None and isinstance(data.get("results"), list):
        figures = bench_figures(data)
        text = bench_headline(data)
    elif data is not None and isinstance(data.get("variants"), dict):
        figures = variants_figures(data)
        text = "; ".join(f"{name}: peak {peak:.2f}x, step {time:.2f}x" for name, (peak, time)
                         in figures["offload"].items()) + " (ratios to plain FSDP2 + fused AdamW)"
    return figures, text or f"see `{path.name}`"


def verdict(family: Family, figures: dict) -> str:
    """A miss anywhere is a miss; a target met on part of the cases is
    not met yet."""
    met = family.met(figures) if family.met is not None and figures else None
    measured = len(figures.get("groups") or [])
    if met and measured < family.cases:
        return f"not measured ({measured} of {family.cases} cases ran)"
    return "not measured" if met is None else ("met" if met else "**missed**")


# --- the ledger ----------------------------------------------------------------

def _freshness(root: Path, history: bool, change: Optional[Commit], date: Optional[str], path: Optional[Path],
               data: Optional[dict]) -> tuple[bool, str]:
    if path is None:
        return False, "no GPU result"
    if not history:
        return False, "kernel history unknown (no git history here)"
    if change is None:
        return False, "no commit touches the kernel paths"
    measured = recorded_commit(data)
    contains = _contains(root, measured, change) if measured else None
    if contains is not None:
        return contains, f"measured at {measured[:7]}, which {'contains' if contains else 'predates'} {change.short}"
    if date < change.date:
        return False, f"result dated before {change.short} ({change.date})"
    committed = _committed_in(root, path)
    if committed is not None and _contains(root, committed, change) is False:
        return False, f"result committed in {committed[:7]}, without {change.short}"
    return True, f"result dated on or after {change.short} ({change.date})"


def ledger_rows(root: Path) -> list[Row]:
    root = Path(root)
    return _rows(root, has_history(root))


def _rows(root: Path, history: bool) -> list[Row]:
    rows = []
    for family in FAMILIES:
        change = last_change(root, family.kernels) if history else None
        found = gpu_results(root / RESULTS, family)
        date, path = found[0] if found else (None, None)
        data = _load(path) if path is not None else None
        fresh, reason = _freshness(root, history, change, date, path, data)
        figures, text = figures_and_headline(path, data, family) if path else ({}, "no GPU result")
        rows.append(Row(family=family.name, kernel_change=change, result=path.name if path else None,
                        result_date=date, headline=text, target=family.target, fresh=fresh, reason=reason,
                        verdict=verdict(family, figures)))
    return rows


def stale_first(root: Path) -> list[str]:
    """The families as a GPU session measures them: the stale ones, least
    recently measured first (never before any date; ties in ledger order),
    then the fresh ones."""
    rows = ledger_rows(Path(root))
    stale = sorted((row for row in rows if not row.fresh), key=lambda row: row.result_date or "")
    return [row.family for row in stale] + [row.family for row in rows if row.fresh]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(root: Path) -> str:
    root = Path(root)
    history = has_history(root)
    rows = _rows(root, history)
    lines = [
        "# GPU evidence",
        "",
        f"Generated by `{COMMAND}` from `{RESULTS.as_posix()}/` and the git history; do not edit by hand "
        f"(`{COMMAND} --check` fails when this file is out of date). For each kernel family: the last commit that "
        "changed its kernels, its newest GPU result in this folder, that result's headline figures and the target "
        "they answer to. A result is fresh when it is dated on or after the kernel change's day and, if "
        "committed, was committed with that change in its history (or, when its JSON records "
        "`machine_info.effilayers.commit`, when that commit contains the change); no result is stale. "
        f"`{COMMAND} --order` lists the stale families first, least recently measured first.",
        "",
    ]
    if not history:
        lines += ["No git history here: the kernel changes' commits are unknown and every family counts as stale.", ""]
    lines += [
        "| family | kernels last changed | newest GPU result | headline | target | verdict | status |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row.kernel_change is not None:
            changed = f"`{row.kernel_change.short}` {row.kernel_change.date}"
        else:
            changed = "no commit" if history else "unknown (no git)"
        result = f"`{row.result}` ({row.result_date})" if row.result else "none"
        status = f"{'fresh' if row.fresh else '**stale**'}: {row.reason}"
        lines.append("| " + " | ".join(_cell(text) for text in (
            row.family, changed, result, row.headline, row.target, row.verdict, status)) + " |")
    stale = sum(not row.fresh for row in rows)
    lines += ["", f"{stale} of {len(rows)} families stale."]
    return "\n".join(lines) + "\n"


# The docs page that shows the ledger's short form to users (it was the README's until the docs site).
PAGE = Path("docs/benchmarks/index.md")
PAGE_START, PAGE_END = "<!-- gpu-ledger:start -->", "<!-- gpu-ledger:end -->"


def page_section(root: Path) -> str:
    """The docs' table of targets against the newest GPU results: the
    ledger's rows for users (no commits, no freshness)."""
    lines = [
        f"Generated by `{COMMAND}` from the newest GPU result of each family in `{RESULTS.as_posix()}/` "
        f"(`{LEDGER.as_posix()}` says which are fresh and how each headline is computed; a time ratio is "
        "effilayers' median over the peer's in the same run, below 1 is faster). Results measured on the GPU "
        "named in the file, with the GPU image's torch 2.11 and Triton 3.6; a target half measured counts as "
        "not measured.",
        "",
        "| family | target | verdict | newest GPU result | figures |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in ledger_rows(root):
        result = f"`{row.result}`" if row.result else "none"
        lines.append("| " + " | ".join(_cell(text) for text in (
            row.family, row.target, row.verdict, result, row.headline)) + " |")
    return "\n".join(lines) + "\n"


def _with_page_section(text: str, section: str) -> Optional[str]:
    if PAGE_START not in text or PAGE_END not in text:
        return None
    head, rest = text.split(PAGE_START, 1)
    return f"{head}{PAGE_START}\n{section}{PAGE_END}{rest.split(PAGE_END, 1)[1]}"


def check(root: Path) -> tuple[bool, str]:
    """(up to date, unified diff from the files on disk to what render and
    page_section make)."""
    root = Path(root)
    diff, current = "", True
    page = root / PAGE
    outputs = [(LEDGER, render(root))]
    if page.is_file():
        text = page.read_text(encoding="utf-8")
        updated = _with_page_section(text, page_section(root))
        if updated is not None:
            outputs.append((PAGE, updated))
    for name, expected in outputs:
        path = root / name
        actual = path.read_text(encoding="utf-8") if path.is_file() else ""
        current &= actual == expected
        diff += "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                             str(name), f"{name} (regenerated)"))
    return current, diff


def main(argv: Optional[list[str]] = None, root: Optional[Path] = None) -> int:
    """The command line; ``root`` (default: the checkout holding this file)
    lets tests run it on a throwaway tree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {LEDGER} is not what this would write")
    mode.add_argument("--order", action="store_true",
                      help="print the family names, stale ones first, least recently measured first")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    if args.order:
        print("\n".join(stale_first(root)))
        return 0
    if args.check:
        current, diff = check(root)
        if not current:
            print(f"{LEDGER} is out of date; run `{COMMAND}`\n{diff}", file=sys.stderr)
        return 0 if current else 1
    (root / LEDGER).write_text(render(root), encoding="utf-8")
    print(f"wrote {LEDGER}")
    page = root / PAGE
    if page.is_file():
        updated = _with_page_section(page.read_text(encoding="utf-8"), page_section(root))
        if updated is not None:
            page.write_text(updated, encoding="utf-8")
            print(f"wrote the GPU targets section of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
