"""Every ```python block of the README runs as written, each in a fresh
namespace (tests/test_docs.py does the same for the docs pages), so an
example that names something it never defines, or an API that changed under
it, fails here. A block that imports torchvision runs
where torchvision imports (CI's torch 2.11 environment has it). Blocks whose
output a section's own test checks run there instead (readme_blocks).

And, read without running anything, so that no environment skips it: every
block imports only what the README's install commands above it installed,
on each of their routes (CPU, CUDA), torchvision from torch's index."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from typing import NamedTuple

import pytest
import tomllib

from .readme_blocks import CHECKED_ELSEWHERE, README, ROOT, Block, blocks, pages

_OPTIONAL = ("torchvision", "timm")
_QUICK = re.compile(r"^(\d+) pairs fused; activations ([\d.]+) -> ([\d.]+) MiB \(([\d.]+)x\)$")


def _check_quick_example(out: str) -> None:
    """The fifteen-line example at the top: ResNet-18's 20 BatchNorm + ReLU
    pairs fused, activations about halved."""
    found = _QUICK.match(out.strip().splitlines()[-1])
    assert found, out
    pairs, before, after, ratio = found.groups()
    assert int(pairs) == 20 and float(after) < float(before) and float(ratio) <= 0.6, out


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def _check_densenet_ratio(out: str) -> None:
    """The DenseNet example's comment: 0.31 of the naive model's activation bytes at 2x3x32x32."""
    assert round(float(_last_line(out)), 2) == 0.31, out


def _check_inplace_resnet_ratio(out: str) -> None:
    """The ResNet example of the ABN guide: ResNet-18 in place keeps 0.52 of plain's bytes at 2x3x64x64."""
    assert round(float(_last_line(out)), 2) == 0.52, out


def _check_budget_met(out: str) -> None:
    assert _last_line(out) == "True", out


# what a block prints, checked where the block says so: a marker in its code -> the check
_OUTPUT_CHECKS = {"pairs fused; activations": _check_quick_example, "# 0.31 here": _check_densenet_ratio,
                  "# 0.52 (ResNet-50": _check_inplace_resnet_ratio, "<= report.budget_bytes)": _check_budget_met}


def run_here(page: str) -> list[Block]:
    """The blocks of ``page`` that no section's own test claims."""
    return [block for block in blocks(page) if (block.page, block.section, block.index) not in CHECKED_ELSEWHERE]


HERE = run_here("README.md")


def test_every_block_runs_in_exactly_one_test():
    everything = blocks(None)
    assert len(everything) == sum((ROOT / page).read_text().count("```python") for page in pages())
    assert len(blocks("README.md")) >= 7 and len(everything) >= 20
    # every block named as run elsewhere still exists where it was
    assert set(CHECKED_ELSEWHERE) <= {(block.page, block.section, block.index) for block in everything}
    assert sum(len(run_here(page)) for page in pages()) + len(CHECKED_ELSEWHERE) == len(everything)
    # each test named there exists and takes its blocks through claimed_block,
    # which refuses a block not listed under that test's name
    for test in set(CHECKED_ELSEWHERE.values()):
        path, name = test.split("::")
        source = (ROOT / path).read_text()
        assert f"\ndef {name}(" in source and "claimed_block(" in source, test
    # every output check still finds its block
    for marker in _OUTPUT_CHECKS:
        assert any(marker in block.code for block in everything), marker
    # and the README's first block is the quick example, whose output is checked here
    assert "pairs fused; activations" in blocks("README.md")[0].code


def run_block(block: Block, capsys) -> None:
    """Runs ``block`` in a fresh namespace (skipped where an optional module
    it imports does not import) and checks what it prints where it says so."""
    code = block.code
    for module in _OPTIONAL:
        if re.search(rf"^(import|from) {module}\b", code, re.M):
            try:
                __import__(module)
            except Exception as error:  # a torchvision built for another torch raises RuntimeError
                pytest.skip(f"this block needs {module}, which does not import here: {error}")
    exec(compile(code, str(ROOT / block.page), "exec"), {"__name__": "readme_example"})
    for marker, check in _OUTPUT_CHECKS.items():
        if marker in code:
            check(capsys.readouterr().out)


