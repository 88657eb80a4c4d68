"""``num-zeros`` over logical gradient elements only: a patch of megatron-core 0.19.2.

What megatron gets wrong: ``optimizer/clip_grads.py`` ``count_zeros_fp32`` counts, for every
param that passes its replica filters (not shared, not a TP duplicate,
``param_is_not_gtp_duplicate``), the zeros of the param's whole local gradient. For a GTP shard
that gradient includes the shard's padding rows (the tail of the padded TP-local dim 0, on the last
GTP rank(s); see ``docs/checkpoint-format.md``, Padding math), whose gradient is always zero.
So ``num-zeros`` grows by every padding element and changes with ``pad_for_alignment``: on the
tiny model at g2/a16 it reads 36744 instead of the 19080 the same run reports without GTP.

The grad norm needs no patch: GTP/TP replicas are already filtered by megatron
(``get_main_grads_for_grad_norm`` with ``param_is_not_gtp_duplicate``) and padding rows hold zero
gradient, which adds nothing to the sum of squares.

:func:`install` wraps ``count_zeros_fp32`` where megatron's optimizers look it up at call time
(``megatron.core.optimizer.optimizer`` and ``.layer_wise_optimizer``): the wrapper runs megatron's
function unchanged, then subtracts the zeros that lie in the padding rows of the GTP params it
counted, summed over the same ``grad_stats_parallel_group`` (one extra int64 all-reduce per step).
It also wraps ``tensor_parallel.copy_gtp_attributes`` so that fp32 master copies of GTP params
(bf16 training) carry the number of logical rows of their shard.
"""

from __future__ import annotations

import importlib

import torch

from gtp.collectives import collective_device
from mcore_compat.patches import megatron_patch

# Modules that bound ``count_zeros_fp32`` by name at import time (``from .clip_grads import ...``).
_COUNT_ZEROS_USERS = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
)
# Set on GTP params' full-shape copies (fp32 master params): logical rows of this rank's shard.
LOGICAL_ROWS_ATTR = "_gtp_logical_rows"
# Set on flat 1-D slices of GTP params (megatron's DistributedOptimizer shards, their fp32 main
# copies): index in the slice where the padding rows begin (its length when none).
PAD_FROM_ATTR = "_gtp_flat_padding_from"
# id(GTP param) -> start of its last flat view (distributed optimizer: the fp32 main copy is
# cloned from that view right after it is tagged).
_LAST_FLAT_START: dict[int, int] = {}

_original_count_zeros = None
_original_copy_gtp_attributes = None


def logical_rows_in_shard(param) -> int | None:
    """Rows of ``param``'s local GTP shard that hold logical (non-padding) data, or ``None`` when
    ``param`` is not a GTP shard (or a copy of one) whose padding is known.

    Rank r of g holds padded rows ``[r*s, (r+1)*s)`` of a TP-local dim 0 of L logical rows, so its
    first ``clamp(L - r*s, 0, s)`` rows are logical and the rest padding.
    """
    rows = getattr(param, LOGICAL_ROWS_ATTR, None)
    if rows is not None:
        return rows
    if not getattr(param, "is_gtp_weight_remat", False):
        return None
    shape, group = getattr(param, "_unsharded_shape", None), getattr(param, "group", None)
    if shape is None or group is None or param.dim() == 0:
        return None
    s = param.shape[0]
    return max(0, min(s, shape[0] - group.rank() * s))


def padding_zeros(param, grad) -> int:
    """Zeros in the padding rows of ``grad`` (the gradient of GTP shard ``param``, or of a flat
    distributed-optimizer slice of one); 0 otherwise."""
    pad_from = getattr(param, PAD_FROM_ATTR, None)
    if pad_from is not None:
        if grad is None or grad.numel() != param.numel() or pad_from >= grad.numel():
            return 0
        pad = grad.detach().reshape(-1)[pad_from:]
        return pad.numel() - int(torch.count_nonzero(pad))
    rows = logical_rows_in_shard(param)
    if rows is None or grad is None or grad.dim() == 0 or grad.shape[0] != param.shape[0] \
            or rows >= grad.shape[0]:
        return 0
    pad = grad.detach()[rows:]
    return pad.numel() - int(torch.count_nonzero(pad))


