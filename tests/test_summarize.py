"""benchmarks/summarize.py: the markdown table of a pytest-benchmark JSON,
with a copy-bandwidth column for each implementation whose rows record one."""

from __future__ import annotations

import json

from benchmarks.summarize import PAGE, page_sections, render_page, summarize

from .readme_blocks import ROOT


def _row(implementation: str, case: str, group: str, median: float, **extra_info) -> dict:
    return {"name": f"test_softmax[{implementation}-{case}]", "group": group, "stats": {"median": median},
            "extra_info": extra_info}


def _table(tmp_path, rows) -> list[list[str]]:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"machine_info": {"effilayers": {"device": "H200"}}, "benchmarks": rows}))
    lines = [line for line in summarize(str(path), "torch").splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_pct_of_copy_is_a_column_per_implementation_that_records_it(tmp_path):
    gpu, cpu = "softmax cuda 4096x32768", "softmax cpu 256x4096"
    header, _, *rows = _table(tmp_path, [
        _row("torch", "cuda-4096x32768", gpu, 2e-3, pct_of_copy=80.4),
        _row("torch-compile", "cuda-4096x32768", gpu, 1e-3, pct_of_copy=85.0),
        _row("effilayers", "cuda-4096x32768", gpu, 1.6e-3, pct_of_copy=91.6, activation_bytes_ratio=0.5),
        _row("torch", "cpu-256x4096", cpu, 4e-3),
        _row("effilayers", "cpu-256x4096", cpu, 2e-3),
    ])
    assert header == ["case", "torch", "effilayers", "torch-compile",
                      "torch % of copy", "effilayers % of copy", "torch-compile % of copy"]
    by_case = {row[0]: row[1:] for row in rows}
    assert by_case[gpu] == ["2.00 ms", "1.60 ms (0.80×), mem 0.50×", "1.00 ms (0.50×)", "80%", "92%", "85%"]
    # CPU rows record no copy fraction: their cells say so, and the ratio stays beside the time.
    assert by_case[cpu] == ["4.00 ms", "2.00 ms (0.50×)", "–", "–", "–", "–"]


def test_no_copy_column_when_no_row_records_one(tmp_path):
    header, _, row = _table(tmp_path, [_row("torch", "cpu", "g", 1e-3), _row("effilayers", "cpu", "g", 2e-3)])
    assert header == ["case", "torch", "effilayers"] and row == ["g", "1.00 ms", "2.00 ms (2.00×)"]


def test_docs_tables_are_generated_from_the_committed_results():
    # The docs' per-family tables are what summarize makes of the files their markers name.
    text = (ROOT / PAGE).read_text()
    sections = page_sections(text)
    assert len(sections) >= 10
    for source, _, _ in sections:
        assert (ROOT / source).is_file() and source.startswith("benchmarks/results/"), source
    assert render_page(text, ROOT) == text


def test_page_sections_are_replaced_in_place(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"machine_info": {"effilayers": {"device": "cpu"}},
                                "benchmarks": [_row("torch", "cpu", "g", 1e-3), _row("effilayers", "cpu", "g", 2e-3)]}))
    page = f"intro\n<!-- summarize {path.name} --baseline torch -->\nstale\n<!-- summarize:end -->\nafter\n"
    rendered = render_page(page, tmp_path)
    assert rendered.startswith("intro\n<!-- summarize ") and rendered.endswith("<!-- summarize:end -->\nafter\n")
    assert "stale" not in rendered and "| g | 1.00 ms | 2.00 ms (2.00×) |" in rendered
    assert page_sections(rendered)[0][:2] == (path.name, "torch")
