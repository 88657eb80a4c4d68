"""The logical checkpoint format for GTP weights (megatron-core 0.19.2): the patch that writes it.

A GTP weight is written exactly as the non-GTP model at the same TP writes it (the factory:
:mod:`ckpt.format.logical_factory`), so a checkpoint saved at any (TP, GTP degree, alignment) loads at
any other, and stock megatron-core without ``gtp/`` can load it into a non-GTP model.
``docs/checkpoint-format.md`` describes the bug this replaces, the format and the sharding
record (:func:`written_sharding_record`, built by :mod:`ckpt.format.sharding_record`).

Usage::

    from ckpt.format import logical_format
    logical_format.configure(cfg.checkpoint.format)   # "logical" -> install(); "stock" -> uninstall()
    ...
    state[SHARDING_RECORD_KEY] = logical_format.written_sharding_record(model, state["model"])

:func:`install` (idempotent; refused unless megatron-core is 0.19.2) replaces, in every loaded
``megatron.core`` module that imported them by name:

* ``megatron.core.utils.make_tp_sharded_tensor_for_checkpoint`` - for a GTP param only (every
  other tensor goes to the original unchanged). Its GTP branch builds
  ``from_rank_offsets`` over the *padded* shard, so the stored global dim 0 is ``tp*(L+pad)``,
  every shard of ``tp_rank > 0`` sits ``tp_rank*pad`` rows late, padding rows reach disk and
  ``allow_shape_mismatch`` hides all of it on load. The replacement returns a
  :class:`LogicalGTPFactory` (a ``ShardedTensorFactory``: megatron applies the same factory to
  every optimizer tensor of the param, see ``dist_checkpointing/optimizer.py``
  ``make_sharded_optimizer_tensor``). It is reached from all three GTP entry points:
  ``make_sharded_tensors_for_checkpoint_with_gtp_remat`` (Column/RowParallelLinear, which
  imports it from ``megatron.core.utils`` at call time), ``VocabParallelEmbedding.sharded_state_dict``
  and ``LanguageModule.tie_embeddings_and_output_weights_state_dict`` (both imported it by name).
  ``allow_shape_mismatch`` requested by a caller (embedding, output layer) is ignored for GTP
  weights: a tensor that cannot be explained exactly fails to load.
* ``megatron.core.transformer.mlp.apply_swiglu_sharded_factory`` - for a :class:`LogicalGTPFactory`
  only. The original ``torch.chunk``s each rank's padded shard into gate/up halves as if it were
  the whole TP shard; under GTP a shard can lie in the gate half, in the up half or straddle
  both. The replacement describes gate rows and up rows of the rank's logical slice at their own
  logical offsets (one or two pieces), so the file is ``[W_0..W_{tp-1}; V_0..V_{tp-1}]`` as
  without GTP.
* ``megatron.core.dist_checkpointing.optimizer.get_param_id_to_sharded_param_map`` (also
  imported by ``megatron.core.optimizer.optimizer``) - it matches optimizer params to model
  entries by ``id(entry.data)``, logs an unmatched entry at debug level and leaves an unmatched
  param out of the map (its moments are then dropped, or a later bare ``Param id N does not
  match`` / ``KeyError`` names no tensor). The replacement matches
  through the entry's back-link :attr:`LogicalGTPFactory.live_param` when there is one (a field
  of the entry, not an attribute of the tensor: the torch strategy replaces ``.data``), by
  ``id(entry.data)`` otherwise, and raises when any optimizer param is left without an entry,
  naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from typing import Any

from ckpt.format.logical_factory import (  # noqa: F401 - the factory names, also read as ckpt.format.logical_format.*
    GTPCheckpointError,
    LogicalGTPFactory,
    LogicalSpec,
    gtp_shard_of,
    high_precision_data,
    make_factory,
    with_stored_rows,
)
from ckpt.format.records import (  # noqa: F401 - the record names, also read as ckpt.format.logical_format.*
    CHECKPOINT_FORMATS,
    GTP_FORMAT_LOGICAL,
    GTP_FORMAT_STOCK,
    SHARDING_RECORD_KEY,
)
from ckpt.format.sharding_record import sharding_record
from mcore_compat.patches import megatron_patch

logger = logging.getLogger(__name__)


_UTILS = "megatron.core.utils"
_MLP = "megatron.core.transformer.mlp"
_DIST_OPT = "megatron.core.dist_checkpointing.optimizer"
# Modules that import the patched names by name; imported before patching so that every copy is
# replaced (a megatron module imported later copies the already patched attribute).
_IMPORT_FIRST = (
    _UTILS,
    _MLP,
    _DIST_OPT,
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.optimizer.optimizer",
    "megatron.core.tensor_parallel.generalized_tensor_parallelism",
)

_INSTALLED = False
_ORIGINALS: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------
def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None,
                                          prepend_offsets=(), **kwargs):
    """Replacement of ``megatron.core.utils.make_tp_sharded_tensor_for_checkpoint``.

    A GTP param gets a :class:`LogicalGTPFactory` (logical format); anything else goes to
    megatron's original with the same arguments.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    if not is_gtp_param(tensor):
        return _ORIGINALS["make_tp_sharded_tensor_for_checkpoint"](
            tensor, key, tp_axis, replica_id, prepend_offsets, **kwargs)
    tp_group = kwargs.pop("tp_group", None)
    kwargs.pop("dp_cp_group", None)
    kwargs.pop("allow_shape_mismatch", None)  # never for GTP weights (module docstring)
    if kwargs:
        raise GTPCheckpointError(f"{key}: unsupported arguments for a GTP weight: {sorted(kwargs)}")
    if getattr(tensor, "is_routed_expert", False) or getattr(tensor, "is_grouped", False):
        raise GTPCheckpointError(f"{key}: GTP expert weights are not supported by ckpt.format.logical_format")
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    shard = gtp_shard_of(tensor, tp_axis, tp_size, tp_rank)
    if replica_id is None:
        # The true replicas of a GTP shard are across the gtp_remat-excluded DP group (as stock).
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(
            with_context_parallel=True, with_gtp_remat=False))
    spec = LogicalSpec(shard, tuple(tuple(o) for o in prepend_offsets), int(tensor.shape[1]))
    return make_factory(tensor, key, spec, replica_id, data=high_precision_data(tensor))


