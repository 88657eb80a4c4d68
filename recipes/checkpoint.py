"""Save and load Megatron ``torch_dist`` checkpoints that reshard across TP, PP, DP and GTP layouts
and between megatron's plain and distributed optimizer.

Folder layout (Megatron-LM's)::

    <save>/iter_0000020/                    megatron dist_checkpointing (torch_dist) files
    <save>/latest_checkpointed_iteration.txt  written only after every rank finished the save

What one checkpoint holds: ``model`` and ``optimizer`` (Adam moments, fp32 main params and
``step``, sharded like their params), the lr scheduler, ``iteration``, the training state
(consumed samples, wandb run id), the resolved run config, the layout it was saved at and each
rank's RNG state.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import re
import shutil
from pathlib import Path

import torch

from gtp.records import TRACKER, megatron_core_version, saved_layout, stored_layout
from gtp.safe_metadata import reused as _metadata_reused
from recipes import faults, vocab
from recipes.lifetime import die_with_parent


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded exactly; the message names the file or tensor."""


def iter_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``<root>/iter_0000020`` (Megatron-LM's 7-digit name)."""
    return Path(root) / f"iter_{iteration:07d}"


def _check_root(root: Path) -> None:
    """``root`` must be a checkpoint dir (the parent of ``iter_*`` dirs)."""
    if root.is_file():
        raise CheckpointError(f"checkpoint.load={str(root)!r} is a file, not a directory: point it "
                              f"at the 'checkpoints' dir of a run")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint.load={str(root)!r}: no such directory")
    if ITER_NAME.fullmatch(root.name):
        raise CheckpointError(
            f"checkpoint.load={str(root)!r} is one saved iteration, not a checkpoint dir: use "
            f"checkpoint.load={str(root.parent)!r} checkpoint.load_iteration={int(root.name[5:])}")


def _unreadable(file: Path, exc: BaseException, what: str) -> CheckpointError:
    """The error for a checkpoint file that exists but cannot be read as ``what``."""
    return CheckpointError(
        f"{file} cannot be read ({_errors(exc)}): it is torn or not {what}; load another "
        f"iteration (checkpoint.load_iteration=N) or another checkpoint.load")


def _errors(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for torch DCP's ``CheckpointException``, that of each
    rank's exception (:func:`_rank_errors`) instead of the traces."""
    errors = _rank_errors(exc)
    if errors:
        return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                         for rank, error in sorted(errors.items()))
    return f"{type(exc).__name__}: {exc}"


def _rank_errors(exc: BaseException) -> dict:
    """rank -> exception of torch DCP's ``CheckpointException`` (its ``failures``: rank ->
    (exception, traceback)); empty for any other exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return {}
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in exc.failures.items()}


def read_tracker(root: str | os.PathLike) -> int:
    """The iteration named by ``<root>/latest_checkpointed_iteration.txt``.

    Raises:
        CheckpointError: the dir or tracker is missing/empty/garbled (not UTF-8, not a number),
            ``root`` is a file or an ``iter_*`` dir, or the tracker names an iteration whose
            folder is missing.
    """
    root = Path(root)
    _check_root(root)
    tracker = root / TRACKER
    if not tracker.is_file():
        found = sorted(p.name for p in root.glob("iter_*"))
        hint = f" (it holds {found} but no complete save)" if found else " (it is empty)"
        raise CheckpointError(
            f"checkpoint.load={str(root)!r} has no {TRACKER}{hint}: point it at the 'checkpoints' "
            f"dir of a run that finished at least one save"
        )
    raw = tracker.read_bytes()
    try:
        text = raw.decode("utf-8").strip()
        iteration = int(text)
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{tracker}: expected an iteration number, found {raw[:40]!r}") from None
    if not iter_dir(root, iteration).is_dir():
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iter_dir(root, iteration)} is missing")
    return iteration


ITER_NAME = re.compile(r"iter_(\d{7,})")


def saved_iterations(root) -> list[int]:
    """Iterations of ``root`` whose ``iter_*`` dir holds a complete save (megatron's two
    metadata files), ascending. Staging dirs are hidden and never listed."""
    found = []
    for p in Path(root).glob("iter_*"):
        match = ITER_NAME.fullmatch(p.name)
        if match and all((p / name).is_file() for name in ("metadata.json", ".metadata")):
            found.append(int(match.group(1)))
    return sorted(found)


def check_loadable(root: str | os.PathLike, iteration: int | None = None) -> Path:
    """Cheap pre-launch check that ``root`` holds a complete checkpoint; returns its iter dir.

    Args:
        root: the checkpoint dir.
        iteration: a specific saved iteration; None: the one the tracker names. Any complete
            ``iter_*`` dir loads, also one newer than the tracker (saves are renamed into place
            only when complete).

    Raises:
        CheckpointError: as :func:`read_tracker`, the iteration is missing or incomplete, its
            data files are truncated, or its metadata is not what a checkpoint holds.
    """
    latest = read_tracker(root)
    if iteration is None:
        iteration = latest
    elif not iter_dir(root, iteration).is_dir():
        raise CheckpointError(
            f"checkpoint.load_iteration={iteration}: no complete save of it in {root}; "
            f"complete iterations there: {saved_iterations(root)}"
        )
    path = iter_dir(root, iteration)
    # megatron 0.19.2 keeps the common state inside .metadata (older versions: common.pt).
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    _check_storage(path)
    return path


def _check_storage(path: Path) -> None:
    """Every item the checkpoint's metadata lists lies inside its data file.

    Cheap (one stat per file) and done before any tensor is read, so a truncated or missing
    ``.distcp`` file fails the load before it changes anything.

    Raises:
        CheckpointError: naming the file, its size, what should be there and one tensor in it.
    """
    from gtp.safe_metadata import UnsafeMetadataError, install, read_metadata

    install()
    try:
        metadata = read_metadata(path)
    except UnsafeMetadataError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a torn .metadata
        raise _unreadable(path / ".metadata", exc, "a torch_dist checkpoint's metadata") from exc
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, fqn) in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            state = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"{file} {state}, but the checkpoint's metadata places data up to byte {end} "
                f"in it (e.g. tensor {fqn!r}): the checkpoint is truncated or incomplete"
            )


def _rng_state() -> dict:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    # Plain values and tensors only (numpy's key array as a tensor), so the state loads with
    # torch.load(weights_only=True).
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "random": random.getstate(),
        "np": [kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    kind, key, pos, has_gauss, gauss = state["np"]
    key = key.numpy() if isinstance(key, torch.Tensor) else key
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    # One entry per global rank; only meaningful when the load layout is identical.
    return ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)


def optimizer_metadata(optimizer) -> dict:
    """The ``metadata`` megatron's ``sharded_state_dict`` takes: the distributed optimizer's
    checkpoint format (``distrib_optim_sharding_type``) when it is one, and
    ``chained_optim_avoid_prefix``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # Tensor keys without megatron's per-optimizer "chained_<i>." prefix: an MoE model has a
    # dense and an expert optimizer where experts are split (EP, ETP != TP, expert GTP), one
    # elsewhere; the keys of each param's moments are then the same at every layout.
    out = {"chained_optim_avoid_prefix": True}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            # The one layout-changing format (recipes.validate refuses the others).
            out["distrib_optim_sharding_type"] = "fully_reshardable"
    return out


def _model_sharded_state_dict(model) -> dict:
    """The model's sharded state dict; with virtual pipeline stages one sub-dict per chunk
    (``chunk0``, ``chunk1``...). Only the ShardedTensor keys reach the file (global layer
    numbers), so the nesting does not tie a checkpoint to a chunk count."""
    from megatron.core.utils import unwrap_model

    from recipes.model import model_chunks

    chunks = model_chunks(model)
    if len(chunks) == 1:
        return unwrap_model(chunks[0]).sharded_state_dict()
    return {f"chunk{i}": unwrap_model(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _load_model_state(model, loaded: dict) -> None:
    from megatron.core.utils import unwrap_model

    from recipes.model import model_chunks

    chunks = model_chunks(model)
    if len(chunks) == 1:
        unwrap_model(chunks[0]).load_state_dict(loaded, strict=True)
        return
    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[f"chunk{i}"], strict=True)


def _sharded_state_dict(model, optimizer, is_loading: bool, adapt=None) -> dict:
    model_sd = _model_sharded_state_dict(model)
    if adapt is not None:
        adapt(model_sd)  # before the optimizer's entries are derived from the model's
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                  metadata=optimizer_metadata(optimizer)),
    }


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


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
        import multiprocessing
        import queue
        import threading

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


