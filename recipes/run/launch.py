"""From a composed Hydra config to running workers.

:func:`run` validates the whole config in the Hydra process, writes the resolved config into the
job's output dir, then either starts ``nproc_per_node`` workers on this machine with torch's
elastic launcher (torchrun's library API) or, when RANK/WORLD_SIZE are already set (torchrun, or
a task of a submitit job: Slurm across nodes), runs this process as that rank.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from ckpt.io import lease, write_durable
from ckpt.io.lease import RUN_ID_ENV, Lease, LeaseHeld
from recipes.checkpoint.auto import AUTO, resolve_auto_load
from recipes.checkpoint.policy import NothingToTrain, prepare_resume, take_checkpoint_fields
from recipes.config import prelaunch, refusal
from recipes.config.errors import ConfigError
from recipes.config.schema import RESOLVED_CONFIG
from recipes.metrics.console import STARTED_ENV
from recipes.run import preemption, pretrained, rank_env
from recipes.run.preemption import (child_pids, forward_to_workers, interrupted_message,
                                    stop_forwarding)
from recipes.run.rank_env import LAUNCHER_PID_ENV, available_cores, cpu_threads_per_rank, job_id

# A worker that died takes the others down within this many seconds (elastic agent's monitor).
MONITOR_INTERVAL_S = 0.5


def write_resolved_config(cfg, output_dir: str) -> Path:
    """Write ``cfg`` with every interpolation resolved to ``<output_dir>/resolved_config.yaml``
    (atomically and durably, through a unique temp file: several writers never collide)."""
    path = Path(output_dir) / RESOLVED_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every task of a submitit job may write it: write_durable uses a temp name per writer.
    write_durable(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path


CLAIM = ".job_claim"
# The leases this process holds for the job in flight (released when run() returns).
_HELD: list = []


def claim_job_dir(output_dir, wait: bool = True) -> str | None:
    """Claim ``output_dir`` for this run: ``<output_dir>/.job_claim``, a lease
    (:class:`ckpt.io.lease.Lease`: run id, job id, host, pid, heartbeat) taken exclusively. A
    live holder is refused (:func:`settle_job_dir` moves a run of the default
    ``outputs/<date>/<time>`` to a free ``-1``, ``-2``, ... dir instead); a stale one
    (:func:`ckpt.io.lease.stale_reason`: its process gone, its heartbeat stopped; this same
    Slurm/submitit job before a requeue once its process is gone or, on another host, its
    heartbeat stopped: waited for unless ``wait`` is False) is taken over. Removed when the job
    ends (:func:`run`) or this process exits.

    Returns:
        A note naming a stale holder taken over, or None.

    Raises:
        ConfigError: naming the dir, the run that holds it and the file to remove.
    """
    claim = Lease(Path(output_dir) / CLAIM)
    try:
        note = claim.take("job dir", wait=wait)
    except LeaseHeld as exc:
        raise ConfigError(f"{exc} (or set hydra.run.dir=OTHER_DIR)") from None
    _HELD.append(claim)
    return note


def _holds_claim(output_dir) -> bool:
    return any(held.path == Path(output_dir) / CLAIM and held.held() for held in _HELD)


# conf/config.yaml's hydra.run.dir: a run started with it gets a dir of its own (settle_job_dir).
DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
# Runs started in one second on one default dir: the base dir, then <dir>-1 .. <dir>-MAX_SUFFIX.
MAX_SUFFIX = 99


def _default_run_dir(cfg) -> bool:
    """This single run's dir is Hydra's default ``outputs/<date>/<time>``: not set by
    ``hydra.run.dir`` or ``output_dir`` (command line or config), not a multirun's job dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    hydra_cfg = HydraConfig.get()
    run_dir = OmegaConf.to_container(hydra_cfg.run, resolve=False).get("dir")
    output_dir = OmegaConf.to_container(cfg, resolve=False).get("output_dir")
    return (hydra_cfg.mode == RunMode.RUN and run_dir == DEFAULT_RUN_DIR
            and output_dir == "${hydra:runtime.output_dir}")


