"""Every megatron-core patch this repository installs goes through the version gate.

The patches are listed from the source (every function that writes into a megatron module or
class is declared with ``mcore_compat.patches.megatron_patch``), and each one, called under a
megatron-core version other than the supported one, raises the gate's error before it patches
anything."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mcore_compat", "gtp", "ckpt", "recipes")
# The patches installed today, "module.function" (a new one is added here when it is written).
EXPECTED = {
    "gtp.backend.install",
    "ckpt.format.logical_format.install",
    "gtp.grad_stats.install",
    "mcore_compat.cpu.install",
    "mcore_compat.cpu.redirect_torch",
    "mcore_compat.dist_checkpointing.set_write_results_queue",
    "mcore_compat.dist_checkpointing.keep_write_errors",
    "mcore_compat.distrib_optimizer.install",
    "mcore_compat.fs_model_space.install",
    "ckpt.io.faults.while_writing",
    "mcore_compat.moe_cpu.install",
    "mcore_compat.moe_cpu.torch_norm_under_sequence_parallel",
    "gtp.expert_grads.tag_expert_params",
    "gtp.expert_grads.scale_expert_gradients",
    "gtp.muon.install",
    "gtp.muon.uninstall",
    "recipes.families.moe.model.experts_leave_rng_alone",
    "recipes.families.gpt.model.mtp_embedding_copy_draws_nothing",
    "ckpt.format.safe_objects.install",
    "gtp.tied_output.install",
    "mcore_compat.lazy_compile.install",
    "mcore_compat.mamba_cpu.install",
    "mcore_compat.mamba_cpu.hybrid_stack_without_te",
    "ckpt.format.mamba_format.install",
    "mcore_compat.gdn_cpu.install",
    "mcore_compat.zero_centered_norm.install",
    "ckpt.format.gdn_format.install",
    "mcore_compat.vision_cpu.install",
}


def _module_name(path: Path) -> str:
    return str(path.relative_to(ROOT).with_suffix("")).replace("/", ".").removesuffix(".__init__")


def _megatron_names(tree: ast.AST) -> set[str]:
    """Names bound to megatron modules or objects in a module: ``import megatron...``, ``from
    megatron... import x``, ``x = importlib.import_module("megatron...")`` or of a module-level
    constant naming a megatron module."""
    constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 and n.value.value.startswith("megatron") for t in n.targets
                 if isinstance(t, ast.Name)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.startswith("megatron")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if getattr(call.func, "attr", None) == "import_module" and call.args:
                arg = call.args[0]
                if (isinstance(arg, ast.Constant) and str(arg.value).startswith("megatron")) or (
                        isinstance(arg, ast.Name) and arg.id in constants):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _patching_functions() -> set[str]:
    """``module.function`` of every top-level function that assigns an attribute of a megatron
    module or object (``megatron_thing.attr = ...`` or ``setattr(megatron_thing, ...)``); a
    private one is listed as the public functions of its module that call it."""
    found = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            megatron = _megatron_names(tree)
            for fn in tree.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                # megatron modules the function itself imports by name
                local = megatron | {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign)
                                    and isinstance(n.value, ast.Call)
                                    and getattr(n.value.func, "attr", None) == "import_module"
                                    for t in n.targets if isinstance(t, ast.Name)}
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else []
                    hit = any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                              and t.value.id in local for t in targets)
                    hit |= (isinstance(node, ast.Call)
                            and getattr(node.func, "id", None) == "setattr" and node.args
                            and isinstance(node.args[0], ast.Name) and node.args[0].id in local)
                    if hit:
                        found |= _public_callers(tree, fn.name, _module_name(path))
                        break
    return found


def _public_callers(tree: ast.Module, name: str, module: str) -> set[str]:
    """``{module.name}`` for a public function; for a private one, its module's public
    functions that call it (itself when none does)."""
    if not name.startswith("_"):
        return {f"{module}.{name}"}
    callers = {f"{module}.{fn.name}" for fn in tree.body if isinstance(fn, ast.FunctionDef)
               and not fn.name.startswith("_") and any(
                   isinstance(n, ast.Call) and getattr(n.func, "id", None) == name
                   for n in ast.walk(fn))}
    return callers or {f"{module}.{name}"}


# In a fresh interpreter: import every module of the three packages, record the registry, then
# call each patch (none installed yet) with megatron-core reporting 0.18.0.
_PROBE = """
import importlib, json, warnings
warnings.simplefilter("ignore")
import megatron.core
from megatron.core.dist_checkpointing.strategies import filesystem_async
for m in MODULES:
    importlib.import_module(m)
from mcore_compat import cpu, lazy_compile
from mcore_compat.patches import PATCHES
refused = {}
for name in sorted(PATCHES):
    module, fn = name.rsplit(".", 1)
    target = getattr(importlib.import_module(module), fn)
    args = {"set_write_results_queue": (object(),), "while_writing": (1, 0)}.get(fn, ())
    megatron.core.__version__ = "0.18.0"
    try:
        out = target(*args)
        if fn == "while_writing":
            out.__enter__()
        refused[name] = "patched"
    except RuntimeError as exc:
        refused[name] = str(exc)
    megatron.core.__version__ = "0.19.2"
untouched = (getattr(filesystem_async, "_results_queue", None) is None
             and not cpu.is_installed() and not lazy_compile.is_installed())
print(json.dumps({"registered": PATCHES, "refused": refused, "untouched": untouched}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    modules = [_module_name(p) for package in PACKAGES
               for p in sorted((ROOT / package).rglob("*.py")) if p.name != "__main__.py"]
    out = subprocess.run([sys.executable, "-c", f"MODULES = {modules!r}" + _PROBE], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_megatron_patch_is_declared_through_the_gate(probe):
    registered = probe["registered"]
    assert set(registered) == EXPECTED, "a patch was added or removed: update EXPECTED"
    assert _patching_functions() <= set(registered), (
        "a function writes into megatron without mcore_compat.patches.megatron_patch")
    assert all(registered.values()), "each patch names what it patches"


def test_every_registered_patch_is_refused_on_another_megatron_version(probe):
    """Each patch, called with megatron-core reporting 0.18.0, raises the gate's error naming
    it, and leaves megatron as it was."""
    assert probe["untouched"]
    assert set(probe["refused"]) == EXPECTED
    for name, message in probe["refused"].items():
        assert "written for megatron-core 0.19.2" in message and "found megatron-core 0.18.0" \
            in message and name in message, (name, message)
