"""The checkpoint lifecycle of one run, owned by one :class:`CheckpointManager` per rank.

1. **Resolve** (before launch, once): :meth:`ResumePlan.resolve` settles ``checkpoint.load`` and
   the iteration to load, and reads its common state; ``recipes.checkpoint.policy.prepare_resume``
   pins ``checkpoint.load_iteration`` in the resolved config the workers read. In the workers
   every rank takes global rank 0's (``recipes.checkpoint.policy.agree_load_iteration``) and opens
   it once (:meth:`ResumePlan.open`).
2. **Load** (:meth:`CheckpointManager.load`): the run state from the plan's checkpoint.
3. **Step** (:meth:`CheckpointManager.step`, once per iteration): finalize a background save
   whose writers have all finished, then save when ``checkpoint.save_interval`` (or
   ``save_at_end``) says so.
4. **Save**: staged, renamed into place and named by the tracker once every rank finished
   (:mod:`ckpt.io.save`); then retention (``checkpoint.keep_last``) and the run's
   ``save`` event. With ``checkpoint.async_save`` the tensors are written in the background and
   that completion runs in a later step.
5. **Stop** (:meth:`CheckpointManager.stop`): a run that stops early saves the iteration it
   stopped after (unless that save is already under way), then waits for the save in flight.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gtp.collectives import collective_device
from ckpt.format.records import IMPORTED_KEY
from ckpt.verify import verify_iteration
from ckpt.io import lineage
from ckpt.io.async_save import AsyncSaves, failure_message
from ckpt.io.errors import CheckpointError
from ckpt.io.files import (TRACKER, ensure_disk_space, iter_dir, read_tracker,
                                      recover_replaced, save_files,
                                      remove_old_checkpoints, saved_iterations, tracked,
                                      write_durable)
from ckpt.io.integrity import check_loadable
from ckpt.io.load import load_checkpoint, load_common
from ckpt.io.save import expected_checkpoint_bytes, finalize_save, stage_save
from ckpt.io.state import sharded_state_dict
from ckpt.io.job import job_id


def _repaired(ck, repair: bool) -> bool:
    """Whether ``ck.load`` is set; with ``repair``, first put back a complete save a crash left
    aside in it."""
    if ck.load is None:
        return False
    if repair and Path(ck.load).is_dir():
        recover_replaced(ck.load)
    return True


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run loads, resolved once per process.

    Attributes:
        load: the checkpoint dir (``checkpoint.load``).
        iteration: the iteration loaded.
        path: its iter dir.
        common: its common state (:func:`ckpt.io.load.load_common`).
    """

    load: str
    iteration: int
    path: Path
    common: dict

    @classmethod
    def resolve(cls, ck, repair: bool = False) -> "ResumePlan | None":
        """``ck.load`` at ``ck.load_iteration`` (None: the tracker's), checked and its common
        state read; None without ``ck.load``. ``repair`` (global rank 0 before launch): first
        put back a complete save that a crash left aside
        (:func:`ckpt.io.files.recover_replaced`).

        Raises:
            CheckpointError: as :func:`ckpt.io.load.load_common`.
        """
        if not _repaired(ck, repair):
            return None
        return cls.open(ck.load, ck.load_iteration)

    @classmethod
    def resolve_iteration(cls, ck, repair: bool = False) -> int | None:
        """The iteration :meth:`resolve` would load, without reading the common state:
        ``ck.load_iteration`` or the tracker's, checked loadable
        (:func:`ckpt.io.integrity.check_loadable`); None without ``ck.load``.
        ``repair`` as for :meth:`resolve`.

        Raises:
            CheckpointError: as :func:`ckpt.io.integrity.check_loadable`.
        """
        if not _repaired(ck, repair):
            return None
        return int(check_loadable(ck.load, ck.load_iteration).name[5:])

    @classmethod
    def open(cls, load, iteration: int | None) -> "ResumePlan":
        """The plan of ``load`` at ``iteration`` (None: the tracker's): one loadability check
        and one read of the common state.

        Raises:
            CheckpointError: as :func:`ckpt.io.load.load_common`.
        """
        path, common = load_common(load, iteration)
        return cls(str(load), int(path.name[5:]), path, common)

    @classmethod
    def auto(cls, root, verify: bool = True, repair: bool = False) -> tuple[int | None, list[str]]:
        """``checkpoint.load=auto``'s choice in the save dir ``root``: the newest save of the
        lineage (:mod:`ckpt.io.lineage`) of the save the tracker names (without a
        usable tracker: of the newest complete save) that loads and, with ``verify``, verifies
        (:func:`ckpt.verify.verify_iteration`). A newer save of the same lineage is taken (a
        crash between its rename and the tracker's write); another lineage's is never taken.
        A save to follow that cannot be read is damaged: its lineage recorded beside the tracker
        (:func:`ckpt.io.lineage.recorded`) is followed, back to the iteration it
        forked at; without that record it is refused.
        With ``repair`` (global rank 0) a damaged save of the lineage is set aside as
        ``iter_N.damaged`` (never deleted, never written over) once the tracker names the save
        chosen; without it nothing is written.

        Returns:
            ``(iteration, notes)``: None when ``root`` holds no complete save; a note per save
            skipped, naming it and why.

        Raises:
            CheckpointError: it cannot tell a save's lineage from the tracker's (a save from
                before lineages beside it), naming both; the save to follow cannot be read and
                its lineage is not recorded, naming it; or no save of the lineage loads.
        """
        saved = saved_iterations(root)
        if not saved:
            return None, []
        mark = tracked(root)
        ref = mark if mark in saved else saved[-1]
        chains: dict = {}

        def chain(it):
            if it not in chains:
                try:
                    chains[it] = load_common(root, it)[1]["train_state"].get(lineage.KEY)
                except CheckpointError as exc:
                    chains[it] = exc
            return chains[it]

        notes, damaged = [], []
        if mark != ref:  # a crash before the first tracker write, or a damaged tracker
            try:
                why = f"the tracker names iteration {read_tracker(root)}, no complete save"
            except CheckpointError as exc:
                why = (f"no {TRACKER}" if not (Path(root) / TRACKER).is_file()
                       else f"no usable tracker ({exc})")
            notes.append(f"> checkpoint.load=auto: {why}; following the lineage of the newest "
                         f"complete save, {iter_dir(root, ref).name}")
        history = chain(ref)
        if isinstance(history, CheckpointError):
            # The save to follow cannot be read: damaged (skipped below). Its lineage as recorded
            # beside the tracker when it was saved says which saves continue it; without that
            # record nothing does (the readable saves may all be another lineage's).
            history = lineage.recorded(root).get(ref, history)
            others = [it for it in saved
                      if it != ref and not isinstance(chain(it), CheckpointError)]
            if isinstance(history, CheckpointError) and others:
                which = "the tracker names" if mark == ref else "the newest"
                raise CheckpointError(
                    f"checkpoint.load=auto cannot tell which saves of {root} continue iteration "
                    f"{ref} ({which}): {iter_dir(root, ref).name} cannot be read ({history}) and "
                    f"{lineage.RECORD} records no lineage for it, so its readable saves "
                    f"{others} may be another run's; load one explicitly (checkpoint.load={root} "
                    f"checkpoint.load_iteration=N)")
            if not isinstance(history, CheckpointError):
                notes.append(f"> checkpoint.load=auto: {iter_dir(root, ref).name} cannot be "
                             f"read; following its lineage as recorded in {lineage.RECORD} "
                             f"(run {history[-1][0]}, from iteration {history[-1][1]})")
        for it in reversed(saved):
            mine = chain(it)
            if it != ref and not isinstance(mine, CheckpointError):
                path = lineage.on_path(mine, it, history) if it < ref else (
                    None if not mine or not history else mine[-1][0] == history[-1][0])
                if path is None:
                    raise CheckpointError(
                        f"checkpoint.load=auto cannot tell whether {iter_dir(root, it).name} "
                        f"continues {iter_dir(root, ref).name} of {root} (one of them was saved "
                        f"before saves recorded their lineage); load one explicitly "
                        f"(checkpoint.load={root} checkpoint.load_iteration={it} or {ref})")
                if not path:
                    notes.append(f"> checkpoint.load=auto: skipped {iter_dir(root, it).name}: "
                                 f"another run's save (lineage {mine[-1][0]}, not "
                                 f"{history[-1][0]}), left in place")
                    continue
            problem = str(mine) if isinstance(mine, CheckpointError) else None
            if problem is None and verify:  # every rank: each chooses alike, whatever rank 0 moves
                found = verify_iteration(iter_dir(root, it)).problems
                problem = "; ".join(str(p) for p in found[:3]) or None
            if problem is not None:
                damaged.append((it, problem))
                continue
            if repair and mark != it:  # the tracker first: it never names a dir set aside
                write_durable(Path(root) / TRACKER, f"{it}\n")
            return it, notes + cls._set_aside(root, damaged, repair)
        raise CheckpointError(f"checkpoint.load=auto: no save of {root} of this run's lineage "
                              f"loads:\n" + "\n".join(notes + cls._set_aside(root, damaged,
                                                                             False)))

    @staticmethod
    def _set_aside(root, damaged: list, repair: bool) -> list[str]:
        """Notes on the damaged saves ``auto`` skipped (``(iteration, problem)``), each set
        aside (:func:`ckpt.io.lineage.set_aside`) with ``repair``."""
        notes = []
        for it, problem in damaged:
            kept = lineage.set_aside(iter_dir(root, it)) if repair else iter_dir(root, it)
            notes.append(f"> checkpoint.load=auto: skipped {iter_dir(root, it).name}: it is "
                         f"damaged ({problem}); kept as {kept}")
        return notes

    @property
    def saved_config(self) -> dict | None:
        """The run config the checkpoint recorded (None for one that recorded none)."""
        return self.common["train_state"].get("config")


