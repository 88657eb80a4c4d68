"""The import graph: ``mcore_compat/`` at the bottom, ``gtp/`` above it, ``recipes/`` on top.

No arrow runs back up: ``mcore_compat`` imports neither ``gtp`` nor ``recipes``, and ``gtp``
never imports ``recipes`` (read from the source of every module, and checked by importing
each package in a fresh interpreter)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"mcore_compat": ("gtp", "recipes"), "gtp": ("recipes",)}


def _imported_top_levels(path: Path) -> set[str]:
    """Top-level package names of every import statement in ``path`` (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_a_package_above_it(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, package
    bad = {str(p.relative_to(ROOT)): sorted(_imported_top_levels(p) & set(FORBIDDEN[package]))
           for p in modules}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_a_package_loads_nothing_above_it(package):
    modules = [str(p.relative_to(ROOT).with_suffix("")).replace("/", ".").removesuffix(".__init__")
               for p in sorted((ROOT / package).rglob("*.py")) if p.name != "__main__.py"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{list(FORBIDDEN[package])!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_no_module_imports_another_modules_private_name():
    """A leading underscore means private to the defining module: no ``from x import _name``
    between the modules of gtp/, recipes/ and mcore_compat/."""
    found = []
    for package in ("mcore_compat", "gtp", "recipes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.split(".")[0] in FORBIDDEN.keys() | {"recipes"}:
                    found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")
                              and not a.name.startswith("__")]
    assert found == []
