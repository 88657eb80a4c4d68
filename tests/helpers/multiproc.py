"""Run a test function on N CPU processes joined in one gloo process group.

    from multiproc import run_distributed

    def _body(x):                      # module level, so it pickles
        return torch.distributed.get_rank() * x

    assert run_distributed(_body, 2, 10) == [0, 10]

Each rank is a fresh process with ``torch.distributed`` initialized (gloo, a free TCP port,
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set) and its world size asserted before
``fn(*args)`` runs. Ranks are forked from one ``forkserver`` per pytest session that has imported
torch, megatron-core and the project's training modules once (:data:`PRELOAD`): a ``spawn``-ed rank
spent about 5 s of CPU importing them, on every rank of every world. A forked rank starts from
that import-only state (no model, no process group, no thread), takes this process's
environment, working directory and ``sys.path`` as a spawned one would, and re-imports
nothing else: a test that needs a module fresh (its import-time behaviour) must not list it
in :data:`PRELOAD`. Return values must pickle; they are sent back as plain pickles (tensors
are copied, not shared). A rank that raises makes :func:`run_distributed` raise
:class:`DistributedTestError` carrying each failing rank's traceback; ranks still blocked in a
collective are terminated. Nothing outlives ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from pathlib import Path

# Ranks still running this long after another rank failed are assumed blocked and terminated.
_GRACE_AFTER_FAILURE_S = 10.0

# Imported once by the forkserver, before any rank forks from it: the modules a training job's
# rank imports (torch, megatron-core, Hydra, the project's worker path). Imports only: none of
# them starts a thread, and none patches megatron but the first, which defers its import-time
# torch.compile as a worker does before it imports megatron.
PRELOAD = [
    "deferred_compile_preload",  # first: before megatron is imported
    "torch", "torch.distributed", "torch.distributed.checkpoint",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
    "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.moe_layer",
    "hydra", "omegaconf",
    "recipes.run.launch", "recipes.run.worker", "recipes.run.loop", "recipes.model.build",
    "recipes.run.optim",
    "ckpt.io", "recipes.metrics.logger", "recipes.data",
    "ckpt.format.logical_format", "ckpt.format.logical_factory",
    "frozen_preload",  # last: freezes what the imports above built
]
_CONTEXT = None
HELPERS = Path(__file__).resolve().parent


def _context():
    """The session's forkserver context, its preload list set before the server starts."""
    global _CONTEXT
    if _CONTEXT is None:
        from multiprocessing import forkserver

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
        # Python 3.12's forkserver is passed the caller's sys.path but never applies it: it finds
        # this folder's preload modules through PYTHONPATH, set while the server starts.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HELPERS), saved]))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _CONTEXT


class DistributedTestError(RuntimeError):
    """One or more ranks failed (exception, crash or timeout)."""


def reset_gtp_globals() -> None:
    """Forget megatron-core 0.19.2's process-global GTP state before another model is built in
    the same process: the registry of every GTP param (written, never read), the prefetch-chain
    links (``reset_gtp_state``, as ``classify_gtp_remat_chains``), the gathered-weight and
    reduced-gradient buffer cache with its tickets, the wgrad buffer pool and the in-flight set.
    A training process builds its model once; a test world builds many."""
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_mod

    gtp_mod._GTP_PARAMS.clear()
    gtp_mod.reset_gtp_state()
    gtp_mod._GTP_CACHE = None
    gtp_mod._wgrad_buf_pool.clear()
    gtp_mod._inflight_comm_params.clear()


# megatron's groups of this rank's world, by (ranks, backend, group_desc, timeout, local sync),
# and the keys the current layout asked for.
_GROUPS: dict = {}
_ASKED: set = set()


