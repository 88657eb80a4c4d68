"""Checkpoint saves written in the background (``checkpoint.async_save``): megatron's
``AsyncCallsQueue`` with one forked writer per rank, its results queue, the plan reuse across
saves of one structure, and the failure message every rank raises."""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing
import os
import queue
import re
import threading
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    _set_process_qos,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from gtp.collectives import all_ranks, any_rank, rank as global_rank
from ckpt.format.records import TRACKER
from mcore_compat.dist_checkpointing import keep_write_errors, set_write_results_queue
from ckpt.io import faults
from ckpt.io.errors import CheckpointError, rank_errors
from ckpt.io.files import read_tracker
from ckpt.io.lifetime import leave_parent_autogroup
from ckpt.io.writers import save_strategy

class _ForkedWriterResults:
    """The writers' results queue of asynchronous saves.

    megatron's forked writer ``put``s one item (its write results, or the exception it raised)
    and the training process ``get_nowait``s it when it finalizes the save. A fork-context pipe
    carries it; a daemon thread here drains the pipe as items arrive, so a writer never blocks
    on a full pipe (a plain ``multiprocessing.Queue`` would: its writer joins its feeder thread
    at exit, and nothing reads before the writer has exited).
    """

    # After the writer exited, what it sent is in the pipe; allow the drain thread this long.
    GRACE_S = 10.0

    def __init__(self):
        self._recv, self._send = multiprocessing.get_context("fork").Pipe(duplex=False)
        self._items: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, name="async-save-results", daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                self._items.put(self._recv.recv())
            except (EOFError, OSError):
                return

    def put(self, item) -> None:
        """In the writer process: send ``item`` (picklable)."""
        self._send.send(item)

    def get_nowait(self):
        """In the training process, once the writer has exited.

        Raises:
            queue.Empty: the writer sent nothing (it died); megatron reports the save failed.
        """
        return self._items.get(timeout=self.GRACE_S)


_RESULTS_QUEUES: dict = {}


def use_in_process_results_queue(async_save: bool = False) -> None:
    """Keep megatron's torch_dist writer from starting a multiprocessing Manager server.

    ``filesystem_async.get_write_results_queue`` (megatron-core 0.19.2) creates a spawned
    ``Manager().Queue()`` per rank on the first save, for the writers' results; the Manager
    server would outlive a killed rank, holding its stdout open and keeping the job's launcher
    waiting. Synchronous saves write in this process, so a thread-safe ``queue.Queue`` does the
    job. Asynchronous saves write in a process forked from this one (megatron's
    ``TemporalAsyncCaller``): their queue is a :class:`_ForkedWriterResults`, a pipe that dies
    with this process. Set before every save (the kind of the save decides), through
    :func:`mcore_compat.dist_checkpointing.set_write_results_queue`.
    """
    keep_write_errors()
    kind = "async" if async_save else "sync"
    if kind not in _RESULTS_QUEUES:  # one of each per process
        _RESULTS_QUEUES[kind] = _ForkedWriterResults() if async_save else queue.Queue()
    set_write_results_queue(_RESULTS_QUEUES[kind])


