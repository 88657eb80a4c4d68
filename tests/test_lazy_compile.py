"""megatron-core's import-time ``torch.compile`` is deferred to each function's first call
(``mcore_compat.lazy_compile``): importing megatron no longer imports Dynamo and Inductor, and
a deferred function compiles once, with its options, on its first call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_compat import lazy_compile

ROOT = Path(__file__).resolve().parents[1]

# In a fresh interpreter: import what a training rank imports, with or without the deferral.
_PROBE = """
import json, sys, warnings
warnings.simplefilter("ignore")
import pytest
import torch
real = torch.compile
if INSTALL:
    from mcore_compat import lazy_compile
    lazy_compile.install()
import megatron.core, megatron.core.optimizer, megatron.core.models.gpt
import megatron.core.transformer.moe.router
from megatron.core import jit
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules,
                  "jit_fuser": jit.jit_fuser.__qualname__,
                  "restored": torch.compile is real}))
"""


@pytest.fixture(scope="module")
def probes() -> dict:
    """``{install: the probe's result}`` for both, in two interpreters at once (each imports
    on one core for seconds)."""
    procs = {install: subprocess.Popen([sys.executable, "-c", f"INSTALL = {install}" + _PROBE],
                                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True) for install in (True, False)}
    results = {}
    for install, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results[install] = json.loads(out.strip().splitlines()[-1])
    return results


def test_megatron_imports_without_dynamo_once_installed(probes):
    assert probes[True] == {"dynamo": False, "inductor": False, "jit_fuser": "lazy_compile",
                            "restored": True}


def test_without_the_deferral_megatron_imports_dynamo(probes):
    """The control: what the deferral removes is there without it."""
    assert probes[False] == {"dynamo": True, "inductor": True, "jit_fuser": "compile",
                             "restored": True}


def test_a_deferred_function_compiles_once_with_its_options_on_the_first_call(monkeypatch):
    calls = []

    def recording_compile(model, **options):
        calls.append((model, options))
        return lambda x: ("compiled", model(x))

    monkeypatch.setattr(lazy_compile, "_REAL_COMPILE", [recording_compile])

    def double(x):
        """Twice x."""
        return 2 * x

    deferred = lazy_compile.lazy_compile(double, mode="max-autotune")
    factory = lazy_compile.lazy_compile(dynamic=False)(double)
    assert calls == [] and deferred.__name__ == "double" and deferred.__doc__ == "Twice x."
    assert [deferred(3), deferred(4), factory(5)] == [("compiled", 6), ("compiled", 8),
                                                      ("compiled", 10)]
    assert calls == [(double, {"mode": "max-autotune"}), (double, {"dynamic": False})]


def test_a_module_is_compiled_at_once(monkeypatch):
    """``torch.compile(module)`` returns an ``OptimizedModule`` that callers may check for."""
    calls = []
    monkeypatch.setattr(lazy_compile, "_REAL_COMPILE",
                        [lambda model, **options: calls.append(model) or "optimized"])
    module = torch.nn.Linear(2, 2)
    assert lazy_compile.lazy_compile(module) == "optimized" and calls == [module]


@pytest.mark.parametrize("version", ["0.18.0", None])
def test_another_or_an_unknown_megatron_version_starts_without_the_deferral(version, monkeypatch):
    """Start-up time only: a megatron-core of another version, or a source checkout without
    package metadata, runs on (its behaviour-changing patches refuse it) without the deferral."""
    from importlib.metadata import PackageNotFoundError

    from mcore_compat import patches

    def installed():
        if version is None:
            raise PackageNotFoundError("megatron-core")
        return version

    def installs() -> int:
        return sum(isinstance(f, lazy_compile._DeferringFinder) for f in sys.meta_path)

    # This process has the deferral (tests/conftest.py): start from a meta_path without it.
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, lazy_compile._DeferringFinder)])
    monkeypatch.setattr(patches, "installed_megatron_version", installed)
    assert lazy_compile.install_if_supported() is False and installs() == 0
    monkeypatch.setattr(patches, "installed_megatron_version", lambda: "0.19.2")
    assert lazy_compile.install_if_supported() is True and installs() == 1
