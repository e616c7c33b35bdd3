"""Every ```python block of the README runs as written, each in a fresh
namespace, so an example that names something it never defines, or an API
that changed under it, fails here. A block that imports torchvision runs
where torchvision imports (CI's torch 2.11 environment has it). Blocks whose
output a section's own test checks run there instead (readme_blocks)."""

from __future__ import annotations

import re

import pytest

from .readme_blocks import CHECKED_ELSEWHERE, README, blocks

_OPTIONAL = ("torchvision", "timm")
_QUICK = re.compile(r"^(\d+) pairs fused; activations ([\d.]+) -> ([\d.]+) MiB \(([\d.]+)x\)$")


def _check_quick_example(out: str) -> None:
    """The fifteen-line example at the top: ResNet-18's 20 BatchNorm + ReLU
    pairs fused, activations about halved."""
    found = _QUICK.match(out.strip().splitlines()[-1])
    assert found, out
    pairs, before, after, ratio = found.groups()
    assert int(pairs) == 20 and float(after) < float(before) and float(ratio) <= 0.6, out


# what a block prints, checked where the block says so: a marker in its code -> the check
_OUTPUT_CHECKS = {"pairs fused; activations": _check_quick_example}
HERE = [block for block in blocks() if (block.section, block.index) not in CHECKED_ELSEWHERE]


def test_every_block_runs_in_exactly_one_test():
    everything = blocks()
    assert len(everything) == README.read_text().count("```python") and len(everything) >= 10
    # every block named as run elsewhere still exists where it was
    assert set(CHECKED_ELSEWHERE) <= {(block.section, block.index) for block in everything}
    assert len(HERE) + len(CHECKED_ELSEWHERE) == len(everything)
    # each test named there exists and takes its blocks through claimed_block,
    # which refuses a block not listed under that test's name
    for test in set(CHECKED_ELSEWHERE.values()):
        path, name = test.split("::")
        source = (README.parent / path).read_text()
        assert f"\ndef {name}(" in source and "claimed_block(" in source, test
    # and the first block is the quick example, whose output is checked here
    assert "pairs fused; activations" in everything[0].code


@pytest.mark.parametrize("code", [pytest.param(block.code, id=f"line-{block.line}") for block in HERE])
def test_readme_python_block_runs(code, capsys):
    for module in _OPTIONAL:
        if re.search(rf"^(import|from) {module}\b", code, re.M):
            try:
                __import__(module)
            except Exception as error:  # a torchvision built for another torch raises RuntimeError
                pytest.skip(f"this block needs {module}, which does not import here: {error}")
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    for marker, check in _OUTPUT_CHECKS.items():
        if marker in code:
            check(capsys.readouterr().out)
