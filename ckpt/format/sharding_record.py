"""The sharding record: how a checkpoint stores its GTP weights (per key: logical rows, padding,
shard rows, TP axis, gating), merged over all ranks, under the common-state key
:data:`ckpt.format.records.SHARDING_RECORD_KEY`. ``docs/checkpoint-format.md`` ("The sharding
record") gives the format; :func:`ckpt.format.logical_format.written_sharding_record` builds it
for the format this process writes."""

from __future__ import annotations

import torch

from gtp.alignment import applied_pad_for_alignment
from ckpt.format.logical_factory import GTPCheckpointError, gtp_shard_of
from ckpt.format.records import GTP_FORMAT_LOGICAL, GTP_FORMAT_STOCK, megatron_core_version


def sharding_record(model, model_sharded_state_dict=None, *, logical: bool) -> dict:
    """The sharding record of a checkpoint written from ``model`` (its format:
    ``docs/checkpoint-format.md``, "The sharding record").

    Args:
        model: the (DDP-wrapped or bare) megatron model, or a list of them (one per virtual
            pipeline stage).
        model_sharded_state_dict: its ``sharded_state_dict()`` (any nesting) when already built
            (before ``dist_checkpointing.save``, which applies factories in place); built here
            otherwise.
        logical: whether GTP weights are written in the logical format
            (``ckpt.format.logical_format``'s patch installed); False tags a GTP checkpoint
            ``stock-0.19.2``.

    Returns:
        A plain dict of ints, strings, bools and lists, identical on every rank (the per-tensor
        records are merged over all ranks).
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
    from megatron.core.transformer.mlp import MLP
    from megatron.core.utils import unwrap_model

    chunks = [unwrap_model(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    if model_sharded_state_dict is None:
        model_sharded_state_dict = [m.sharded_state_dict() for m in chunks]
    # Chunk-local names (a virtual pipeline stage numbers its layers from 0): informative only.
    names = {id(p): n for m in chunks for n, p in m.named_parameters()}
    gated_ids = {
        id(m.linear_fc1.weight) for c in chunks for m in c.modules()
        if isinstance(m, MLP) and m.config.gated_linear_unit and hasattr(m, "linear_fc1")
    }
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = tp_group.size()
    g = parallel_state.get_gtp_weight_remat_world_size()
    # Routed experts are split over the expert tensor parallel group (megatron's SequentialMLP
    # keys ``...experts.experts.``), and sharded over the expert GTP group.
    etp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    etp = etp_group.size() if etp_group is not None else tp
    eg = max(1, parallel_state.get_expert_gtp_weight_remat_world_size())  # 0: no group
    tensors: dict[str, dict] = {}
    for entry in nested_values(model_sharded_state_dict):
        param = getattr(entry, "live_param", None)
        if param is None:
            param = getattr(entry, "data", None)
        if param is None or not is_gtp_param(param):
            continue
        spec = getattr(entry, "spec", None)
        if spec is not None:
            shard = spec.shard
        else:  # stock 0.19.2 entry: the shard's rows come from the param
            group = etp_group if ".experts.experts." in entry.key and etp_group else tp_group
            shard = gtp_shard_of(param, int(getattr(param, "partition_dim", 0)),
                                 group.size(), group.rank(), gated=id(param) in gated_ids)
        cols = int(param.shape[1]) * (shard.tp if shard.tp_axis == 1 else 1)
        record = {
            "L": shard.L, "pad": shard.pad, "shard_rows": shard.shard_rows,
            "tp_axis": shard.tp_axis, "gated": shard.gated,
            "singleton_local_shards": shard.singleton_local_shards,
            "global_shape": [shard.global_rows, cols],
        }
        if shard.components:  # stored under <key><suffix>, each tp * rows (Mamba's in_proj)
            record["components"] = [[suffix, rows] for suffix, rows in shard.components]
        key = entry.key
        old = tensors.get(key)
        params = sorted({*(old or {}).get("params", []), names.get(id(param), "?")})
        if old is not None and {k: v for k, v in old.items() if k != "params"} != record:
            raise GTPCheckpointError(f"{key}: GTP shards differ between layers: {old} vs {record}")
        tensors[key] = {**record, "params": params}
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, tensors)
        merged: dict[str, dict] = {}
        for part in gathered:
            for key, rec in part.items():
                if key in merged:
                    rec = {**rec, "params": sorted({*merged[key]["params"], *rec["params"]})}
                merged[key] = rec
        tensors = dict(sorted(merged.items()))
    has_gtp = bool(tensors) or g > 1 or eg > 1
    return {
        "gtp_format": GTP_FORMAT_STOCK if (has_gtp and not logical) else GTP_FORMAT_LOGICAL,
        "tp": tp,
        "gtp_remat_size": g,
        "expert_tensor_parallel_size": etp,
        "expert_gtp_remat_size": eg,
        "pad_for_alignment": applied_pad_for_alignment() if max(g, eg) > 1 else 0,
        "megatron_core": megatron_core_version(),
        "tensors": tensors,
    }

