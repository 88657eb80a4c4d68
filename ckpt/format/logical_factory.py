"""The logical sharded-tensor factory of one GTP weight (megatron-core 0.19.2).

A GTP weight is described to megatron's dist-checkpointing exactly as the non-GTP model at the
same TP describes it: each rank's padding rows are trimmed, pieces sit at their logical offsets,
and an all-padding shard contributes one empty piece (``docs/checkpoint-format.md``, "The
logical format"). :mod:`ckpt.format.logical_format` installs the megatron replacements that return these
factories.

What a :class:`LogicalGTPFactory` does:

* save: ``build`` cuts the rank's shard (the param, or any optimizer tensor of the param: Adam
  ``exp_avg``/``exp_avg_sq``, fp32 main copies) into the pieces of
  :func:`gtp.shards.logical_pieces`, each a ``ShardedTensor`` with explicit ``global_shape`` /
  ``global_offset`` and ``axis_fragmentations=None`` (unequal pieces), never
  ``allow_shape_mismatch``. Pieces share the tensor's memory (no copy, see ``_rows``); layer
  axes (layer-stacked keys) are leading size-1 dims of the piece rather than
  ``prepend_axis_num``, which megatron's irregular-sharding path (``CheckpointableShardedTensor``)
  does not support. ``step`` is saved by megatron as ``common_step``.
* load: the pieces are views of the live tensor, so megatron's reader fills the logical rows in
  place; ``merge`` then zeroes the padding rows and returns that same tensor (no new shard).
* The parameter keeps its padded shape: GTP gathers keep using the untrimmed padded buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from gtp.alignment import applied_pad_for_alignment
from gtp.shards import GTPShard, logical_pieces, logical_rows


class GTPCheckpointError(RuntimeError):
    """The logical format cannot describe a tensor, or an optimizer param has no model entry."""


@dataclass(frozen=True)
class LogicalSpec:
    """Everything :class:`LogicalGTPFactory` needs besides the data.

    Attributes:
        shard: the weight's :class:`gtp.shards.GTPShard` on this rank.
        prepend_offsets: megatron's ``(axis, rank_offset, fragments)`` of the prepended axes
            (layer stacking); all of them are prepended axes.
        local_cols: local dim 1 of the shard (row-parallel: the TP-local in_features).
        stored_rows, kept_rows: None, or (set by :func:`with_stored_rows`) the file's dim 0
            when it differs from the shard's, and the leading global rows actually read from
            or written to it; rows from ``kept_rows`` on are zero in the model.
    """

    shard: GTPShard
    prepend_offsets: tuple
    local_cols: int
    stored_rows: Optional[int] = None
    kept_rows: Optional[int] = None

    @property
    def shard_shape(self) -> tuple[int, int]:
        return (self.shard.shard_rows, self.local_cols)

    def pieces(self):
        return logical_pieces(self.shard)

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
        if self.shard.tp_axis == 1:
            return self.local_cols * self.shard.tp, self.shard.tp_rank * self.local_cols
        return self.local_cols, 0


@dataclass
class LogicalGTPFactory(ShardedTensorFactory):
    """``ShardedTensorFactory`` of one GTP weight in the logical format.

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
                f"ckpt.format.logical_format: sharded offset {(axis, rank_offset, fragments)} is not on a "
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
        # An empty piece of an all-padding shard sits at one offset on every rank that has one:
        # one rank writes it, or torch_dist keeps one record and the other ranks' bytes sit in
        # their files unrecorded (a save that gtp verify then refuses).
        rid = replica_id if hi > lo or _writes_empty_piece(spec) else _not_main(replica_id)
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
            replica_id=rid,
        ))
    return out


def _writes_empty_piece(spec: LogicalSpec) -> bool:
    """Whether this rank writes its empty piece: the first all-padding GTP rank, at TP rank 0
    (a row-parallel weight's empty pieces differ in their column offset, one per TP rank)."""
    lay = spec.shard
    empty = [r for r in range(lay.g)
             if not len(range(*logical_rows(lay.L, lay.g, lay.pad_for_alignment, r)))]
    if not empty:  # a piece emptied by kept_rows: not an all-padding shard's
        return True
    return lay.gtp_rank == empty[0] and (lay.tp_axis == 1 or lay.tp_rank == 0)


def _not_main(replica_id):
    """``replica_id`` marked as not the main replica (megatron saves main replicas only)."""
    if isinstance(replica_id, tuple):
        return (replica_id[0] + 1,) + tuple(replica_id[1:])
    return replica_id + 1


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


def make_factory(tensor, key, spec: LogicalSpec, replica_id, data=None) -> LogicalGTPFactory:
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
    ``kept_rows`` on load as zeros. Used for vocabulary rows (``ckpt.adapt.vocab``): a checkpoint
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
    shard = spec.shard
    if shard.gated or shard.components or shard.tp_axis != 0:
        raise GTPCheckpointError(f"{factory.key}: stored rows can only be limited for a "
                                 f"column-parallel, non-gated GTP weight")
    if not 0 <= kept_rows <= min(stored_rows, shard.global_rows):
        raise GTPCheckpointError(
            f"{factory.key}: kept_rows={kept_rows} not within [0, min(stored_rows={stored_rows}, "
            f"{shard.global_rows} model rows)]")
    new_spec = dataclasses.replace(spec, stored_rows=int(stored_rows), kept_rows=int(kept_rows))
    return dataclasses.replace(factory, build_fn=functools.partial(_build_pieces, new_spec),
                               spec=new_spec)


def gtp_shard_of(param, tp_axis: int, tp_size: int, tp_rank: int, gated: bool = False,
                 singleton_local_shards: bool = False) -> GTPShard:
    """The :class:`GTPShard` of a live GTP param, checked against its padding.

    Raises:
        GTPCheckpointError: the param's shard size / pad_length are not what megatron's
            ``GTP_CONFIG.pad_for_alignment`` gives (the config changed after the model was built).
    """
    pad_for_alignment = applied_pad_for_alignment()
    if param.dim() != 2:
        raise GTPCheckpointError(f"GTP param of shape {tuple(param.shape)}: only 2-D weights")
    group = param.group
    shard = GTPShard(
        L=int(param._unsharded_shape[0]), tp=tp_size, tp_rank=tp_rank, g=group.size(),
        gtp_rank=group.rank(), pad_for_alignment=pad_for_alignment,
        tp_axis=tp_axis, gated=gated, singleton_local_shards=singleton_local_shards,
    )
    if shard.shard_rows != param.shape[0] or shard.pad != param.pad_length:
        raise GTPCheckpointError(
            f"GTP param {getattr(param, '_debug_name', '') or tuple(param.shape)}: shard "
            f"{param.shape[0]} rows with pad {param.pad_length}, but GTP_CONFIG.pad_for_alignment="
            f"{pad_for_alignment} gives {shard.shard_rows} rows with pad {shard.pad}"
        )
    return shard



def high_precision_data(param):
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
