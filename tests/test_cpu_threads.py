"""CPU threads per rank: ``nproc`` ranks on one machine share its cores.

torch gives every process every core by default, so two gloo ranks on two cores ran four
OpenMP threads spinning against each other (the suite's ``test_resume_exact.py`` took 165 s
instead of 71 s under load). train.py's launcher gives each worker ``OMP_NUM_THREADS`` = cores /
ranks unless the user set it; the test worlds do the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multiproc import run_distributed

CORES = len(os.sched_getaffinity(0))


def _captured_env(monkeypatch, nproc: int) -> dict:
    import torch.distributed.launcher.api as api

    from recipes.run import launch

    seen = {}

    def capture(config, entrypoint):
        def run(*args):
            seen.update(os.environ)
        return run

    monkeypatch.setattr(api, "elastic_launch", capture)
    launch.launch_local(Path("unused.yaml"), nproc)
    return seen


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_launcher_shares_the_cores_among_its_workers(monkeypatch, nproc):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = _captured_env(monkeypatch, nproc)
    assert seen["OMP_NUM_THREADS"] == str(max(1, CORES // nproc))
    assert "OMP_NUM_THREADS" not in os.environ  # for this launch's workers only


def test_a_users_omp_num_threads_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _captured_env(monkeypatch, 2)["OMP_NUM_THREADS"] == "3"
    assert os.environ["OMP_NUM_THREADS"] == "3"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def test_test_world_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_distributed(_threads, 2) == [max(1, CORES // 2)] * 2
