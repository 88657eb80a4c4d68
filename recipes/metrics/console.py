"""What a run prints: a copy of the console in the job's ``train.log``, and megatron's
once-per-process messages said once.

:func:`job_log` copies file descriptors 1 and 2 (this process and the workers it starts, which
inherit them) into ``<output_dir>/train.log`` while the console still shows everything.
:func:`quiet_megatron` drops megatron log records that every rank repeats word for word.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import threading
from pathlib import Path

from recipes.metrics.logger import format_duration

JOB_LOG = "train.log"
# The epoch seconds the job started at (set by recipes.run.launch.run_job): the summary's wall time.
STARTED_ENV = "GTP_RECIPES_STARTED"


def _under_other_launcher() -> bool:
    """torchrun or Slurm/submitit started this process as one rank: they keep its output."""
    return "RANK" in os.environ or any(k.startswith("SUBMITIT_") for k in os.environ)


def _pump(read_fd: int, console_fd: int, log) -> None:
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        for out in (lambda c: os.write(console_fd, c), log.write):
            try:
                out(chunk)
            except OSError:
                pass
        log.flush()
    os.close(read_fd)


@contextlib.contextmanager
def job_log(output_dir):
    """Within the block, everything written to stdout and stderr (by this process and by the
    processes it starts) also goes to ``<output_dir>/train.log`` (appended). Nothing is copied
    when this process is one rank of a torchrun/Slurm job."""
    if _under_other_launcher() or output_dir is None:
        yield
        return
    path = Path(str(output_dir)) / JOB_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "ab", buffering=0)
    saved, threads = {}, []
    for fd in (1, 2):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        read_fd, write_fd = os.pipe()
        saved[fd] = os.dup(fd)
        os.dup2(write_fd, fd)
        os.close(write_fd)
        t = threading.Thread(target=_pump, args=(read_fd, saved[fd], log), daemon=True)
        t.start()
        threads.append(t)
    try:
        yield
    finally:
        for fd in (1, 2):
            with contextlib.suppress(Exception):
                (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(saved[fd], fd)  # the pipe's last writer here is gone: the pump sees EOF
        for t in threads:
            t.join(timeout=5)
        for fd in saved.values():
            os.close(fd)
        log.close()


# megatron messages each rank logs identically once per process.
_ONCE_PER_JOB = ("GPTModel IS DEPRECATED",)
# Printed by megatron's torch_dist strategy on the first save even when the save is synchronous
# (its sync save runs its async path): noise unless checkpoint.async_save is on.
_ASYNC_DEPRECATION = "MCore's async save is deprecated"


class _MegatronFilter(logging.Filter):
    def __init__(self, rank: int, async_save: bool) -> None:
        super().__init__()
        self.rank, self.async_save = rank, async_save

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(_ASYNC_DEPRECATION):
            return self.async_save and self.rank == 0
        if self.rank != 0 and message.startswith(_ONCE_PER_JOB):
            return False
        return True


def quiet_megatron(rank: int, async_save: bool) -> None:
    """On every handler of the root logger and on megatron's loggers, drop megatron's repeated
    messages except on global rank 0 (the async-save deprecation also when saves are
    synchronous). A later call (another job in the same process) replaces the earlier filter."""
    flt = _MegatronFilter(rank, async_save)
    holders = [*logging.getLogger().handlers, *(logging.getLogger(name) for name in (
        "megatron", "megatron.core.dist_checkpointing.strategies.torch",
        "megatron.core.models.gpt.gpt_model"))]
    for holder in holders:
        for old in [f for f in holder.filters if isinstance(f, _MegatronFilter)]:
            holder.removeFilter(old)
        holder.addFilter(flt)


def format_summary(logger, wall_s: float, train_iters: int, checkpoint, how: str | None,
                   save_root=None) -> str:
    """The closing lines of a run that reached ``train.train_iters`` (rank 0 prints them).

    Args:
        logger: the run's ``recipes.metrics.logger.MetricLogger`` (last row, validation losses, the
            offline wandb dir).
        wall_s: seconds the job took (since :data:`STARTED_ENV`).
        train_iters: ``train.train_iters``.
        checkpoint: the iter dir to resume from (the last complete save, or the one loaded),
            None when there is none.
        how: the command that continues the run (``recipes.run.preemption.CONTINUE_ENV``), if any.
        save_root: ``checkpoint.save`` (None: saving is off).
    """
    last = logger.last
    lines = [f"> run complete: iteration {last.get('iteration', train_iters)}/{train_iters} in "
             f"{format_duration(wall_s)} (wall time)"]
    if "lm loss" in last:
        lines.append(f">   final lm loss: {last['lm loss']:.6E}")
    if logger.last_validation is not None:
        (final, at), (best, best_at) = logger.last_validation, logger.best_validation
        lines.append(f">   lm loss validation: final {final:.6E} (iteration {at}), "
                     f"best {best:.6E} (iteration {best_at})")
    if checkpoint is None:
        why = ("checkpoint.save=null" if save_root is None else
               f"none saved into {save_root}: checkpoint.save_interval, checkpoint.save_at_end")
        lines.append(f">   no checkpoint to resume from ({why})")
    elif save_root is None:
        # Only the checkpoint this run loaded: what it trained since is not saved, and
        # checkpoint.load=auto finds nothing without checkpoint.save.
        lines.append(f">   resume from: {checkpoint} (the checkpoint this run loaded; it saved "
                     f"nothing: checkpoint.save=null)")
    else:
        lines.append(f">   resume from: {checkpoint}")
        if how:
            # The same run trained further: a larger train.train_iters (twice, for example).
            words = [w for w in shlex.split(how) if not w.startswith("train.train_iters=")]
            words.append(f"train.train_iters={2 * train_iters}")
            lines.append(f">   train on with: {' '.join(shlex.quote(w) for w in words)}")
    if logger.wandb_offline_dir is not None:
        lines.append(f">   wandb offline run: upload it with `wandb sync {logger.wandb_offline_dir}`")
    return "\n".join(lines)