@pytest.mark.parametrize("block", [pytest.param(block, id=f"line-{block.line}") for block in HERE])
def test_readme_python_block_runs(block, capsys):
    run_block(block, capsys)


# ---- what the install commands above a block installed -------------------------------------

_BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
_PIP = re.compile(r"^(?:python -m )?pip install (.+)$", re.M)
_OPTION_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                      "-r", "--requirement"}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# top-level module -> the distribution that installs it (the standard library needs none); a
# block importing anything else fails until it is added here
DISTRIBUTION = {"torch": "torch", "torchvision": "torchvision", "timm": "timm", "effilayers": "effilayers",
                "numpy": "numpy", "triton": "triton", "tqdm": "tqdm", "matplotlib": "matplotlib"}


def _project() -> dict:
    with open(README.parent / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["project"]


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()


class Pip(NamedTuple):
    command: str
    named: set[str]      # the distributions it names
    installs: set[str]   # and those the project (".", ".[extras]") brings: effilayers, its dependencies and extras'


def pip_install(arguments: str) -> Pip:
    project, named, installs, words = _project(), set(), set(), iter(shlex.split(arguments, comments=True))
    for word in words:
        if word in _OPTION_WITH_VALUE:
            next(words)
        elif word.startswith("-"):
            continue
        elif word == "." or word.startswith(".["):
            extras = word[2:-1].split(",") if word.startswith(".[") else []
            requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
            installs |= {"effilayers"} | {_name(r) for r in requirements}
        else:
            named.add(_name(word))
    return Pip(f"pip install {arguments}", named, named | installs)


def install_routes(line: int) -> list[list[Pip]]:
    """Each way through the README's pip commands above ``line``, in order:
    a bash block with a command naming torch starts a route (the CPU and the
    CUDA blocks are alternatives); a later block's commands join every route."""
    text = README.read_text()
    routes: list[list[Pip]] = []
    for match in _BASH.finditer(text):
        if text.count("\n", 0, match.start()) + 2 > line:
            break
        commands = [pip_install(found.group(1)) for found in _PIP.finditer(match.group(1))]
        if any("torch" in command.named for command in commands):
            routes.append(commands)
        else:
            routes = [route + commands for route in routes]
    return routes


def imported_distributions(block: Block) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names)
    assert modules <= set(DISTRIBUTION), f"{block.id}: map {sorted(modules - set(DISTRIBUTION))}"
    return {DISTRIBUTION[module] for module in modules}


def check_imports(block: Block, routes: list[list[Pip]]) -> None:
    needed = imported_distributions(block)
    assert routes, f"{block.id}: no install command above this block"
    for route in routes:
        missing = needed - set().union(*(command.installs for command in route))
        assert not missing, (f"{block.id} imports {sorted(missing)}, which {route[0].command!r} and "
                             "the commands after it do not install")


@pytest.mark.parametrize("block", [pytest.param(block, id=f"line-{block.line}") for block in blocks()])
def test_each_block_imports_only_what_the_install_commands_above_it_installed(block):
    check_imports(block, install_routes(block.line))


def test_torchvision_comes_from_torchs_index_and_timm_after_it():
    routes = install_routes(README.read_text().count("\n") + 1)
    assert len(routes) >= 2  # CPU and CUDA
    for route in routes:
        first = {name: next((i for i, command in enumerate(route) if name in command.installs), None)
                 for name in ("torch", "torchvision", "timm")}
        # in torch's own command, so from its index; then timm, which would otherwise fetch PyPI's torchvision
        assert first["torchvision"] == first["torch"] and "torchvision" in route[first["torch"]].named, route
        assert first["timm"] is not None and first["timm"] > first["torchvision"], route
    assert any(f"--index-url {CPU_INDEX}" in route[0].command for route in routes), "no route installs a CPU torch"
    # and the README says so wherever an extra brings torchvision
    paragraphs = [" ".join(paragraph.split()) for paragraph in README.read_text().split("\n\n")]
    for extra, requirements in _project()["optional-dependencies"].items():
        if "torchvision" in {_name(r) for r in requirements}:
            assert any(f"`.[{extra}]`" in p and "torchvision from torch's index" in p for p in paragraphs), extra
