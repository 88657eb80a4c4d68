"""Train several jobs, one after another, in one multi-process gloo world.

A ``train.py`` job on CPU spends most of its time starting processes (the launcher, then every
worker importing torch and megatron-core) rather than training a tiny model for a few
iterations. Tests that need many short jobs of the same world size run them here instead: each
rank of one :func:`multiproc.run_distributed` world runs every job through
``recipes.run.launch.run`` as a torchrun/Slurm rank does (``RANK``/``WORLD_SIZE`` set: the same
validation, resume plan, resolved config and ``recipes.run.worker.run`` as ``train.py`` under
torchrun, with the job's overrides as its command line), then drops the job's process groups and megatron's globals before the next one.

    from inworld import train_jobs

    results = train_jobs(cache, [(dir_a, ["parallelism=dp2"]), (dir_b, [...])])
    results[0].stdout      # rank 0's console of job 0 ("> layout ...", resume table, ...)

Consecutive jobs of the same world size (``parallelism.nproc_per_node``, as ``train.py`` would
start) share a world; the jobs run in the order given, so a job may load an earlier one's save.

Every job must succeed (a failure raises, naming the job and its console): refusals before
launch are tested through ``train.py`` itself, where the exit code is part of the behaviour.
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

from multiproc import reset_model_parallel, run_distributed

REPO = Path(__file__).resolve().parents[2]
# Every test job's defaults (train_run's and train_jobs'): the tiny model, few iterations, one
# warmup step.
FAST = ("train.train_iters=4", "optim.lr_warmup_iters=1", "logger=none")


@dataclass
class Job:
    """One finished job: rank 0's console (what it wrote to ``sys.stdout``/``sys.stderr``
    while it ran; not the other ranks', not the launcher's, not output written by C++ or below
    Python's streams): a test may look for a line in it, never conclude from a line's absence."""

    out_dir: Path
    stdout: str


def job_overrides(out_dir, cache_dir, overrides) -> list[str]:
    """The command line of ``python train.py hydra.run.dir=OUT_DIR ...FAST overrides``, with
    Hydra's run-time interpolations (output dir, save dir) filled in as Hydra fills them."""
    given = {o.split("=", 1)[0] for o in overrides}
    filled = [f"{key}={value}" for key, value in (
        ("output_dir", out_dir), ("checkpoint.save", f"{out_dir}/checkpoints"),
        ("data.cache_dir", cache_dir)) if key not in given]
    return [*filled, *FAST, *overrides]


def compose_job(out_dir, cache_dir, overrides) -> object:
    """The config of :func:`job_overrides`' command line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from recipes.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=job_overrides(out_dir, cache_dir, overrides))
    return cfg


def forget_job_globals() -> None:
    """What one job leaves in its processes that a later job of the same world must not see,
    beyond megatron's parallel state and GTP globals (``multiproc.reset_model_parallel``):
    megatron's MoE metrics tracker (sized by the job's layers, holding its groups) and the
    worker's "this process trains" mark (an error before the next job trains is a refusal
    again). The console filters of ``recipes.metrics.console.quiet_megatron`` are replaced by the next
    job's own."""
    from megatron.core.transformer.moe import moe_logging

    from recipes.run import worker

    moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())
    worker._TRAINING.clear()


def world_size_of(cfg) -> int:
    """The processes ``train.py`` starts for ``cfg`` (``parallelism.nproc_per_node``)."""
    return int(cfg.parallelism.nproc_per_node)


def _jobs(jobs):
    import torch.distributed as dist

    from recipes.run import launch
    from recipes.config.schema import register_configs

    register_configs()  # the resolvers a composed config may still name
    rank = dist.get_rank()
    consoles = []
    for out_dir, overrides, cfg in jobs:
        assert world_size_of(cfg) == dist.get_world_size(), (out_dir, world_size_of(cfg))
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                # The command line, as Hydra gives train.py's (a resume keeps the model and
                # tokenizer fields it gives, takes the rest from the checkpoint).
                launch.run(cfg, overrides)
        except BaseException:  # noqa: BLE001 - name the job, keep its console
            raise RuntimeError(f"job {out_dir} ({' '.join(overrides)}) failed on rank {rank}:\n"
                               f"{buf.getvalue()[-4000:]}\n{traceback.format_exc()}") from None
        finally:
            os.environ.pop("GTP_RECIPES_CONTINUE", None)
            reset_model_parallel()
            forget_job_globals()
        dist.barrier()  # every rank done with this job's files before the next job starts
        consoles.append(buf.getvalue() if rank == 0 else "")
    return consoles


def train_jobs(cache_dir, jobs, timeout: float = 900) -> list[Job]:
    """Run ``jobs`` (``[(out_dir, [override, ...]), ...]``, in order), consecutive jobs of one
    world size in one world; return a :class:`Job` per job.

    Raises:
        multiproc.DistributedTestError: a job failed (its rank-0 console and traceback named).
    """
    # Composed once here, not on every rank: Hydra's compose costs more CPU than a tiny job's
    # training. Each rank gets a pickled copy, as a torchrun rank reads the resolved config.
    jobs = [(str(out), list(overrides)) for out, overrides in jobs]
    groups: list[tuple[int, list]] = []
    for out, overrides in jobs:
        cfg = compose_job(out, cache_dir, overrides)
        size = world_size_of(cfg)
        if not groups or groups[-1][0] != size:
            groups.append((size, []))
        groups[-1][1].append((out, job_overrides(out, cache_dir, overrides), cfg))
    consoles = []
    for size, group in groups:
        consoles += run_distributed(_jobs, size, group, timeout=timeout)[0]
    return [Job(Path(out), text) for (out, _), text in zip(jobs, consoles)]