def apply_swiglu_sharded_factory(original_sh_ten, sharded_offsets, singleton_local_shards=False,
                                 tp_group=None, dp_group=None):
    """Replacement of ``megatron.core.transformer.mlp.apply_swiglu_sharded_factory``.

    A :class:`LogicalGTPFactory` (gated fc1 GTP weight) becomes the gated logical factory;
    anything else goes to megatron's original.
    """
    if not isinstance(original_sh_ten, LogicalGTPFactory):
        return _ORIGINALS["apply_swiglu_sharded_factory"](
            original_sh_ten, sharded_offsets, singleton_local_shards, tp_group=tp_group,
            dp_group=dp_group)
    spec = original_sh_ten.spec
    if tuple(tuple(o) for o in sharded_offsets) != spec.prepend_offsets:
        raise GTPCheckpointError(
            f"{original_sh_ten.key}: sharded offsets {sharded_offsets} differ from the weight's "
            f"{spec.prepend_offsets}")
    shard = dataclasses.replace(spec.shard, gated=True,
                                singleton_local_shards=bool(singleton_local_shards))
    return make_factory(original_sh_ten.live_param, original_sh_ten.key,
                         dataclasses.replace(spec, shard=shard), original_sh_ten.replica_id,
                         data=original_sh_ten.data)


