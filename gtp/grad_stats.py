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

from mcore_compat.version import check_megatron_version


# Modules that bound ``count_zeros_fp32`` by name at import time (``from .clip_grads import ...``).
_COUNT_ZEROS_USERS = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
)
# Set on GTP params' full-shape copies (fp32 master params): logical rows of this rank's shard.
LOGICAL_ROWS_ATTR = "_gtp_logical_rows"

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
    """Zeros in the padding rows of ``grad`` (the gradient of GTP shard ``param``); 0 otherwise."""
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
    from megatron.core.tensor_parallel import (
        param_is_not_gtp_duplicate,
        param_is_not_tensor_parallel_duplicate,
    )
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
    from gtp.collectives import collective_device

    pad = torch.tensor([local], dtype=torch.int64, device=collective_device(grad_stats_parallel_group))
    torch.distributed.all_reduce(pad, op=torch.distributed.ReduceOp.SUM,
                                 group=grad_stats_parallel_group)
    return total - pad.item()


def _copy_gtp_attributes(destination, source):
    """megatron's ``copy_gtp_attributes`` plus the logical row count of a same-shape copy."""
    _original_copy_gtp_attributes(destination, source)
    rows = logical_rows_in_shard(source)
    if rows is not None and tuple(destination.shape) == tuple(source.shape):
        setattr(destination, LOGICAL_ROWS_ATTR, rows)


def install() -> None:
    """Make megatron's ``num-zeros`` skip GTP padding rows (idempotent). Install before the
    optimizer is built (the fp32 master copies of bf16 params are tagged at construction)."""
    global _original_count_zeros, _original_copy_gtp_attributes
    if _original_count_zeros is not None:
        return
    import megatron.core
    from megatron.core import tensor_parallel

    check_megatron_version(megatron.core.__version__,
                           "gtp.grad_stats patches optimizer.clip_grads.count_zeros_fp32")
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
