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


def test_without_an_affinity_mask_every_core_is_available(monkeypatch):
    """macOS has no ``os.sched_getaffinity``: the launcher counts every core there."""
    from recipes.run.rank_env import cpu_threads_per_rank

    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_per_rank(2) == 4


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


class _Task:  # what rank_env_from_submitit reads of submitit.JobEnvironment()
    job_id, global_rank, local_rank, num_tasks, num_nodes, hostnames = "77", 1, 1, 4, 2, ["h"]


def test_submitit_tasks_free_to_use_every_core_share_them(monkeypatch):
    """submitit's local executor starts each task as a process free to run on every core (two
    tasks on two cores ran four threads, and a requeued job resumed off its uninterrupted
    trajectory's rounding); a Slurm task bound to its own cores keeps them; a set value
    stands."""
    import submitit

    from recipes.run.launch import rank_env_from_submitit

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(submitit, "JobEnvironment", _Task)
    assert rank_env_from_submitit()["OMP_NUM_THREADS"] == str(max(1, CORES // 2))  # 2 a node
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert "OMP_NUM_THREADS" not in rank_env_from_submitit()
    monkeypatch.undo()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setattr(submitit, "JobEnvironment", _Task)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in rank_env_from_submitit()