def _count_zeros_logical(parameters, grad_stats_parallel_group, use_decoupled_grad=False,
                         tp_group=None, expert_tp_group=None):
    """megatron's ``count_zeros_fp32`` minus the zeros in GTP padding rows (same filters, same
    reduction group). Every rank of the group calls it, as megatron's function."""
    from megatron.core.tensor_parallel import (param_is_not_gtp_duplicate,
                                               param_is_not_tensor_parallel_duplicate)
    from megatron.core.transformer.module import param_is_not_shared

    total = _original_count_zeros(
        parameters, grad_stats_parallel_group, use_decoupled_grad=use_decoupled_grad,
        tp_group=tp_group, expert_tp_group=expert_tp_group,
    )
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grad_attr = "decoupled_grad" if use_decoupled_grad else "grad"
    local = 0
    for param in parameters:
        grad = getattr(param, grad_attr, None)
        if grad is None or getattr(param, "__fsdp_param__", False):
            continue
        if (param_is_not_shared(param)
                and param_is_not_tensor_parallel_duplicate(param, tp_group=tp_group,
                                                           expert_tp_group=expert_tp_group)
                and param_is_not_gtp_duplicate(param)):
            local += padding_zeros(param, grad)

    pad = torch.tensor([local], dtype=torch.int64, device=collective_device(grad_stats_parallel_group))
    torch.distributed.all_reduce(pad, op=torch.distributed.ReduceOp.SUM,
                                 group=grad_stats_parallel_group)
    return total - pad.item()


def _copy_gtp_attributes(destination, source):
    """megatron's ``copy_gtp_attributes`` plus where the padding lies in the copy: the logical
    row count of a same-shape copy; for a flat 1-D slice (``DistributedOptimizer``: a view of
    the param's ``[start, end)`` elements, then its fp32 clone) the index where padding starts."""
    _original_copy_gtp_attributes(destination, source)
    rows = logical_rows_in_shard(source)
    if rows is None:
        return
    if tuple(destination.shape) == tuple(source.shape):
        setattr(destination, LOGICAL_ROWS_ATTR, rows)
        return
    if destination.dim() != 1 or source.dim() != 2:
        return
    if destination.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        start = destination.storage_offset() - source.storage_offset()
        _LAST_FLAT_START[id(source)] = start
    elif id(source) in _LAST_FLAT_START:
        start = _LAST_FLAT_START[id(source)]
    else:
        return
    logical = rows * source.shape[1]
    setattr(destination, PAD_FROM_ATTR, max(0, min(destination.numel(), logical - start)))


@megatron_patch("optimizer.clip_grads.count_zeros_fp32 (and its importers), "
                "tensor_parallel.copy_gtp_attributes")
def install() -> None:
    """Make megatron's ``num-zeros`` skip GTP padding rows (idempotent). Install before the
    optimizer is built (the fp32 master copies of bf16 params are tagged at construction)."""
    global _original_count_zeros, _original_copy_gtp_attributes
    if _original_count_zeros is not None:
        return
    from megatron.core import tensor_parallel

    modules = [importlib.import_module(name) for name in _COUNT_ZEROS_USERS]
    _original_count_zeros = modules[0].count_zeros_fp32
    for module in modules:
        if module.count_zeros_fp32 is not _original_count_zeros:
            raise RuntimeError(f"gtp.grad_stats: {module.__name__}.count_zeros_fp32 was already "
                               "replaced by something else")
        module.count_zeros_fp32 = _count_zeros_logical
    _original_copy_gtp_attributes = tensor_parallel.copy_gtp_attributes
    tensor_parallel.copy_gtp_attributes = _copy_gtp_attributes


def is_installed() -> bool:
    """Whether :func:`install` has patched this process."""
    return _original_count_zeros is not None


# Layer types of :func:`grad_norms_by_part`, in a fixed order (the first match of a name wins).
LAYER_TYPES = ("embedding", "output", "norms", "attention", "mlp")
# With routed experts, their params (``mlp.experts.``) form their own group, ahead of ``mlp``.
MOE_LAYER_TYPES = ("embedding", "output", "norms", "attention", "experts", "mlp")


def layer_type(name: str, moe: bool = False) -> str:
    """The layer type of a GPTModel parameter name (``module.`` wrappers allowed):
    ``embedding`` (word and position embeddings), ``output`` (output_layer), ``norms`` (every
    LayerNorm/RMSNorm, the final one included), ``attention`` (self_attention's linears),
    with ``moe`` ``experts`` (the routed experts, megatron's ``mlp.experts.``), ``mlp`` (the
    MLP's linears; in an MoE layer the router and shared experts).

    Raises:
        ValueError: a name matching none of them.
    """
    if ".embedding." in f".{name}":
        return "embedding"
    if "output_layer." in name:
        return "output"
    if "layernorm" in name or "layer_norm" in name or ".norm." in name:
        return "norms"
    if ".self_attention." in name:
        return "attention"
    if moe and ".mlp.experts." in f".{name}":
        return "experts"
    if ".mlp." in name:
        return "mlp"
    raise ValueError(f"parameter {name!r} is of no known layer type {LAYER_TYPES}")


