"""Parameter shapes without building a model: :class:`ParamShape` (one entry of a model
family's parameter table, ``recipes.families.parameter_shapes``), the shape one rank holds at a
layout (:func:`local_shape`), the attention widths and the padded vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gtp.shards import gtp_padding


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model.

    Attributes:
        name: ``GPTModel.named_parameters()`` name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``.
        shape: full logical shape (all TP ranks together, no GTP padding).
        tp_axis: dim split over TP ranks (0 column-parallel / vocab rows, 1 row-parallel), None
            when every TP rank holds all of it.
        gtp: GTP shards its TP-local dim 0 (megatron-core 0.19.2 wraps the ``weight`` of every
            ``VocabParallelEmbedding``, ``ColumnParallelLinear`` and ``RowParallelLinear``).
    """

    name: str
    shape: tuple[int, ...]
    tp_axis: Optional[int] = None
    gtp: bool = False
    # A routed expert's weight: split over expert_model_parallel_size (whole experts), its
    # tp_axis over expert_tensor_parallel_size, GTP-sharded over expert_gtp_remat_size.
    expert: bool = False


def query_groups(m) -> int:
    """K/V head groups: ``num_query_groups``, or one per attention head when null."""
    groups = m.get("num_query_groups") if hasattr(m, "get") else getattr(m, "num_query_groups", None)
    return groups or m.num_attention_heads


def getter(m):
    """``get(key, default)`` of a ``model`` config: an OmegaConf node or a dataclass."""
    return m.get if hasattr(m, "get") else lambda k, d=None: getattr(m, k, d)


def kv_channels(m) -> int:
    """Width of one attention head: ``model.kv_channels``, or hidden / heads when null."""
    return getter(m)("kv_channels") or m.hidden_size // m.num_attention_heads


def qkv_rows(m) -> int:
    """Full dim 0 of ``linear_qkv``: ``(heads + 2 * groups) * kv_channels`` (megatron
    ``SelfAttention``: per query group, its query heads then K then V); with
    ``attention_output_gate``, ``(2 * heads + 2 * groups) * kv_channels`` (per query group, its
    query heads, then as many gate heads, then K then V: megatron's
    ``SelfAttention.get_query_key_value_tensors``)."""
    heads = m.num_attention_heads * (2 if getter(m)("attention_output_gate", False) else 1)
    return (heads + 2 * query_groups(m)) * kv_channels(m)


def count(shapes: list[ParamShape]) -> int:
    """Total elements of the full logical shapes."""
    total = 0
    for p in shapes:
        n = 1
        for d in p.shape:
            n *= d
        total += n
    return total


def tp_local_shape(p: ParamShape, tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds before GTP: ``tp_axis`` divided by ``tp``."""
    shape = list(p.shape)
    if p.tp_axis is not None:
        shape[p.tp_axis] //= tp
    return tuple(shape)


def local_shape(p: ParamShape, tp: int, g: int, pad_for_alignment: int) -> tuple[tuple[int, ...], int]:
    """``(shape on one rank, GTP padding rows)`` at ``tp`` x GTP degree ``g``.

    A GTP weight's TP-local dim 0 is padded (``gtp.shards.gtp_padding``, megatron's
    ``gtp_remat_shard_dim0`` math) and split over ``g`` ranks; every rank holds the same shape.

    Raises:
        ValueError: ``pad_for_alignment == 0`` and the TP-local dim 0 does not divide by ``g``.
    """
    shape = tp_local_shape(p, tp)
    if not (p.gtp and g > 1):
        return shape, 0

    pad_length, rows = gtp_padding(shape[0], g, pad_for_alignment)
    return (rows, *shape[1:]), pad_length


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rows after padding: ``vocab_size`` rounded up to a multiple of
    ``lcm(divisible_by, tp)``.

    Megatron-LM (``_vocab_size_with_padding``) uses ``divisible_by * tp``, which changes the
    padded size, hence the softmax over padded logits and the loss, when TP changes. With the lcm
    the padded size is the same at every TP dividing ``divisible_by``, so a run resumed at another
    TP computes exactly the same function.
    """
    multiple = math.lcm(divisible_by, tp)
    return ((vocab_size + multiple - 1) // multiple) * multiple
