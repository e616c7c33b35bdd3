"""The docs site (docs/, built by mkdocs.yml): every ```python block of every
page runs as written, each in a fresh namespace, as the README's do
(tests/test_readme.py, with the same rules for blocks that need torchvision
or timm); a block whose printed results a section's own test checks runs
there instead (tests/readme_blocks.py, CHECKED_ELSEWHERE).

A docs page has no install commands of its own: its blocks may import what
every route of the README's install commands installs. And, read without
building anything (CI's newest environment runs `mkdocs build --strict`), the
navigation names every page once, and every page it names exists."""

from __future__ import annotations

import re

import pytest

from .readme_blocks import DOCS, README, ROOT, blocks, pages
from .test_readme import check_imports, install_routes, run_block, run_here

DOCS_BLOCKS = [block for page in pages()[1:] for block in run_here(page)]
ALL_DOCS_BLOCKS = [block for page in pages()[1:] for block in blocks(page)]


@pytest.mark.parametrize("block", [pytest.param(block, id=block.id) for block in DOCS_BLOCKS])
def test_docs_python_block_runs(block, capsys):
    run_block(block, capsys)


@pytest.mark.parametrize("block", [pytest.param(block, id=block.id) for block in ALL_DOCS_BLOCKS])
def test_docs_block_imports_only_what_the_readme_install_commands_installed(block):
    check_imports(block, install_routes(README.read_text().count("\n") + 1))


def _nav_pages() -> list[str]:
    # mkdocs.yml's nav entries are "- Title: path.md" lines; the API pages too
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", nav, flags=re.M)


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_navigation_names_every_page_once():
    named = _nav_pages()
    named += _hooks().guide_pages(named)  # the guide pages mkdocs.yml leaves to docs/hooks.py
    on_disk = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(named) == on_disk, (sorted(set(on_disk) - set(named)), sorted(set(named) - set(on_disk)))
    assert len(named) == len(set(named))


def test_every_feature_has_a_guide_page_and_an_api_page():
    guide = {path.stem for path in (DOCS / "guide").glob("*.md")}
    assert {"abn", "densenet", "softmax", "cross-entropy", "linear-cross-entropy", "reductions", "optim",
            "memory", "checkpoint-fit", "bench", "distributed"} <= guide
    api = "".join(path.read_text() for path in (DOCS / "api").glob("*.md"))
    for module in ("effilayers.nn", "effilayers.functional", "effilayers.optim", "effilayers.memory",
                   "effilayers.checkpoint", "effilayers.models", "effilayers.fit", "effilayers.max_batch"):
        assert f"::: {module}\n" in api, module


def test_api_pages_list_what_nn_and_functional_export():
    """docs/hooks.py reads the families' export lists without importing
    them; what it finds is what the modules export when imported."""
    import effilayers.functional
    import effilayers.nn

    hooks = _hooks()
    for module in (effilayers.nn, effilayers.functional):
        entries = hooks.api_entries(module.__name__)
        assert sorted(name for _, name in entries) == sorted(module.__all__)
        for defining, name in entries:
            assert getattr(module, name).__module__ == defining, (defining, name)
    # a guide page the nav does not name is added, after the named ones
    on_disk = sorted(f"guide/{path.name}" for path in (DOCS / "guide").glob("*.md"))
    assert hooks.guide_pages(["guide/abn.md"]) == [page for page in on_disk if page != "guide/abn.md"]
    config = {"nav": [{"Home": "index.md"}, {"User guide": ["guide/bench.md", {"ABN": "guide/abn.md"}]}]}
    pages = hooks.on_config(config)["nav"][1]["User guide"]
    assert pages[:2] == ["guide/bench.md", {"ABN": "guide/abn.md"}] and sorted(pages[2:]) == [
        page for page in on_disk if page not in ("guide/bench.md", "guide/abn.md")]


def test_readme_links_the_docs_and_the_gpu_ledger():
    text = README.read_text()
    links = set(re.findall(r"\]\(([^)#\s]+)", text))
    local = {link for link in links if "://" not in link}
    assert {"docs/index.md", "benchmarks/results/GPU.md"} <= local
    missing = sorted(link for link in local if not (ROOT / link).exists())
    assert not missing, missing