def get_param_id_to_sharded_param_map(model_sharded_state_dict, optim_params_iter):
    """Replacement of ``dist_checkpointing.optimizer.get_param_id_to_sharded_param_map``.

    Same result, but (1) an entry's back-link ``live_param`` is used when present, else
    ``id(entry.data)``; (2) an optimizer param without a model entry is an error.

    Raises:
        GTPCheckpointError: some optimizer params match no model entry (named, with shapes).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.optimizer import get_optim_param_to_id_map
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    params = list(optim_params_iter)
    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(params)
    out = {}
    for entry in nested_values(model_sd):
        live = getattr(entry, "live_param", None)
        src = live if live is not None else entry.data
        param_id = param_to_id.get(id(src))
        if param_id is not None:
            out[param_id] = entry
    missing = sorted(set(param_to_id.values()) - set(out))
    if missing:
        names = [
            f"#{i} {getattr(params[i], '_debug_name', '') or ''} shape {tuple(params[i].shape)}"
            for i in missing
        ]
        raise GTPCheckpointError(
            f"{len(missing)} optimizer params have no entry in the model's sharded state dict "
            f"(their moments would be dropped): {names[:10]}"
        )
    return out


# --------------------------------------------------------------------------------------------
# install / uninstall / configure
# --------------------------------------------------------------------------------------------
_TARGETS = {
    # name: (module holding the original, replacement)
    "make_tp_sharded_tensor_for_checkpoint": (_UTILS, make_tp_sharded_tensor_for_checkpoint),
    "apply_swiglu_sharded_factory": (_MLP, apply_swiglu_sharded_factory),
    "get_param_id_to_sharded_param_map": (_DIST_OPT, get_param_id_to_sharded_param_map),
}


def _swap_everywhere(name: str, old, new) -> list[str]:
    swapped = []
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and getattr(module, name, None) is old:
            setattr(module, name, new)
            swapped.append(mod_name)
    return swapped


@megatron_patch("the sharded-state-dict functions of _TARGETS, wherever megatron imported them")
def install() -> None:
    """Switch megatron-core 0.19.2 to the logical checkpoint format (idempotent).

    Raises:
        RuntimeError: megatron-core is not 0.19.2, or a target is not megatron's original
            function (someone else patched it).
    """
    global _INSTALLED
    if _INSTALLED:
        return
    for mod in _IMPORT_FIRST:
        importlib.import_module(mod)
    for name, (home, new) in _TARGETS.items():
        old = getattr(sys.modules[home], name)
        if getattr(old, "__module__", None) != home:
            raise RuntimeError(f"ckpt.format.logical_format: {home}.{name} is not megatron's own ({old!r})")
        _ORIGINALS[name] = old
    for name, (_, new) in _TARGETS.items():
        where = _swap_everywhere(name, _ORIGINALS[name], new)
        logger.debug("ckpt.format.logical_format: %s replaced in %s", name, where)
    _INSTALLED = True


def uninstall() -> None:
    """Restore megatron's functions everywhere they were replaced (no-op when not installed)."""
    global _INSTALLED
    if not _INSTALLED:
        return
    for name, (_, new) in _TARGETS.items():
        _swap_everywhere(name, new, _ORIGINALS[name])
    _INSTALLED = False


def is_installed() -> bool:
    """Whether the logical format is active in this process."""
    return _INSTALLED


def configure(checkpoint_format: str) -> None:
    """Apply ``checkpoint.format`` (old name ``gtp.checkpoint_layout``): "logical" installs the
    patch, "stock" leaves (or puts back) megatron-core 0.19.2's own behaviour.

    Raises:
        ValueError: another value.
    """
    if checkpoint_format == "logical":
        install()
    elif checkpoint_format == "stock":
        uninstall()
    else:
        raise ValueError(
            f"checkpoint.format={checkpoint_format!r} (old name gtp.checkpoint_layout) is "
            f"invalid; valid: {list(CHECKPOINT_FORMATS)}"
        )


# --------------------------------------------------------------------------------------------
# The sharding record
# --------------------------------------------------------------------------------------------
def written_sharding_record(model, model_sharded_state_dict=None) -> dict:
    """The sharding record of a checkpoint this process writes from ``model``: in the
    logical format when :func:`install` is active, else tagged ``stock-0.19.2`` (arguments and
    result: :func:`ckpt.format.sharding_record.sharding_record`)."""
    return sharding_record(model, model_sharded_state_dict, logical=_INSTALLED)
