"""The ```python blocks of the README and of the docs pages (docs/**/*.md),
found once for every test that runs them.

``tests/test_readme.py`` runs each README block as written and
``tests/test_docs.py`` each docs block; a block whose printed results a
section's own test checks (``CHECKED_ELSEWHERE``) runs there instead, once,
taken through ``claimed_block``; test_readme checks that each of those still
exists and that each block runs in exactly one test.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^#+ .*$", re.M)


class Block(NamedTuple):
    page: str      # the file, relative to the repository root ("README.md", "docs/guide/abn.md")
    line: int      # the block's first line of code in that file
    section: str   # the heading above it, as written ("### ...")
    index: int     # its place among that section's blocks
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """The README, then every markdown page of the docs site, in path order."""
    return ["README.md"] + sorted(path.relative_to(ROOT).as_posix() for path in DOCS.rglob("*.md"))


def blocks(page: Optional[str] = "README.md") -> list[Block]:
    """The blocks of ``page``, or of every page when ``page`` is None."""
    if page is None:
        return [block for name in pages() for block in blocks(name)]
    text = (ROOT / page).read_text()
    found: list[Block] = []
    for match in _FENCE.finditer(text):
        headings = _HEADING.findall(text, 0, match.start())
        section = headings[-1] if headings else ""
        index = sum(1 for block in found if block.section == section)
        found.append(Block(page, text.count("\n", 0, match.start()) + 2, section, index, match.group(1)))
    return found


def section_blocks(page: str, section: str) -> list[str]:
    """The code of the blocks of ``page`` under the heading ``section`` (up to the next heading)."""
    return [block.code for block in blocks(page) if block.section == section]


def claimed_block(page: str, section: str, index: int, test: str) -> str:
    """The code of block ``index`` under ``section`` of ``page``, for ``test``
    to run and check. The block must be listed in ``CHECKED_ELSEWHERE`` under
    that test, so that test_readme and test_docs leave it out: each block runs
    in exactly one test."""
    claimant = CHECKED_ELSEWHERE.get((page, section, index))
    assert claimant == test, f"{page} {section!r} block {index}: CHECKED_ELSEWHERE names {claimant!r}, not {test!r}"
    return section_blocks(page, section)[index]


_FIT_PAGE, _CHECKPOINT = "docs/guide/checkpoint-fit.md", "## Checkpointing with BatchNorm"
_MAX_BATCH, _FIT = "## The largest batch that fits", "## A model within an activation budget"
_LINEAR_CE = "docs/guide/linear-cross-entropy.md"
# (page, section, index) -> the test that runs the block and checks what it prints
CHECKED_ELSEWHERE = {
    (_FIT_PAGE, _CHECKPOINT, 0): "tests/test_max_batch.py::test_docs_examples_run",
    (_FIT_PAGE, _MAX_BATCH, 0): "tests/test_max_batch.py::test_docs_examples_run",
    (_FIT_PAGE, _FIT, 0): "tests/test_max_batch.py::test_docs_examples_run",
    (_LINEAR_CE, "# Linear + cross-entropy without the logits", 0):
        "tests/test_linear_cross_entropy_api.py::test_docs_example_runs_and_matches_torch",
}
