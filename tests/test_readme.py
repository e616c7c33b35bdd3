"""Every ```python block of the README runs as written, each in a fresh
namespace, so an example that names something it never defines, or an API
that changed under it, fails here. A block that imports torchvision runs
where torchvision imports (CI's torch 2.11 environment has it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_OPTIONAL = ("torchvision", "timm")


def _blocks() -> list:
    text = README.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
        blocks.append(pytest.param(match.group(1), id=f"line-{line}"))
    return blocks


BLOCKS = _blocks()


def test_the_readme_has_python_blocks_to_run():
    assert len(BLOCKS) == README.read_text().count("```python") and len(BLOCKS) >= 10


@pytest.mark.parametrize("code", BLOCKS)
def test_readme_python_block_runs(code, capsys):
    for module in _OPTIONAL:
        if re.search(rf"^(import|from) {module}\b", code, re.M):
            try:
                __import__(module)
            except Exception as error:  # a torchvision built for another torch raises RuntimeError
                pytest.skip(f"this block needs {module}, which does not import here: {error}")
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
