"""The README's ```python blocks, found once for every test that runs them.

``tests/test_readme.py`` runs each block as written; a block whose printed
results a section's own test checks (``CHECKED_ELSEWHERE``) runs there
instead, once, taken through ``claimed_block``; test_readme checks that each
of those still exists and that each block runs in exactly one test.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^#+ .*$", re.M)


class Block(NamedTuple):
    line: int      # the block's first line of code in README.md
    section: str   # the heading above it, as written ("### ...")
    index: int     # its place among that section's blocks
    code: str


def blocks() -> list[Block]:
    text = README.read_text()
    found: list[Block] = []
    for match in _FENCE.finditer(text):
        headings = _HEADING.findall(text, 0, match.start())
        section = headings[-1] if headings else ""
        index = sum(1 for block in found if block.section == section)
        found.append(Block(text.count("\n", 0, match.start()) + 2, section, index, match.group(1)))
    return found


def section_blocks(section: str) -> list[str]:
    """The code of the blocks under the heading ``section`` (up to the next heading)."""
    return [block.code for block in blocks() if block.section == section]


def claimed_block(section: str, index: int, test: str) -> str:
    """The code of block ``index`` under ``section``, for ``test`` to run and
    check. The block must be listed in ``CHECKED_ELSEWHERE`` under that test,
    so that test_readme leaves it out: each block runs in exactly one test."""
    claimant = CHECKED_ELSEWHERE.get((section, index))
    assert claimant == test, f"{section!r} block {index}: CHECKED_ELSEWHERE names {claimant!r}, not {test!r}"
    return section_blocks(section)[index]


_CHECKPOINT = "### Checkpointing with BatchNorm, and the largest batch that fits"
# (section, index) -> the test that runs the block and checks what it prints
CHECKED_ELSEWHERE = {
    (_CHECKPOINT, 0): "tests/test_max_batch.py::test_readme_examples_run",
    (_CHECKPOINT, 1): "tests/test_max_batch.py::test_readme_examples_run",
    (_CHECKPOINT, 2): "tests/test_max_batch.py::test_readme_examples_run",
    ("#### Linear + cross-entropy without the logits", 0):
        "tests/test_linear_cross_entropy_api.py::test_readme_example_runs_and_matches_torch",
}
