"""Markdown table of a pytest-benchmark JSON: per group, each entry's median
time as a ratio to the baseline entry's (plain PyTorch), and its activation
bytes ratio when the benchmark recorded one; then, for each implementation
whose GPU rows record ``pct_of_copy``, a column of it (the CUDA-event time
against a device-to-device copy of the same bytes), so the ratios to torch
and torch.compile and the fraction of the bandwidth ceiling sit side by side.

    python benchmarks/summarize.py benchmarks/results/abn-cpu-2026-11-22.json --baseline torch
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a pytest-benchmark JSON file")
    parser.add_argument("--baseline", default="torch", help="implementation the ratios are taken against")
    args = parser.parse_args()
    print(summarize(args.result, args.baseline))


if __name__ == "__main__":
    main()
