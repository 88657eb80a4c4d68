"""One training process: ``python -m recipes.run.worker RESOLVED_CONFIG.yaml``.

Started by ``train.py`` through torch's elastic launcher (or run directly under torchrun/Slurm,
with RANK/WORLD_SIZE/MASTER_ADDR set). Reads the resolved config that ``train.py`` wrote; never
runs Hydra.

megatron and the modules that import it are imported inside the functions (start-up time:
``recipes.run.launch`` imports this module before launch, for its constants).
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker: keep a signal that comes while torch is imported
    from recipes.run import preemption as _preemption

    _preemption.note_early()
    # Before megatron is imported: its import-time torch.compile costs seconds on every rank.
    from mcore_compat import lazy_compile as _lazy_compile

    _lazy_compile.install_if_supported()

import gc
import json
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from ckpt.format import safe_objects
from ckpt.format.records import IMPORTED_KEY, saved_layout
from mcore_compat import distrib_optimizer
from ckpt import io as checkpoint
from recipes.model import gtp_setup, moe, mtp, te
from recipes.model.build import build_model, count_parameters
from recipes.run import preemption, pretrained
from recipes.config import refusal
from ckpt.io import lineage
from recipes.checkpoint.policy import agree_load_iteration, planned_samples
from recipes.config.schema import RESOLVED_CONFIG, to_dict
from recipes.metrics.console import STARTED_ENV, format_summary, quiet_megatron
from recipes.data import build_iterators, build_tokenizer, build_train_iterator
from recipes.config.errors import ConfigError
from ckpt.io.lifetime import die_with_parent
from recipes.metrics.logger import MetricLogger, plan_wandb_run
from recipes.metrics.experts import attach_metrics
from recipes.run.optim import (apply_schedule_override, build_optimizer, build_scheduler,
                           layer_wise_param_layouts)
from recipes.run.preemption import part_of_interrupt
from recipes.run.pretrained import describe
from recipes.run.rank_env import LAUNCHER_PID_ENV
from recipes.config.validate import validate

# megatron and torch.distributed.checkpoint warn at import and on every save about optional
# GPU packages (apex, TE) and deprecations that do not apply on this path; keep the log readable.
for _module in ("megatron", "torch.distributed", "torch.utils.cpp_extension"):
    warnings.filterwarnings("ignore", module=_module)
# torch logs "No CUDA runtime is found" once per process on import: once per job is enough.
if int(os.environ.get("RANK", "0")) != 0:
    import logging

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

# Non-empty once this process trains (recipes.run.loop.train): no refusal after that.
_TRAINING: list = []


@dataclass
class RunState:
    """What the loop needs and the checkpoint restores."""

    model: Any
    optimizer: Any
    scheduler: Any
    data_iterator: Any
    num_microbatches: int
    iteration: int = 0
    consumed_samples: int = 0
    # recipes.data.ValidationBatches, or None without validation.
    validation: Any = None
    skipped: int = 0
    # The checkpoint's fixed train-state entries of this run (wandb_run_id, config, data_plan).
    train_state: dict = field(default_factory=dict)


def init_distributed() -> bool:
    """Join the process group from torchrun-style env vars (gloo on CPU, nccl on CUDA).

    Returns:
        Whether this call created it (False: the caller's process group is used and left to
        the caller to destroy).
    """
    if torch.distributed.is_initialized():
        return False
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch may have started before it was set
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(backend)
    return True


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker (Megatron-LM's
    ``_set_random_seed`` with pipeline rank 0). Identical on every rank, so CPU initialization
    draws the same logical weights at every layout."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


_FROZEN: list[bool] = []  # non-empty once this process froze its objects


def freeze_imported_objects() -> None:
    """Once per process: move every object alive now (the modules torch, megatron-core and
    their imports built, about half a million on CPU) out of reach of Python's cyclic garbage
    collector (``gc.freeze``); later calls do nothing. (``gc.get_freeze_count()`` cannot tell:
    an import may already have frozen a few hundred objects of its own.)

    They live as long as the process does, yet every full collection walks them: megatron calls
    ``gc.collect()`` itself in each distributed-optimizer save and load
    (``DistributedOptimizer.sharded_state_dict``), each a sizeable part of a second on CPU, and
    automatic collections add more. Only the first call freezes: a process that builds a second
    model (a test world) would otherwise freeze the first one's cycles, and with them its
    process groups' threads.
    """
    if _FROZEN:
        return
    gc.collect()
    gc.freeze()
    _FROZEN.append(True)


def setup(cfg, parallel_dims, optimizer_cfg=None):
    """Process groups, GTP backend, model, DDP, optimizer, scheduler (no data, no checkpoint).

    ``optimizer_cfg``: the config to build the optimizer from when it differs from ``cfg`` (a
    resume that overrides the lr schedule builds with the checkpoint's values, so megatron finds
    its param groups on load).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    from mcore_compat import cpu as cpu_compat, moe_cpu

    freeze_imported_objects()
    cpu_compat.install()
    moe_cpu.install()
    safe_objects.install()  # no pickle of a checkpoint loaded here runs code
    gtp_setup.before_model(cfg, parallel_dims)
    parallel_state.initialize_model_parallel(**parallel_dims.megatron_kwargs())
    set_seed(cfg.train.seed)

    tokenizer = build_tokenizer(cfg.data)
    chunks, config = build_model(cfg, parallel_dims, tokenizer.vocab_size,
                                 reseed=lambda: set_seed(cfg.train.seed))
    for chunk in chunks:
        if torch.cuda.is_available():
            # As Megatron-LM's get_model: built on CPU (use_cpu_initialization), trained on the GPU.
            chunk.cuda(torch.cuda.current_device())
        gtp_setup.after_model(chunk, parallel_dims, cfg)
        moe.after_model(chunk, parallel_dims)
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        # As Megatron-LM: bf16 weights, inputs cast on entry and logits/loss returned in fp32.
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=parallel_dims.use_distributed_optimizer,
        **te.ddp_fields(config))
    layouts = layer_wise_param_layouts(cfg, chunks, ddp_config)
    # As Megatron-LM: only the first chunk's buffer is bucketed (interleaved schedule).
    ddp = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0,
                                   **({"full_param_layout": layouts[i]} if layouts else {}))
           for i, chunk in enumerate(chunks)]
    for chunk in ddp:
        gtp_setup.after_ddp(chunk, parallel_dims)
        moe.after_ddp(chunk, parallel_dims)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in ddp] if len(ddp) > 1 else ddp[0].no_sync
    if parallel_dims.use_distributed_optimizer:
        distrib_optimizer.install()
    optimizer = build_optimizer(optimizer_cfg or cfg, ddp)
    scheduler = build_scheduler(cfg, optimizer)
    ddp = ddp if len(ddp) > 1 else ddp[0]
    return tokenizer, ddp, optimizer, scheduler


