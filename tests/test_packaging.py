"""Packaging promises: no second torch at install time, csrc/ ships in the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)


def test_build_never_requires_torch():
    # An isolated build environment would otherwise download another torch.
    requires = pyproject()["build-system"]["requires"]
    assert not any(req.lower().startswith("torch") for req in requires), requires


def test_declared_dependencies_and_extras():
    project = pyproject()["project"]
    assert project["dependencies"] == ["torch>=2.11", "numpy"]
    extras = project["optional-dependencies"]
    assert any(req.startswith("triton") and "Linux" in req for req in extras["triton"])
    assert {"pytest", "pytest-benchmark", "hypothesis"} <= set(extras["test"])
    assert {"tqdm", "matplotlib"} <= set(extras["bench"])
    # the docs site's builder, its theme and the API reference's plugin (CI builds it with --strict)
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= {req.split("[")[0].split(">")[0] for req in extras["docs"]}


@pytest.mark.slow
def test_wheel_ships_the_kernel_sources(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("effilayers-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in sorted((ROOT / "csrc").rglob("*")):
        if source.suffix in (".h", ".cuh", ".cpp", ".cu"):
            assert f"effilayers/csrc/{source.relative_to(ROOT / 'csrc')}" in names, source
    assert not any(name.endswith(".so") for name in names)  # nothing compiled unless asked
    for init in sorted((ROOT / "effilayers").rglob("__init__.py")):
        assert init.relative_to(ROOT).as_posix() in names, init
    for table in sorted((ROOT / "effilayers").rglob("tuned_*.json")):
        assert table.relative_to(ROOT).as_posix() in names, table


def test_packages_and_tuned_tables_are_found_not_listed():
    """A new op family needs no line in pyproject.toml: setup.py finds its
    package, and a tuned table (benchmarks/tune.py merge) in any package's
    folder is package data. The wheel test checks the result."""
    setuptools = pyproject()["tool"]["setuptools"]
    assert "packages" not in setuptools
    assert setuptools["package-data"]["*"] == ["tuned_*.json"]
    found = 'find_packages(include=["effilayers", "effilayers.*"]) + ["effilayers.csrc"]'
    assert found in (ROOT / "setup.py").read_text()


# Where the tools that go over every family would keep a list of them: each
# finds the families on disk instead (effilayers/_core/families.py, or the
# bench files' LEDGER for the two benchmark scripts).
FAMILY_FINDERS = ("effilayers/functional.py", "effilayers/nn/__init__.py", "effilayers/_selftest.py",
                  "effilayers/_kernel_report.py", "benchmarks/ledger.py", "benchmarks/gpu_session.py", "docs/hooks.py",
                  "mkdocs.yml")


def test_no_central_list_names_an_op_family():
    """A new family is found by being in its folders: no string in the
    places that go over every family names one (mkdocs.yml's navigation
    names guide pages, which docs/hooks.py completes, not families)."""
    import ast

    from effilayers._core.families import family_names

    families = set(family_names())
    assert {"softmax", "abn", "adam"} <= families
    for path in FAMILY_FINDERS:
        text = (ROOT / path).read_text()
        if path.endswith(".py"):
            # the elements of literal collections: a list of families would be one
            strings = {element.value for node in ast.walk(ast.parse(text))
                       if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict))
                       for element in (node.keys + node.values if isinstance(node, ast.Dict) else node.elts)
                       if isinstance(element, ast.Constant) and isinstance(element.value, str)}
        else:
            strings = set(text.replace(":", " ").split())
        named = sorted(s for s in strings if s in families or s.removeprefix("effilayers.ops.") in families)
        assert not named, (path, named)


def test_no_build_artifact_is_committed():
    # A wheel once landed at the repository root by accident (issue 30): packages and
    # compiled objects are built, never committed.
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    assert done.returncode == 0, f"the check needs this checkout's git index: {done.stderr.strip()}"
    artifacts = [name for name in done.stdout.splitlines()
                 if name.endswith((".whl", ".egg", ".tar.gz", ".zip", ".so", ".o", ".pyc"))]
    assert not artifacts, artifacts
