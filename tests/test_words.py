"""One meaning per word (``docs/code-map.md``, "Words"): a ``layout`` is the parallel sizes a run
uses or a checkpoint was saved with, never the run's ``ParallelDims`` instance, which is named
``parallel_dims``. Read from the source of every module (no import)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("ckpt", "gtp", "mcore_compat", "recipes", "tests", "benchmarks", "scripts", "train.py")
# Calls that return a ParallelDims: recipes.config.validate.validate,
# recipes.config.prelaunch.check, ParallelDims.from_config, the constructor.
GRID_CALLS = {"validate", "check", "from_config", "ParallelDims"}
# Where the process grid lives: no identifier ``layout`` at all (recipes/report reads the
# ``layout`` dicts that runs log, meaning 1).
NO_LAYOUT_NAME = ("gtp/", "mcore_compat/", "recipes/config/", "recipes/model/", "recipes/run/",
                  "recipes/dry_run/", "recipes/checkpoint/", "recipes/families/")


def _files():
    for name in SOURCES:
        path = ROOT / name
        yield from [path] if path.is_file() else sorted(path.rglob("*.py"))


def _call_name(node) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def parallel_dims_named_layout(tree: ast.AST, rel: str) -> list[str]:
    """``rel:line`` of each ``layout`` that holds a ParallelDims: a parameter annotated
    ``ParallelDims``, a name assigned from a call of :data:`GRID_CALLS`, or any name or parameter
    ``layout`` in :data:`NO_LAYOUT_NAME`."""
    bad = []
    strict = rel.startswith(NO_LAYOUT_NAME)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "layout":
            if strict or (node.annotation is not None
                          and "ParallelDims" in ast.unparse(node.annotation)):
                bad.append(f"{rel}:{node.lineno}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            grid = (_call_name(node.value) in GRID_CALLS
                    or (isinstance(node, ast.AnnAssign)
                        and "ParallelDims" in ast.unparse(node.annotation)))
            if "layout" in names and (grid or strict):
                bad.append(f"{rel}:{node.lineno}")
        elif strict and isinstance(node, ast.Name) and node.id == "layout":
            bad.append(f"{rel}:{node.lineno}")
    return sorted(set(bad), key=lambda where: int(where.rsplit(":", 1)[1]))


def test_no_parallel_dims_is_named_layout():
    bad = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        bad += parallel_dims_named_layout(ast.parse(path.read_text(), str(path)), rel)
    assert bad == [], "name the ParallelDims instance parallel_dims, not layout"


def test_the_scan_finds_each_kind():
    src = ("def f(cfg, layout: ParallelDims):\n    pass\n"
           "layout = validate(cfg, 2)\n"
           "saved = {'layout': 1}\n")
    assert parallel_dims_named_layout(ast.parse(src), "tests/x.py") == ["tests/x.py:1",
                                                                           "tests/x.py:3"]
    meaning_one = "def g(ckpt, layout=None):\n    return analyze(ckpt, layout)\n"
    assert parallel_dims_named_layout(ast.parse(meaning_one), "ckpt/stock/x.py") == []
    assert parallel_dims_named_layout(ast.parse(meaning_one), "recipes/run/x.py") == [
        "recipes/run/x.py:1", "recipes/run/x.py:2"]
