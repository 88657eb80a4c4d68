"""The import graph: ``mcore_compat/`` at the bottom, then ``gtp/`` (the GTP runtime), then
``ckpt/`` (the checkpoint), ``recipes/`` on top.

No arrow runs back up: ``mcore_compat`` imports none of the others, ``gtp`` neither ``ckpt`` nor
``recipes``, and ``ckpt`` never ``recipes`` (read from the source of every module, and checked
by importing each package in a fresh interpreter); nor does a plug-in registration
(``pyproject.toml``'s entry points), which the imports would not show. The one exception is an
entry point's module, ``python -m gtp``'s ``gtp/__main__.py``, which no module imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from import_graph import ImportGraph

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"mcore_compat": ("gtp", "ckpt", "recipes"), "gtp": ("ckpt", "recipes"),
             "ckpt": ("recipes",)}
# ``python -m gtp`` (the checkpoint command line, ckpt/cli.py, with recipes' model families): an
# entry point that no module imports, so it may import above its package.
ENTRY_SHIMS = {"gtp.__main__"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_a_package_above_it(package):
    imports = {mod: imps for mod, imps in ImportGraph(ROOT).imports.items()
               if mod.split(".")[0] == package and mod not in ENTRY_SHIMS}
    assert imports, package
    bad = {mod: sorted({i.target.split(".")[0] for i in imps} & set(FORBIDDEN[package]))
           for mod, imps in imports.items()}
    assert {k: v for k, v in bad.items() if v} == {}


# Below recipes/, nothing needs the run's config library: ckpt/ and gtp/ are usable without it.
WITHOUT_HYDRA = ("hydra", "omegaconf")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_a_package_loads_nothing_above_it(package):
    modules = [str(p.relative_to(ROOT).with_suffix("")).replace("/", ".").removesuffix(".__init__")
               for p in sorted((ROOT / package).rglob("*.py")) if p.name != "__main__.py"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{[*FORBIDDEN[package], *WITHOUT_HYDRA]!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_no_module_imports_an_entry_shim():
    graph = project_import_graph()
    assert {mod for mod, targets in graph.items() if targets & ENTRY_SHIMS} == set()
    assert all(mod in graph for mod in ENTRY_SHIMS)


def upward_entry_points(pyproject: Path) -> list[str]:
    """The entry points of ``pyproject`` that point from a package into one above it: a group
    named after a project package (``gtp.model_families``: what ``gtp`` looks up) whose entry
    names a module of a package that may not be imported from there (:data:`FORBIDDEN`)."""
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    groups = dict(project.get("entry-points", {}))
    bad = []
    for group, entries in sorted(groups.items()):
        owner = group.split(".")[0]
        for name, value in sorted(entries.items()):
            if value.split(":")[0].split(".")[0] in FORBIDDEN.get(owner, ()):
                bad.append(f"{group}: {name} = {value}")
    return bad


def test_no_entry_point_runs_from_a_package_into_one_above_it():
    """A plug-in registration is an import the source does not show: none may run upward (the
    model families and the run-config vocab are passed down as values, ckpt.families.install),
    and no module of a lower package looks entry points up at all."""
    assert upward_entry_points(ROOT / "pyproject.toml") == []
    lookups = [f"{path.relative_to(ROOT)}" for package in FORBIDDEN if package != "recipes"
               for path in sorted((ROOT / package).rglob("*.py"))
               if "entry_points(" in path.read_text()]
    assert lookups == []


def test_the_entry_point_rule_finds_an_upward_registration(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[project.scripts]\nrun = "recipes.run.launch:main"\n'
        '[project.entry-points."gtp.model_families"]\ngpt = "recipes.families.gpt.formats:F"\n'
        '[project.entry-points."ckpt.readers"]\nok = "gtp.shards:f"\n')
    assert upward_entry_points(tmp_path / "pyproject.toml") == [
        "gtp.model_families: gpt = recipes.families.gpt.formats:F"]


def test_no_module_imports_another_modules_private_name():
    """A leading underscore means private to the defining module: no ``from x import _name``
    between the modules of gtp/, ckpt/, recipes/ and mcore_compat/."""
    found = []
    for package in ("mcore_compat", "gtp", "ckpt", "recipes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.split(".")[0] in FORBIDDEN.keys() | {"recipes"}:
                    found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")
                              and not a.name.startswith("__")]
    assert found == []


def project_import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: project modules it imports}``, imports inside functions included
    (:class:`tests.helpers.import_graph.ImportGraph`)."""
    return ImportGraph(root).graph()


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
    """No two modules of mcore_compat/, gtp/, ckpt/ or recipes/ import each other, directly or through
    others, counting imports inside functions (Python resolves those late, so it never reports
    the circle, but the modules still cannot be understood or moved one without the other)."""
    graph = project_import_graph()
    assert len(graph) > 80 and graph["ckpt.hf.hf_export"], len(graph)
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


