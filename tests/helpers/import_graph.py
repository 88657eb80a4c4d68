"""The project's imports read from the source (ast), for the import-graph tests.

Every import statement of mcore_compat/, gtp/, ckpt/ and recipes/ is resolved to what it loads: a
project module (relative imports resolved; ``from pkg import name`` is ``pkg.name`` when that is
a module, the submodule that a package's ``_LAZY`` table loads ``name`` from
(``mcore_compat.lazy.lazy_names``), else ``pkg``) or an outside name (``torch.nn``, ``os``)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("mcore_compat", "gtp", "ckpt", "recipes")
STDLIB = frozenset(sys.stdlib_module_names)


@dataclass(frozen=True)
class Import:
    """One name an import statement loads."""

    target: str  # a project module, or the dotted outside name
    project: bool
    line: int
    module_level: bool  # False: inside a function (runs when the function is called)


def _module_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root).with_suffix("")).replace("/", ".").removesuffix(".__init__")


class ImportGraph:
    """The import statements of every project module under ``root``."""

    def __init__(self, root: Path):
        self.paths = {_module_name(p, root): p for package in PACKAGES
                      for p in sorted((root / package).rglob("*.py"))}
        self._lazy = {mod: self._lazy_names(mod) for mod in self.paths}
        self.imports = {mod: self._read(mod) for mod in self.paths}
        self._outside: dict[str, frozenset[str]] = {}

    def _known(self, name: str) -> str | None:
        while name and name not in self.paths:
            name = name.rpartition(".")[0]
        return name or None

    def _lazy_names(self, package: str) -> dict[str, str]:
        """``{name: submodule}`` of a package whose ``__getattr__`` loads names on first use."""
        path = self.paths.get(package)
        if path is None or path.name != "__init__.py":
            return {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY"
                                                    for t in node.targets):
                return {name: f"{package}.{sub}"
                        for sub, names in ast.literal_eval(node.value).items() for name in names}
        return {}

    def _read(self, mod: str) -> list[Import]:
        path = self.paths[mod]
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: list[Import] = []

        def add(name: str, line: int, module_level: bool) -> None:
            known = self._known(name)
            found.append(Import(known or name, bool(known), line, module_level))

        def visit(node: ast.AST, module_level: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(alias.name, child.lineno, module_level)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*parts, base] if base else parts)
                    lazy = self._lazy.get(base, {})
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        if sub not in self.paths and self._known(base):
                            sub = lazy.get(alias.name, base)
                        add(sub, child.lineno, module_level)
                else:
                    visit(child, module_level and not isinstance(
                        child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), filename=str(path)), True)
        return found

    def graph(self) -> dict[str, set[str]]:
        """``{module: project modules it imports}``, function-local imports included."""
        return {mod: {i.target for i in imps if i.project and i.target != mod}
                for mod, imps in self.imports.items()}

    def outside_packages(self, mod: str) -> frozenset[str]:
        """The outside modules (dotted names cut to 3 parts: ``torch.nn.functional``,
        ``megatron.core.models``) that importing ``mod`` loads through module-level imports,
        its parent packages' and those of every project module it loads that way."""
        memo = self._outside
        if mod not in memo:
            seen, todo, found = set(), [mod], set()
            while todo:
                m = todo.pop()
                if m in seen:
                    continue
                seen.add(m)
                parts = m.split(".")
                todo += [p for i in range(1, len(parts))
                         if (p := ".".join(parts[:i])) in self.paths]
                for imp in self.imports[m]:
                    if imp.module_level:
                        if imp.project:
                            todo.append(imp.target)
                        elif imp.target.split(".")[0] not in STDLIB:
                            found.add(".".join(imp.target.split(".")[:3]))
            memo[mod] = frozenset(found)
        return memo[mod]

    def needless_local_imports(self, lazy_stdlib=frozenset()) -> list[str]:
        """Imports inside functions that keep nothing off their module's start-up:
        ``"module:line target"`` for a standard-library module (except ``lazy_stdlib``) and for
        a project module whose module-level imports load no outside package that the importing
        module's do not already load."""
        bad = []
        for mod, imps in self.imports.items():
            for imp in imps:
                if imp.module_level or imp.target == mod:
                    continue
                top = imp.target.split(".")[0]
                if imp.project:
                    needless = not self.outside_packages(imp.target) - self.outside_packages(mod)
                else:
                    needless = top in STDLIB and top not in lazy_stdlib
                if needless:
                    bad.append(f"{mod}:{imp.line} {imp.target}")
        return bad
