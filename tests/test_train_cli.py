"""train.py as a user runs it: multirun, and bad input refused with a clear message; bf16
training and its resume at another layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.metrics.logger import read_metrics


def test_multirun_gives_each_job_its_own_workers_and_dir(train_run, tmp_path):
    proc = train_run(tmp_path, "parallelism=tp1,tp2", "train.train_iters=2",
                     "checkpoint.save_interval=0", "checkpoint.save_at_end=false", multirun=True)
    jobs = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert len(jobs) == 2, (jobs, proc.stdout[-3000:])
    layouts = []
    for job in jobs:
        rows, events = read_metrics(job)
        assert [r["iteration"] for r in rows] == [1, 2]
        layouts.append(events[0]["layout"])
    assert sorted((l["tensor_model_parallel_size"], l["world_size"]) for l in layouts) == [(1, 1), (2, 2)]


@pytest.fixture(scope="module")
def trained(train_jobs, tmp_path_factory) -> Path:
    """The runs this file's other tests load or read, trained in one world as torchrun's
    workers train them (tests/helpers/inworld.py): ``src`` (the default model, 2 iterations), a
    bf16 run ``a`` saved under GTP and its resume ``b`` at tp2 without GTP. What train.py itself
    does with them (refusing a load) still goes through train.py."""
    root = tmp_path_factory.mktemp("trained")
    train_jobs([
        (root / "src", ["train.train_iters=2"]),
        (root / "a", ["precision=bf16", "gtp=tp2_align16", "train.train_iters=2",
                      "checkpoint.save_interval=2"]),
        (root / "b", ["precision=bf16", "parallelism=tp2", "train.train_iters=3",
                      f"checkpoint.load={root}/a/checkpoints"]),
    ])
    return root


def _no_worker_started(out: Path):
    assert not (out / "metrics.jsonl").exists()


def test_unknown_key_is_refused(train_run, tmp_path):
    proc = train_run(tmp_path, "model.hidden_sise=96", rc=1)
    assert "hidden_sise" in proc.stdout
    _no_worker_started(tmp_path)


def test_impossible_world_size_is_refused_before_launch(train_run, tmp_path):
    proc = train_run(tmp_path, "parallelism=tp2", "parallelism.nproc_per_node=3", rc=2)
    assert "error: world size 3 is not divisible by tensor_model_parallel_size=2" in proc.stdout
    _no_worker_started(tmp_path)


def test_empty_checkpoint_dir_is_refused_before_launch(train_run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = train_run(tmp_path / "out", f"checkpoint.load={empty}", rc=2)
    assert f"checkpoint.load='{empty}' has no latest_checkpointed_iteration.txt" in proc.stdout
    _no_worker_started(tmp_path / "out")


def test_checkpoint_of_another_model_shape_is_refused_before_launch_naming_the_field(
        trained, train_run, tmp_path):
    src = trained / "src"
    proc = train_run(tmp_path / "dst", "model.hidden_size=96", f"checkpoint.load={src}/checkpoints",
                     rc=2)
    assert "holds a differently shaped model" in proc.stdout
    assert "model.hidden_size=96 (checkpoint: 72); set model.hidden_size=72" in proc.stdout
    _no_worker_started(tmp_path / "dst")


def test_bf16_trains_and_resumes_at_another_layout(trained):
    """bf16 weights with megatron's fp32 main params (Float16Module + Float16Optimizer) on CPU,
    saved under GTP (logical format) and resumed at tp2 without GTP."""
    rows, _ = read_metrics(trained / "b")
    assert [r["iteration"] for r in rows] == [3]
    assert 0 < rows[0]["grad-norm"] < 100 and rows[0]["lm loss"] < 6