class AsyncSaves:
    """The checkpoint saves still being written in the background (``checkpoint.async_save``).

    megatron's ``AsyncCallsQueue`` (``dist_checkpointing.strategies.async_utils``, non-persistent:
    each save forks one writer process per rank, whose copy-on-write memory is the snapshot of
    the state at the save, so training goes on changing the live tensors). A save is complete
    only once every rank's writer has finished: then megatron's finalize steps (the global
    ``.metadata``) run on every rank, and after them this save's tracker update. At most one save
    is in flight: scheduling a new one first waits for the previous.

    The saves of a job reuse their plan while the checkpoint structure stays the same
    (megatron-LM's ``--ckpt-assume-constant-structure``, checked rather than assumed): they share
    one megatron ``TorchDistSaveShardedStrategy`` with cached save plans, and megatron's
    validation runs only when some rank's structure differs from the last validated save's
    (:meth:`save_options`). From the second save of a structure the validation is skipped and
    each rank's local plan reused (the global plan is still gathered on rank 0); from the third
    the whole plan is reused. The stall then holds building the sharded state dict, the
    structure check (two all-reduces), the layout record's gather, megatron's write
    preparation and the fork of the writer.

    Every method is a collective: every rank calls it at the same point.
    """

    def __init__(self):
        self._queue = AsyncCallsQueue(persistent=False)
        # A process that ends with a save in flight (an exception, Ctrl-C) kills its writer
        # instead of joining it at exit: that save can never be finalized.
        atexit.register(self.abort)
        self._strategy = None  # megatron's torch_dist strategy, its plans cached
        self._writers = None  # it, spread over the data-parallel replicas (ckpt.io.writers)
        self._fingerprint: str | None = None  # of the last save that validated and returned
        self._pending: str | None = None
        self._in_flight: tuple[Path, int] | None = None  # (root, iteration) being written

    def save_options(self, state: dict) -> dict:
        """``dist_checkpointing.save`` keyword arguments for saving ``state`` (a collective).

        Applies megatron's sharded-tensor factories to ``state`` in place (as its ``save``
        would first), so that the structure compared is what is written: the structure
        (:func:`structure_fingerprint`) is compared with the last validated save's on every
        rank; if it is the same everywhere, the cached strategy is reused and megatron's
        ``validate_access_integrity`` is skipped. That validation checks the sharding (unchanged
        since it passed) and compares rank 0's common state with every other rank's (iteration,
        scheduler, config: the same on every rank by construction; megatron only warns on a
        difference, and after the first save of a structure that warning is not looked for).
        Otherwise a fresh strategy is made and the save is validated; its structure counts as
        validated once :meth:`agree_on_plan_reuse` runs after ``save`` returned.

        Returns:
            ``{"sharded_strategy": :func:`ckpt.io.writers.save_strategy` of the cached
            strategy, "validate_access_integrity": bool}``.
        """
        apply_factories(state)
        fingerprint = structure_fingerprint(state)
        same = all_ranks(fingerprint == self._fingerprint and self._strategy is not None)
        if not same:
            self._strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
            self._writers = save_strategy(self._strategy, cache=True)
            self._fingerprint = None
        self._pending = fingerprint
        return {"sharded_strategy": self._writers, "validate_access_integrity": not same}

    def agree_on_plan_reuse(self) -> None:
        """After ``save`` returned on every rank: record the structure as validated and make the
        cached plan's reuse a decision of all ranks (a collective).

        megatron sets ``validated_cache_reuse`` (and, on rank 0, its cached global metadata) on
        each rank from its own plan; a rank that reused its plan while another planned again
        would hang the next save in the planning collectives. Where ranks differ, the cache is
        dropped and the next save plans and validates afresh on every rank.
        """
        if self._strategy is None:
            return
        local = bool(self._strategy.validated_cache_reuse)
        some_reuse, some_plan = any_rank(local, not local)
        if not (some_reuse and some_plan):  # every rank reused its plan, or none did
            self._fingerprint = self._pending
        else:
            self._strategy = self._fingerprint = None

    def schedule(self, request, root=None, iteration: int | None = None) -> None:
        """Start writing megatron's ``AsyncRequest`` (after the previous save is finalized): the
        writer megatron forks leaves this rank's scheduling group in its first instruction after
        the fork (:func:`_writer_fork_hook`). ``root`` and ``iteration``: the save's, for the
        error should it fail."""
        global _FORK_HOOK_REGISTERED, _WRITER_PARENT
        self.wait()
        self._in_flight = None if root is None else (Path(root), iteration)
        if not _FORK_HOOK_REGISTERED:
            os.register_at_fork(after_in_child=_writer_fork_hook)
            _FORK_HOOK_REGISTERED = True
        _WRITER_PARENT = (os.getpid(), threading.get_ident())
        try:
            self._queue.schedule_async_request(request)
        finally:
            _WRITER_PARENT = None

    def poll(self) -> None:
        """Finalize the save in flight if every rank's writer has finished (does not wait).

        Raises:
            CheckpointError: as :meth:`wait`.
        """
        if self._queue.get_num_unfinalized_calls():
            self._finalize(blocking=False)

    def wait(self) -> None:
        """Wait for the save in flight, then finalize it.

        Raises:
            CheckpointError: a rank's writer failed or died (on every rank; from megatron's
                ``CheckpointException``, a ``BaseException`` that torch's error recording
                misses); names the iteration, the ranks and each one's error, and the
                iteration the tracker still names.
        """
        if self._queue.get_num_unfinalized_calls():
            self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        calls = getattr(self._queue, "async_calls", None) or []
        writer = getattr(calls[0].async_caller, "process", None) if calls else None
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointException as exc:
            raise CheckpointError(self._failure_message(exc, writer)) from exc

    def _failure_message(self, exc, writer) -> str:
        """What failed in a background save (a collective: every rank of the save raised);
        :func:`failed_save_message`, with each rank's writer's exit code."""
        exit_code = getattr(writer, "exitcode", None)
        root, iteration = self._in_flight if self._in_flight is not None else (None, None)
        return failed_save_message(exc, root, iteration, exit_code, "the background save")

    def abort(self) -> None:
        """Kill the writer of a save still in flight (megatron's
        ``TemporalAsyncCaller.close(abort=True)``); that save is never finalized: its staging
        dir stays hidden and the tracker names the previous checkpoint. Not a collective."""
        calls = getattr(self._queue, "async_calls", None) or []
        while calls:
            calls.popleft().async_caller.close(abort=True)

    @property
    def pending(self) -> int:
        """Saves scheduled but not finalized yet (0 or 1)."""
        return self._queue.get_num_unfinalized_calls()


