"""Markdown table of a pytest-benchmark JSON: per group, each entry's median
and its ratio to effilayers' median in the same group.

    python benchmarks/summarize.py benchmarks/results/stats-cpu-2026-11-22.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def implementation(name: str) -> str:
    match = re.search(r"\[([a-z_-]+?)-(cpu|cuda)-", name)
    return match.group(1) if match else name


def summarize(path: str) -> str:
    with open(path) as handle:
        data = json.load(handle)
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        groups[bench["group"]][implementation(bench["name"])] = bench["stats"]["median"]
    names = sorted({impl for group in groups.values() for impl in group}, key=lambda n: (n != "effilayers", n))
    info = data["machine_info"].get("effilayers", {})
    lines = [
        f"Device: {info.get('device', '?')}, {info.get('threads', '?')} threads, torch {info.get('torch', '?')}. "
        f"Command: `{info.get('command', '?')}`",
        "",
        "| case | " + " | ".join(f"{n} (median)" for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for group in sorted(groups):
        ours = groups[group].get("effilayers")
        cells = []
        for name in names:
            median = groups[group].get(name)
            if median is None:
                cells.append("–")
            elif ours and name != "effilayers":
                cells.append(f"{median * 1e3:.2f} ms ({median / ours:.1f}×)")
            else:
                cells.append(f"{median * 1e3:.2f} ms")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a pytest-benchmark JSON file")
    print(summarize(parser.parse_args().result))


if __name__ == "__main__":
    main()