# Packages beside a run, and the only modules outside them that may import them.
BESIDE_THE_RUN = {"recipes.report": set(), "recipes.dry_run": {"recipes.run.launch"}}


def test_the_sweep_report_and_the_dry_run_stay_out_of_the_run():
    """The sweep report (matplotlib, reads finished runs' logs) and the dry run (sizes, no
    process) are packages of their own: no module of a run imports them, except the launcher's
    ``train.dry_run=true`` branch."""
    graph = project_import_graph()
    found = {f"{mod} -> {target}" for mod, targets in graph.items() for target in targets
             for package, allowed in BESIDE_THE_RUN.items()
             if (target == package or target.startswith(package + "."))
             and not (mod == package or mod.startswith(package + ".")) and mod not in allowed}
    assert found == set()


# Standard-library modules that are data more than code, imported by the one function that reads
# them: the 700 KB help-topic table of the built-in corpus (recipes/data/corpus.py).
LAZY_STDLIB = frozenset({"pydoc_data"})


def test_an_import_inside_a_function_keeps_a_package_off_start_up():
    """An import inside a function is there for start-up time only: it names an outside
    package (torch, megatron-core, transformers, ...), or a project module that loads one that
    the importing module does not already load. Any other import (the standard library, a
    project module that costs nothing more) is at the top of the module, where a reader and the
    import-graph tests see it."""
    assert ImportGraph(ROOT).needless_local_imports(LAZY_STDLIB) == []


def test_the_start_up_rule_finds_needless_local_imports(tmp_path):
    for package in ("mcore_compat", "gtp", "recipes"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "gtp" / "heavy.py").write_text("import torch\n")
    (tmp_path / "gtp" / "light.py").write_text("import os\n")
    (tmp_path / "recipes" / "a.py").write_text(
        "def f():\n    import json\n    from gtp import light\n    from gtp import heavy\n"
        "    import torch\n    import pydoc_data\n")
    (tmp_path / "recipes" / "b.py").write_text("import torch\n\n\ndef f():\n"
                                                "    from gtp import heavy\n")
    graph = ImportGraph(tmp_path)
    assert graph.outside_packages("recipes.b") == {"torch"}
    assert graph.needless_local_imports(LAZY_STDLIB) == [
        "recipes.a:2 json", "recipes.a:3 gtp.light", "recipes.b:5 gtp.heavy"]


def test_no_module_is_over_500_lines():
    """No module of mcore_compat/, gtp/, ckpt/, recipes/, tests/ (their helpers included),
    or benchmarks/ is over 500 lines: a longer one is split by what its parts do."""
    long = {str(p.relative_to(ROOT)): n
            for package in ("mcore_compat", "gtp", "ckpt", "recipes", "tests", "benchmarks")
            for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_launchers_modules_import_neither_torch_nor_megatron():
    """What ``train.py`` imports before its pre-launch checks loads neither torch nor
    megatron-core (about 5 s of a refused run's 7): a config refusal answers in about 2 s."""
    launcher = ["recipes.run.launch", "recipes.checkpoint.policy", "recipes.checkpoint.auto",
                "recipes.config.prelaunch", "recipes.run.pretrained", "recipes.data.tokenizers",
                "recipes.metrics.console", "recipes.run.rank_env", "recipes.config.refusal"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {launcher!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
