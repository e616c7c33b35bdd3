"""Markdown table of a pytest-benchmark JSON: per group, each entry's median
time as a ratio to the baseline entry's (plain PyTorch), and its activation
bytes ratio when the benchmark recorded one; then, for each implementation
whose GPU rows record ``pct_of_copy``, a column of it (the CUDA-event time
against a device-to-device copy of the same bytes), so the ratios to torch
and torch.compile and the fraction of the bandwidth ceiling sit side by side.

    python benchmarks/summarize.py benchmarks/results/abn-cpu-2026-11-22.json --baseline torch
    python benchmarks/summarize.py --page docs/benchmarks/results.md

With ``--page``, every section of that file written as

    <!-- summarize benchmarks/results/<file>.json --baseline <name> -->
    ...
    <!-- summarize:end -->

is replaced by the table of the file and baseline its opening marker names;
tests/test_summarize.py checks that the committed page is what this makes.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

try:
    from benchmarks.ledger import implementation_labels
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repository root is not
    from ledger import implementation_labels


def summarize(path: str, baseline: str) -> str:
    with open(path) as handle:
        data = json.load(handle)
    rows: dict[str, list[dict]] = defaultdict(list)
    for bench in data["benchmarks"]:
        rows[bench["group"]].append(bench)
    groups: dict[str, dict[str, dict]] = {}
    for group, benches in rows.items():
        ids = [re.search(r"\[(.*)\]$", bench["name"])[1] if "[" in bench["name"] else bench["name"]
               for bench in benches]
        groups[group] = dict(zip(implementation_labels(ids), benches))
    names = sorted({impl for group in groups.values() for impl in group}, key=lambda n: (n != baseline, n))
    copied = [name for name in names
              if any("pct_of_copy" in group[name].get("extra_info", {}) for group in groups.values() if name in group)]
    info = data["machine_info"].get("effilayers", {})
    lines = [
        f"Device: {info.get('device', '?')}, {info.get('threads', '?')} threads, torch {info.get('torch', '?')}. "
        f"Command: `{info.get('command', '?')}`. Time: median (ratio to {baseline}); "
        "bandwidth: the bench's CUDA-event time against a device-to-device copy of the same bytes, where measured; "
        "memory: activation bytes ratio to plain PyTorch where measured.",
        "",
        "| case | " + " | ".join(names + [f"{name} % of copy" for name in copied]) + " |",
        "| --- |" + " --- |" * (len(names) + len(copied)),
    ]
    for group in sorted(groups):
        base = groups[group].get(baseline)
        cells = []
        for name in names:
            bench = groups[group].get(name)
            if bench is None:
                cells.append("–")
                continue
            median = bench["stats"]["median"]
            cell = f"{median * 1e3:.2f} ms"
            if base is not None and name != baseline:
                cell += f" ({median / base['stats']['median']:.2f}×)"
            memory_ratio = bench.get("extra_info", {}).get("activation_bytes_ratio")
            if memory_ratio is not None:
                cell += f", mem {memory_ratio:.2f}×"
            cells.append(cell)
        for name in copied:
            copy_percent = groups[group].get(name, {}).get("extra_info", {}).get("pct_of_copy")
            cells.append("–" if copy_percent is None else f"{copy_percent:.0f}%")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PAGE = "docs/benchmarks/results.md"
_SECTION = re.compile(r"^<!-- summarize (\S+\.json) --baseline (\S+) -->\n(.*?)^<!-- summarize:end -->$",
                      re.S | re.M)


def page_sections(page: str) -> list[tuple[str, str, str]]:
    """(results file, baseline, text between the markers) of each section of a page."""
    return [(match[1], match[2], match[3]) for match in _SECTION.finditer(page)]


def render_page(page: str, root: Path = Path(".")) -> str:
    """The page with every section's table regenerated from the file it names."""
    return _SECTION.sub(lambda match: (f"<!-- summarize {match[1]} --baseline {match[2]} -->\n"
                                       f"{summarize(str(root / match[1]), match[2])}\n<!-- summarize:end -->"), page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", nargs="?", help="a pytest-benchmark JSON file")
    parser.add_argument("--baseline", default="torch", help="implementation the ratios are taken against")
    parser.add_argument("--page", help=f"regenerate every summarize section of this file ({PAGE})")
    args = parser.parse_args()
    if args.page:
        path = Path(args.page)
        path.write_text(render_page(path.read_text()))
        print(f"updated {path}")
    elif args.result:
        print(summarize(args.result, args.baseline))
    else:
        parser.error("give a results file, or --page")


if __name__ == "__main__":
    main()