class CheckpointManager:
    """Load, save, finalize and prune the checkpoints of one run (every rank holds one; global
    rank 0 renames and prunes). Every method but :meth:`should_save` is a collective.

    Args:
        ck: the ``checkpoint`` config group (``save``, ``save_interval``, ``save_at_end``,
            ``keep_last``, ``async_save``, ``verify_on_load``).
        plan: what this run loads (:class:`ResumePlan`), or None.
        layout_record: this run's :func:`ckpt.io.state.layout_record`.
    """

    def __init__(self, ck, plan: ResumePlan | None = None, layout_record: dict | None = None):
        self.root = ck.save
        self.interval = ck.save_interval
        self.save_at_end = ck.save_at_end
        self.keep_last = ck.keep_last
        self.verify = ck.get("verify_on_load", True)
        self.plan = plan
        self.layout_record = layout_record or {}
        # The iteration this run resumed from (kept by retention), or None.
        self.loaded = plan.iteration if plan is not None else None
        # The newest complete checkpoint of this run's lineage (for messages): where it resumed.
        self.last_good: Path | None = None
        # checkpoint.async_save: saves written in the background, finalized in poll()/wait().
        self.async_saves = AsyncSaves() if ck.get("async_save", False) else None
        self._started: int | None = None  # iteration of the last save started
        self._space_checked = False  # the exact disk pre-check of step() done

    def load(self, model, optimizer, scheduler) -> dict | None:
        """Load the plan's checkpoint into ``model``, ``optimizer`` and ``scheduler``
        (:func:`ckpt.io.load.load_checkpoint`, from the plan's common state).

        Returns:
            The checkpoint's common state; None without a plan (nothing loaded).

        Raises:
            CheckpointError: as :func:`ckpt.io.load.load_checkpoint`.
        """
        if self.plan is None:
            return None
        plan = self.plan
        common = load_checkpoint(plan.load, model, optimizer, scheduler, self.layout_record,
                                 plan.iteration, verify=self.verify,
                                 opened=(plan.path, plan.common))
        self.last_good = iter_dir(plan.load, plan.iteration)
        return common

    def should_save(self, iteration: int, train_iters: int) -> bool:
        """Save after ``iteration``: every ``save_interval``, and at the end with
        ``save_at_end``."""
        if not self.root:
            return False
        return bool((self.interval and iteration % self.interval == 0)
                    or (iteration == train_iters and self.save_at_end))

    def step(self, state, train_iters: int, logger=None) -> None:
        """After each iteration: finalize the background save in flight if every rank's writer
        has finished, then save ``state`` if :meth:`should_save`.

        After the run's first iteration (unless it saves then) the disk pre-check of a save runs
        once, so a save that cannot fit is refused before the iterations up to the first save
        are spent.

        Raises:
            CheckpointError: as :meth:`wait`, or a save that cannot start (disk space).
        """
        self.poll()
        checked, self._space_checked = self._space_checked, True  # once
        if self.should_save(state.iteration, train_iters):
            self.save(state, logger)
        elif self.root and not checked:  # the state a save holds exists now
            ensure_disk_space(self.root, expected_checkpoint_bytes(
                sharded_state_dict(state.model, state.optimizer, is_loading=False)),
                files=save_files(torch.distributed.get_world_size()))

    def check_space(self) -> None:
        """Before the first iteration of a resumed run with ``checkpoint.save``: its saves will
        be about the size of the one it loaded; refuse one that cannot fit (or find no inodes)
        now, not after the iterations before the first save are spent. A fresh run is checked
        exactly after its first iteration (:meth:`step`: its optimizer state exists from
        then), and every save checks again (:func:`ckpt.io.save.prepare_staging`).

        Raises:
            CheckpointError: as :func:`ckpt.io.files.ensure_disk_space`.
        """
        if not self.root or self.plan is None:
            return
        loaded = sum(f.stat().st_size for f in Path(self.plan.path).iterdir() if f.is_file())
        ensure_disk_space(self.root, loaded, files=save_files(torch.distributed.get_world_size()))

    def stop(self, state, logger=None) -> None:
        """The run stops after ``state.iteration``: save it synchronously unless its save has
        already started (a regular save of this iteration, waited for), then wait for the save
        in flight. Without ``checkpoint.save`` only the wait.

        Raises:
            CheckpointError: as :meth:`wait`.
        """
        if self.root and self._started != state.iteration:
            self.save(state, logger, sync=True)
        self.wait()

    def save(self, state, logger=None, sync: bool = False) -> Path:
        """Write the checkpoint of ``state.iteration`` (every rank calls this).

        Staged into a hidden dir, renamed into place and named by the tracker once every rank
        finished (:func:`ckpt.io.save.finalize_save`), then older complete saves
        beyond ``keep_last`` are removed and rank 0 logs the ``save`` event. With
        ``checkpoint.async_save`` the files are written in the background and all of that
        happens in a later :meth:`poll` / :meth:`wait`, unless ``sync`` (the save of an exit:
        complete on return, after the save in flight).

        Args:
            state: the worker's ``RunState`` (model, optimizer, scheduler, counters and
                ``train_state``: the run's fixed training-state entries).
            logger: the ``MetricLogger`` on rank 0, else None.

        Returns:
            The iter dir (complete on return only without ``async_save``, or with ``sync``).
        """
        iteration = state.iteration
        if self.async_saves is not None:
            with self._peer_lost_fails(self._started):
                self.async_saves.wait()  # the save still in flight moves the tracker first
        previous = tracked(self.root) if torch.distributed.get_rank() == 0 else None
        train_state = self._train_state(state, logger)
        complete = functools.partial(self._complete, iteration, previous, logger,
                                     time.perf_counter(), train_state.get(lineage.KEY))
        async_saves = None if sync else self.async_saves
        self._started = iteration
        with self._peer_lost_fails(iteration):
            staged = stage_save(self.root, iteration, state.model, state.optimizer,
                                state.scheduler, train_state, self.layout_record,
                                async_saves=async_saves, on_written=complete)
            if async_saves is None:
                complete(staged)
        return iter_dir(self.root, iteration)

    @contextlib.contextmanager
    def _peer_lost_fails(self, iteration: int | None):
        """A collective of a save that fails because a peer left (a rank killed or failed while
        the save was in flight: gloo's "closed/reset by peer", a ``DistError``) fails the save of
        ``iteration`` in the one form of a failed save (the launcher names the lost rank)."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            dist_error = getattr(torch.distributed, "DistError", ())
            if iteration is None or not (isinstance(exc, dist_error) or (
                    isinstance(exc, RuntimeError) and "by peer" in str(exc))):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            raise CheckpointError(failure_message(
                self.root, iteration, {torch.distributed.get_rank(): f"another rank stopped "
                                       f"answering ({type(exc).__name__}: {first})"})) from exc

    def _train_state(self, state, logger) -> dict:
        """The checkpoint's ``train_state``: the counters of ``state``, its fixed entries, this
        job's id and rank 0's wandb step of this iteration's row (a fork from this checkpoint
        branches there; a broadcast)."""
        step = torch.tensor([logger.last_step if logger is not None else 0],
                            device=collective_device())
        torch.distributed.broadcast(step, src=0)
        fixed = state.train_state
        return {"consumed_samples": state.consumed_samples,
                "wandb_run_id": fixed.get("wandb_run_id"),
                "job_id": job_id(),  # Slurm/submitit's: a requeue of it is the same run
                "lineage": fixed.get("lineage"),  # ckpt.io.lineage
                "wandb_step": int(step.item()), "config": fixed.get("config"),
                "data_plan": fixed.get("data_plan"), "skipped_iterations": state.skipped,
                IMPORTED_KEY: fixed.get(IMPORTED_KEY)}  # checkpoint.pretrained's HF model

    def _complete(self, iteration: int, previous: int | None, logger, started: float,
                  chain: list | None, staged: Path) -> None:
        """Every rank, once every rank's files of ``iteration`` are written: rename the staged
        save into place (its lineage ``chain`` recorded beside the tracker), then (rank 0) note
        a tracker that moves back, prune and log the seconds since the save started
        (``started``: ``time.perf_counter()``)."""
        path = finalize_save(self.root, iteration, staged, chain=chain)
        self.last_good = path
        if torch.distributed.get_rank() != 0:
            return
        if previous is not None and previous > iteration:
            retention = (f", or checkpoint.keep_last={self.keep_last} removes it once "
                         f"{self.keep_last} newer complete save(s) exist" if self.keep_last else "")
            print(f"> note: {TRACKER} in {self.root} moves back from {previous} to {iteration}; "
                  f"{iter_dir(self.root, previous).name} stays (checkpoint.load_iteration="
                  f"{previous} loads it) unless this run saves iteration {previous} too, which "
                  f"replaces it{retention}", flush=True)
        if self.keep_last:
            keep = (iteration,) if self.loaded is None else (iteration, self.loaded)
            remove_old_checkpoints(self.root, self.keep_last, keep=keep)
        seconds = time.perf_counter() - started
        if logger is not None:
            logger.event("save", iteration=iteration, path=str(path), seconds=round(seconds, 3))
        print(f"> saved checkpoint at iteration {iteration} to {path} in {seconds:.1f} s",
              flush=True)

    def poll(self) -> None:
        """Finalize the background save in flight if every rank's writer has finished (a
        collective; no-op without ``async_save``).

        Raises:
            CheckpointError: as :meth:`wait`.
        """
        if self.async_saves is not None:
            with self._peer_lost_fails(self._started):
                self.async_saves.poll()

    def wait(self) -> None:
        """Wait for the background save in flight and finalize it (a collective; no-op without
        ``async_save``).

        Raises:
            CheckpointError: a rank's writer failed or died; nothing was renamed into place,
                the tracker still names the previous checkpoint.
        """
        if self.async_saves is not None:
            with self._peer_lost_fails(self._started):
                self.async_saves.wait()