def _layer_index(name: str, offset: int) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1]) + offset
    return None


def grad_norms_by_part(chunks, num_layers: int, group, expert_group=None,
                       expert_tp_group=None) -> dict:
    """L2 norms of the reduced gradients (``main_grad``) per layer type and per transformer layer,
    each logical element counted once at any layout, as megatron's total ``grad-norm``
    (``optimizer.clip_grads.get_grad_norm_fp32`` over ``get_main_grads_for_grad_norm``): shared
    params, TP duplicates and GTP duplicates are skipped, GTP padding rows are left out, and the
    squares are summed over ``group`` (the optimizer's ``get_grad_stats_parallel_group()``).
    Collective over ``group`` (and ``expert_group``): every rank calls this with its own
    parameters.

    With routed experts (``expert_group`` given), params megatron reduces over the expert
    data-parallel group (``allreduce = False``) are handled as megatron's expert optimizer does
    them (``optimizer.get_megatron_optimizer``: its ``grad_stats_parallel_group`` is
    ``expt_tp_pp_with_egtp_remat``, the expert tensor x expert model x pipeline x expert-GTP
    group; duplicates filtered over ``expert_tp_group``): their squares are summed over
    ``expert_group``, the others' over ``group``, and ``grad-norm/experts`` is added.

    Call it after the backward pass and gradient reduction, before the optimizer step (which
    clips gradients in place).

    Args:
        chunks: ``[(named_parameters, layer_offset), ...]``, one pair per model chunk of this
            rank: the chunk's ``named_parameters()`` and the global index of its first
            transformer layer (0 without pipeline parallelism).
        num_layers: transformer layers of the whole model.
        group: the gradient-statistics process group (it spans the pipeline stages too).
        expert_group: the expert gradient-statistics group (None: a dense model).
        expert_tp_group: the expert tensor-parallel group (with ``expert_group``).

    Returns:
        ``{"grad-norm/<type>": float}`` for each of :data:`LAYER_TYPES` (:data:`MOE_LAYER_TYPES`
        with ``expert_group``) and ``{"grad-norm/layer-<i>": float}`` for ``i`` in
        ``range(num_layers)`` (0-based).
    """
    from megatron.core.tensor_parallel import (param_is_not_gtp_duplicate,
                                               param_is_not_tensor_parallel_duplicate)
    from megatron.core.transformer.module import param_is_not_shared

    moe = expert_group is not None
    types = MOE_LAYER_TYPES if moe else LAYER_TYPES
    # Summed where the group's collective needs them (CUDA under NCCL, CPU under gloo); row 0
    # over ``group``, row 1 (experts) over ``expert_group``.
    sums = torch.zeros(2, len(types) + num_layers, dtype=torch.float64,
                       device=collective_device(group))
    for named_params, layer_offset in chunks:
        for name, param in named_params:
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                continue
            if not (param_is_not_shared(param)
                    and param_is_not_tensor_parallel_duplicate(
                        param, expert_tp_group=expert_tp_group if moe else None)
                    and param_is_not_gtp_duplicate(param)):
                continue
            rows = logical_rows_in_shard(param)
            if rows is not None and grad.dim() > 0 and grad.shape[0] == param.shape[0]:
                grad = grad[:rows]
            square = grad.detach().double().square().sum().to(sums.device)
            row = 1 if moe and not getattr(param, "allreduce", True) else 0
            sums[row, types.index(layer_type(name, moe))] += square
            layer = _layer_index(name, layer_offset)
            if layer is not None:
                sums[row, len(types) + layer] += square
    dense, experts = sums[0].clone(), sums[1].clone()
    torch.distributed.all_reduce(dense, group=group)
    if moe:
        torch.distributed.all_reduce(experts, group=expert_group)
    norms = (dense + experts).sqrt().tolist()
    out = {f"grad-norm/{t}": norms[i] for i, t in enumerate(types)}
    out.update({f"grad-norm/layer-{i}": norms[len(types) + i] for i in range(num_layers)})
    return out