def failed_save_message(exc, root, iteration, exit_code=None, what: str = "the save") -> str:
    """What failed in a save whose ``dist_checkpointing.save`` raised ``exc`` on every rank (a
    collective).

    megatron's ``CheckpointException`` carries the failures (rank -> (exception, traceback)) on
    its coordinator only, and each rank knows its own writer's exit code (``exit_code``, of an
    asynchronous save's writer process): the ranks gather both, so every rank's message names
    every failed rank and its error (``OSError: [Errno 28] No space left on device``), the
    iteration, and the iteration the tracker still names.
    """
    mine = {}
    for rank, error in rank_errors(exc).items():
        text = str(error)
        mine[rank] = f"{type(error).__name__}: {text}"
        if "results_queue should not be empty" in text:  # megatron's words for it
            mine[rank] = "its writer ended without reporting a result"
        elif _WORKER_FAILURE.match(text):  # megatron's wrap of the writer's own error
            mine[rank] = f"writing its files failed: {_WORKER_FAILURE.match(text).group(1)}"
    if exit_code not in (None, 0):  # this rank's own writer, whatever megatron gathered
        mine[global_rank()] = f"its writer exited with code {exit_code}" + (
            f" (signal {-exit_code})" if exit_code < 0 else "")
    failures = dict(mine)
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        try:
            torch.distributed.all_gather_object(every, mine)
        except RuntimeError:  # a rank is gone (killed): what this rank knows
            every = []
        for other in every:  # a writer's exit code over megatron's words for it
            for rank, text in other.items():
                if rank not in failures or text.startswith("its writer exited"):
                    failures[rank] = text
    if not failures:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        failures = {global_rank(): f"megatron's {first}"}
    return failure_message(root, iteration, failures, what)


