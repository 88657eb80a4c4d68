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


def _module_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root).with_suffix("")).replace("/", ".").removesuffix(".__init__")


def project_import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the modules of mcore_compat/, gtp/ and recipes/,
    function-local imports included (every import statement in the file), relative imports
    resolved; ``from pkg import name`` is an arrow to ``pkg.name`` when that is a module, else to
    ``pkg``."""
    paths = {_module_name(p, root): p for package in ("mcore_compat", "gtp", "recipes")
             for p in sorted((root / package).rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                            for a in node.names]
        graph[mod] = {t for t in map(known, targets) if t and t != mod}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_project_modules():
    """No two modules of mcore_compat/, gtp/ or recipes/ import each other, directly or through
    others, counting imports inside functions (Python resolves those late, so it never reports
    the circle, but the modules still cannot be understood or moved one without the other)."""
    graph = project_import_graph()
    assert len(graph) > 80 and graph["gtp.hf_export"], len(graph)
    circles = import_circles(graph)
    where = {tuple(c): {m: sorted(graph[m] & set(c)) for m in c} for c in circles}
    assert circles == [], where


def test_the_circle_check_finds_a_circle_made_by_a_function_local_import(tmp_path):
    (tmp_path / "recipes").mkdir()
    for package in ("mcore_compat", "gtp"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "recipes" / "__init__.py").write_text("")
    (tmp_path / "recipes" / "a.py").write_text("from recipes.b import f\n")
    (tmp_path / "recipes" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "recipes" / "c.py").write_text("def g():\n    from recipes import a\n")
    graph = project_import_graph(tmp_path)
    assert graph["recipes.b"] == {"recipes.c"}
    assert import_circles(graph) == [["recipes.a", "recipes.b", "recipes.c"]]


def test_no_module_is_over_500_lines():
    """No module of mcore_compat/, gtp/ or recipes/ is over 500 lines: a longer one is split by
    what its parts do."""
    long = {str(p.relative_to(ROOT)): n for package in ("mcore_compat", "gtp", "recipes")
            for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_launchers_modules_import_neither_torch_nor_megatron():
    """What ``train.py`` imports before its pre-launch checks loads neither torch nor
    megatron-core (about 5 s of a refused run's 7): a config refusal answers in about 2 s."""
    launcher = ["recipes.launch", "recipes.checkpoint.policy", "recipes.checkpoint.auto",
                "recipes.prelaunch", "recipes.pretrained", "recipes.data.tokenizers",
                "recipes.console", "recipes.rank_env", "recipes.refusal"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {launcher!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
