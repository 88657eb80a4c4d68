"""Shared fixtures: run ``train.py`` as a user would, in a subprocess, into a temp dir; an
importable TransformerEngine stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Helpers shared between test files (multiproc, compose, resume_checks, wandb_offline, golden_curve).
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

# As a worker does before it imports megatron: its import-time torch.compile costs seconds.
from mcore_compat import lazy_compile  # noqa: E402

lazy_compile.install_if_supported()
# Gives ckpt/ the model families (ckpt.families.install), as a run does: tests call ckpt directly.
import recipes.families  # noqa: E402,F401
# Small and fast: the tiny model, few iterations, one warmup step (tests/helpers/inworld.py's).
from inworld import FAST  # noqa: E402
# `make test-times`: the per-file time table in docs/testing.md (tests/helpers/time_table.py).
from time_table import pytest_addoption, pytest_configure  # noqa: E402,F401


@pytest.fixture
def stand_in_te(monkeypatch):
    """An importable ``transformer_engine.pytorch`` (no GPU code behind it)."""
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    return pytorch


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized-corpus cache for the whole session."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def checkpoint_matrix(tmp_path_factory):
    """``(root, results)`` of the checkpoint layout matrix (tests/helpers/checkpoint_matrix.py):
    one 4-process world, run once for the test files that read it."""
    import checkpoint_matrix as matrix

    return matrix.run(tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="session")
def train_run(data_cache):
    """``train_run(out_dir, *overrides, rc=0)``: run ``train.py`` into ``out_dir``.

    Returns the ``CompletedProcess`` (stdout and stderr merged into ``.stdout``); asserts the exit
    code is ``rc`` (None: any). ``env`` adds environment variables.
    """

    def run(out_dir: Path, *overrides: str, rc: int | None = 0, multirun: bool = False,
            timeout=600, env: dict | None = None):
        args = [sys.executable, str(REPO / "train.py")]
        if multirun:
            args += ["-m", f"hydra.sweep.dir={out_dir}"]
        else:
            args += [f"hydra.run.dir={out_dir}"]
        args += [*FAST, f"data.cache_dir={data_cache}", *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
        proc = subprocess.run(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        assert rc is None or proc.returncode == rc, (
            f"train.py {' '.join(overrides)} exited {proc.returncode}, expected {rc}:\n"
            + proc.stdout[-6000:]
        )
        return proc

    return run


@pytest.fixture(scope="session")
def train_jobs(data_cache):
    """``train_jobs([(out_dir, [override, ...]), ...])``: train those jobs in order, consecutive
    jobs of one world size in one gloo world, each as a torchrun rank runs it
    (``tests/helpers/inworld.py``); returns an ``inworld.Job`` per job. Cheaper than a
    ``train.py`` process tree per job; every job must succeed."""
    from inworld import train_jobs as run

    def jobs(specs, timeout: float = 900):
        return run(data_cache, specs, timeout=timeout)

    return jobs


def _reaches(fn, name: str, module, seen: set) -> bool:
    """Whether ``fn`` (or a function of ``module`` it calls, transitively) names ``name``."""
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return False
    seen.add(fn)
    names, stack = set(), [code]
    while stack:  # nested functions and lambdas too
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    if name in names:
        return True
    return any(_reaches(getattr(module, n), name, module, seen) for n in names
               if getattr(getattr(module, n, None), "__module__", None) == module.__name__)


def _functions(item):
    """The test function (under hypothesis: the test it wraps) and its fixtures' functions."""
    fn = getattr(item, "function", None)
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
    out = [fn] if fn is not None else []
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            out.append(fixturedef.func)
    return out


def pytest_collection_modifyitems(config, items):
    """Mark what ``make test-fast`` leaves out: ``e2e`` for tests that run train.py (the
    ``train_run`` or ``train_jobs`` fixture) or another script in a fresh interpreter (``subprocess``),
    ``multiprocess`` for tests that reach ``run_distributed`` (directly or through a fixture)."""
    import sys as _sys

    for item in items:
        if {"train_run", "train_jobs"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        for fn in _functions(item):
            module = _sys.modules.get(getattr(fn, "__module__", ""), None)
            if module is None:
                continue
            if _reaches(fn, "run_distributed", module, set()):
                item.add_marker(pytest.mark.multiprocess)
            if _reaches(fn, "subprocess", module, set()):
                item.add_marker(pytest.mark.e2e)