def check_same_run(cfg) -> None:
    """Every rank must write into the same job and checkpoint dirs (torchrun/Slurm ranks each
    resolve the config, and ``${now:...}`` can differ between them).

    Raises:
        ConfigError: on every rank, naming each rank's dirs.
    """
    mine = (str(cfg.output_dir), str(cfg.checkpoint.save))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        listing = "; ".join(f"rank {r}: output_dir={o}, checkpoint.save={c}"
                            for r, (o, c) in enumerate(everyone))
        raise ConfigError(f"the ranks of this job resolved different run dirs ({listing}); set "
                           f"hydra.run.dir (and checkpoint.save) explicitly for every rank")


def run(cfg, resume=None) -> None:
    """Train as configured, on the process group this process belongs to.

    ``resume``: the :class:`ckpt.io.manager.ResumePlan` this process resolved before
    launch (a rank that ran its own pre-launch checks), reused when every rank agrees on it.
    """
    from megatron.core import parallel_state

    from ckpt.io.manager import CheckpointManager, ResumePlan

    started = float(os.environ.get(STARTED_ENV) or time.time())
    preemption.install(cfg.train)  # a signal from here on: save at the next iteration boundary
    created_world = init_distributed()
    quiet_megatron(torch.distributed.get_rank(), bool(cfg.checkpoint.get("async_save", False)))
    check_same_run(cfg)
    ck = cfg.checkpoint
    early = preemption.before_training(cfg.train, int(ck.load_iteration or 0) if ck.load else 0)
    if early is not None:  # a signal while it started: nothing trained, nothing to save
        if torch.distributed.get_rank() == 0:
            print(early, flush=True)
        if created_world:
            torch.distributed.destroy_process_group()
        preemption.after_exit()
        return
    load_iteration = agree_load_iteration(ck)
    if load_iteration is None:
        resume = None
    elif resume is None or (resume.load, resume.iteration) != (str(ck.load), load_iteration):
        resume = ResumePlan.open(ck.load, load_iteration)  # this rank's one read of it
    parallel_dims = validate(cfg, torch.distributed.get_world_size(), resume)
    saved_cfg, optimizer_cfg = None, None
    if resume is not None:
        saved_cfg = resume.saved_config
        if saved_cfg and cfg.optim.get("override_opt_param_scheduler", False):
            optimizer_cfg = OmegaConf.merge(cfg, {"optim": {
                k: saved_cfg["optim"][k] for k in ("lr", "min_lr", "weight_decay")}})
    tokenizer, model, optimizer, scheduler = setup(cfg, parallel_dims, optimizer_cfg)
    layout_rec = checkpoint.layout_record(parallel_dims)
    rank = torch.distributed.get_rank()

    train_state = {"consumed_samples": 0}
    iteration, resumed_from = 0, None
    manager = CheckpointManager(ck, resume, layout_rec)
    common = manager.load(model, optimizer, scheduler)
    manager.check_space()  # a resumed run's saves fit: refused before the first iteration
    if common is not None:
        if optimizer_cfg is not None:
            apply_schedule_override(optimizer, scheduler, cfg)
        iteration, train_state = common["iteration"], dict(common["train_state"])
        resumed_from = saved_layout(common)
    elif ck.get("pretrained"):
        # weights only: iteration 0, fresh optimizer
        train_state[IMPORTED_KEY] = pretrained.load_weights(cfg, model, optimizer)
    plan = plan_wandb_run(cfg, train_state if resumed_from is not None else None,
                          iteration if resumed_from is not None else None)
    run_id = plan["run_id"]

    chain = lineage.of_run(train_state if resumed_from is not None else None, iteration, plan)
    train_state["data_plan"] = planned_samples(train_state, iteration, saved_cfg, cfg)

    data_iterator, validation, dp_size = _iterators(cfg, parallel_dims, train_state, tokenizer)
    state = RunState(
        model, optimizer, scheduler, data_iterator,
        num_microbatches=cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp_size),
        iteration=iteration, consumed_samples=train_state["consumed_samples"],
        validation=validation, skipped=train_state.get("skipped_iterations", 0),
        train_state={"wandb_run_id": run_id, "config": to_dict(cfg),
                     "data_plan": train_state["data_plan"], "lineage": chain,
                     IMPORTED_KEY: train_state.get(IMPORTED_KEY)},
    )

    logger = (_start_logger(cfg, state, plan, parallel_dims, layout_rec, resumed_from)
              if rank == 0 else None)

    from recipes.run.loop import train

    attach_metrics(cfg, state, logger)  # the load-balancing loss of MoE models (else nothing)
    mtp.attach_metrics(cfg, state, logger)  # mtp_N loss with MTP layers (else nothing)

    _TRAINING.append(True)  # an error from here on is no refusal of the input
    try:
        stopped = train(state, cfg, logger, manager)
        manager.wait()
        if stopped is None and logger is not None:
            print(format_summary(logger, time.time() - started, cfg.train.train_iters,
                                 manager.last_good, os.environ.get(preemption.CONTINUE_ENV),
                                 ck.save), flush=True)
    finally:
        if logger is not None:
            logger.close()
    if stopped is not None and rank == 0:
        print(preemption.exit_message(stopped, state.iteration,
                                      manager.last_good if ck.save else None), flush=True)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    if created_world:
        torch.distributed.destroy_process_group()
    if stopped is not None:
        preemption.after_exit()  # submitit's handler of its signal: requeue the job


