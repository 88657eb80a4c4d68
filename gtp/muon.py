"""Muon under GTP: megatron-core 0.19.2's ``TensorParallelMuon`` orthogonalized with the logical
(unpadded) matrix, and the expert Muon optimizer's grad norm over the EGTP-merged group.

Three narrow patches (:func:`install`, refused on another megatron version):

* ``megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize``: for a GTP
  weight (``is_gtp_weight_remat`` with a GTP group of size > 1) megatron all-gathers the padded
  GTP shards in ``scaled_orthogonalize_fn_with_gtp_remat`` and hands the *padded* matrix to
  Newton-Schulz and to ``get_muon_scale_factor``, so the update is scaled by
  ``sqrt(max(padded_rows, cols))`` instead of the logical shape (x1.0607 on a 32-row weight
  padded to 36), and ``linear_qkv`` is split into q, k, v on the shard's rows, which a shard
  boundary or the padding can cut. The replacement gathers the shards, drops the ``pad_length``
  padding rows (at the tail of the gathered TP-local matrix, megatron's
  ``_gtp_slice_one_param``), runs megatron's own per-matrix path on the logical matrix (q, k, v
  split on whole query groups, then ``scaled_orthogonalize_fn``: Newton-Schulz over the TP group
  in the configured ``tp_mode`` and the scale factor of the logical shape), pads the result
  back with zero rows and keeps this rank's shard. Upstream megatron scales by the logical rows
  after 0.19.2. Weights that are not GTP-sharded take megatron's path unchanged.
* ``megatron.core.optimizer._get_megatron_emerging_optimizer``: the expert Muon optimizer gets
  ``grad_stats_parallel_group = pg_collection.tp_ep_pp``, which misses the expert-GTP axis, so
  with EGTP > 1 its grad norm (and clipping) counts one EGTP shard only. The wrapper sets it to
  ``parallel_state.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True)``, the
  group megatron's standard (Adam) path uses for expert params. No change at EGTP 1.
* ``megatron.core.tensor_parallel.copy_gtp_attributes``: the fp32 main param megatron's bf16
  optimizer (``Float16OptimizerWithFloat16Params``) and the layer-wise distributed optimizer
  make of a GTP weight keeps ``is_gtp_weight_remat`` but not ``pad_length``, so the
  orthogonalize above saw a padded matrix with no padding to drop (bf16 Muon under GTP failed
  on ``linear_qkv``). The wrapper copies ``pad_length`` too.
"""

from __future__ import annotations

import torch

from mcore_compat.patches import megatron_patch

# megatron's optimizer modules are imported on use: recipes import this module only for
# optim=muon, and the TensorParallelMuon class needs the optional emerging-optimizers package.
_PATCHED = False


def _gtp_group(optimizer, param):
    """The GTP group ``param`` is sharded over (expert or dense), or None when it is not."""
    if not getattr(param, "is_gtp_weight_remat", False) or optimizer.pg_collection is None:
        return None
    pgs = optimizer.pg_collection
    group = getattr(pgs, "expt_gtp_remat" if getattr(param, "expert_tp", False) else "gtp_remat",
                    None)
    if group is None or group.size() <= 1:
        return None
    return group


def logical_orthogonalize(optimizer, param, logical: torch.Tensor) -> torch.Tensor:
    """Megatron's per-matrix Muon update of one TP-local logical matrix (no GTP, no padding).

    ``TensorParallelMuon.orthogonalize`` of megatron-core 0.19.2 with the GTP gather left out:
    the TP group and ``partition_dim`` by ``tp_mode``, the q/k/v split of ``linear_qkv`` into
    ``qkv_split_shapes`` per query group, and ``scaled_orthogonalize_fn`` (Newton-Schulz, then
    ``get_muon_scale_factor`` of the full matrix's shape, times ``extra_scale_factor``).

    Args:
        optimizer: the ``TensorParallelMuon``.
        param: the parameter (for its TP attributes and ``is_qkv``).
        logical: ``[rows, cols]`` fp32, the TP-local momentum without GTP padding rows.

    Returns:
        The update, same shape and dtype as ``logical``.
    """
    pgs = optimizer.pg_collection
    tp_group = None
    if pgs:
        tp_group = pgs.expt_tp if getattr(param, "expert_tp", False) else pgs.tp
    partition_dim = None if optimizer.tp_mode == "blockwise" else getattr(param, "partition_dim", None)
    if partition_dim == -1:
        partition_dim = None
    shapes = getattr(param, "qkv_split_shapes", None) or optimizer.qkv_split_shapes
    if not (optimizer.split_qkv and optimizer.is_qkv_fn is not None and optimizer.is_qkv_fn(param)):
        return optimizer.scaled_orthogonalize_fn(logical, tp_group, partition_dim)
    if shapes is None or logical.shape[0] % sum(shapes):
        raise RuntimeError(f"Muon q/k/v split of a {tuple(logical.shape)} linear_qkv weight into "
                           f"query groups of {shapes} rows is impossible")
    groups = logical.shape[0] // sum(shapes)
    parts = torch.split(logical.view(groups, sum(shapes), -1), shapes, dim=1)
    parts = [optimizer.scaled_orthogonalize_fn(p.reshape(-1, logical.shape[-1]), tp_group,
                                               partition_dim).view(groups, -1, logical.shape[-1])
             for p in parts]
    return torch.cat(parts, dim=1).view(logical.shape)