def settle_job_dir(cfg) -> str | None:
    """Claim the job dir (:func:`claim_job_dir`) before anything of this run is written there.

    A run of the default ``outputs/<date>/<time>`` whose dir another live run holds (both
    started in the same second) takes ``<dir>-1``, ``<dir>-2``, ... instead: the first claim
    that succeeds names it (an exclusive create: two runs never share one, and neither is
    refused), ``cfg.output_dir`` and the dirs under it follow, and a note names the dir taken.
    Such a run (re)writes Hydra's ``.hydra/`` record into its dir: a run started in the same
    second may have written its own over it. An explicit dir (``hydra.run.dir``, a multirun's
    job dir) held by a live run is refused. Nothing is claimed for a dry run or for one rank of a
    torchrun/Slurm job (:func:`run_job` as before).

    Returns:
        The notes to print (the dir taken instead, a stale holder taken over), or None.

    Raises:
        ConfigError: an explicit dir held by a live run, or every suffix up to
            :data:`MAX_SUFFIX` held.
    """
    if cfg.train.get("dry_run", False) or "RANK" in os.environ or any(
            k.startswith("SUBMITIT_") for k in os.environ):
        return None
    base = str(cfg.output_dir)
    if not _default_run_dir(cfg):
        return claim_job_dir(base)
    out, note = claim_free_dir(base)
    notes = [note]
    if out != base:
        _move_run_dir(out)
        notes.insert(0, f"> note: job dir {base} is in use by another run started in the same "
                        f"second; this run's job dir is {out}")
    _write_hydra_record(cfg, out)
    return "\n".join(n for n in notes if n) or None


def claim_free_dir(base: str) -> tuple[str, str | None]:
    """Claim the first of ``base``, ``base-1`` .. ``base-MAX_SUFFIX`` no live run holds
    (:func:`claim_job_dir`; a live holder of this job's id on another host is another run here,
    not this job before a requeue: not waited for).

    Returns:
        ``(dir claimed, note naming a stale holder taken over or None)``.

    Raises:
        ConfigError: every one of them held by a live run.
    """
    for i in range(MAX_SUFFIX + 1):
        out = base if i == 0 else f"{base}-{i}"
        try:
            return out, claim_job_dir(out, wait=False)
        except ConfigError:
            continue
    raise ConfigError(f"job dir {base} and {base}-1 .. {base}-{MAX_SUFFIX} are all in use by "
                      f"live runs; set hydra.run.dir=OTHER_DIR")


def _move_run_dir(out: str) -> None:
    """Point Hydra's ``runtime.output_dir`` (and so ``cfg.output_dir``, ``checkpoint.save``,
    every ``${hydra:runtime.output_dir}``) at ``out``."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    runtime = HydraConfig.get().runtime
    with read_write(runtime):
        runtime.output_dir = out


def _write_hydra_record(cfg, out: str) -> None:
    """Hydra's ``.hydra/`` files of this run in ``out``, as Hydra writes them."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is None:
        return
    record = Path(out) / str(hydra_cfg.output_subdir)
    record.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", HydraConfig.instance().cfg),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        (record / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def take_save_dir(cfg, is_rank0: bool) -> str | None:
    """One live writer per ``checkpoint.save`` (:mod:`ckpt.io.lease`): global rank 0 takes its
    writer lease; the other ranks of a torchrun/Slurm job refuse a live lease of another job.

    Returns:
        A note naming a stale holder taken over, or None.

    Raises:
        LeaseHeld: naming the dir, the other job and the file to remove.
    """
    root = cfg.checkpoint.save
    if not root:
        return None
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # prepare_resume names the dir that cannot be written
    if is_rank0:
        try:
            held, note = lease.take_save_dir(root)
        except OSError:
            return None  # a dir that cannot be written: prepare_resume names it
        _HELD.append(held)
        return note
    holder = lease.read(Path(root) / lease.WRITER_LEASE)
    mine = job_id()
    # Another host's holder is watched as rank 0 watches it (ckpt.io.lease.stale_reason).
    if holder is not None and holder.get("job_id") != mine and lease.stale_reason(
            holder, mine, lease.STALE_AFTER_S) is None:
        raise lease.LeaseHeld(f"checkpoint.save {root} is in use by {lease.describe(holder)}; "
                              f"use another dir, or, if that run is gone, remove "
                              f"{Path(root) / lease.WRITER_LEASE}")
    return None