def _iterators(cfg, parallel_dims, train_state: dict, tokenizer):
    """``(train iterator or one per virtual stage, validation batches or None, dp size)`` of
    this rank, continuing at ``train_state["consumed_samples"]``."""
    from megatron.core import parallel_state

    # Without CP: the context-parallel ranks of a replica read the same micro-batches and split
    # each one's sequence (recipes.model.context_parallel), as Megatron-LM's data loader.
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    dp_rank, dp_size = torch.distributed.get_rank(dp_group), torch.distributed.get_world_size(dp_group)
    # Every pipeline stage (and virtual stage) reads the same micro-batches: the first uses the
    # tokens, the last the labels and loss mask.
    vpp = parallel_dims.virtual_pipeline_model_parallel_size
    data_iterator, validation = build_iterators(cfg, train_state["consumed_samples"], dp_rank,
                                                dp_size, tokenizer=tokenizer,
                                                plan=train_state["data_plan"])
    if vpp:
        data_iterator = [data_iterator] + [
            build_train_iterator(cfg, train_state["consumed_samples"], dp_rank, dp_size,
                                 tokenizer=tokenizer, plan=train_state["data_plan"])
            for _ in range(vpp - 1)]
    return data_iterator, validation, dp_size


def _start_logger(cfg, state, plan: dict, parallel_dims, layout_rec: dict, resumed_from):
    """Rank 0's ``MetricLogger``; prints the layout line and records the start or the resume
    event (``resumed_from``: the saved layout, None for a new run)."""
    ck, model, iteration, run_id = cfg.checkpoint, state.model, state.iteration, plan["run_id"]
    config_dict = state.train_state["config"]
    logger = MetricLogger(cfg, cfg.output_dir, plan, config_dict,
                          resumed_from=iteration if resumed_from is not None else None)
    n_params = count_parameters(model)
    fork = (f" (fork of {plan['parent']['run_id']} at iteration {plan['parent']['iteration']})"
            if plan["parent"] else " (continued)" if plan["resume"] else "")
    wandb_run = f", wandb run {run_id}{fork}" if cfg.logger.get("wandb", False) else ""
    print(f"> layout {parallel_dims.describe()}, parameters on rank 0: {n_params}{wandb_run}",
          flush=True)
    if resumed_from is not None:
        parent = plan["parent"]
        logger.event("resume", iteration=iteration, from_layout=resumed_from, layout=layout_rec,
                     load=str(ck.load), wandb_run_id=run_id,
                     wandb_parent_run_id=parent and parent["run_id"],
                     num_threads=torch.get_num_threads())
    else:  # num_threads: CPU threads per rank (recipes.run.rank_env.cpu_threads_per_rank)
        logger.event("start", iteration=0, layout=layout_rec, num_threads=torch.get_num_threads(),
                     **describe(cfg))
    return logger


