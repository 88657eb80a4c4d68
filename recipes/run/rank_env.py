"""The launchers' variables in ``train.py``'s environment: torchrun's, checked before launch, and
the scheduler's job id (:func:`job_id`, :mod:`ckpt.io.job`'s) that makes a requeued job the same
run.

torchrun (and a submitit task, :func:`recipes.run.launch.rank_env_from_submitit`) sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` together; this process then runs as that rank.
Without ``RANK`` it is a local run of ``parallelism.nproc_per_node`` processes, or of
``WORLD_SIZE`` when that is set (said, naming where it came from). Anything else is a stray
variable: refused, naming it and the fix.
"""

from __future__ import annotations

import os

from omegaconf import open_dict

from ckpt.io.job import job_id  # noqa: F401 - the launcher's and the tests' name for it
from recipes.config.errors import ConfigError

# Set by train.py's local launch (recipes.run.launch.launch_local) to its pid: its workers die with it.
LAUNCHER_PID_ENV = "GTP_RECIPES_LAUNCHER_PID"
_LOCAL = "for a local run of parallelism.nproc_per_node processes"


def check(cfg) -> str | None:
    """Refuse a malformed or stray torchrun variable; for a local run whose ``WORLD_SIZE`` (from
    the environment) differs from ``parallelism.nproc_per_node``, set the latter to it.

    Returns:
        A note saying the world came from ``WORLD_SIZE``, or None.

    Raises:
        ConfigError: naming the variable, its value and the fix.
    """
    env = os.environ
    world, rank = env.get("WORLD_SIZE"), env.get("RANK")
    if world is not None and not (world.isdigit() and int(world) >= 1):
        raise ConfigError(f"WORLD_SIZE={world!r} (from the environment) is not a process count: "
                          f"torchrun and Slurm set it to an integer >= 1; unset WORLD_SIZE "
                          f"{_LOCAL}, or start with torchrun")
    if rank is not None:
        if world is None:
            raise ConfigError(
                f"RANK={rank} is set in the environment but WORLD_SIZE is not: a stray RANK "
                f"(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together); unset "
                f"RANK {_LOCAL}, or start with torchrun")
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ConfigError(
                f"RANK={rank} and WORLD_SIZE={world} are set in the environment but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: this process "
                f"cannot join a process group; unset RANK WORLD_SIZE {_LOCAL}, or start with "
                f"torchrun (it sets all four)")
        if not (rank.isdigit() and int(rank) < int(world)):
            raise ConfigError(f"RANK={rank!r} (from the environment) is invalid: torchrun sets "
                              f"0 <= RANK < WORLD_SIZE={world}; unset RANK WORLD_SIZE {_LOCAL}, "
                              f"or start with torchrun")
        return None
    nproc = int(cfg.parallelism.nproc_per_node)
    if world is None or int(world) == nproc:
        return None
    with open_dict(cfg):
        cfg.parallelism.nproc_per_node = int(world)
    return (f"> world size {world} from WORLD_SIZE={world} in the environment (not "
            f"parallelism.nproc_per_node={nproc}): {world} processes on this machine; unset "
            f"WORLD_SIZE to run parallelism.nproc_per_node")


def cpu_threads_per_rank(nproc: int) -> int:
    """The intra-op CPU threads (``OMP_NUM_THREADS``) each of ``nproc`` ranks started on this
    machine gets: the cores this process may run on (its affinity mask) shared evenly, at least
    one. torch's default gives every rank every core, so ``nproc`` ranks run ``nproc`` times as
    many OpenMP threads as there are cores, spinning against each other (torchrun sets 1 for
    the same reason)."""
    return max(1, available_cores() // max(1, int(nproc)))


def available_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (Linux), else
    every core (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
