"""MkDocs hooks (``hooks:`` in mkdocs.yml): what the site takes from the op
families on disk, so that a new family needs no edit here or in mkdocs.yml.

* The user guide's navigation gains every ``docs/guide/*.md`` that the
  ``nav`` does not name, after the pages it names.
* ``::: effilayers.nn`` and ``::: effilayers.functional`` (the API pages)
  become one entry per exported object, in its defining module: those two
  modules collect their exports from the families at import time, which
  mkdocstrings' static reading does not follow. The names come from each
  family's ``ops/<family>/module.py`` ``__all__`` and ``op.py``
  ``FUNCTIONAL``, read with ``ast`` (building the site imports neither torch
  nor effilayers).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "effilayers" / "ops"
GUIDE_SECTION = "User guide"


def _literal(path: Path, name: str) -> tuple[str, ...]:
    """The tuple or list of strings assigned to ``name`` at the top of ``path``."""
    if not path.is_file():
        return ()
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return tuple(ast.literal_eval(node.value))
    return ()


def exports(role: str, name: str) -> list[tuple[str, str]]:
    """(module, object) of every family's ``ops/<family>/<role>.py`` ``name``
    list, families in the order ``_core/families.py`` finds them."""
    families = sorted(path.parent.name for path in OPS.glob("*/__init__.py"))
    return [(f"effilayers.ops.{family}.{role}", item) for family in families
            for item in _literal(OPS / family / f"{role}.py", name)]


def api_entries(module: str) -> list[tuple[str, str]]:
    """The objects ``effilayers.nn`` / ``effilayers.functional`` export, as
    (defining module, name)."""
    if module == "effilayers.nn":
        return exports("module", "__all__") + [("effilayers.nn.pooling", "MaxPool2d")]
    if module == "effilayers.functional":
        return exports("op", "FUNCTIONAL")
    raise ValueError(f"no collected exports for {module}")


def _expanded(module: str) -> str:
    lines = [f"::: {module}", "    options:", "      members: false", ""]
    for defining, name in api_entries(module):
        lines += [f"::: {defining}.{name}", "    options:", "      show_root_full_path: false", ""]
    return "\n".join(lines)


def guide_pages(named: list[str]) -> list[str]:
    """``docs/guide/*.md`` the nav does not name, sorted."""
    return sorted(f"guide/{path.name}" for path in (ROOT / "docs" / "guide").glob("*.md")
                  if f"guide/{path.name}" not in named)


def on_config(config):
    for section in config["nav"]:
        if isinstance(section, dict) and GUIDE_SECTION in section:
            pages = section[GUIDE_SECTION]
            pages.extend(guide_pages([page if isinstance(page, str) else next(iter(page.values()))
                                      for page in pages]))
    return config


def on_page_markdown(markdown, page, config, files):
    for module in ("effilayers.nn", "effilayers.functional"):
        markdown = markdown.replace(f"::: {module}\n", _expanded(module) + "\n")
    return markdown