def _run_or_refuse(cfg, launched_by_train_py: bool) -> None:
    """:func:`run`; a refusal (:mod:`recipes.config.refusal`) before training starts (a checkpoint or
    config this process cannot load) exits 2 with its one message, no traceback (the launcher
    prints it once). A later error is a failure (:func:`_run_or_interrupt`)."""
    try:
        run(cfg)
    except Exception as exc:
        text = None if _TRAINING else refusal.message(exc)
        if text is None:
            raise
        refusal.record(text, launched_by_train_py)
        raise SystemExit(refusal.EXIT_CODE) from None


def main(argv=None) -> None:
    """Entry point: load the resolved config and run.

    Raises:
        SystemExit: 2 for a refusal (its message recorded for the launcher), 130 on Ctrl-C.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is not None:  # started by train.py: never outlive it (a kill -9 of train.py)

        die_with_parent(int(launcher))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m recipes.run.worker {RESOLVED_CONFIG}")
    cfg = OmegaConf.load(argv[0])
    # Inside record(): torch's error file is written for a failure, not for an interrupt.
    record(_run_or_interrupt)(cfg, launcher is not None)


def _run_or_interrupt(cfg, launched_by_train_py: bool) -> None:
    """:func:`_run_or_refuse`; Ctrl-C exits 130 with one line per rank (the launcher names the
    checkpoint), also on a rank still in a collective (a save's) that sees the first rank leave
    before its own SIGINT comes (:func:`recipes.run.preemption.part_of_interrupt`). A failed save or
    a lost peer during training exits 1 with one line, no traceback (:func:`failure_text`);
    any other error keeps its traceback."""
    try:
        _run_or_refuse(cfg, launched_by_train_py)
    except (KeyboardInterrupt, Exception) as exc:
        try:
            interrupted = part_of_interrupt(exc)
        except KeyboardInterrupt:  # the SIGINT came while it looked at the chain
            interrupted = True
        if not interrupted:
            text = failure_text(exc)
            if text is None:
                raise
            _report_failure(text, launched_by_train_py)
            raise SystemExit(1) from None
        print(f"> rank {os.environ.get('RANK', '?')}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def failure_text(exc: BaseException) -> str | None:
    """The one line a failure during training is reported with, no traceback: a failed save
    (a :class:`~ckpt.io.CheckpointError`, whose message says which ranks failed, why
    and what the tracker still names) or a collective that failed because a peer left (a rank
    killed or failed: the launcher names that rank first). None for any other error (a bug: its
    traceback is kept)."""
    if not _TRAINING:
        return None
    chain, seen = [], exc
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for error in chain:
        if isinstance(error, checkpoint.CheckpointError):
            return f"{type(error).__name__}: {error}"
    for error in chain:
        if preemption.collective_failed(error):
            first = (str(error).strip().splitlines() or [""])[0]
            return f"lost a peer during training: {type(error).__name__}: {first}"
    return None


def _report_failure(text: str, launched_by_train_py: bool) -> None:
    """Report a failure once: into torch elastic's error file, which ``train.py``'s launcher
    prints in its closing summary (:func:`recipes.run.launch.launch_local`); printed here as
    ``error: ...`` when no such launcher will."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            path = None  # a dead file system: say it here instead
    if not (path and launched_by_train_py):
        print(f"error: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
