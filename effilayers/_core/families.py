"""The op families, found on disk: every package under ``effilayers/ops/``.

The tools that go over all families (the self-test, the kernel report, the
tuning sweep) ask here for a family's module of a given role
(``selftest``, ``triton``, ...) instead of keeping a list of names, so that a
new family is picked up by being there.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

OPS = Path(__file__).resolve().parents[1] / "ops"


def family_names() -> list[str]:
    """The family packages under ``effilayers/ops/``, sorted."""
    return sorted(path.parent.name for path in OPS.glob("*/__init__.py"))


def family_modules(role: str) -> list[ModuleType]:
    """``effilayers.ops.<family>.<role>`` of every family that has one."""
    return [importlib.import_module(f"effilayers.ops.{family}.{role}")
            for family in family_names() if (OPS / family / f"{role}.py").is_file()]


def family_exports(role: str, names: str) -> dict[str, object]:
    """The objects every family's ``<role>.py`` lists in its attribute
    ``names`` (``module.py``'s ``__all__``, ``op.py``'s ``FUNCTIONAL``), by
    name, in family order: what ``effilayers.nn`` and
    ``effilayers.functional`` export."""
    return {name: getattr(module, name) for module in family_modules(role) for name in getattr(module, names, ())}
