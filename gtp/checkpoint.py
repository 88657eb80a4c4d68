"""The logical checkpoint layout for GTP weights (megatron-core 0.19.2), and its metadata.

A GTP weight is written exactly as the non-GTP model at the same TP writes it: each rank's
padding rows are trimmed, pieces sit at their logical offsets, and an all-padding shard
contributes one empty piece. So a checkpoint saved at any (TP, GTP degree, alignment) loads at
any other, and stock megatron-core without ``gtp/`` can load it into a non-GTP model.
``docs/checkpoint-format.md`` describes the bug this replaces, the format and its records.

Usage::

    from gtp import checkpoint
    checkpoint.configure(cfg.gtp.checkpoint_layout)   # "logical" -> install(); "stock" -> uninstall()
    ...
    state["gtp_layout"] = checkpoint.layout_metadata(model, state["model"])

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

What a :class:`LogicalGTPFactory` does:

* save: ``build`` cuts the rank's shard (the param, or any optimizer tensor of the param: Adam
  ``exp_avg``/``exp_avg_sq``, fp32 main copies) into the pieces of
  :func:`gtp.layout.logical_pieces`, each a ``ShardedTensor`` with explicit ``global_shape`` /
  ``global_offset`` and ``axis_fragmentations=None`` (unequal pieces), never
  ``allow_shape_mismatch``. Pieces share the tensor's memory (no copy, see ``_rows``); layer axes (layer-stacked
  keys) are leading size-1 dims of the piece rather than ``prepend_axis_num``, which megatron's
  irregular-sharding path (``CheckpointableShardedTensor``) does not support. ``step`` is saved by
  megatron as ``common_step``.
* load: the pieces are views of the live tensor, so megatron's reader fills the logical rows in
  place; ``merge`` then zeroes the padding rows and returns that same tensor (no new shard).
* The parameter keeps its padded shape: GTP gathers keep using the untrimmed padded buffer.

Metadata format (``layout_metadata``; stored by ``recipes/checkpoint.py`` under the common-state
key :data:`METADATA_KEY` = ``"gtp_layout"``)::

    {
      "gtp_format": "logical-v1",      # or "stock-0.19.2": GTP weights in megatron 0.19.2's padded
                                       # layout (written with checkpoint_layout=stock). A checkpoint
                                       # without "gtp_layout" predates this metadata: legacy, layout
                                       # unknown unless the run config says.
      "tp": 2,                         # tensor-parallel size that wrote it
      "gtp_remat_size": 2,             # GTP degree g (1: no GTP)
      "pad_for_alignment": 16,         # GTP_CONFIG.pad_for_alignment at save (0 when g == 1)
      "megatron_core": "0.19.2",
      "tensors": {                     # one entry per checkpoint key holding a GTP weight
        "decoder.layers.mlp.linear_fc1.weight": {
          "L": 200,                    # logical TP-local dim 0 (gated: gate + up rows)
          "pad": 24,                   # padding rows appended to the TP-local dim 0 (P = L + pad)
          "shard_rows": 112,           # rows of each GTP shard, P / g
          "tp_axis": 0,                # 0 column-parallel (TP splits dim 0), 1 row-parallel (dim 1)
          "gated": true,               # SwiGLU fc1: TP-local rows are [gate (L/2); up (L/2)]
          "singleton_local_shards": false,  # gated halves under <key>_w / <key>_v
          "global_shape": [400, 72],   # logical on-disk shape of the key, layer axes excluded
          "params": ["decoder.layers.0.mlp.linear_fc1.weight", ...]
        }, ...
      }
    }

In a ``logical-v1`` file each key's stored shape is ``global_shape`` (with the layer axis in
front for layer-stacked keys), exactly what the non-GTP model at that TP writes. In a
``stock-0.19.2`` file the rows of each GTP key are what :func:`gtp.layout.stock_0192_offsets` says
(column-parallel dim 0 ``tp*g*shard_rows``, padding included). With g == 1 both formats are the
same and the tag is ``logical-v1``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from gtp.layout import TensorLayout, logical_pieces
from gtp.records import (  # noqa: F401 - the record names, also read as gtp.checkpoint.*
    CHECKPOINT_LAYOUTS,
    GTP_FORMAT_LOGICAL,
    GTP_FORMAT_STOCK,
    METADATA_KEY,
)
from gtp.records import megatron_core_version
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


class GTPCheckpointError(RuntimeError):
    """The logical layout cannot describe a tensor, or an optimizer param has no model entry."""


# --------------------------------------------------------------------------------------------
# The factory
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogicalSpec:
    """Everything :class:`LogicalGTPFactory` needs besides the data.

    Attributes:
        layout: the weight's :class:`gtp.layout.TensorLayout` on this rank.
        prepend_offsets: megatron's ``(axis, rank_offset, fragments)`` of the prepended axes
            (layer stacking); all of them are prepended axes.
        local_cols: local dim 1 of the shard (row-parallel: the TP-local in_features).
        stored_rows, kept_rows: None, or (set by :func:`with_stored_rows`) the file's dim 0
            when it differs from the layout's, and the leading global rows actually read from
            or written to it; rows from ``kept_rows`` on are zero in the model.
    """

    layout: TensorLayout
    prepend_offsets: tuple
    local_cols: int
    stored_rows: Optional[int] = None
    kept_rows: Optional[int] = None

    @property
    def shard_shape(self) -> tuple[int, int]:
        return (self.layout.shard_rows, self.local_cols)

    def pieces(self):
        return logical_pieces(self.layout)

    def extents(self) -> list[tuple[Any, int, int, int, int]]:
        """``(piece, lo, hi, global_offset, global_size)`` per piece as it is stored: the
        piece's own rows, or, with ``kept_rows`` set, cut to the global rows below it (an
        emptied piece sits at the end of the stored tensor, as in :func:`logical_pieces`)."""
        out = []
        for p in self.pieces():
            if self.kept_rows is None:
                out.append((p, p.lo, p.hi, p.global_offset, p.global_size))
                continue
            keep = max(0, min(p.rows, self.kept_rows - p.global_offset))
            if keep == 0:
                out.append((p, p.lo, p.lo, self.stored_rows, self.stored_rows))
            else:
                out.append((p, p.lo, p.lo + keep, p.global_offset, self.stored_rows))
        return out

    def global_cols(self) -> tuple[int, int]:
        """(dim-1 size on disk, this rank's dim-1 offset)."""
        if self.layout.tp_axis == 1:
            return self.local_cols * self.layout.tp, self.layout.tp_rank * self.local_cols
        return self.local_cols, 0


@dataclass
class LogicalGTPFactory(ShardedTensorFactory):
    """``ShardedTensorFactory`` of one GTP weight in the logical layout.

    ``data`` is the live param in the model's entry and an optimizer tensor of that param in the
    optimizer's (megatron's ``dataclasses.replace``); both extra fields are dataclass fields, so
    they survive that replace.

    Attributes:
        live_param: back-link to the live ``GTPShardedParam``, used for every optimizer
            param-to-key lookup (:func:`get_param_id_to_sharded_param_map`).
        spec: the :class:`LogicalSpec` the pieces are built from.
    """

    live_param: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    spec: Optional[LogicalSpec] = None

    def __post_init__(self):
        # The merge fills this factory's own ``data`` (the live param or optimizer tensor) in
        # place; megatron's ``dataclasses.replace(factory, data=...)`` runs this again, so the
        # optimizer's copy merges into its own tensor. ``without_data()`` (megatron's
        # ``load_preprocess`` drops the factories' data before loading) keeps the merge target:
        # it is the live tensor, not a copy.
        if self.spec is not None and self.data is not None:
            self.merge_fn = functools.partial(_merge_pieces, self.spec, target=self.data)


def _prepended(spec: LogicalSpec) -> tuple[list[int], list[int]]:
    n = len(spec.prepend_offsets)
    shape, offset = [1] * n, [0] * n
    for axis, rank_offset, fragments in spec.prepend_offsets:
        if not 0 <= axis < n:
            raise GTPCheckpointError(
                f"gtp.checkpoint: sharded offset {(axis, rank_offset, fragments)} is not on a "
                f"prepended axis (prepend_offsets={spec.prepend_offsets}); not supported"
            )
        shape[axis], offset[axis] = fragments, rank_offset
    return shape, offset


def _build_pieces(spec: LogicalSpec, key: str, data: torch.Tensor, replica_id, flattened_range):
    """The factory's build_fn: one ShardedTensor per logical piece of ``data``."""
    if flattened_range is not None:
        raise GTPCheckpointError(f"{key}: flattened ranges (distributed optimizer) not supported")
    if tuple(data.shape) != spec.shard_shape:
        raise GTPCheckpointError(
            f"{key}: tensor of shape {tuple(data.shape)} given for a GTP shard of padded shape "
            f"{spec.shard_shape}"
        )
    pre_shape, pre_offset = _prepended(spec)
    cols, col0 = spec.global_cols()
    out = []
    for piece, lo, hi, global_offset, global_size in spec.extents():
        part = data if (lo, hi) == (0, data.shape[0]) else _rows(data, lo, hi)
        # Layer axes go into the local shape (a view with leading 1s), not prepend_axis_num:
        # megatron sends irregular ShardedTensors through CheckpointableShardedTensor, which
        # ignores prepend_axis_num (its chunk would have fewer dims than its offset).
        part = part.view((1,) * len(pre_shape) + tuple(part.shape))
        out.append(ShardedTensor(
            key + piece.key_suffix, part, part.dtype, tuple(part.shape),
            tuple(pre_shape) + (global_size, cols),
            tuple(pre_offset) + (global_offset, col0),
            None,  # irregular: explicit global shape and offset
            replica_id=replica_id,
        ))
    return out


def _rows(data: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of ``data`` without a copy, in a tensor megatron's writer will not clone.

    megatron's torch_dist writer (``FileSystemWriterAsync.prepare_write_data``, its
    ``_clone_or_dequantize_if_needed``) clones every CPU tensor whose storage is larger than the
    tensor, because ``torch.save`` writes whole storages: a plain ``data[lo:hi]`` would be copied
    (the padded shard's size again in memory during the save). A CPU tensor is instead aliased
    through numpy into a tensor whose storage is exactly these rows (same memory; the alias
    keeps ``data`` alive). Other devices are copied to the host by the writer anyway.

    Args:
        data: a 2-D (rows, cols) shard, any dtype.
        lo, hi: row range, ``0 <= lo <= hi <= rows``.

    Returns:
        A (hi - lo, cols) tensor sharing ``data``'s memory.
    """
    view = data.detach()[lo:hi]
    if view.device.type != "cpu" or not view.is_contiguous() or view.numel() == 0:
        return view
    raw = data.detach().view(torch.uint8).numpy()[lo:hi]  # bytes of the rows, no copy
    return torch.from_numpy(raw).view(data.dtype)


def _padding_rows(spec: LogicalSpec, shard_rows: int) -> list[tuple[int, int]]:
    """Row ranges of the shard that no stored piece covers (its padding, and the rows past
    ``kept_rows``), in order."""
    out, at = [], 0
    for _, lo, hi, _, _ in sorted(spec.extents(), key=lambda e: e[1]):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < shard_rows:
        out.append((at, shard_rows))
    return out


def _aliases_rows(target: torch.Tensor, ten: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether ``ten`` is exactly rows ``lo:hi`` of the contiguous ``target`` in memory."""
    row_bytes = target.shape[1] * target.element_size()
    return (ten.device == target.device and ten.dtype == target.dtype and ten.is_contiguous()
            and ten.numel() == (hi - lo) * target.shape[1]
            and ten.data_ptr() == target.data_ptr() + lo * row_bytes)


def _merge_pieces(spec: LogicalSpec, loaded, target: Optional[torch.Tensor] = None):
    """The factory's merge_fn: the padded shard, logical rows loaded, padding rows zero.

    Args:
        spec: the weight's :class:`LogicalSpec`.
        loaded: one tensor per piece of ``spec.extents()``, in order (``(1,)*n + (rows, cols)``).
        target: the factory's ``data`` (live param or optimizer tensor, ``spec.shard_shape``).
            When it is a contiguous tensor of that shape and the loaded dtype, the result is
            ``target`` itself: pieces that the reader already read into their rows of ``target``
            (the pieces :func:`_build_pieces` made are views of it) are left as they are, others
            are copied in, and only the padding rows are zeroed. No new shard is allocated.
            Otherwise (no target: a factory built without data) a new zero-filled shard is
            returned.
    """
    extents = spec.extents()
    if len(loaded) != len(extents):
        raise GTPCheckpointError(f"expected {len(extents)} loaded pieces, got {len(loaded)}")
    ref = loaded[0]
    if (target is not None and tuple(target.shape) == spec.shard_shape and target.dtype == ref.dtype
            and target.device == ref.device and target.is_contiguous()):
        out = target.detach()
        with torch.no_grad():
            for (_, lo, hi, _, _), ten in zip(extents, loaded):
                if not _aliases_rows(out, ten, lo, hi):
                    out[lo:hi].copy_(ten.reshape(hi - lo, spec.local_cols))
            for lo, hi in _padding_rows(spec, out.shape[0]):
                out[lo:hi].zero_()
        return out
    out = torch.zeros(spec.shard_shape, dtype=ref.dtype, device=ref.device)
    for (_, lo, hi, _, _), ten in zip(extents, loaded):
        out[lo:hi] = ten.reshape(hi - lo, spec.local_cols)
    return out


def _make_factory(tensor, key, spec: LogicalSpec, replica_id, data=None) -> LogicalGTPFactory:
    """The factory of the live param ``tensor``; ``data`` (default ``tensor``) is what its
    pieces are cut from and merged into."""
    return LogicalGTPFactory(
        key, tensor if data is None else data, functools.partial(_build_pieces, spec),
        functools.partial(_merge_pieces, spec), replica_id, None, live_param=tensor, spec=spec,
    )


def with_stored_rows(factory: LogicalGTPFactory, stored_rows: int,
                     kept_rows: int) -> LogicalGTPFactory:
    """The same GTP weight, loaded from (or saved to) a tensor of ``stored_rows`` global dim-0
    rows of which only the first ``kept_rows`` are read (written); the model's rows from
    ``kept_rows`` on load as zeros. Used for vocabulary rows (``recipes.vocab``): a checkpoint
    of another padded vocabulary size. Megatron applies the returned factory to every optimizer
    tensor of the param too, each merging into its own tensor in place.

    Args:
        factory: the weight's :class:`LogicalGTPFactory` (column-parallel, not gated).
        stored_rows: global dim 0 of the tensor in the file.
        kept_rows: ``<= min(stored_rows, tp * L)``.

    Raises:
        GTPCheckpointError: a gated or row-parallel weight, or ``kept_rows`` out of range.
    """
    spec = factory.spec
    layout = spec.layout
    if layout.gated or layout.tp_axis != 0:
        raise GTPCheckpointError(f"{factory.key}: stored rows can only be limited for a "
                                 f"column-parallel, non-gated GTP weight")
    if not 0 <= kept_rows <= min(stored_rows, layout.global_rows):
        raise GTPCheckpointError(
            f"{factory.key}: kept_rows={kept_rows} not within [0, min(stored_rows={stored_rows}, "
            f"{layout.global_rows} model rows)]")
    new_spec = dataclasses.replace(spec, stored_rows=int(stored_rows), kept_rows=int(kept_rows))
    return dataclasses.replace(factory, build_fn=functools.partial(_build_pieces, new_spec),
                               spec=new_spec)


def tensor_layout_of(param, tp_axis: int, tp_size: int, tp_rank: int, gated: bool = False,
                     singleton_local_shards: bool = False) -> TensorLayout:
    """The :class:`TensorLayout` of a live GTP param, checked against its padding.

    Raises:
        GTPCheckpointError: the param's shard size / pad_length are not what megatron's
            ``GTP_CONFIG.pad_for_alignment`` gives (the config changed after the model was built).
    """
    from gtp.alignment import applied_pad_for_alignment

    pad_for_alignment = applied_pad_for_alignment()
    if param.dim() != 2:
        raise GTPCheckpointError(f"GTP param of shape {tuple(param.shape)}: only 2-D weights")
    group = param.group
    layout = TensorLayout(
        L=int(param._unsharded_shape[0]), tp=tp_size, tp_rank=tp_rank, g=group.size(),
        gtp_rank=group.rank(), pad_for_alignment=pad_for_alignment,
        tp_axis=tp_axis, gated=gated, singleton_local_shards=singleton_local_shards,
    )
    if layout.shard_rows != param.shape[0] or layout.pad != param.pad_length:
        raise GTPCheckpointError(
            f"GTP param {getattr(param, '_debug_name', '') or tuple(param.shape)}: shard "
            f"{param.shape[0]} rows with pad {param.pad_length}, but GTP_CONFIG.pad_for_alignment="
            f"{pad_for_alignment} gives {layout.shard_rows} rows with pad {layout.pad}"
        )
    return layout


# --------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------
def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None,
                                          prepend_offsets=(), **kwargs):
    """Replacement of ``megatron.core.utils.make_tp_sharded_tensor_for_checkpoint``.

    A GTP param gets a :class:`LogicalGTPFactory` (logical layout); anything else goes to
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
        raise GTPCheckpointError(f"{key}: GTP expert weights are not supported by gtp.checkpoint")
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    layout = tensor_layout_of(tensor, tp_axis, tp_size, tp_rank)
    if replica_id is None:
        # The true replicas of a GTP shard are across the gtp_remat-excluded DP group (as stock).
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(
            with_context_parallel=True, with_gtp_remat=False))
    spec = LogicalSpec(layout, tuple(tuple(o) for o in prepend_offsets), int(tensor.shape[1]))
    return _make_factory(tensor, key, spec, replica_id, data=_high_precision(tensor))


def _high_precision(param):
    """The tensor a GTP param's pieces are cut from: the param itself, or for a native-FP8 GTP
    param (``gtp.fp8_param_gather``) a dequantized copy, as megatron's own
    ``make_tp_sharded_tensor_for_checkpoint`` does (``dequantize_gtp_native_fp8``): the file
    holds high-precision values, and a load fills the copy, which the model's
    ``load_state_dict`` then quantizes into the param."""
    from megatron.core.fp8_utils import is_float8tensor

    if not is_float8tensor(param):
        return param
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import (
        dequantize_gtp_native_fp8,
    )

    return dequantize_gtp_native_fp8(param)


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
    layout = dataclasses.replace(spec.layout, gated=True,
                                 singleton_local_shards=bool(singleton_local_shards))
    return _make_factory(original_sh_ten.live_param, original_sh_ten.key,
                         dataclasses.replace(spec, layout=layout), original_sh_ten.replica_id,
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
    """Switch megatron-core 0.19.2 to the logical checkpoint layout (idempotent).

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
            raise RuntimeError(f"gtp.checkpoint: {home}.{name} is not megatron's own ({old!r})")
        _ORIGINALS[name] = old
    for name, (_, new) in _TARGETS.items():
        where = _swap_everywhere(name, _ORIGINALS[name], new)
        logger.debug("gtp.checkpoint: %s replaced in %s", name, where)
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
    """Whether the logical layout is active in this process."""
    return _INSTALLED


def configure(checkpoint_layout: str) -> None:
    """Apply ``gtp.checkpoint_layout``: "logical" installs the patch, "stock" leaves (or puts
    back) megatron-core 0.19.2's own behaviour.

    Raises:
        ValueError: another value.
    """
    if checkpoint_layout == "logical":
        install()
    elif checkpoint_layout == "stock":
        uninstall()
    else:
        raise ValueError(
            f"gtp.checkpoint_layout={checkpoint_layout!r} is invalid; valid: {list(CHECKPOINT_LAYOUTS)}"
        )


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------
def layout_metadata(model, model_sharded_state_dict=None) -> dict:
    """The ``gtp_layout`` record of a checkpoint written from ``model`` (format: module doc).

    Args:
        model: the (DDP-wrapped or bare) megatron model, or a list of them (one per virtual
            pipeline stage).
        model_sharded_state_dict: its ``sharded_state_dict()`` (any nesting) when already built
            (before ``dist_checkpointing.save``, which applies factories in place); built here
            otherwise.

    Returns:
        A plain dict of ints, strings, bools and lists, identical on every rank (the per-tensor
        records are merged over all ranks).
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
    from megatron.core.transformer.mlp import MLP
    from megatron.core.utils import unwrap_model

    from gtp.alignment import applied_pad_for_alignment

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
    tensors: dict[str, dict] = {}
    for entry in nested_values(model_sharded_state_dict):
        param = getattr(entry, "live_param", None)
        if param is None:
            param = getattr(entry, "data", None)
        if param is None or not is_gtp_param(param):
            continue
        spec = getattr(entry, "spec", None)
        if spec is not None:
            layout = spec.layout
        else:  # stock 0.19.2 entry: the layout comes from the param
            layout = tensor_layout_of(param, int(getattr(param, "partition_dim", 0)), tp,
                                      tp_group.rank(), gated=id(param) in gated_ids)
        cols = int(param.shape[1]) * (layout.tp if layout.tp_axis == 1 else 1)
        record = {
            "L": layout.L, "pad": layout.pad, "shard_rows": layout.shard_rows,
            "tp_axis": layout.tp_axis, "gated": layout.gated,
            "singleton_local_shards": layout.singleton_local_shards,
            "global_shape": [layout.global_rows, cols],
        }
        key = entry.key
        old = tensors.get(key)
        params = sorted({*(old or {}).get("params", []), names.get(id(param), "?")})
        if old is not None and {k: v for k, v in old.items() if k != "params"} != record:
            raise GTPCheckpointError(f"{key}: GTP layouts differ between layers: {old} vs {record}")
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
    has_gtp = bool(tensors) or g > 1
    return {
        "gtp_format": GTP_FORMAT_STOCK if (has_gtp and not _INSTALLED) else GTP_FORMAT_LOGICAL,
        "tp": tp,
        "gtp_remat_size": g,
        "pad_for_alignment": applied_pad_for_alignment() if g > 1 else 0,
        "megatron_core": megatron_core_version(),
        "tensors": tensors,
    }
