"""The host side of a save and a load, per rank and per node, counted from the same per-tensor
sizes as :func:`recipes.dry_run.sizes.rank_sizes` (``recipes.model.shapes``), without building
anything.

What a rank writes at a save (``ckpt/io/writers.py`` decides it; this module counts it):

* tensors replicated over the data-parallel group (dp x cp; the routed experts' over the expert
  data-parallel group): the weights, a plain optimizer's state, and with
  ``optim.distrib_optim_sharding_type=fully_reshardable`` the distributed optimizer's state
  (megatron's ``DistributedOptimizer.get_parameter_state_dp_zero`` gathers every param's fp32
  main param, ``exp_avg`` and ``exp_avg_sq`` of the model-parallel rank to every DP rank, so each
  is a replicated tensor) are spread over the replicas by megatron's
  ``FullyParallelSaveStrategyWrapper``; its plan, ``exchange_utils.distribute_shards_to_ranks``
  (greedy, largest first, to the least loaded replica), is called here on the tensors' sizes,
  so the figure is megatron's own plan of whole tensors, not an even split;
* with ``fully_sharded_model_space`` (``mcore_compat/fs_model_space.py``) each DP rank writes its
  own range of the fp32 main params and moments, 12 bytes per parameter of the range, written by
  that rank alone: ``ceil(12 x dense / (dp x cp)) + ceil(12 x experts / expert dp)``.

A tensor held by GTP peers whole (norms, biases) is written by one peer: the figures are those of
the most loaded rank (GTP rank 0 of the most loaded pipeline stage). GTP padding rows are never
written. Not counted: the common state (rank 0, kilobytes), RNG states and torch.save's records
(a few hundred bytes per tensor; ``tests/test_dry_run_host.py`` bounds them).

What a rank reads at a load at the same layout (``ckpt/io/load.py``): its own weights (every
replica reads them: a load does not use megatron's fully parallel load), and with
``fully_sharded_model_space`` its own optimizer range; with ``fully_reshardable`` megatron's
request is the whole model-parallel rank's state, read on every DP rank and then trimmed.

Host memory above the steady state (GPU runs keep the state in device memory):

* a ``fully_reshardable`` save holds the model-parallel rank's whole fp32 state twice on every
  DP rank (``get_parameter_state_dp_zero``'s gather buffers and the world tensors built from
  them; the issue measured 2.1x the state at dp2 and 1.9x at dp4 on CPU), a load once;
* ``fully_sharded_model_space`` copies nothing (its boxes alias the live state): a save's
  torch_dist writer stages one tensor at a time (one writer thread), a load reads each
  requested run into one buffer before copying it in place: about the largest tensor written or
  read; ``checkpoint.async_save=true`` stages every byte the rank writes in host memory first.

Per node: ``train.gpus_per_node`` ranks (default 8; fewer when the world is smaller) of the most
loaded kind, an upper bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from recipes.dry_run.sizes import PARAM_BYTES, stage_tensors
from recipes.metrics.logger import format_bytes

# The distributed optimizer's checkpoint formats (optim.distrib_optim_sharding_type).
FORMATS = ("fully_sharded_model_space", "fully_reshardable")
# fp32 main param, exp_avg and exp_avg_sq: bytes per parameter of the distributed optimizer's
# checkpoint state (fp32 parameters save their own copy as the main param).
STATE_BYTES = 12


@dataclass(frozen=True)
class HostSizes:
    """Host-side bytes of one save and one load at the same layout, per rank of the most loaded
    kind, and the ranks per node the node figures multiply by."""

    written: int  # bytes this rank writes (its __<rank>_0.distcp, less torch.save's records)
    # the same for each DP rank of that model-parallel rank (each with the most loaded expert
    # data-parallel rank's share of the routed experts)
    written_per_dp_rank: tuple[int, ...]
    read: int  # bytes this rank reads at a load at the same layout
    save_host: int  # host memory above the steady state at a save
    load_host: int  # host memory above the steady state at a load
    ranks_per_node: int
    format: str  # the distributed optimizer's format, or "plain" (no distributed optimizer)


def _spread(sizes: dict, ranks: int) -> list[int]:
    """Bytes each of ``ranks`` replicas writes of the replicated tensors ``{id: bytes}``:
    megatron's ``FullyParallelSaveStrategyWrapper`` plan (``distribute_shards_to_ranks``)."""
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    plan = distribute_shards_to_ranks({k: list(range(ranks)) for k in sizes}, sizes, ranks, set())
    out = [0] * ranks
    for key, rank in plan.items():
        out[rank] += sizes[key]
    return out


