"""What one checkpoint holds, as megatron's sharded state dicts: the model (one sub-dict per
virtual pipeline chunk), the optimizer, each rank's RNG state and the layout record.

The common (non-sharded) entries a save adds beside them: ``iteration``,
``opt_param_scheduler``, ``train_state`` (consumed samples, wandb run id, resolved config...),
``layout`` (:func:`layout_record` without ``pad_for_alignment``), the real vocabulary size
(``ckpt.adapt.vocab``) and the sharding record (``ckpt.format.sharding_record``).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

from ckpt.format.records import megatron_core_version
from ckpt.io.chunks import model_chunks


def rng_state() -> dict:
    """This rank's python, numpy, torch (and CUDA) RNG states and megatron's RNG tracker's;
    plain values and tensors only (numpy's key array as an int64 tensor), so the state loads
    with ``torch.load(weights_only=True)``."""
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


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["random"])
    kind, key, pos, has_gauss, gauss = state["np"]
    key = key.numpy() if isinstance(key, torch.Tensor) else key
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def rng_sharded_object() -> ShardedObject:
    """This rank's :func:`rng_state` as the ``rng_state`` entry: one per global rank, so it is
    only meaningful when the load layout is identical."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)


# The distributed optimizer's checkpoint format where the run names none: each DP rank its own
# range (mcore_compat.fs_model_space). "fully_reshardable" (megatron's default) is read and
# written too; both hold the same keys and global shapes.
DISTRIB_OPTIM_FORMAT = "fully_sharded_model_space"
DISTRIB_OPTIM_FORMATS = ("fully_sharded_model_space", "fully_reshardable")


def optimizer_metadata(optimizer, sharding_type: str | None = None) -> dict:
    """The ``metadata`` megatron's ``sharded_state_dict`` takes: the distributed optimizer's
    checkpoint format (``distrib_optim_sharding_type``: ``sharding_type``, default
    :data:`DISTRIB_OPTIM_FORMAT`) when it is one, and ``chained_optim_avoid_prefix`` when
    megatron built an expert optimizer."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    out = {}
    groups = [g for opt in chain
              for g in getattr(getattr(opt, "optimizer", None), "param_groups", [])]
    if any(g.get("is_expert_parallel") for g in groups):
        # An MoE model has a dense and an expert optimizer where its experts are split (EP,
        # ETP != TP, expert GTP), one elsewhere: without megatron's "chained_<i>." prefix the
        # keys of each param's moments are the same at every layout.
        out["chained_optim_avoid_prefix"] = True
    for opt in chain:
        if isinstance(opt, DistributedOptimizer):
            # A layout-changing format (recipes.config.validate refuses the others).
            out["distrib_optim_sharding_type"] = sharding_type or DISTRIB_OPTIM_FORMAT
    return out


def model_sharded_state_dict(model) -> dict:
    """The model's sharded state dict; with virtual pipeline stages one sub-dict per chunk
    (``chunk0``, ``chunk1``...). Only the ShardedTensor keys reach the file (global layer
    numbers), so the nesting does not tie a checkpoint to a chunk count."""
    chunks = model_chunks(model)
    if len(chunks) == 1:
        return unwrap_model(chunks[0]).sharded_state_dict()
    return {f"chunk{i}": unwrap_model(c).sharded_state_dict() for i, c in enumerate(chunks)}


def load_model_state(model, loaded: dict) -> None:
    """Load ``loaded`` (the ``model`` entry dist_checkpointing returned, nested as
    :func:`model_sharded_state_dict`) into ``model`` strictly."""
    chunks = model_chunks(model)
    if len(chunks) == 1:
        unwrap_model(chunks[0]).load_state_dict(loaded, strict=True)
        return
    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[f"chunk{i}"], strict=True)


def sharded_state_dict(model, optimizer, is_loading: bool, adapt=None,
                       sharding_type: str | None = None) -> dict:
    """``{"model": ..., "optimizer": ...}`` for megatron's save or load; ``adapt(model_sd)``
    edits the model's entries before the optimizer's are derived from them; ``sharding_type``:
    the distributed optimizer's format (:func:`optimizer_metadata`)."""
    model_sd = model_sharded_state_dict(model)
    if adapt is not None:
        adapt(model_sd)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                  metadata=optimizer_metadata(
                                                      optimizer, sharding_type)),
    }


def layout_record(parallel_dims) -> dict:
    """The run's layout as a dict: the fields of ``parallel_dims`` (the run's
    ``recipes.config.parallel_dims.ParallelDims``) plus the megatron-core version.

    A checkpoint stores it without ``pad_for_alignment`` (:func:`ckpt.format.records.stored_layout`;
    the sharding record owns that fact) and :func:`ckpt.format.records.saved_layout` reads it
    back in this form.
    """
    return {**dataclasses.asdict(parallel_dims), "megatron_core": megatron_core_version()}
