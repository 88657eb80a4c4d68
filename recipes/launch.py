"""From a composed Hydra config to running workers.

:func:`run` validates the whole config in the Hydra process, writes the resolved config into the
job's output dir, then either starts ``nproc_per_node`` workers on this machine with torch's
elastic launcher (torchrun's library API) or, when RANK/WORLD_SIZE are already set (torchrun, or
a task of a submitit job: Slurm across nodes), runs this process as that rank.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from recipes.worker import LAUNCHER_PID_ENV, RESOLVED_CONFIG

# A worker that died takes the others down within this many seconds (elastic agent's monitor).
MONITOR_INTERVAL_S = 0.5


def write_resolved_config(cfg, output_dir: str) -> Path:
    """Write ``cfg`` with every interpolation resolved to ``<output_dir>/resolved_config.yaml``
    (atomically and durably, through a unique temp file: several writers never collide)."""
    from recipes.checkpoint import write_durable

    path = Path(output_dir) / RESOLVED_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every task of a submitit job may write it: write_durable uses a temp name per writer.
    write_durable(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path


CLAIM = ".job_claim"


def claim_job_dir(output_dir) -> None:
    """Claim ``output_dir`` for this run: create ``<output_dir>/.job_claim`` exclusively, holding
    this process's host and pid. A claim by a live process on this host (two runs started in the
    same second share Hydra's default ``outputs/<date>/<time>``) is refused; a stale one (its
    process is gone) is taken over. The claim is removed when this process exits.

    Raises:
        ConfigError: naming the dir and the process that holds it.
    """
    import atexit
    import socket

    from recipes.validate import ConfigError

    path = Path(output_dir) / CLAIM
    path.parent.mkdir(parents=True, exist_ok=True)
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = path.read_text().split()
            host, pid = (holder + ["", "0"])[:2]
            alive = host == socket.gethostname() and pid.isdigit() and _pid_alive(int(pid))
            if alive or host != socket.gethostname():
                raise ConfigError(
                    f"job dir {output_dir} is in use by another run (process {pid} on "
                    f"{host or '?'}); start again a second later or set hydra.run.dir=OTHER_DIR"
                ) from None
            path.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        atexit.register(lambda: path.unlink(missing_ok=True))
        return
    raise ConfigError(f"job dir {output_dir} is in use by another run; set hydra.run.dir=OTHER_DIR")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch_local(config_path: Path, nproc: int) -> None:
    """Start ``nproc`` workers on this machine and wait for them.

    Raises:
        SystemExit(1): a worker failed; its error (the first failure) is printed first.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
    )
    # Each worker has the kernel kill it when this process ends (recipes.lifetime): the elastic
    # agent starts them in sessions of their own, where nothing else would reach them.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        elastic_launch(config, sys.executable)("-m", "recipes.worker", str(config_path))
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda item: _failure_order(*item))
        for i, (rank, failure) in enumerate(failures):
            head = "error" if i == 0 else "then"
            print(f"\n{head}: worker rank {rank} failed (exit code {failure.exitcode}):",
                  file=sys.stderr)
            print(_failure_message(failure), file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        os.environ.pop(LAUNCHER_PID_ENV, None)  # for the workers of this launch only


# Errors a rank raises because *another* rank went away: they are consequences, not causes.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _failure_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    if failure.exitcode < 0 and not failure.error_file_data:
        return f"killed by signal {-failure.exitcode} (no Python error: the process died)"
    return str(message)


def _failure_order(rank: int, failure) -> tuple:
    """Sort key putting the root cause first: a rank that died of a signal other than the
    launcher's own SIGTERM, then a rank that raised an error other than a lost peer, then ranks
    the launcher stopped or that lost their peer; ties by time, then rank."""
    no_error = failure.exitcode < 0 and not failure.error_file_data
    died = no_error and failure.exitcode != -signal.SIGTERM
    consequence = (no_error and not died) or any(s in str(failure.message) for s in _PEER_LOST)
    return (0 if died else 2 if consequence else 1, failure.timestamp, rank)


def rank_env_from_submitit() -> dict | None:
    """torchrun-style variables for this process when it is a task of a submitit job (Slurm, or
    submitit's local executor), else None.

    From ``submitit.JobEnvironment()``: ``RANK`` = global_rank, ``LOCAL_RANK`` = local_rank,
    ``WORLD_SIZE`` = num_tasks (nodes x tasks_per_node), ``MASTER_ADDR`` = the job's first host
    and ``MASTER_PORT`` = a port derived from the job id (the same on every task, different for
    jobs sharing a node).
    """
    if not any(k.startswith("SUBMITIT_") for k in os.environ):
        return None
    import submitit

    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        return None
    job_id = str(env.job_id)
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return {
        "RANK": str(env.global_rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "MASTER_ADDR": env.hostnames[0],
        "MASTER_PORT": str(20000 + int(digits[-6:]) % 20000),
    }


def run(cfg) -> None:
    """Validate ``cfg``, settle the checkpoint to load and the save dir, write the resolved config
    (what runs), and run the job (local launch or as one rank); with ``train.dry_run`` only
    validate and print the dry-run report.

    Under a submitit launcher (``hydra/launcher=slurm`` or ``submitit_local``) every task of the
    job calls this and runs as its global rank (:func:`rank_env_from_submitit`).

    Raises:
        ConfigError, CheckpointError: bad input, before any worker starts.
    """
    from recipes.checkpointer import NothingToTrain, prepare_resume

    submitit_env = rank_env_from_submitit()
    if submitit_env is not None:
        os.environ.update(submitit_env)
    from recipes import prelaunch

    layout = prelaunch.check(cfg)
    if cfg.train.get("dry_run", False):
        from recipes.dry_run import report

        print(report(cfg, layout), flush=True)
        return
    as_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    is_rank0 = not as_rank or int(os.environ["RANK"]) == 0
    try:
        prepare_resume(cfg, layout)
    except NothingToTrain as exc:
        if is_rank0:
            print(f"> {exc}", flush=True)
        return
    prelaunch.clamp_warmup(cfg, resume_settled=True)  # the schedule that will run
    if not as_rank:
        claim_job_dir(cfg.output_dir)
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    # Under torchrun/Slurm one rank writes the record; every rank runs its own resolved copy
    # (the worker stops the job if the ranks disagree on the run dirs).
    config_path = Path(cfg.output_dir) / RESOLVED_CONFIG
    if is_rank0:
        config_path = write_resolved_config(resolved, cfg.output_dir)
        print(f"> job output dir: {cfg.output_dir}\n> layout: {layout.describe()}", flush=True)
    if as_rank:
        from recipes.worker import run as run_worker

        run_worker(resolved)
    else:
        launch_local(config_path, cfg.parallelism.nproc_per_node)
