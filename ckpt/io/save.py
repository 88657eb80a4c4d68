"""One save: staged into a hidden dir on every rank (synchronously or by the background
writers of :mod:`ckpt.io.async_save`), then renamed into place and named by the
tracker once every rank finished (:func:`finalize_save`)."""

from __future__ import annotations

import functools
import gc
import os
import shutil
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import is_main_replica
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.format.logical_format import SHARDING_RECORD_KEY, written_sharding_record
from gtp.collectives import barrier, collective_device, rank as global_rank
from ckpt.format.records import TRACKER, stored_layout
from ckpt.io import faults
from ckpt.adapt import vocab
from ckpt.io import lineage
from ckpt.io.async_save import (
    AsyncSaves,
    failed_save_message,
    failure_message,
    use_in_process_results_queue,
    write_in_background,
)
from ckpt.io.errors import CheckpointError
from ckpt.io.files import (
    ensure_disk_space,
    fsync_dir,
    iter_dir,
    save_files,
    staging_dir,
    write_durable,
)
from ckpt.io.state import rng_sharded_object, sharded_state_dict
from ckpt.io.lease import RUN_ID_ENV, LeaseHeld, check_writer
from ckpt.io.writers import save_strategy


def gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (megatron pauses it the same way
    around its async save, ``async_utils._disable_gc``).

    A save or load builds and drops tens of thousands of short-lived containers (sharded
    tensors, plans, read items): enough to start full collections, each of which walks every
    object of the training process. Reference counting frees them anyway; cycles among them are
    collected by the first collection after ``fn`` returns.
    """
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


def expected_checkpoint_bytes(sharded_state: dict) -> int:
    """Bytes the tensors of one save will take, summed over all ranks (a collective).

    Counts each tensor's main replica only (``replica_id`` all zeros), as the writer does.
    """
    local = 0
    for item in nested_values(sharded_state):
        data = getattr(item, "data", None)
        if isinstance(data, torch.Tensor) and is_main_replica(getattr(item, "replica_id", 0)):
            local += data.numel() * data.element_size()
    if not torch.distributed.is_initialized():
        return local
    total = torch.tensor([local], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(total)
    return int(total.item())


@gc_paused
def stage_save(root, iteration: int, model, optimizer, scheduler, common: dict,
               layout_dict: dict, async_saves: AsyncSaves | None = None,
               on_written=None) -> Path:
    """Write every rank's files of ``iteration`` into :func:`staging_dir` (every rank calls this).

    Nothing under ``root`` that a loader reads changes: a crash here leaves only the hidden
    staging dir, which the next save of the same iteration removes. Args as
    :func:`save_checkpoint`.

    With ``async_saves`` the tensors are written in the background (megatron's async
    torch_dist save, after the previous save in flight is finalized) and this returns at once;
    ``on_written(staged)`` then runs on every rank in megatron's finalize step, once every
    rank's writer has finished (``async_saves.poll()`` / ``wait()``): it is where the caller
    calls :func:`finalize_save`. Without, the files are written when this returns and
    ``on_written`` is not used.

    Returns:
        The staging dir; :func:`finalize_save` makes it the checkpoint.

    Raises:
        CheckpointError: not enough disk space (before anything is written); a synchronous
            write failed on some rank (a full disk, a file-size limit, a read-only file
            system: on every rank, naming each failed rank's error).
    """
    staged = staging_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if async_saves is not None:
        async_saves.wait()  # the previous save completes (or fails) before this one starts
    use_in_process_results_queue(async_saves is not None)
    state = sharded_state_dict(model, optimizer, is_loading=False,
                               sharding_type=layout_dict.get("distrib_optim_sharding_type"))
    prepare_staging(root, iteration, expected_checkpoint_bytes(state))
    state.update(
        iteration=iteration,
        opt_param_scheduler=scheduler.state_dict(),
        train_state=common,
        # pad_for_alignment is the sharding record's (one owner); saved_layout() joins them.
        layout=stored_layout(layout_dict),
        rng_state=rng_sharded_object(),
        # The real (unpadded) vocabulary: a load with another tokenizer is refused.
        **{vocab.RECORD_KEY: vocab.real_vocab_size(model)},
        # How GTP weights are laid out in this file (docs/checkpoint-format.md); built before
        # save, which applies the sharded factories in place.
        **{SHARDING_RECORD_KEY: written_sharding_record(model, state["model"])},
    )
    if async_saves is None:
        try:
            with faults.while_writing(iteration, rank):
                dist_checkpointing.save(state, str(staged), sharded_strategy=save_strategy())
            faults.maybe_fail("save", iteration, rank)
        except CheckpointException as exc:  # a BaseException: torch's error file misses it
            raise CheckpointError(failed_save_message(exc, root, iteration)) from None
        except OSError as exc:  # this rank's own, outside DCP's gathered errors (rank 0's
            # .metadata): the others learn of it as a lost peer (CheckpointManager.save)
            raise CheckpointError(failure_message(
                root, iteration, {rank: f"writing its files failed: {exc}"})) from None
        return staged
    # megatron's own async path ("mcore"; the "nvrx" default needs nvidia-resiliency-ext).
    request = dist_checkpointing.save(state, str(staged), async_sharded_save=True,
                                      async_strategy="mcore", **async_saves.save_options(state))
    async_saves.agree_on_plan_reuse()
    if request.async_fn is not None:
        request = request._replace(async_fn=functools.partial(
            write_in_background, request.async_fn, iteration, rank))

    def written() -> None:
        faults.maybe_fail("save", iteration, rank)
        if on_written is not None:
            on_written(staged)

    # Runs after megatron's own finalize steps (the global .metadata into the staged dir).
    request.add_finalize_fn(written)
    async_saves.schedule(request, root, iteration)
    return staged


def agree_failures(local: str | None) -> dict:
    """Every rank's failure of one step (``local``: this rank's, None for none), on every rank
    (a collective where there are several ranks): rank -> its cause."""
    rank = global_rank()
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return {rank: local} if local else {}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, local)
    return {r: text for r, text in enumerate(every) if text}


def prepare_staging(root, iteration: int, needed_bytes: int) -> Path:
    """Before a save writes anything (every rank calls this): each rank checks the space and
    inodes it needs (:func:`ckpt.io.files.ensure_disk_space`), then global rank 0
    creates the staging dir (removing a leftover of an interrupted save: never a checkpoint).
    A failure on any rank (a full disk, a read-only file system) fails the save on every rank
    with the same message, in the one form of a failed save.

    Raises:
        CheckpointError: ``the save of iteration N into DIR failed on rank(s) ...``.
    """
    staged = staging_dir(root, iteration)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    problem = None
    try:
        ensure_disk_space(root, needed_bytes, files=save_files(world))
    except CheckpointError as exc:
        problem = f"refused before anything was written: {exc}"
    except OSError as exc:
        problem = f"measuring the free space failed: {exc}"
    if problem is None and global_rank() == 0:
        try:
            if staged.exists():
                shutil.rmtree(staged)
            staged.mkdir(parents=True)
        except OSError as exc:
            problem = f"creating its staging dir failed: {exc}"
    failures = agree_failures(problem)  # also every rank waits for the staging dir
    if failures:
        raise CheckpointError(failure_message(root, iteration, failures,
                                              outcome="Nothing was written into place"))
    return staged


def finalize_save(root, iteration: int, staged: Path, chain: list | None = None) -> Path:
    """Make a staged save the checkpoint of ``iteration`` once every rank finished writing.

    A barrier first (a rank that died or failed while writing stops the others here, and the
    staged dir is never renamed); then global rank 0 moves any existing ``iter_*`` of the same
    iteration aside, renames the staged dir into place, writes the tracker, then removes the
    old one. Every step is a rename within ``root``: a crash at any point leaves either the old
    or the new complete checkpoint under its name (or the old one as ``.iter_*.replaced``,
    which :func:`ckpt.io.files.recover_replaced` puts back). ``chain``: the save's
    lineage, recorded beside the tracker before it names the save
    (:func:`ckpt.io.lineage.record`).

    Returns:
        The iter dir.

    Raises:
        CheckpointError: on every rank, the same message in the one form of a failed save
            (:func:`ckpt.io.async_save.failure_message`), when rank 0 could not
            rename, record or write the tracker, naming the step and its error; a
            :class:`ckpt.io.lease.LeaseHeld` on rank 0 when another run took the dir over (this
            save kept aside, :func:`keep_unowned`).
    """
    barrier()
    path = iter_dir(root, iteration)
    failure, step, renamed = [None], "checking the writer lease", False
    if global_rank() == 0:
        try:
            try:
                check_writer(root)  # still this run's dir: one live writer (ckpt/io/lease.py)
            except LeaseHeld as exc:
                raise LeaseHeld(f"{exc}; {keep_unowned(root, iteration, staged)}") from None
            replaced = Path(root) / f".{path.name}.replaced"
            step = "moving the previous save of this iteration aside"
            if path.exists():
                if replaced.exists():
                    shutil.rmtree(replaced)
                os.replace(path, replaced)
            step = "renaming it into place"
            os.replace(staged, path)
            renamed = True
            fsync_dir(root)
            step = f"recording its lineage ({lineage.RECORD})"
            lineage.record(root, iteration, chain)
            # The tracker first: a crash before it leaves the old save aside for
            # recover_replaced.
            step = f"writing {TRACKER}"
            write_durable(Path(root) / TRACKER, f"{iteration}\n")
        except (CheckpointError, OSError) as exc:
            failure[0] = exc
        else:
            try:
                if replaced.exists():
                    shutil.rmtree(replaced)
            except OSError as exc:  # the save is complete and tracked: a leftover, said once
                print(f"> warning: {path.name} is saved, but the copy it replaced could not be "
                      f"removed ({exc}); {replaced} is never loaded: remove it", flush=True)
    text = None
    if failure[0] is not None:
        outcome = (f"{path.name} is complete in place (checkpoint.load_iteration={iteration} "
                   f"loads it)" if renamed else "Nothing was renamed into place")
        text = failure_message(root, iteration, {0: f"{step} failed: {type(failure[0]).__name__}: "
                                                    f"{failure[0]}"}, outcome=outcome)
    # Every rank raises rank 0's error (none waits alone in a later collective).
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        message = [text]
        torch.distributed.broadcast_object_list(message, src=0)
        text = message[0]
    if text is not None:
        raise (LeaseHeld if isinstance(failure[0], LeaseHeld) else CheckpointError)(text)
    return path


def keep_unowned(root, iteration: int, staged: Path) -> str:
    """A complete save that may not be renamed into place (another run took ``root``'s writer
    lease) is kept, not dropped: renamed to ``iter_NNNNNNN.lease-lost.RUN_ID`` beside the
    others (never listed, loaded or pruned as a save; a hidden staging dir would be removed by
    the other run's save of the same iteration). Returns the sentence saying where, and how to
    resume from it."""
    name = iter_dir(root, iteration).name
    kept = Path(root) / f"{name}.lease-lost.{os.environ.get(RUN_ID_ENV) or os.getpid()}"
    try:
        os.replace(staged, kept)
    except OSError:
        kept = staged
    return (f"its complete files are kept as {kept} (to resume from them: move it to "
            f"NEW_DIR/{name} and run with checkpoint.load=NEW_DIR "
            f"checkpoint.load_iteration={iteration})")


def save_checkpoint(root, iteration: int, model, optimizer, scheduler, common: dict,
                    layout_dict: dict, async_saves: AsyncSaves | None = None, on_done=None) -> Path:
    """Save a checkpoint of ``iteration`` under ``root`` (every rank calls this).

    Staged (:func:`stage_save`) then renamed into place (:func:`finalize_save`): an existing
    complete checkpoint of the same iteration stays loadable until the new one is complete on
    every rank. A run saves through :class:`ckpt.io.manager.CheckpointManager`,
    which adds retention and the run's messages.

    Args:
        root: the checkpoint dir (``checkpoint.save``).
        iteration: completed optimizer steps.
        model: the DDP-wrapped megatron model.
        optimizer: the megatron optimizer.
        scheduler: megatron's ``OptimizerParamScheduler``.
        common: small state identical on every rank (consumed samples, wandb run id, resolved
            config...): plain python values only, so it loads with ``weights_only=True``.
        layout_dict: the ``ParallelDims`` the run uses (:func:`ckpt.io.state.layout_record`),
            recorded so a loader knows what wrote it.
        async_saves: None: write now and return when the checkpoint is complete. Else the
            tensors are written in the background (megatron's async torch_dist save) into the
            staging dir, and the save completes (renamed into place, tracker written: the
            finalize step of :func:`finalize_save`) in a later ``async_saves.poll()`` /
            ``wait()``, once every rank's writer has finished.
        on_done: ``on_done(path)`` is called on every rank right after the tracker names this
            checkpoint.

    Returns:
        The iter dir. The tracker file names it only once every rank finished writing.
    """
    def written(staged: Path) -> None:
        path = finalize_save(root, iteration, staged, chain=common.get(lineage.KEY))
        if on_done is not None:
            on_done(path)

    staged = stage_save(root, iteration, model, optimizer, scheduler, common, layout_dict,
                        async_saves=async_saves, on_written=written)
    if async_saves is None:
        written(staged)
    return iter_dir(root, iteration)