def launch_local(config_path: Path, nproc: int, exit_signals: list[int] = (),
                 save_root=None) -> None:
    """Start ``nproc`` workers on this machine and wait for them. ``exit_signals`` received
    here are passed on to the workers, which save and exit 0
    (:func:`recipes.run.preemption.forward_to_workers`).

    Raises:
        SystemExit(1): a worker failed; its error (the first failure) is printed first.
        SystemExit(2): a worker refused its input (:mod:`recipes.config.refusal`): its message, once.
        SystemExit(128 + signal): Ctrl-C (or SIGHUP/SIGQUIT): torch's agent stopped the
            workers; the last complete checkpoint of ``save_root`` is named.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    previous = {signum: signal.getsignal(signum) for signum in exit_signals}
    config = LaunchConfig(
        signals_to_handle=forward_to_workers(list(exit_signals),
                                             lambda: child_pids("recipes.run.worker")),
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
    # Each worker has the kernel kill it when this process ends (ckpt.io.lifetime): the elastic
    # agent starts them in sessions of their own, where nothing else would reach them.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    threads_given = "OMP_NUM_THREADS" in os.environ  # the user's choice stands
    if not threads_given:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(nproc))
    # The agent logs each failed or stopped worker; the summary below says it once.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "recipes.run.worker", str(config_path))
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda item: _failure_order(*item))
        if refusal.is_refusal(failures[0][1]):  # bad input: its one message, printed once
            for text in _refusals(failures):
                print(f"error: {text}", file=sys.stderr)
            raise SystemExit(refusal.EXIT_CODE) from None
        said: dict = {}  # message -> the rank that said it: each message once
        for i, (rank, failure) in enumerate(failures):
            head = "error" if i == 0 else "then"
            text = _failure_message(failure)
            # the same message under another class name (rank 0's LeaseHeld, the others'
            # CheckpointError for one refused save) is the same error
            key = re.sub(r"^\w+: ", "", text)
            if key in said:
                print(f"\n{head}: worker rank {rank} failed (exit code {failure.exitcode}): "
                      f"the same error as rank {said[key]}", file=sys.stderr)
                continue
            said[key] = rank
            print(f"\n{head}: worker rank {rank} failed (exit code {failure.exitcode}):",
                  file=sys.stderr)
            print(text, file=sys.stderr)
        raise SystemExit(1) from None
    except SignalException as exc:
        print(interrupted_message(exc.sigval.name, save_root), file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        agent_log.setLevel(agent_level)
        stop_forwarding()  # a multirun's next job has workers of its own
        os.environ.pop(LAUNCHER_PID_ENV, None)  # for the workers of this launch only
        if not threads_given:
            os.environ.pop("OMP_NUM_THREADS", None)
        for signum, handler in previous.items():  # a multirun's next job, or none
            signal.signal(signum, handler)


# Errors a rank raises because *another* rank went away or failed: consequences, not causes.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "failed on another rank")


def _refusals(failures: list) -> list[str]:
    """The distinct messages of the refusals among ``failures`` (sorted by
    :func:`_failure_order`), the first always; a consequence of another rank's failure left out."""
    texts = []
    for i, (_, failure) in enumerate(failures):
        text = _failure_message(failure)
        if refusal.is_refusal(failure) and text not in texts and (
                i == 0 or _failure_order(0, failure)[0] != 2):
            texts.append(text)
    return texts


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