def _use_in_process_results_queue(async_save: bool = False) -> None:
    """Keep megatron's torch_dist writer from starting a multiprocessing Manager server.

    ``filesystem_async.get_write_results_queue`` (megatron-core 0.19.2) creates a spawned
    ``Manager().Queue()`` per rank on the first save, for the writers' results; the Manager
    server would outlive a killed rank, holding its stdout open and keeping the job's launcher
    waiting. Synchronous saves write in this process, so a thread-safe ``queue.Queue`` does the
    job. Asynchronous saves write in a process forked from this one (megatron's
    ``TemporalAsyncCaller``): their queue is a :class:`_ForkedWriterResults`, a pipe that dies
    with this process. Set before every save (the kind of the save decides).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    kind = "async" if async_save else "sync"
    if kind not in _RESULTS_QUEUES:  # one of each per process
        _RESULTS_QUEUES[kind] = _ForkedWriterResults() if async_save else queue.Queue()
    filesystem_async._results_queue = _RESULTS_QUEUES[kind]


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
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)
        # A process that ends with a save in flight (an exception, Ctrl-C) kills its writer
        # instead of joining it at exit: that save can never be finalized.
        atexit.register(self.abort)
        self._strategy = None
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
            ``{"sharded_strategy": TorchDistSaveShardedStrategy, "validate_access_integrity":
            bool}``.
        """
        from megatron.core.dist_checkpointing.mapping import apply_factories
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        apply_factories(state)
        fingerprint = structure_fingerprint(state)
        same = _all_ranks(fingerprint == self._fingerprint and self._strategy is not None)
        if not same:
            self._strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
            self._fingerprint = None
        self._pending = fingerprint
        return {"sharded_strategy": self._strategy, "validate_access_integrity": not same}

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
        some_reuse, some_plan = _any_rank(local, not local)
        if not (some_reuse and some_plan):  # every rank reused its plan, or none did
            self._fingerprint = self._pending
        else:
            self._strategy = self._fingerprint = None

    def schedule(self, request, root=None, iteration: int | None = None) -> None:
        """Start writing megatron's ``AsyncRequest`` (after the previous save is finalized): the
        writer megatron forks leaves this rank's scheduling group in its first instruction after
        the fork (:func:`_writer_fork_hook`). ``root`` and ``iteration``: the save's, for the
        error should it fail."""
        import threading

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
        from torch.distributed.checkpoint.api import CheckpointException

        calls = getattr(self._queue, "async_calls", None) or []
        writer = getattr(calls[0].async_caller, "process", None) if calls else None
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointException as exc:
            raise CheckpointError(self._failure_message(exc, writer)) from exc

    def _failure_message(self, exc, writer) -> str:
        """What failed in a background save (a collective: every rank of the save raised).

        megatron's ``CheckpointException`` carries the failures (rank -> (exception,
        traceback)) on its coordinator only, and each rank knows its own writer's exit code:
        the ranks gather both, so every rank's error names every failed rank.
        """
        exit_code = getattr(writer, "exitcode", None)
        mine = {}
        for rank, error in _rank_errors(exc).items():
            mine[rank] = f"{type(error).__name__}: {error}"
            if "results_queue should not be empty" in str(error):  # megatron's words for it
                mine[rank] = "its writer ended without reporting a result"
        if exit_code not in (None, 0):  # this rank's own writer, whatever megatron gathered
            mine[_rank()] = f"its writer exited with code {exit_code}" + (
                f" (signal {-exit_code})" if exit_code < 0 else "")
        failures = dict(mine)
        if torch.distributed.is_initialized():
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
            for other in every:  # a writer's exit code over megatron's words for it
                for rank, text in other.items():
                    if rank not in failures or text.startswith("its writer exited"):
                        failures[rank] = text
        parts = [f"rank {rank}: {text}" for rank, text in sorted(failures.items())] or [
            f"megatron's {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"]
        what = "the background save"
        tracked = ""
        if self._in_flight is not None:
            root, iteration = self._in_flight
            what += f" of iteration {iteration} into {root}"
            if not (root / TRACKER).exists():
                tracked = f"; {root} has no {TRACKER} yet (no save into it has completed)"
            else:
                try:
                    tracked = f"; {TRACKER} still names iteration {read_tracker(root)}"
                except CheckpointError as error:
                    tracked = f"; the tracker cannot be read: {error}"
        return (f"{what} failed on rank(s) {sorted(failures)}: {'; '.join(parts)}. Nothing "
                f"was renamed into place (the files written stay in the hidden staging dir)"
                f"{tracked}")

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
    import hashlib

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

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