def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs) -> torch.Tensor:
    """Replacement of ``TensorParallelMuon.orthogonalize`` (megatron-core 0.19.2) for GTP
    weights: gather the GTP shards of ``grad`` (``[shard_rows, cols]``), drop the
    ``p.pad_length`` padding rows, :func:`logical_orthogonalize`, put zero padding rows back and
    return this rank's ``[shard_rows, cols]`` shard. Any other weight: megatron's own method."""
    group = _gtp_group(self, p)
    if group is None:
        return orthogonalize.__wrapped__(self, p, grad, **kwargs)
    size, rank = group.size(), group.rank()
    shards = [torch.empty_like(grad) for _ in range(size)]
    torch.distributed.all_gather(shards, grad.contiguous(), group=group)
    full = torch.cat(shards, dim=0)
    pad = int(getattr(p, "pad_length", 0) or 0)
    update = logical_orthogonalize(self, p, full[: full.shape[0] - pad])
    if pad:
        update = torch.nn.functional.pad(update, (0, 0, 0, pad))
    rows = grad.shape[0]
    return update[rank * rows:(rank + 1) * rows].contiguous()


def tag_qkv(model_chunks) -> None:
    """Mark every GTP-sharded ``linear_qkv`` weight ``is_qkv`` with its ``qkv_split_shapes``.

    megatron-core 0.19.2's ``_get_megatron_emerging_optimizer`` decides ``is_qkv`` on the GTP
    shard's row count (``shard_rows % sum(qkv_split_shapes) == 0``), so a padded or cut shard is
    orthogonalized as one matrix; :func:`orthogonalize` splits the gathered logical matrix,
    which always holds whole query groups. Call before ``get_megatron_optimizer``.
    """
    from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes

    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if name.endswith("linear_qkv.weight") and getattr(param, "is_gtp_weight_remat", False):
                param.is_qkv = True
                param.qkv_split_shapes = _get_qkv_split_shapes(chunk.config)


def _fix_expert_grad_stats_group(optimizer) -> int:
    """Give the expert Muon optimizers of a built chain the EGTP-merged grad-stats group (EGTP
    > 1 only); returns how many were changed."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    if parallel_state.get_expert_gtp_weight_remat_world_size() <= 1:
        return 0
    merged = parallel_state.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True)
    changed = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, TensorParallelMuon):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(not getattr(p, "allreduce", True) for p in params):
            opt.grad_stats_parallel_group = merged
            changed += 1
    return changed


def copy_gtp_attributes(destination, source) -> None:
    """Replacement of ``megatron.core.tensor_parallel.copy_gtp_attributes`` (megatron-core
    0.19.2): megatron's copy of ``is_gtp_weight_remat`` and ``allreduce``, plus ``pad_length``
    (the padding rows :func:`orthogonalize` drops) when ``source`` has it."""
    copy_gtp_attributes.__wrapped__(destination, source)
    if hasattr(source, "pad_length"):
        destination.pad_length = source.pad_length


@megatron_patch("optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize, "
                "optimizer._get_megatron_emerging_optimizer and "
                "tensor_parallel.copy_gtp_attributes")
def install() -> None:
    """Install the three patches (idempotent).

    Raises:
        RuntimeError: megatron-core is not 0.19.2 (mcore_compat.version).
        ImportError: the ``emerging-optimizers`` package is missing.
    """
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core import optimizer as optimizer_module
    from megatron.core.optimizer import emerging_optimizers

    if not emerging_optimizers.HAVE_EMERGING_OPTIMIZERS:
        raise ImportError("optim.optimizer=muon needs the emerging-optimizers and absl-py "
                          "packages (pyproject.toml; `make setup` installs them)")
    cls = emerging_optimizers.TensorParallelMuon
    orthogonalize.__wrapped__ = cls.orthogonalize
    cls.orthogonalize = orthogonalize
    original = optimizer_module._get_megatron_emerging_optimizer

    def _get_megatron_emerging_optimizer(*args, **kwargs):
        built = original(*args, **kwargs)
        _fix_expert_grad_stats_group(built)
        return built

    _get_megatron_emerging_optimizer.__wrapped__ = original
    optimizer_module._get_megatron_emerging_optimizer = _get_megatron_emerging_optimizer
    from megatron.core import tensor_parallel

    # megatron's optimizers call it as tensor_parallel.copy_gtp_attributes (looked up on use).
    copy_gtp_attributes.__wrapped__ = tensor_parallel.copy_gtp_attributes
    tensor_parallel.copy_gtp_attributes = copy_gtp_attributes
    _PATCHED = True


@megatron_patch("optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize, "
                "optimizer._get_megatron_emerging_optimizer and "
                "tensor_parallel.copy_gtp_attributes (puts megatron's back)")
def uninstall() -> None:
    """Put megatron's three functions back (tests: the unfixed behaviour)."""
    global _PATCHED
    if not _PATCHED:
        return
    from megatron.core import optimizer as optimizer_module
    from megatron.core.optimizer import emerging_optimizers

    emerging_optimizers.TensorParallelMuon.orthogonalize = orthogonalize.__wrapped__
    optimizer_module._get_megatron_emerging_optimizer = \
        optimizer_module._get_megatron_emerging_optimizer.__wrapped__
    from megatron.core import tensor_parallel

    tensor_parallel.copy_gtp_attributes = copy_gtp_attributes.__wrapped__
    _PATCHED = False