def failure_message(root, iteration: int, failures: dict, what: str = "the save",
                    outcome: str = "Nothing was renamed into place (the files written stay in "
                                   "the hidden staging dir)") -> str:
    """The one form of every save failure (docs/failures.md): ``the save of iteration N into
    DIR failed on rank(s) [R]: rank R: CAUSE. OUTCOME; latest_checkpointed_iteration.txt still
    names iteration M``. ``failures``: rank -> its cause; ranks with the same cause are named
    together."""
    groups: dict = {}
    for rank, text in sorted(failures.items()):
        groups.setdefault(text, []).append(rank)
    parts = [f"rank {ranks[0]}: {text}" if len(ranks) == 1 else f"ranks {ranks}: {text}"
             for text, ranks in groups.items()]
    tracked = ""
    if root is not None:
        root = Path(root)
        what += f" of iteration {iteration} into {root}"
        try:
            if not (root / TRACKER).exists():
                tracked = f"; {root} has no {TRACKER} yet (no save into it has completed)"
            else:
                tracked = f"; {TRACKER} still names iteration {read_tracker(root)}"
        except (CheckpointError, OSError) as error:
            tracked = f"; the tracker cannot be read: {error}"
    return (f"{what} failed on rank(s) {sorted(failures)}: {'; '.join(parts)}. {outcome}"
            f"{tracked}")


# megatron-core 0.19.2's words around a writer's error (filesystem_async.py), with the error's own
# text after them once mcore_compat.dist_checkpointing.keep_write_errors is installed.
_WORKER_FAILURE = re.compile(r"Worker failure: (?:An error is caught while starting worker "
                             r"\d+, error: )?(.*)", re.S)


# Nice value of the forked writer (megatron's persistent async writer's default): where it
# competes with training for cores, training keeps most of them; on idle cores it runs at full
# speed.
WRITER_NICE = 10


def structure_fingerprint(state: dict) -> str:
    """A digest of the structure of a sharded state dict: for each ``ShardedBase`` in it, its
    type, key, global shape and offset, fragmentation, replica id and the shape and dtype of its
    local data (every piece, main replica or not, and every sharded object); not the data.
    With its factories applied (their pieces are then in it), two saves with the same
    fingerprint on every rank have the same write items.

    Returns:
        A sha256 hex digest (64 characters).
    """
    fields = ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
              "flattened_range", "prepend_axis_num", "allow_shape_mismatch")
    items = []
    for value in nested_values(state):
        if not isinstance(value, ShardedBase):
            continue
        data = getattr(value, "data", None)
        local = (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None
        items.append((type(value).__name__, local,
                      *(repr(getattr(value, name, None)) for name in fields)))
    return hashlib.sha256(repr(items).encode()).hexdigest()


# (rank pid, thread) while that thread of the rank, in AsyncSaves.schedule, forks megatron's
# writer; None otherwise.
_WRITER_PARENT: tuple[int, int] | None = None
_FORK_HOOK_REGISTERED = False


def _writer_fork_hook() -> None:
    """``os.register_at_fork`` child hook: in the writer forked by :meth:`AsyncSaves.schedule`,
    leave the rank's scheduling group at once (:func:`ckpt.io.lifetime.leave_parent_autogroup`),
    before Python's process start-up, which would otherwise run at the rank's weight while the
    rank returns to training. Forks by other threads, by other code and by the writer itself are
    left alone."""
    global _WRITER_PARENT
    parent, _WRITER_PARENT = _WRITER_PARENT, None
    if parent is not None and parent[1] == threading.get_ident():
        leave_parent_autogroup(parent[0], WRITER_NICE)


def write_in_background(write_fn, iteration: int, rank: int, *args, **kwargs) -> None:
    """The forked writer (already in a scheduling group of its own: :func:`_writer_fork_hook`):
    the ``async_write`` fault point, then megatron's write at nice :data:`WRITER_NICE`
    (megatron's ``async_utils._set_process_qos``, as its persistent writer: raised to that
    value, never lowered)."""
    try:
        faults.maybe_fail("async_write", iteration, rank)
        _set_process_qos(WRITER_NICE, None)
    except Exception as exc:  # noqa: BLE001 - reported as megatron's writer reports its own
        # Where megatron's writer puts its results or its error: the save then fails on every
        # rank naming this error, not only "its writer exited with code 1".
        filesystem_async.get_write_results_queue().put(exc)
        return
    write_fn(*args, **kwargs)
