"""checkpoint.async_save=true: megatron's async torch_dist save, finalized before the tracker."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from recipes import checkpoint
from recipes.metrics import read_metrics

COMMON = ["train.train_iters=4", "optim.lr_warmup_iters=1", "checkpoint.save_interval=2"]


def _tensors(iter_path, tmp) -> dict:
    """Every tensor of a torch_dist checkpoint, read with torch's own converter."""
    tmp.mkdir(exist_ok=True)
    out = tmp / (iter_path.name + ".pt")
    dcp_to_torch_save(iter_path, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def _losses(run_dir) -> dict:
    return {r["iteration"]: r["lm loss"] for r in read_metrics(run_dir)[0]}


@pytest.fixture(scope="module")
def runs(train_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    train_run(root / "sync", *COMMON)
    train_run(root / "async", *COMMON, "checkpoint.async_save=true")
    return root


def test_async_save_writes_what_the_synchronous_save_writes(runs, tmp_path):
    """Training goes on while iteration 2 is written; the files still hold iteration 2's state."""
    for run in ("sync", "async"):
        assert checkpoint.read_tracker(runs / run / "checkpoints") == 4
        # Every staged save was renamed into place.
        assert not list((runs / run / "checkpoints").glob(".iter_*")), run
    assert _losses(runs / "sync") == _losses(runs / "async")
    for it in (2, 4):
        want = _tensors(checkpoint.iter_dir(runs / "sync" / "checkpoints", it), tmp_path / "s")
        got = _tensors(checkpoint.iter_dir(runs / "async" / "checkpoints", it), tmp_path / "a")
        assert sorted(got) == sorted(want) and len(want) > 10
        for key in want:
            assert torch.equal(got[key], want[key]), (it, key)


def test_writer_killed_during_async_save_keeps_the_previous_checkpoint(train_run, tmp_path):
    proc = train_run(tmp_path, *COMMON, "checkpoint.async_save=true", rc=1, env={"GTP_RECIPES_FAULT": "kill:async_write:4:1"})
    assert "injected fault kill:async_write:4:1" in proc.stdout
    assert re.search(r"error: worker rank \d failed", proc.stdout), proc.stdout[-2000:]
    root = tmp_path / "checkpoints"
    assert checkpoint.read_tracker(root) == 2, "the tracker must still name the last complete save"
    # Nothing of the failed save was renamed into place: only the hidden staging dir is left.
    assert not checkpoint.iter_dir(root, 4).exists()
    assert not (checkpoint.staging_dir(root, 4) / ".metadata").exists()
    assert checkpoint.iter_dir(root, 2).is_dir()
