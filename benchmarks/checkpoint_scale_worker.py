"""The scale benchmark's worker (one rank of a launch of ``benchmarks.checkpoint_scale``): builds
its model with the distributed optimizer, runs one training step, then saves and loads a
checkpoint in each distributed-optimizer format in turn, measuring each save and load on every
rank (``benchmarks.measure.measure``: seconds, RSS peak over the RSS right before, I/O bytes)."""

from __future__ import annotations

import contextlib
import json
import shutil
from math import prod
from pathlib import Path
from unittest import mock

from benchmarks.measure import barrier, in_turn, measure

# The formats compared: what the file holds and how a load requests it.
# "main": megatron's fully_reshardable as the project ran it before issue 55 (DP rank 0 writes
# every replicated tensor, a load requests the whole state on every rank, then trims);
# "fully_reshardable": the same format with today's writers and loads (writes spread over the
# replicas, a load requests its own ranges); "fully_sharded_model_space": the default.
FORMATS = ("main", "fully_reshardable", "fully_sharded_model_space")


def rank_file_bytes(iter_path: Path, rank: int) -> int:
    """Bytes of ``__<rank>_*.distcp`` in ``iter_path``: what global rank ``rank`` wrote."""
    return sum(f.stat().st_size for f in Path(iter_path).glob(f"__{rank}_*.distcp"))


def checkpoint_bytes(iter_path: Path) -> dict:
    """From a checkpoint's metadata: bytes of the model tensors and of the optimizer state
    (logical shapes, stored dtypes)."""
    import torch
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(iter_path))
    size = {k: prod(t.global_shape) * torch.empty((), dtype=t.dtype).element_size()
            for k, t in meta.items()}
    optim = sum(v for k, v in size.items() if k.startswith("optimizer."))
    return {"model_bytes": sum(size.values()) - optim, "optimizer_bytes": optim}


@contextlib.contextmanager
def as_format(name: str):
    """Within: saves and loads behave as format ``name`` of :data:`FORMATS` (for ``main``: the
    base torch_dist strategy, no spreading of replicas, and the whole-state load request that
    ``ckpt.io.load`` made before issue 55)."""
    if name != "main":
        yield
        return
    import ckpt.io.load
    import ckpt.io.save
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    with mock.patch.object(ckpt.io.save, "save_strategy",
                           lambda *a, **k: TorchDistSaveShardedStrategy("torch_dist", 1)), \
            mock.patch.object(ckpt.io.load, "DISTRIB_OPTIM_FORMAT", "fully_reshardable"):
        yield


def worker(cfg_path: str, out_path: str) -> None:
    """One rank of a launch: build the model of ``cfg_path`` (world = dp, tp1), train one step,
    then ``bench.repeats`` times save and load in each of ``bench.formats`` in turn; write every
    rank's measurements (seconds, bytes) as JSON to ``out_path`` (rank 0)."""
    import torch
    from megatron.core import parallel_state

    from ckpt import io as checkpoint
    from ckpt.format import logical_format
    from benchmarks.runs import start_rank, trained_model

    cfg, rank, world, parallel_dims = start_rank(cfg_path)
    bench = cfg.bench
    model, optimizer, scheduler, _ = trained_model(cfg, parallel_dims)  # Adam moments exist
    logical_format.configure("logical")
    record = checkpoint.layout_record(parallel_dims)
    common = {"consumed_samples": cfg.data.global_batch_size, "wandb_run_id": None}
    root = Path(bench.files)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    mine: dict = {"rank": rank, "dp_size": dp_size,
                  "local_param_numel": sum(p.numel() for p in model.parameters()),
                  "save": {f: [] for f in bench.formats}, "load": {f: [] for f in bench.formats}}
    shared: dict = {"layout": parallel_dims.describe()}
    for rep in range(int(bench.repeats)):
        for name in in_turn(bench.formats, rep):
            where = root / f"{name}_{rep}"
            rec = {**record, "distrib_optim_sharding_type":
                   "fully_reshardable" if name == "main" else name}
            with as_format(name):
                saved = measure(lambda: checkpoint.save_checkpoint(
                    where, 1, model, optimizer, scheduler, common, rec))
                saved["file_bytes"] = rank_file_bytes(checkpoint.iter_dir(where, 1), rank)
                if rank == 0 and "checkpoint" not in shared:
                    # The largest single tensor: a param's fp32 state (a stored tensor stacks
                    # the layers, so it is taken from the model).
                    shared["checkpoint"] = {
                        **checkpoint_bytes(checkpoint.iter_dir(where, 1)),
                        "largest_tensor_bytes": 4 * max(p.numel() for p in model.parameters())}
                loaded = measure(lambda: checkpoint.load_checkpoint(
                    where, model, optimizer, scheduler, rec, verify=False))
            mine["save"][name].append(saved)
            mine["load"][name].append(loaded)
            barrier()
            if rank == 0:
                shutil.rmtree(where)
            barrier()
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps({**shared, "ranks": every}))
    barrier()