def run_as_rank(resolved, plan) -> None:
    """Run this process as its torchrun/Slurm rank (:func:`recipes.run.worker.run`). A failed save or
    a lost peer during training ends it with one ``error:`` line and exit 1, no traceback
    (:func:`recipes.run.worker.failure_text`; ``train.py`` would take a ``CheckpointError`` for a
    refusal of its input, exit 2); any other error raises.

    Raises:
        SystemExit(1): such a failure, said.
    """
    from recipes.run.worker import failure_text, run as run_worker

    try:
        run_worker(resolved, plan)
    except Exception as exc:
        text = failure_text(exc)
        if text is None:
            raise
        print(f"error: {text}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def rank_env_from_submitit() -> dict | None:
    """torchrun-style variables for this process when it is a task of a submitit job (Slurm, or
    submitit's local executor), else None.

    From ``submitit.JobEnvironment()``: ``RANK`` = global_rank, ``LOCAL_RANK`` = local_rank,
    ``WORLD_SIZE`` = num_tasks (nodes x tasks_per_node), ``MASTER_ADDR`` = the job's first host
    and ``MASTER_PORT`` = a port derived from the job id (the same on every task, different for
    jobs sharing a node); ``OMP_NUM_THREADS`` (unless set) = the machine's cores / tasks per node
    when a task may run on every core.
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
    ranks = {
        "RANK": str(env.global_rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "MASTER_ADDR": env.hostnames[0],
        "MASTER_PORT": str(20000 + int(digits[-6:]) % 20000),
    }
    # Tasks free to run on every core (submitit's local executor; Slurm binds its tasks) share
    # them as train.py's own workers do.
    if "OMP_NUM_THREADS" not in os.environ and available_cores() == os.cpu_count():
        ranks["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(env.num_tasks // env.num_nodes))
    return ranks


def run(cfg, overrides: list[str] | None = None) -> None:
    """:func:`run_job`, then give back the dir leases it took (a multirun runs many jobs in one
    process; they are also given back at exit)."""
    try:
        run_job(cfg, overrides)
    finally:
        while _HELD:
            _HELD.pop().release()
        os.environ.pop(RUN_ID_ENV, None)  # the next job of a multirun is another run


def run_job(cfg, overrides: list[str] | None = None) -> None:
    """Validate ``cfg``, settle the checkpoint to load and the save dir, write the resolved config
    (what runs), and run the job (local launch or as one rank); with ``train.dry_run`` only
    validate and print the dry-run report.

    ``overrides`` are the command line's (default: Hydra's, :func:`recipes.config.schema.given_overrides`):
    the model and tokenizer fields they give are kept where a resume or ``checkpoint.pretrained``
    would take the checkpoint's. A caller composing configs outside a Hydra app passes its own.

    Under a submitit launcher (``hydra/launcher=slurm`` or ``submitit_local``) every task of the
    job calls this and runs as its global rank (:func:`rank_env_from_submitit`).

    Raises:
        ConfigError, CheckpointError: bad input, before any worker starts.
    """
    os.environ[STARTED_ENV] = str(time.time())  # the workers' summary counts from here
    submitit_env = rank_env_from_submitit()
    if submitit_env is not None:
        os.environ.update(submitit_env)

    world_note = rank_env.check(cfg)  # a stray RANK or a bad WORLD_SIZE: refused here
    as_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    is_rank0 = not as_rank or int(os.environ["RANK"]) == 0
    dry_run = cfg.train.get("dry_run", False)
    notes = [world_note] + ([] if dry_run else [take_save_dir(cfg, is_rank0)])
    auto = cfg.checkpoint.get("load") == AUTO
    notes.append(resolve_auto_load(cfg, is_rank0 and not dry_run))
    for note in notes:
        if note and is_rank0:
            print(note, flush=True)
    # model fields from checkpoint.pretrained, before validation; a requeued fine-tune
    # (checkpoint.load=auto found its own save) resumes that save.
    pretrained.apply_source(cfg, overrides, requeued=auto)
    lr_note = pretrained.lr_note(cfg, overrides)
    if lr_note and is_rank0:
        print(lr_note, flush=True)
    from recipes.data.tokenizers import check_before_launch

    check_before_launch(cfg.data)

    plan = None
    if cfg.checkpoint.get("load") is not None:
        # Lazy (start-up time): megatron is imported before launch only by a run that loads.
        from ckpt.io.manager import ResumePlan

        # The one resolution of what this process loads (ckpt/io/manager.py).
        plan = ResumePlan.resolve(cfg.checkpoint, repair=is_rank0 and not dry_run)
        note = take_checkpoint_fields(cfg, plan, overrides)
        if note:
            if is_rank0:
                print(note, flush=True)
            check_before_launch(cfg.data)  # a tokenizer taken from the checkpoint, too
    parallel_dims = prelaunch.check(cfg, plan=plan)
    if not dry_run:  # the dry run's sizes, against this machine's memory on CPU
        from recipes.dry_run.sizes import check_host_memory

        check_host_memory(cfg, parallel_dims)
    if dry_run:
        from recipes.dry_run import report

        print(report(cfg, parallel_dims), flush=True)
        return
    try:
        prepare_resume(cfg, parallel_dims, plan, auto=auto)
    except NothingToTrain as exc:
        if is_rank0:
            print(f"> {exc}", flush=True)
        return
    prelaunch.clamp_warmup(cfg, resume_settled=True)  # the schedule that will run
    if not as_rank and not _holds_claim(cfg.output_dir):  # train.py claimed it already
        note = claim_job_dir(cfg.output_dir)
        if note:
            print(note, flush=True)
    pretrained.prepare(cfg, is_rank0)
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    # Under torchrun/Slurm one rank writes the record; every rank runs its own resolved copy
    # (the worker stops the job if the ranks disagree on the run dirs).
    config_path = Path(cfg.output_dir) / RESOLVED_CONFIG
    if is_rank0:
        config_path = write_resolved_config(resolved, cfg.output_dir)
        print(f"> job output dir: {cfg.output_dir}\n> layout: {parallel_dims.describe()}",
              flush=True)

    # The command that continues it (a submitit job is requeued by submitit instead).
    if submitit_env is None and not any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        os.environ[preemption.CONTINUE_ENV] = preemption.continue_command(sys.argv, cfg.output_dir)
    if as_rank:
        run_as_rank(resolved, plan)
    else:
        launch_local(config_path, cfg.parallelism.nproc_per_node,
                     preemption.exit_signals(cfg.train), cfg.checkpoint.save)
