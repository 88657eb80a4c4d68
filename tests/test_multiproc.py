"""The test worlds themselves (tests/helpers/multiproc.py): every world's ranks start from the
forkserver's import-only state, whatever an earlier world did, and see this process's
environment and working directory as spawned ranks would."""

from __future__ import annotations

import os

from multiproc import run_distributed


def _dirty() -> bool:
    """Leave process-global state behind: megatron patched for CPU, a module global set."""
    from mcore_compat import cpu

    from recipes.run import worker

    cpu.install()
    worker._TRAINING.append(True)
    return cpu.is_installed()


def _state() -> tuple:
    import sys

    from mcore_compat import cpu

    from recipes.run import worker

    return (cpu.is_installed(), list(worker._TRAINING), "megatron.core" in sys.modules,
            os.environ.get("GTP_TEST_MARK"), os.getcwd())


def test_a_world_starts_from_the_imports_only_whatever_the_last_world_did(tmp_path, monkeypatch):
    assert run_distributed(_dirty, 2) == [True, True]
    monkeypatch.setenv("GTP_TEST_MARK", "set after the forkserver started")
    monkeypatch.chdir(tmp_path)
    want = (False, [], True, "set after the forkserver started", str(tmp_path))
    assert run_distributed(_state, 2) == [want, want]