def host_sizes(cfg, parallel_dims, padded_vocab: int) -> HostSizes:
    """:class:`HostSizes` of ``cfg`` at ``parallel_dims`` for a ``padded_vocab``-row vocabulary.

    Units: bytes. The pipeline stage is :func:`recipes.dry_run.sizes.stage_tensors`' most loaded.

    Raises:
        ValueError: ``train.gpus_per_node`` < 1.
    """
    tensors = stage_tensors(cfg, parallel_dims, padded_vocab)
    dtype = PARAM_BYTES[cfg.precision.params_dtype]
    dp = parallel_dims.data_parallel_size * parallel_dims.context_parallel_size
    edp = parallel_dims.expert_data_parallel_size
    distributed = parallel_dims.use_distributed_optimizer
    fmt = parallel_dims.distrib_optim_sharding_type if distributed else "plain"
    dense = sum(t.stored for t in tensors if not t.expert)
    experts = sum(t.stored for t in tensors if t.expert)
    # The replicated tensors of the dense and the expert groups: weights, and per parameter the
    # optimizer state when it is replicated (plain optimizer: Adam's moments, and the fp32 main
    # param when parameters are bf16; fully_reshardable: the gathered 12 bytes).
    state = {"plain": 8 + (4 if dtype != 4 else 0), "fully_reshardable": STATE_BYTES}.get(fmt, 0)
    groups = {False: {}, True: {}}
    for t in tensors:
        groups[t.expert][t.name] = t.stored * dtype
        for i in range(state // 4):
            groups[t.expert][f"{t.name}/state{i}"] = t.stored * 4
    dense_spread = _spread(groups[False], dp)
    expert_spread = _spread(groups[True], edp) if groups[True] else [0]
    own = 0
    if fmt == "fully_sharded_model_space":
        own = -(-dense * STATE_BYTES // dp) - (-experts * STATE_BYTES // edp)
    written = [own + d + max(expert_spread) for d in dense_spread]
    largest = max((t.stored * 4 for t in tensors), default=0)
    whole_state = (dense + experts) * STATE_BYTES
    weights = (dense + experts) * dtype
    if fmt == "fully_reshardable":
        read = weights + whole_state
        save_host, load_host = 2 * whole_state, whole_state
    elif fmt == "fully_sharded_model_space":
        read = weights + own
        save_host = load_host = largest
    else:  # a plain optimizer: every replica holds and reads the whole state
        read = weights + (dense + experts) * state
        save_host = load_host = largest
    if cfg.checkpoint.get("async_save"):
        save_host = max(save_host, max(written))
    per_node = min(parallel_dims.world_size, int(cfg.train.get("gpus_per_node", 8)))
    if per_node < 1:
        raise ValueError(f"train.gpus_per_node={cfg.train.gpus_per_node} is invalid: it must be "
                         f"an integer >= 1")
    return HostSizes(written=max(written), written_per_dp_rank=tuple(written), read=read,
                     save_host=save_host, load_host=load_host, ranks_per_node=per_node,
                     format=fmt)


def _memory(h: HostSizes) -> str:
    """``save X, load Y per rank, X' and Y' per node`` of ``h``."""
    n = h.ranks_per_node
    return (f"save {format_bytes(h.save_host)}, load {format_bytes(h.load_host)} per rank; "
            f"{format_bytes(h.save_host * n)} and {format_bytes(h.load_host * n)} per node")


def host_lines(cfg, parallel_dims, padded_vocab: int) -> list[str]:
    """The dry run's lines for :func:`host_sizes`, per rank and per node; with the distributed
    optimizer, a last line for the other format (``optim.distrib_optim_sharding_type``)."""
    h = host_sizes(cfg, parallel_dims, padded_vocab)
    fmt = (f"optim.distrib_optim_sharding_type={h.format}" if h.format != "plain"
           else "no distributed optimizer")
    lines = [
        f"> checkpoint at a save and a load at this layout ({fmt}), per rank: writes "
        f"{format_bytes(h.written)}, reads {format_bytes(h.read)}",
        f">   host memory above the steady state: {_memory(h)} "
        f"(train.gpus_per_node={h.ranks_per_node} ranks)",
    ]
    if h.format != "plain":
        other = next(f for f in FORMATS if f != h.format)
        o = host_sizes(cfg, dataclasses.replace(parallel_dims, distrib_optim_sharding_type=other),
                       padded_vocab)
        lines.append(f">   with {other}: writes {format_bytes(o.written)}, reads "
                     f"{format_bytes(o.read)}; host memory {_memory(o)}")
    return lines
