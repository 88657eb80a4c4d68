"""Who writes what in a save and who reads what in a load: the one place that decides.

A checkpoint's tensors are megatron ``ShardedTensor``s; a rank writes the ones whose
``replica_id`` is all zeros (megatron's main replica). What each rank writes:

* **the distributed optimizer's state** (fp32 main params and Adam moments): each data-parallel
  rank its own range, nothing gathered (``optim.distrib_optim_sharding_type=
  fully_sharded_model_space``, :mod:`mcore_compat.fs_model_space`); of GTP peers holding the same
  range of a param GTP does not shard, one;
* **tensors replicated over data-parallel ranks** (the weights at dp > 1, a plain optimizer's
  state, the copies GTP peers hold of the norms and biases): spread over the replicas by
  megatron's ``FullyParallelSaveStrategyWrapper`` (greedy, by bytes; the distribution is computed
  from metadata only, no tensor is sent), within the data-parallel group (context parallel
  included): the largest writer writes about ``1/dp`` of them;
* **the common state** (iteration, config, records; kilobytes): global rank 0, as megatron does;
* **RNG states**: every rank its own.

What each rank reads: what it keeps, nothing else (the distributed optimizer's range at the new
layout, its own weights), each requested run of stored rows read once
(:mod:`ckpt.format.dcp_reader`). A weight replicated over the data-parallel group is read by
every replica: megatron's ``FullyParallelLoadStrategyWrapper`` would read it once and broadcast
it, but one rank's failed read inside its exchange leaves the others waiting in a broadcast, so
a load does not use it.
"""

from __future__ import annotations


def parallelization_group():
    """The group a save's replicated tensors are spread over and a load's are read once in:
    megatron's data-parallel group with context parallelism (as Megatron-LM's
    ``--ckpt-fully-parallel-save``), or None outside a model-parallel setup."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save_strategy(base=None, cache: bool = False):
    """The sharded strategy a save writes with: ``base`` (default megatron's
    ``TorchDistSaveShardedStrategy``) wrapped so that replicated tensors are spread over the
    data-parallel replicas.

    Args:
        base: the torch_dist strategy to wrap (the async saves' cached one).
        cache: keep the distribution for the next save of the same structure (the caller
            makes a new strategy when the structure changes).
    """
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = base if base is not None else TorchDistSaveShardedStrategy("torch_dist", 1)
    group = parallelization_group()
    if group is None or group.size() == 1:
        return base
    return FullyParallelSaveStrategyWrapper(base, group, do_cache_distribution=cache)