def _any_rank(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is true on any rank (one collective for all of them,
    :func:`_max_over_ranks`; the flags as they are without a process group)."""
    if not torch.distributed.is_initialized():
        return flags
    return _max_over_ranks(flags)


def _all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (a collective, :func:`_any_rank`
    of its negation; ``flag`` as is without a process group)."""
    return not _any_rank(not flag)[0]


def _leave_rank_autogroup(rank_pid: int) -> bool:
    """Move the forked writer out of its rank's scheduling group, to one of its own at
    :data:`WRITER_NICE`, armed to be killed when its rank dies.

    With the kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``; they apply to
    tasks in the root CPU cgroup) each session shares the cores as one unit, and torch's elastic
    launcher starts every rank in a session of its own: a writer forked into its rank's session
    is niced only against that rank and, while the rank waits, takes the rank's whole share
    against the other ranks (measured with 4 ranks on 2 cores: the barrier after an async save
    waited 0.3-0.9 s for ranks that got no core; SCHED_IDLE did not help either). ``setsid``
    gives the writer a session, hence an autogroup, of its own, niced through
    ``/proc/self/autogroup`` (:func:`_set_autogroup_nice`). Outside the rank's process group the
    launcher's ``killpg`` no longer reaches the writer, so the kernel's death signal
    (``PR_SET_PDEATHSIG``: SIGKILL when the rank dies) is armed first, and without it the
    writer stays in the rank's session; it exits at once if the rank already died. In a CPU
    cgroup the new session changes nothing and megatron's per-process nice does the work.

    Returns:
        Whether the writer now runs in a session of its own.
    """
    if not die_with_parent(rank_pid):  # exits at once if the rank already died
        return False
    try:
        os.setsid()
    except OSError:
        return False  # a process-group leader cannot start a session
    _set_autogroup_nice(WRITER_NICE)
    return True


def _set_autogroup_nice(nice: int, path: str = "/proc/self/autogroup",
                        attempts: int = 30) -> bool:
    """Set the nice value of this process's autogroup (raising it needs no privilege).

    Without CAP_SYS_ADMIN the kernel accepts one autogroup nice change per 100 ms on the whole
    machine and answers EAGAIN to the others, and every rank's writer starts at the same moment:
    each retries after 0.10-0.15 s (jittered) until its value is read back.

    Returns:
        Whether ``path`` reads back ``nice`` (False where there are no autogroups).
    """
    import random
    import time

    for _ in range(attempts):
        try:
            with open(path, "w") as f:
                f.write(str(nice))
        except BlockingIOError:  # EAGAIN: another autogroup changed its nice in the last 100 ms
            time.sleep(0.1 + 0.05 * random.random())
            continue
        except OSError:
            return False
        try:
            with open(path) as f:
                return f.read().split()[-1] == str(nice)
        except (OSError, IndexError):
            return False
    return False


# (rank pid, thread) while that thread of the rank, in AsyncSaves.schedule, forks megatron's
# writer; None otherwise.
_WRITER_PARENT: tuple[int, int] | None = None
_FORK_HOOK_REGISTERED = False


def _writer_fork_hook() -> None:
    """``os.register_at_fork`` child hook: in the writer forked by :meth:`AsyncSaves.schedule`,
    leave the rank's scheduling group at once (:func:`_leave_rank_autogroup`), before Python's
    process start-up, which would otherwise run at the rank's weight while the rank returns to
    training. Forks by other threads, by other code and by the writer itself are left alone."""
    import threading

    global _WRITER_PARENT
    parent, _WRITER_PARENT = _WRITER_PARENT, None
    if parent is not None and parent[1] == threading.get_ident():
        _leave_rank_autogroup(parent[0])


def _write_in_background(write_fn, iteration: int, rank: int, *args, **kwargs) -> None:
    """The forked writer (already in a scheduling group of its own: :func:`_writer_fork_hook`):
    the ``async_write`` fault point, then megatron's write at nice :data:`WRITER_NICE`
    (megatron's ``async_utils._set_process_qos``, as its persistent writer: raised to that
    value, never lowered)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import _set_process_qos

    faults.maybe_fail("async_write", iteration, rank)
    _set_process_qos(WRITER_NICE, None)
    write_fn(*args, **kwargs)


def staging_dir(root, iteration: int) -> Path:
    """``<root>/.iter_0000020.staging``: where a save is written before it is renamed into place.

    Hidden, so nothing that lists ``iter_*`` (loading, retention, the tracker) ever sees it.
    """
    return Path(root) / f".{iter_dir(root, iteration).name}.staging"


def _gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (megatron pauses it the same way
    around its async save, ``async_utils._disable_gc``).

    A save or load builds and drops tens of thousands of short-lived containers (sharded
    tensors, plans, read items): enough to start full collections, each of which walks every
    object of the training process (about 0.25 s per rank for gpt125m, measured in
    ``benchmarks.checkpoint_io``). Reference counting frees them anyway; cycles among them are
    collected by the first collection after ``fn`` returns.
    """
    import gc

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


@_gc_paused
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
        CheckpointError: not enough disk space (before anything is written).
    """
    from megatron.core import dist_checkpointing

    staged = staging_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if async_saves is not None:
        async_saves.wait()  # the previous save completes (or fails) before this one starts
    _use_in_process_results_queue(async_saves is not None)
    state = _sharded_state_dict(model, optimizer, is_loading=False)
    ensure_disk_space(root, expected_checkpoint_bytes(state))
    if rank == 0:
        # A leftover of an interrupted save: never a checkpoint (it was never renamed).
        if staged.exists():
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
    _barrier()
    from gtp.checkpoint import METADATA_KEY, layout_metadata

    state.update(
        iteration=iteration,
        opt_param_scheduler=scheduler.state_dict(),
        train_state=common,
        # pad_for_alignment is the gtp_layout record's (one owner); saved_layout() joins them.
        layout=stored_layout(layout_dict),
        rng_state=_rng_sharded_object(),
        # The real (unpadded) vocabulary: a load with another tokenizer is refused.
        **{vocab.RECORD_KEY: vocab.real_vocab_size(model)},
        # How GTP weights are laid out in this file (gtp/checkpoint.py documents the format);
        # built before save, which applies the sharded factories in place.
        **{METADATA_KEY: layout_metadata(model, state["model"])},
    )
    if async_saves is None:
        with faults.while_writing(iteration, rank):
            dist_checkpointing.save(state, str(staged))
        faults.maybe_fail("save", iteration, rank)
        return staged
    # megatron's own async path ("mcore"; the "nvrx" default needs nvidia-resiliency-ext).
    request = dist_checkpointing.save(state, str(staged), async_sharded_save=True,
                                      async_strategy="mcore", **async_saves.save_options(state))
    async_saves.agree_on_plan_reuse()
    if request.async_fn is not None:
        request = request._replace(async_fn=functools.partial(
            _write_in_background, request.async_fn, iteration, rank))

    def written() -> None:
        faults.maybe_fail("save", iteration, rank)
        if on_written is not None:
            on_written(staged)

    # Runs after megatron's own finalize steps (the global .metadata into the staged dir).
    request.add_finalize_fn(written)
    async_saves.schedule(request, root, iteration)
    return staged


def finalize_save(root, iteration: int, staged: Path) -> Path:
    """Make a staged save the checkpoint of ``iteration`` once every rank finished writing.

    A barrier first (a rank that died or failed while writing stops the others here, and the
    staged dir is never renamed); then global rank 0 moves any existing ``iter_*`` of the same
    iteration aside, renames the staged dir into place, writes the tracker, then removes the
    old one. Every step is a rename within ``root``: a crash at any point leaves either the old
    or the new complete checkpoint under its name (or the old one as ``.iter_*.replaced``,
    which :func:`recover_replaced` puts back).

    Returns:
        The iter dir.
    """
    _barrier()
    path = iter_dir(root, iteration)
    failure = [None]
    if _rank() == 0:
        from recipes.lease import check_writer

        try:
            check_writer(root)  # still this run's dir: one live writer (recipes/lease.py)
            replaced = Path(root) / f".{path.name}.replaced"
            if path.exists():
                if replaced.exists():
                    shutil.rmtree(replaced)
                os.replace(path, replaced)
            os.replace(staged, path)
            fsync_dir(root)
            # The tracker first: a crash before it leaves the old save aside for
            # recover_replaced.
            write_durable(Path(root) / TRACKER, f"{iteration}\n")
            if replaced.exists():
                shutil.rmtree(replaced)
        except (CheckpointError, OSError) as exc:
            failure[0] = exc
    # Every rank raises rank 0's error (none waits alone in a later collective).
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        message = [None if failure[0] is None else f"{type(failure[0]).__name__}: {failure[0]}"]
        torch.distributed.broadcast_object_list(message, src=0)
        if failure[0] is None and message[0] is not None:
            raise CheckpointError(f"finalizing the save of iteration {iteration} into {root} "
                                  f"failed on rank 0: {message[0]}")
    if failure[0] is not None:
        raise failure[0]
    return path


def recover_replaced(root) -> list[Path]:
    """Put back a complete checkpoint that a crash left as ``.iter_*.replaced`` (its
    replacement never got renamed into place); returns the dirs restored."""
    restored = []
    for aside in Path(root).glob(".iter_*.replaced"):
        target = Path(root) / aside.name[1:-len(".replaced")]
        if not target.exists():
            os.replace(aside, target)
            restored.append(target)
    return restored


def save_checkpoint(root, iteration: int, model, optimizer, scheduler, common: dict,
                    layout_dict: dict, async_saves: AsyncSaves | None = None, on_done=None) -> Path:
    """Save a checkpoint of ``iteration`` under ``root`` (every rank calls this).

    Staged (:func:`stage_save`) then renamed into place (:func:`finalize_save`): an existing
    complete checkpoint of the same iteration stays loadable until the new one is complete on
    every rank.

    Args:
        root: the checkpoint dir (``checkpoint.save``).
        iteration: completed optimizer steps.
        model: the DDP-wrapped megatron model.
        optimizer: the megatron optimizer.
        scheduler: megatron's ``OptimizerParamScheduler``.
        common: small state identical on every rank (consumed samples, wandb run id, resolved
            config...): plain python values only, so it loads with ``weights_only=True``.
        layout_dict: the ``Layout`` the run uses (:func:`layout_record`), recorded so a loader
            knows what wrote it.
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
        path = finalize_save(root, iteration, staged)
        if on_done is not None:
            on_done(path)

    staged = stage_save(root, iteration, model, optimizer, scheduler, common, layout_dict,
                        async_saves=async_saves, on_written=written)
    if async_saves is None:
        written(staged)
    return iter_dir(root, iteration)


def write_durable(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a unique temp file beside it, fsync,
    rename, fsync of the dir. Readers see the old or the new content, never a torn one."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path) -> None:
    """fsync a directory, so renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Checkpoint files add metadata and alignment to the raw tensor bytes; ask for this much more.
SPACE_MARGIN = 1.10
SPACE_SLACK_BYTES = 16 << 20


def expected_checkpoint_bytes(sharded_state: dict) -> int:
    """Bytes the tensors of one save will take, summed over all ranks (a collective).

    Counts each tensor's main replica only (``replica_id`` all zeros), as the writer does.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    local = 0
    for item in nested_values(sharded_state):
        data = getattr(item, "data", None)
        if isinstance(data, torch.Tensor) and is_main_replica(getattr(item, "replica_id", 0)):
            local += data.numel() * data.element_size()
    if not torch.distributed.is_initialized():
        return local
    from gtp.collectives import collective_device

    total = torch.tensor([local], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(total)
    return int(total.item())


def ensure_disk_space(root, needed_bytes: int, free_bytes: int | None = None) -> None:
    """Refuse to start a save that cannot fit, instead of leaving a half-written checkpoint.

    Args:
        root: the checkpoint dir (or the nearest existing parent is measured).
        needed_bytes: tensor bytes of the save (:func:`expected_checkpoint_bytes`).
        free_bytes: free bytes to assume (tests); default: measured with ``shutil.disk_usage``.

    Raises:
        CheckpointError: naming the dir, the free and the needed space.
    """
    target = Path(root)
    while not target.exists() and target != target.parent:
        target = target.parent
    free = shutil.disk_usage(target).free if free_bytes is None else free_bytes
    needed = int(needed_bytes * SPACE_MARGIN) + SPACE_SLACK_BYTES
    if free < needed:
        raise CheckpointError(
            f"not enough disk space to save a checkpoint in {root}: {free / 2**20:.1f} MiB free, "
            f"about {needed / 2**20:.1f} MiB needed; free space or set checkpoint.save elsewhere "
            f"(checkpoint.keep_last=K removes older saves)"
        )


def remove_old_checkpoints(root, keep_last: int, keep: tuple[int, ...] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (rank 0 only).

    Counts only complete saves (:func:`saved_iterations`); never removes the one the tracker
    names, nor those in ``keep``, nor anything incomplete (staging dirs are hidden).
    """
    current = read_tracker(root)
    done = saved_iterations(root)
    removed = []
    for it in done[:-keep_last] if keep_last else []:
        if it != current and it not in keep:
            shutil.rmtree(iter_dir(root, it))
            removed.append(iter_dir(root, it))
    return removed


def load_common(root, iteration: int | None = None) -> tuple[Path, dict]:
    """The iter dir and the common (non-sharded) state of a checkpoint (default: the tracker's)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

    from gtp import dcp_reader

    path = check_loadable(root, iteration)
    dcp_reader.install()  # a damaged data file is named (DataFileError)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (Exception, DCPCheckpointException) as exc:  # torn or foreign (a BaseException from DCP)
        where = path / "common.pt" if (path / "common.pt").exists() else path  # else in DCP files
        raise _unreadable(where, exc, "a megatron checkpoint's common state") from exc
    for key in ("iteration", "layout", "train_state", "opt_param_scheduler"):
        if key not in common:
            raise CheckpointError(f"{path} was not written by gtp-recipes: common state lacks {key!r}")
    return path, common


@_gc_paused
@_metadata_reused()  # one unpickling of .metadata for the whole load
def load_checkpoint(root, model, optimizer, scheduler, layout_dict: dict,
                    iteration: int | None = None, verify: bool = True) -> dict:
    """Load a checkpoint of ``root`` (the tracker's, or ``iteration``) into ``model``,
    ``optimizer`` and ``scheduler``.

    The checkpoint may have been saved at any layout: dist_checkpointing reshards every tensor.
    At another padded vocabulary size the real vocabulary rows load exactly and the padding rows
    are zero (``recipes.vocab``). Each rank's RNG state is restored only when the layout is
    identical (the state is per rank).

    Args:
        layout_dict: this run's :func:`layout_record`.
        verify: check every byte of the checkpoint first (``checkpoint.verify_on_load``;
            :func:`gtp.verify.check_share`, each rank a share of the data files).

    Returns:
        The checkpoint's common state (``iteration``, ``train_state``, ``layout``...).

    Raises:
        CheckpointError: incomplete or damaged checkpoint (naming the file and the item, before
            any tensor is read), another real vocabulary size (both named, before any tensor is
            read), a tensor missing from it, or a shape mismatch (naming the tensor and both
            shapes).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.utils import unwrap_model
    # torch DCP's CheckpointException derives from BaseException, not Exception.
    from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

    path, common = load_common(root, iteration)
    if verify:
        verify_before_load(path)
    message = vocab.refusal(common.get(vocab.RECORD_KEY), vocab.real_vocab_size(model), path)
    if message:
        raise CheckpointError(message)
    # A legacy GTP checkpoint (megatron-core 0.19.2's padded layout) is converted once into
    # <root>/gtp_converted/ and loaded from there; its RNG states are not carried over.
    from gtp import checkpoint as gtp_checkpoint, dcp_reader, legacy

    try:
        path, converted = legacy.prepare_load(path, common, layout_dict,
                                              stock_writer=not gtp_checkpoint.is_installed())
    except legacy.LegacyCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    from recipes import optim_checkpoint

    try:
        mine = optim_checkpoint.kind_of(optimizer)
        saved = optim_checkpoint.saved_kind(common.get("optimizer", {}))
    except optim_checkpoint.OptimizerCheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    optim_checkpoint.prepare_for_load(optimizer)
    stored = _stored_shapes(path)
    real = vocab.real_vocab_size(model)

    def adapt(model_sd):
        if real is None:
            return
        for sd in (model_sd.values() if "chunk0" in model_sd else (model_sd,)):
            try:
                vocab.adapt_to_stored_rows(sd, stored, real, path)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None

    state = _sharded_state_dict(model, optimizer, is_loading=True, adapt=adapt)
    check_shapes(state, path, stored, skip_prefixes=("optimizer.state.param.",
                                                    "optimizer.state.fp32_param."))
    from recipes import precision_change
    from recipes.model import model_chunks

    precision = precision_change.prepare(
        state, stored, mine, precision_change.saved_is_bf16(
            common["train_state"].get("config"), stored),
        precision_change.is_bf16(model_chunks(model)))
    dropped = optim_checkpoint.prepare_request(state["optimizer"], stored, mine, saved)
    same_layout = saved_layout(common) == dict(layout_dict) and not converted
    if same_layout:
        state["rng_state"] = _rng_sharded_object()
    failure = None
    try:
        # megatron's naming: "unexpected" = requested here but absent from the checkpoint (an
        # error, raised before any tensor is read); "missing" = in the checkpoint but not
        # requested (fine: e.g. another layout's RNG).
        dcp_reader.install()  # a request for a run of stored rows reads those bytes only
        # Every byte of these files was just verified: the reader need not CRC them again.
        with dcp_reader.crc_unchecked() if verify and not converted else contextlib.nullcontext():
            loaded = dist_checkpointing.load(state, str(path),
                                             strict=StrictHandling.RAISE_UNEXPECTED)
    except (Exception, DCPCheckpointException) as exc:  # noqa: BLE001 - reported below
        failure = exc
    # A rank can fail alone (its own tensors, a file only it reads): agree before anyone
    # raises, so no rank waits alone in a later collective.
    if any_rank_failed(failure is not None):
        if failure is None:
            raise CheckpointError(f"cannot load {path}: loading failed on another rank")
        what = ("lacks tensors this model needs" if "unexpected" in str(failure).lower()
                else "cannot be loaded")
        detail = str(failure)
        if isinstance(failure, DCPCheckpointException):  # each rank's error first, then traces
            detail = _errors(failure) + "\n" + detail
        detail = detail if len(detail) <= 2000 else detail[:2000] + " ..."
        raise CheckpointError(f"{path} {what}: {detail}") from failure
    precision_change.finish(precision, loaded)
    _load_model_state(model, loaded["model"])
    # Weights first: a distributed optimizer resumed from a plain fp32 run takes its main
    # params from them.
    optimizer.load_state_dict(optim_checkpoint.finish_load(
        optimizer, loaded["optimizer"], common["optimizer"], mine, saved, dropped))
    precision_change.after_optimizer_load(precision, optimizer, model_chunks(model))
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return common


def verify_before_load(path: Path) -> None:
    """:func:`gtp.verify.check_share` on every rank; a problem any rank finds fails the load on
    every rank, each naming the same files and items (a collective)."""
    from gtp import verify

    problems = verify.check_share(path, torch.distributed.get_rank(),
                                  torch.distributed.get_world_size())
    if any_rank_failed(bool(problems)):
        found: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, problems[:5])
        problems = list(dict.fromkeys(p for mine in found for p in mine))  # .metadata's: all
        raise CheckpointError(
            f"{verify.CheckpointDamaged(path, problems)}: not loaded "
            f"(checkpoint.verify_on_load); load another iteration (checkpoint.load_iteration=N) "
            f"or another checkpoint.load")


def any_rank_failed(failed: bool, group=None) -> bool:
    """True on every rank when ``failed`` is true on any rank of ``group`` (a collective; its
    flag lives on the device the group's backend needs)."""
    return _max_over_ranks((failed,), group)[0]


def _max_over_ranks(flags, group=None) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks of ``group``: one all-reduce MAX of one int32 per flag,
    on the device the group's backend needs."""
    from gtp.collectives import collective_device

    values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32,
                          device=collective_device(group))
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in values.tolist())


def _stored_shapes(path) -> dict:
    """``{key: global shape}`` of every tensor in the checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    try:
        stored = dist_checkpointing.load_tensors_metadata(str(path))
    except Exception as exc:
        raise _unreadable(Path(path) / ".metadata", exc,
                          "a torch_dist checkpoint's metadata") from exc
    return {key: tuple(sh.global_shape) for key, sh in stored.items()}


def check_shapes(sharded_state: dict, path, stored: dict | None = None,
                 skip_prefixes: tuple = ()) -> dict:
    """Compare every requested tensor's global shape with the checkpoint's, before loading.

    Tensors megatron marks ``allow_shape_mismatch`` (vocab rows padded per TP) are skipped, and
    absent keys starting with one of ``skip_prefixes`` (main params, which
    ``recipes.optim_checkpoint`` maps between optimizer kinds) are not reported.
    Every rank reads the same metadata and so raises the same error.

    Args:
        stored: the checkpoint's ``{key: global shape}`` (read from ``path`` when None).

    Returns:
        ``stored``.

    Raises:
        CheckpointError: naming the first tensors whose shapes differ (both shapes) or that the
            checkpoint lacks.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if stored is None:
        stored = _stored_shapes(path)
    wrong, absent = [], []
    for sh in nested_values(sharded_state):
        if not isinstance(sh, ShardedTensor) or sh.allow_shape_mismatch:
            continue
        if sh.key not in stored:
            if not sh.key.startswith(skip_prefixes):
                absent.append(sh.key)
        elif tuple(stored[sh.key]) != tuple(sh.global_shape):
            wrong.append(f"{sh.key}: checkpoint {tuple(stored[sh.key])}, "
                         f"this model {tuple(sh.global_shape)}")
    if wrong:
        raise CheckpointError(
            f"{path} holds a differently shaped model: " + "; ".join(sorted(set(wrong))[:5])
            + " (check model.* against the checkpoint's run config)")
    if absent:
        raise CheckpointError(f"{path} lacks tensors this model needs: {sorted(set(absent))[:10]}")
    return stored


# The model-only steps of a load, public for recipes.checkpoint_weights (weights-only starts).
model_sharded_state_dict, load_model_state, stored_shapes = (
    _model_sharded_state_dict, _load_model_state, _stored_shapes)


def layout_record(layout) -> dict:
    """The run's layout as a dict: the ``Layout`` fields plus the megatron-core version.

    A checkpoint stores it without ``pad_for_alignment`` (:func:`gtp.records.stored_layout`;
    the ``gtp_layout`` record owns that fact) and :func:`gtp.records.saved_layout` reads it
    back in this form.
    """
    return {**dataclasses.asdict(layout), "megatron_core": megatron_core_version()}
