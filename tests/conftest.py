"""Shared fixtures: run ``train.py`` as a user would, in a subprocess, into a temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Small and fast: the tiny model, few iterations, one warmup step.
FAST = ["train.train_iters=4", "optim.lr_warmup_iters=1", "logger=none"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized-corpus cache for the whole session."""
    return tmp_path_factory.mktemp("data_cache")


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
        args += FAST + [f"data.cache_dir={data_cache}", *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
        proc = subprocess.run(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        assert rc is None or proc.returncode == rc, (
            f"train.py {' '.join(overrides)} exited {proc.returncode}, expected {rc}:\n"
            + proc.stdout[-6000:]
        )
        return proc

    return run
