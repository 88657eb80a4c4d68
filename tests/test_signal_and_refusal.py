"""What train.py prints and returns when a run ends before it trains: a signal in a worker's
first seconds (issue 33.6) and a refused load (issue 33.4)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt import io as checkpoint
from recipes.run.preemption import child_pids

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_sigterm_while_the_workers_import_torch_exits_0_and_says_nothing_was_trained(
        data_cache, tmp_path):
    """SIGTERM to train.py the moment its workers exist (before preemption.install, while they
    import torch): exit 0, no failed worker, no save, and the line says no iteration ran."""
    args = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path}", "logger=none",
            f"data.cache_dir={data_cache}", "train.train_iters=4", "optim.lr_warmup_iters=1"]
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not child_pids("recipes.run.worker", proc.pid) and time.time() < deadline:
            time.sleep(0.005)
        assert child_pids("recipes.run.worker", proc.pid), "no worker started"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "failed" not in out and "Traceback" not in out, out[-3000:]
    assert re.search(r"> exit on SIGTERM before iteration 1: no iteration was trained, nothing "
                     r"to save", out), out[-3000:]
    assert not checkpoint.saved_iterations(tmp_path / "checkpoints")
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