def _reuse_megatron_groups() -> None:
    """Make megatron-core 0.19.2's ``parallel_state.create_group`` (every group of
    ``initialize_model_parallel``) hand back the group it made for the same ranks, backend and
    name under the previous layout of this world, as a fresh process would have one: creating a
    gloo group (a store rendezvous of its ranks) and shutting it down again cost a few hundredths
    of a second each, about 24 of them per layout on 4 ranks. Every rank builds the same layouts
    in the same order, so every rank skips the same creations. Groups with ``pg_options`` are
    made afresh. (A reused group is not added again to megatron's list for
    ``update_pg_timeout``, which no test calls.)"""
    from megatron.core import parallel_state as ps

    create = ps.create_group
    if getattr(create, "reuses_groups", False):
        return

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        if pg_options is not None or ranks is None:
            return create(ranks, timeout, backend, pg_options, use_local_synchronization,
                          group_desc)
        key = (tuple(ranks), backend, group_desc, timeout, use_local_synchronization)
        if key not in _GROUPS:
            _GROUPS[key] = create(ranks, timeout, backend, None, use_local_synchronization,
                                  group_desc)
        _ASKED.add(key)
        return _GROUPS[key]

    create_group.reuses_groups = True
    ps.create_group = create_group


def reset_model_parallel() -> None:
    """Destroy megatron's parallel state and every process group but the world and the ones
    of the last layout, which megatron's next layout reuses where it asks for the same ranks
    and name (:func:`_reuse_megatron_groups`, installed here).

    A world reused across many layouts would otherwise keep every layout's gloo groups (megatron's
    ``destroy_model_parallel`` only drops its references), each with its own I/O threads that
    keep waking up: hundreds of them slow every later collective. megatron-core 0.19.2 also
    keeps every GTP param ever built in ``generalized_tensor_parallelism._GTP_PARAMS`` (written,
    never read), and with them their gtp_remat groups: cleared here too. So is its global MoE
    metrics tracker, whose per-layer entries keep the first MoE model's layer count.
    """
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from torch.distributed import distributed_c10d as c10d

    reset_gtp_globals()
    destroy_moe_metrics_tracker()
    gc.collect()  # the last layout's model and optimizer hold their groups
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # Kept: the groups the last layout asked for (the next one likely asks for most of them).
    # Every live gloo group costs its ranks CPU while idle (its threads wake up), so no more.
    for key in [k for k in _GROUPS if k not in _ASKED]:
        del _GROUPS[key]
    _ASKED.clear()
    kept = {id(group) for group in _GROUPS.values()}
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD and id(group) not in kept:
            dist.destroy_process_group(group)
    _reuse_megatron_groups()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, timeout, results, environ):
    # The forkserver's environment is the one it started with: take the caller's, as spawn does.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    try:
        import torch
        import torch.distributed as dist

        from recipes.run.rank_env import cpu_threads_per_rank

        # As train.py's launcher gives its workers (the forkserver's torch took every core).
        threads = environ.get("OMP_NUM_THREADS") or cpu_threads_per_rank(world_size)
        torch.set_num_threads(int(threads))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        assert dist.get_world_size() == world_size, (dist.get_world_size(), world_size)
        value = fn(*args)
        payload = (rank, True, pickle.dumps(value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        payload = (rank, False, traceback.format_exc())
    results.put(payload)
    try:
        import torch.distributed as dist

        if payload[1] and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown problems do not hide the result
        pass


def run_distributed(fn, world_size: int, *args, timeout: float = 120) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the results ordered by rank.

    Args:
        fn: a picklable (module-level) callable.
        world_size: number of processes.
        args: picklable positional arguments passed to every rank.
        timeout: seconds for the whole run, process start-up included.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died without
            reporting, or the run exceeded ``timeout``.
    """
    assert world_size >= 1, world_size
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker,
                    args=(fn, rank, world_size, port, args, timeout, results, environ),
                    name=f"rank{rank}")
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now > deadline or (failed_at and now > failed_at + _GRACE_AFTER_FAILURE_S):
                break
            try:
                rank, ok, data = results.get(timeout=0.2)
                outcome[rank] = (ok, data)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
            except queue_mod.Empty:
                # A rank that died without reporting (segfault, os._exit) never will.
                for rank, proc in enumerate(procs):
                    if rank not in outcome and proc.exitcode not in (None, 0):
                        outcome[rank] = (False, f"rank {rank} died with exit code {proc.exitcode}")
                        failed_at = failed_at or time.monotonic()
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcome) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()

    errors = [f"--- rank {r} ---\n{data}" for r, (ok, data) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        head = f"{fn.__name__} on {world_size} ranks:"
        if missing:
            why = "terminated after another rank failed" if errors else f"timed out ({timeout}s)"
            head += f" ranks {missing} did not finish ({why})."
        raise DistributedTestError("\n".join([head, *errors]))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
